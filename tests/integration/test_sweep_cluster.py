"""``hpcrl sweep`` against the real local Slurm cluster (tests/cluster/): one job array per sweep.

* A 2-point learning-rate sweep of a tiny run (3 GRPO steps of the tiny random Qwen2, the real bootstrap: the
  trainer, the engine as the rollout job step, weight sync) goes to Slurm as one array; both tasks complete
  and each point folder holds its own run; ``hpcrl status`` / ``logs`` / ``sweep --report`` read them.
* With a stand-in bootstrap (:func:`sleep_in_first_attempt`: record the job's environment, then sleep in the
  run's first attempt), one array task is preempted (``scancel --signal=USR2 <id>_1``) and requeued alone
  (the other task keeps running: requeueing an array task by its raw job id would requeue every task), the
  other is cancelled, and ``hpcrl sweep --resubmit`` submits just that point as a new one-task array.

* A 4-point sweep (2 at once) is cancelled with running and pending tasks: one pending point alone
  (``hpcrl cancel SWEEP --points``, after which Slurm 22.05 keeps no record of that task: UNKNOWN, never
  started), then the whole sweep (``hpcrl cancel SWEEP``: the array, its pending tasks shown by sacct as one
  folded row ``<id>_[2-3%2]``); ``hpcrl sweep --resubmit`` brings back all four points, which run the real
  bootstrap and complete. ``hpcrl status`` is read at every stage. The running tasks hold in a stand-in
  bootstrap (:func:`hold_then_run`) until the cancel, so only the resubmitted runs pay for real steps.

Each test takes about a minute on a free 2-core cluster (the cancel test about three); the waits are long
because other tests' jobs may hold the two nodes first.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.config import load_config
from hpcrl.slurm import entry
from hpcrl.slurm.state import FINAL_STATES, attempt_dirs, query_states

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 400
"""Longest wait for a state: covers other sessions' jobs holding the nodes first."""

SWEEP = """\
run: {{name: lrs, num_rollout: 3}}
model: {{path: {model}}}
sft: {{enabled: false}}
data: {{source: addition}}
rollout: {{batch_size: 8, n_samples_per_prompt: 8, max_new_tokens: 8, eval_interval: 0, router: false,
          dynamic_filter: null}}
train: {{lr_warmup_steps: 0}}
slurm: {{cpus_per_task: {cpus}, time: "00:05:00", signal: USR2@60,
        extra_sbatch: ["--comment=hpcrl-sweep-test"]}}
sweep:
  grid: {{train.lr: [1.0e-4, 3.0e-4]}}
  array_parallelism: 2
"""
POINTS = ["lr=0.0001", "lr=0.0003"]
SEEDS = """\
  seeds: [1, 2]
"""
POINTS4 = [f"lr={lr},seed={seed}" for lr in ("0.0001", "0.0003") for seed in (1, 2)]
HOLD = "hold"
"""While this file is in the sweep folder, :func:`hold_then_run` holds each task instead of running it."""


def sleep_in_first_attempt(cfg, run_dir: Path) -> int:
    """Stand-in bootstrap (``HPCRL_SLURM_BOOTSTRAP``): record the job's environment (the probe), then sleep up
    to 120 s in the run's first attempt, to be preempted or cancelled; later attempts return at once."""
    from tests.integration.slurm_probe import _record

    _record(run_dir)
    if len(attempt_dirs(run_dir)) == 1:
        (run_dir / "sleeping").write_text(os.environ.get("SLURM_JOB_ID", "?"))
        time.sleep(120)
    return 0


def hold_then_run(cfg, run_dir: Path) -> int:
    """Stand-in bootstrap: while the sweep folder holds :data:`HOLD`, record the job's environment, mark the
    point ``sleeping`` and sleep (up to 300 s, to be cancelled); otherwise run the real bootstrap."""
    if (run_dir.parent / HOLD).exists():
        from tests.integration.slurm_probe import _record

        _record(run_dir)
        (run_dir / "sleeping").write_text(os.environ.get("SLURM_JOB_ID", "?"))
        time.sleep(300)
        return 1
    return entry.default_bootstrap(cfg, run_dir)


