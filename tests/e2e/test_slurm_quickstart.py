"""The quickstart under real Slurm (issue #4 point 9): ``hpcrl submit`` on the local cluster (tests/cluster/),
colocated on one fake node and disaggregated as a het job over n1 + n2, with the real bootstrap: torch.distributed
from Slurm's variables, the engines as the rollout job step started by trainer rank 0, the GRPO loop, weight sync.

Both runs start from the quickstart's SFT model (shipped: ``tests/warm_starts/quickstart``) and take a shorter budget than the
quickstart: 150 steps of 8 prompts (the quickstart's 16 halved) without the nonzero-std filter, so the mean
training reward is the policy's sampled accuracy, and "learns" is that it rises (first 50 steps vs last 50 steps).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.slurm.state import FINAL_STATES, query_states
from tests.warm_starts import WARM_STARTS, install, load

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
HPCRL = Path(sys.executable).with_name("hpcrl")
STEPS = 150


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    """The quickstart's base model and the link to its SFT warm start (~40% greedy) in its store, installed from
    the shipped one (tests/warm_starts)."""
    folder = tmp_path_factory.mktemp("quickstart-warm-start")
    got = install("quickstart", folder)
    return got["base"], folder / load(WARM_STARTS["quickstart"]).sft.output


def submit(work: Path, sft_model, *overrides: str, warm_start: bool = True) -> tuple[str, Path]:
    """``hpcrl submit`` of the quickstart from its base model with the session's warm start as its cache
    (``warm_start``: the job finds it under its key), or (``warm_start=False``) from the warm-started model
    itself with ``sft.enabled=false``."""
    base, sft = sft_model
    shutil.copy(REPO / "configs" / "quickstart.yaml", work / "quickstart.yaml")
    start = ([f"model.path={base}", f"sft.output={sft}"] if warm_start
             else [f"model.path={Path(sft).resolve()}", "sft.enabled=false"])
    args = ["submit", "quickstart.yaml", *start, f"run.num_rollout={STEPS}", "rollout.batch_size=8",
            f"rollout.eval_interval={STEPS}", "rollout.dynamic_filter=null", "train.lr_warmup_steps=20",
            "slurm.time=00:30:00", "slurm.signal=USR2@60", *overrides]
    out = subprocess.run([str(HPCRL), *args], cwd=work, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()  # "submitted [heterogeneous] job ID (launcher): RUN_DIR"
    return words[words.index("job") + 1], Path(words[words.index("job") + 3])


def wait_final(job_id: str, run_dir: Path, timeout: float = 1500) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = query_states([job_id])[job_id]
        if state in FINAL_STATES:
            return state
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=30)
            pytest.fail(f"job {job_id} still {state} after {timeout} s; logs in {run_dir}")
        time.sleep(2)


def job_log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted((run_dir / "submitit").glob("*.err")))


def check_learned(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 0]
    assert [r["step"] for r in steps] == list(range(STEPS))
    first = sum(r["rollout/reward_mean"] for r in steps[:50]) / 50
    last = sum(r["rollout/reward_mean"] for r in steps[-50:]) / 50
    evals = [(r["step"], round(r["eval/accuracy"], 3)) for r in rows if "eval/accuracy" in r]
    print(f"{run_dir.name}: mean sampled reward {first:.3f} (steps 0-49) -> {last:.3f} (steps {STEPS - 50}-"
          f"{STEPS - 1}); greedy eval {evals}; step median "
          f"{sorted(r['timing/step_seconds'] for r in steps)[STEPS // 2]:.2f} s")
    assert last >= first + 0.03, f"no learning: reward {first:.3f} -> {last:.3f}"
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in steps)
    return {"first": first, "last": last, "evals": evals}


def test_quickstart_colocated_on_one_node(tmp_path, slurm_cluster, sft_model):
    job_id, run_dir = submit(tmp_path, sft_model, "run.name=colo", "slurm.cpus_per_task=2")
    state = wait_final(job_id, run_dir)
    assert state == "COMPLETED", job_log(run_dir)
    check_learned(run_dir)
    attempt = run_dir / "logs" / "attempt-0"
    engine = json.loads((attempt / "engines" / "engine-0.json").read_text())
    # on the job's one node, whichever Slurm gave it (n2 when n1 was still being released by a test before)
    for _ in range(30):  # the accounting daemon may lag the job's end by a moment
        nodes = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "NodeList", "-j", job_id], capture_output=True,
                               text=True, timeout=30).stdout.split()
        if nodes:
            break
        time.sleep(1)
    node = nodes[0]
    assert engine["node"] == node and engine["url"].startswith(f"http://{node}:")
    # the rollout step ran as a step of this job and was torn down at the end
    steps = subprocess.run(["sacct", "-n", "-P", "-o", "JobID,JobName,State", "-j", job_id], capture_output=True,
                           text=True, timeout=30).stdout
    assert any(line.split("|")[1] == "colo-rollout" for line in steps.splitlines()), steps


def test_quickstart_disaggregated_het_job_over_two_nodes(tmp_path, slurm_cluster, sft_model):
    # from the warm-started model itself: with 2 trainer ranks the warm start's key (it holds the trainer's
    # layout) is not the session's, and training it again inside the job cost ~270 s of CI; the warm start
    # on two ranks is tests/integration/test_sft_run.py's, in a Slurm job test_sweep_cluster.py's
    job_id, run_dir = submit(tmp_path, sft_model, "run.name=het", "run.placement=disaggregate",
                             "train.nprocs=2", "train.micro_batch_size=32", "slurm.cpus_per_task=1",
                             "slurm.rollout={nodes: 1, cpus_per_task: 2}", warm_start=False)
    state = wait_final(job_id, run_dir)
    assert state == "COMPLETED", job_log(run_dir)
    check_learned(run_dir)
    engine = json.loads((run_dir / "logs" / "attempt-0" / "engines" / "engine-0.json").read_text())
    assert engine["node"] == "n2"  # het group 1; the trainer (2 tasks, DP=2) is group 0 on n1
    config = (run_dir / "config.yaml").read_text()
    assert "method: distributed" in config


def test_dead_rollout_step_fails_the_job_fast_with_its_log(tmp_path, slurm_cluster):
    """With engine restarts off (``rollout.max_engine_restarts: 0``; by default a new engine step replaces it:
    tests/integration/test_fault_tolerance_slurm.py), killing the rollout job step mid-run ends the job within
    seconds, with the step's log tail in the job's error log (never a hang on requests to dead engines)."""
    shutil.copy(REPO / "configs" / "quickstart.yaml", tmp_path / "quickstart.yaml")
    out = subprocess.run([str(HPCRL), "submit", "quickstart.yaml", "run.name=dies", "sft.enabled=false",
                          f"model.path={tmp_path}/tiny", "run.num_rollout=100000", "rollout.eval_interval=0",
                          "rollout.dynamic_filter=null", "rollout.max_engine_restarts=0",
                          "slurm.cpus_per_task=2", "slurm.time=00:10:00", "slurm.signal=USR2@60"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    job_id, run_dir = words[words.index("job") + 1], Path(words[words.index("job") + 3])
    deadline = time.monotonic() + 300
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > 3):
        assert time.monotonic() < deadline and query_states([job_id])[job_id] not in FINAL_STATES, job_log(run_dir)
        time.sleep(1)
    steps = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], capture_output=True, text=True,
                           timeout=30).stdout.split("\n")
    rollout = [line.split()[0] for line in steps if line.endswith(" dies-rollout")]
    assert len(rollout) == 1, steps
    t0 = time.monotonic()
    subprocess.run(["scancel", rollout[0]], check=True, timeout=30)
    state = wait_final(job_id, run_dir, timeout=180)
    seconds = time.monotonic() - t0
    log = job_log(run_dir)
    print(f"rollout step {rollout[0]} cancelled: job {state} after {seconds:.0f} s")
    assert state == "FAILED" and seconds < 90
    assert "RolloutStepError" in log and "rollout-step.log" in log, log[-3000:]