@pytest.fixture
def work(tmp_path, monkeypatch, slurm_cluster):
    """Submit directory; jobs can import this module (the stand-in bootstrap)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv(entry.BOOTSTRAP_ENV, raising=False)
    return tmp_path


def hpcrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("hpcrl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "hpcrl"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)


def submit_sweep(work: Path, model: Path, cpus: int, extra: str = "", points: int = 2) -> tuple[str, Path]:
    (work / "sweep.yaml").write_text(SWEEP.format(model=model, cpus=cpus) + extra)
    out = hpcrl("sweep", "sweep.yaml")
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()  # "submitted sweep NAME: job array ID with N tasks (...): SWEEP_DIR"
    assert words[3:5] == ["job", "array"] and words[6:8] == ["with", str(points)], out.stdout
    return words[5], work / "runs" / "lrs"


def wait_states(job_ids: list[str], want=FINAL_STATES, timeout: float = WAIT_S) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        states = query_states(job_ids)
        if all(s in want for s in states.values()):
            return states
        if time.monotonic() > deadline:
            subprocess.run(["scancel", *job_ids], timeout=30, check=False)
            pytest.fail(f"jobs still {states} after {timeout} s")
        time.sleep(1)


def wait_file(path: Path, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.5)


def sacct_ids(array_id: str) -> dict[str, str]:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", array_id],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return dict(line.split("|")[:2] for line in out.splitlines() if "|" in line)


def job_log(sweep_dir: Path) -> str:
    logs = sorted((sweep_dir / "submitit").glob("*.err"))
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in logs)


def probe(run_dir: Path, restart: int = 0) -> dict:
    return json.loads((run_dir / f"probe-0-{restart}.json").read_text())["env"]


def test_sweep_runs_each_point_as_a_task_of_one_array(work, tiny_model_dir):
    array_id, sdir = submit_sweep(work, tiny_model_dir, cpus=2)
    tasks = [f"{array_id}_0", f"{array_id}_1"]
    shown = subprocess.run(["scontrol", "show", "job", tasks[0]], capture_output=True, text=True, timeout=30)
    assert "Comment=hpcrl-sweep-test" in shown.stdout  # slurm.extra_sbatch reaches the array
    states = wait_states(tasks)
    assert states == {t: "COMPLETED" for t in tasks}, job_log(sdir)
    deadline = time.monotonic() + 30  # sacct may show the pending array as one row "<id>_[0-1]" for a moment
    while sacct_ids(array_id) != {t: "COMPLETED" for t in tasks} and time.monotonic() < deadline:
        time.sleep(1)
    assert sacct_ids(array_id) == {t: "COMPLETED" for t in tasks}  # one array id, tasks _0 and _1

    for i, (name, lr) in enumerate(zip(POINTS, (1e-4, 3e-4))):
        run_dir = sdir / name
        assert load_config(run_dir / "config.yaml").train.lr == lr
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["step"] >= 0] == [0, 1, 2]
        assert json.loads((run_dir / "job.json").read_text())["job_id"] == tasks[i]
        assert len(attempt_dirs(run_dir)) == 1

    out = hpcrl("status", str(sdir))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"sweep lrs: 2 points, job array {array_id} ({sdir})"
    assert [line.split()[:3] for line in lines[2:4]] == [[POINTS[0], tasks[0], "COMPLETED"],
                                                         [POINTS[1], tasks[1], "COMPLETED"]]
    assert lines[-1] == "2 COMPLETED"
    out = hpcrl("status", str(sdir / POINTS[1]))  # one point is a run folder
    assert out.returncode == 0
    assert out.stdout.splitlines()[1].split()[:3] == [POINTS[1], tasks[1], "COMPLETED"]
    out = hpcrl("logs", str(sdir / POINTS[0]))
    assert out.returncode == 0 and entry.ATTEMPT_MARKER in out.stdout

    out = hpcrl("sweep", "--report", str(sdir))
    assert out.returncode == 0, out.stderr
    with open(sdir / "report.csv", newline="") as f:
        report = list(csv.DictReader(f))
    assert [(r["point"], r["train.lr"], r["job_id"], r["state"], r["steps"]) for r in report] == [
        (POINTS[0], "0.0001", tasks[0], "COMPLETED", "3"), (POINTS[1], "0.0003", tasks[1], "COMPLETED", "3")]
    assert all(r["final_reward_mean"] != "" for r in report)
    assert (sdir / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_preempted_task_requeues_alone_and_cancelled_point_is_resubmitted(work, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(entry.BOOTSTRAP_ENV, "tests.integration.test_sweep_cluster.sleep_in_first_attempt")
    array_id, sdir = submit_sweep(work, tiny_model_dir, cpus=1)
    first, second = (sdir / n for n in POINTS)
    tasks = [f"{array_id}_0", f"{array_id}_1"]
    wait_file(first / "sleeping")
    wait_file(second / "sleeping")
    for i, run_dir in enumerate((first, second)):
        env = probe(run_dir)
        assert (env["SLURM_ARRAY_JOB_ID"], env["SLURM_ARRAY_TASK_ID"]) == (array_id, str(i))
        assert env["HPCRL_RUN_DIR"] == str(run_dir)  # each task finds its own run folder

    # preemption of task 1 (whose raw job id is the array's id): requeued and resumed alone
    subprocess.run(["scancel", "--signal=USR2", tasks[1]], check=True, timeout=30)
    wait_file(second / "probe-0-1.json")
    assert wait_states([tasks[1]]) == {tasks[1]: "COMPLETED"}, job_log(sdir)
    assert probe(second, 1)["SLURM_RESTART_COUNT"] == "1" and len(attempt_dirs(second)) == 2
    assert query_states([tasks[0]]) == {tasks[0]: "RUNNING"} and len(attempt_dirs(first)) == 1

    # task 0 cancelled, then resubmitted alone as a new one-task array
    subprocess.run(["scancel", tasks[0]], check=True, timeout=30)
    assert wait_states([tasks[0]]) == {tasks[0]: "CANCELLED"}
    out = hpcrl("status", str(sdir))
    assert out.stdout.splitlines()[-1] == "1 CANCELLED, 1 COMPLETED", out.stdout
    out = hpcrl("sweep", "--resubmit", str(sdir))
    assert out.returncode == 0, out.stderr
    words = out.stdout.splitlines()[0].split()  # "resubmitted job array ID with 1 tasks: NAME -> ID_0"
    new_id = words[3]
    assert words[:3] + words[4:] == ["resubmitted", "job", "array", "with", "1", "tasks:", POINTS[0], "->",
                                     f"{new_id}_0"], out.stdout
    assert wait_states([f"{new_id}_0"]) == {f"{new_id}_0": "COMPLETED"}, job_log(sdir)
    env = probe(first)  # the new job's first start, in the same run folder
    assert (env["SLURM_ARRAY_JOB_ID"], env["SLURM_ARRAY_TASK_ID"]) == (new_id, "0")
    assert env["HPCRL_RUN_DIR"] == str(first) and len(attempt_dirs(first)) == 2
    manifest = json.loads((sdir / "sweep.json").read_text())
    assert [(p["job_id"], p["previous_job_ids"]) for p in manifest["points"]] == [(f"{new_id}_0", [tasks[0]]),
                                                                                  (tasks[1], [])]
    out = hpcrl("status", str(sdir))
    assert out.stdout.splitlines()[-1] == "2 COMPLETED", out.stdout
    again = hpcrl("sweep", "--resubmit", str(sdir))
    assert again.returncode == 0 and again.stdout.startswith("nothing to resubmit")


def status_rows(sdir: Path) -> tuple[dict[str, str], list[str]]:
    """``hpcrl status SWEEP``: point -> STATE, and the lines under the table (the counts, then the notes)."""
    out = hpcrl("status", str(sdir))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = {line.split()[0]: line.split()[2] for line in lines[2:2 + len(POINTS4)]}
    assert list(rows) == POINTS4, out.stdout
    return rows, lines[2 + len(POINTS4):]


def test_cancelled_sweep_with_pending_tasks_is_resubmitted_whole(work, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(entry.BOOTSTRAP_ENV, "tests.integration.test_sweep_cluster.hold_then_run")
    (work / "runs" / "lrs").mkdir(parents=True)
    (work / "runs" / "lrs" / HOLD).write_text("")
    array_id, sdir = submit_sweep(work, tiny_model_dir, cpus=2, extra=SEEDS, points=4)
    tasks = [f"{array_id}_{i}" for i in range(4)]
    for name in POINTS4[:2]:  # the throttle (%2) runs tasks 0 and 1 first
        wait_file(sdir / name / "sleeping")
    assert status_rows(sdir)[0] == dict(zip(POINTS4, ["RUNNING", "RUNNING", "PENDING", "PENDING"]))

    # one pending point alone: Slurm 22.05 then keeps no record of that task (UNKNOWN, with the reason)
    out = hpcrl("cancel", str(sdir), "--points", POINTS4[3])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[:2] == [f"cancelling 1 of 4 points of sweep lrs ({sdir}):",
                                           f"  job {tasks[3]}: {POINTS4[3]} (PENDING)"], out.stdout
    assert out.stdout.splitlines()[2].startswith(f"cancelled {tasks[3]} (1 UNKNOWN); "), out.stdout
    assert status_rows(sdir)[0] == dict(zip(POINTS4, ["RUNNING", "RUNNING", "PENDING", "UNKNOWN"]))

    # the whole sweep: printed first, then the array cancelled by its id (running and pending tasks)
    out = hpcrl("cancel", str(sdir))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"cancelling 3 of 4 points of sweep lrs ({sdir}):",
        f"  job array {array_id}: {POINTS4[0]} (RUNNING), {POINTS4[1]} (RUNNING), {POINTS4[2]} (PENDING)",
        f"cancelled {array_id} (3 CANCELLED); bring the points back with: hpcrl sweep --resubmit {sdir}"
    ], out.stdout  # hpcrl cancel waited for the tasks to end (COMPLETING for a few seconds)
    rows = status_rows(sdir)
    assert rows[0] == dict(zip(POINTS4, ["CANCELLED"] * 3 + ["UNKNOWN"]))
    notes = rows[1]
    assert len(notes) == 2 and notes[0] == "3 CANCELLED, 1 UNKNOWN", notes
    assert notes[1] == (f"{POINTS4[3]}: UNKNOWN: job {tasks[3]}: not queued (squeue), and sacct has no "
                        f"record of task 3 of array {array_id} though it has the array's other tasks (Slurm "
                        "keeps none for a pending task cancelled by its own id: it never started); never "
                        "started; hpcrl sweep --resubmit brings it back"), notes
    folded = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", array_id],
                            capture_output=True, text=True, timeout=30, check=True).stdout
    assert f"{array_id}_[2" in folded  # the task that never started is only in the folded row
    assert not (sdir / POINTS4[2] / "sleeping").exists() and not attempt_dirs(sdir / POINTS4[3])
    out = hpcrl("cancel", str(sdir))
    assert out.returncode == 0 and out.stdout.startswith(f"nothing to cancel in {sdir}"), out.stdout

    # --resubmit brings back all four points; they run the real bootstrap and complete
    (sdir / HOLD).unlink()
    out = hpcrl("sweep", "--resubmit", str(sdir))
    assert out.returncode == 0, out.stderr
    words = out.stdout.splitlines()[0].split()  # "resubmitted job array ID with 4 tasks: ..."
    new_id = words[3]
    assert words[:3] + words[4:7] == ["resubmitted", "job", "array", "with", "4", "tasks:"], out.stdout
    rows = status_rows(sdir)[0]
    assert set(rows.values()) <= {"PENDING", "RUNNING", "COMPLETED"}, rows
    new_tasks = [f"{new_id}_{i}" for i in range(4)]
    assert wait_states(new_tasks) == {t: "COMPLETED" for t in new_tasks}, job_log(sdir)
    rows, notes = status_rows(sdir)
    assert rows == dict.fromkeys(POINTS4, "COMPLETED") and notes == ["4 COMPLETED"]
    manifest = json.loads((sdir / "sweep.json").read_text())
    assert [(p["job_id"], p["previous_job_ids"]) for p in manifest["points"]] == [
        (new, [old]) for new, old in zip(new_tasks, tasks)]
    for name in POINTS4:
        rows = [json.loads(line) for line in (sdir / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["step"] >= 0] == [0, 1, 2], name


WARM = """\
run: {{name: warm, num_rollout: 1}}
model: {{path: {model}}}
sft: {{enabled: true, output: {sft}, steps: 4, batch_size: 16, lr: 3.0e-3, eval_interval: 2}}
data: {{source: addition, num_train: 200, num_eval: 8}}
rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, eval_interval: 0, router: false,
          dynamic_filter: null}}
train: {{lr_warmup_steps: 0, micro_batch_size: 8}}
slurm: {{cpus_per_task: 2, time: "00:05:00"}}
sweep:
  seeds: [1, 2]
  array_parallelism: 2
"""


def test_sweep_seeds_warm_start_from_their_own_folders_and_keep_the_cache(work, tiny_model_dir):
    """Issue #40 point 5 on the cluster: a sweep over two seeds whose points warm-start (an SFT run on the
    Megatron trainer inside each array task, engines as its rollout job step, then RL) ends with each point's
    RL started from the warm start of its own seed. The seed-1 warm start made on the login node before
    (``hpcrl sft``: the quickstart's cache) has the seed-1 points' key and is used, not trained again; a
    warm start of another recipe behind the same ``sft.output`` survives the sweep."""
    sft = work / ".cache" / "sft"
    (work / "warm.yaml").write_text(WARM.format(model=tiny_model_dir, sft=sft))
    made = {}
    for name, extra in (("quick", []), ("older", ["sft.lr=1e-3"])):
        out = hpcrl("sft", "warm.yaml", "run.seed=1", *extra, timeout=400)
        assert out.returncode == 0, out.stderr[-3000:]
        made[name] = Path(out.stdout.split()[-1])
    assert made["quick"] != made["older"]
    out = hpcrl("sweep", "warm.yaml")
    assert out.returncode == 0, out.stderr
    array_id, sdir = out.stdout.split()[5], work / "runs" / "warm"
    tasks = [f"{array_id}_0", f"{array_id}_1"]
    assert wait_states(tasks) == {t: "COMPLETED" for t in tasks}, job_log(sdir)
    starts = {p: Path(json.loads((sdir / p / "warm_start.json").read_text())["model"]) for p in ("seed=1", "seed=2")}
    assert starts["seed=1"] == made["quick"].resolve()
    assert starts["seed=2"] != starts["seed=1"] and starts["seed=2"].parent == made["quick"].resolve().parent
    assert json.loads((starts["seed=2"] / "sft_key.json").read_text())["seed"] == 2
    for folder in made.values():  # both earlier warm starts still there, the seed-1 one not trained again
        assert json.loads((folder / "sft_key.json").read_text())["seed"] == 1
    assert [p.name for p in (made["quick"].parent / f"{made['quick'].name}.run" / "logs").iterdir()] == ["attempt-0"]
    for p in ("seed=1", "seed=2"):
        rows = [json.loads(x) for x in (sdir / p / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["step"] >= 0] == [0]
