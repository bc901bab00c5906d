"""``hpcrl submit`` / status / logs / cancel against the real local Slurm cluster (tests/cluster/).

The jobs run the real entry point (``hpcrl.slurm.entry``: the submitit function job, or ``hpcrl run-slurm``
from the plain template) with a stand-in bootstrap (``tests/integration/slurm_probe.py``) instead of the RL
loop, so each job takes seconds: what is tested is the launch (het groups, environment, requeue), not
training. The RL loop submitted for real is the end-to-end tier (issue #4 point 9).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.slurm import entry, state
from hpcrl.slurm.state import FINAL_STATES, query_states

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
BASE = ["run.num_rollout=2", "slurm.time=00:05:00", "slurm.signal=USR2@60", "slurm.cpus_per_task=1"]
CONFIG = "model: {create: tiny-qwen2}\ndata: {source: addition}\n"


@pytest.fixture
def work(tmp_path, monkeypatch, slurm_cluster):
    """Submit directory; jobs import the probe bootstrap from the repository."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(CONFIG)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(entry.BOOTSTRAP_ENV, "tests.integration.slurm_probe.record")
    return tmp_path


def hpcrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("hpcrl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "hpcrl"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)


def submit(*args: str) -> tuple[str, Path]:
    out = hpcrl("submit", "run.yaml", *BASE, *args)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()  # "submitted [heterogeneous] job ID (launcher): RUN_DIR"
    return words[words.index("job") + 1], Path(words[words.index("job") + 3])


def wait_state(job_id: str, want=FINAL_STATES, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        s = query_states([job_id])[job_id]
        if s in want:
            return s
        assert time.monotonic() < deadline, f"job {job_id} still {s} after {timeout} s"
        time.sleep(0.5)


def wait_file(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.3)


def probe(run_dir: Path, task: int = 0, restart: int = 0) -> dict:
    return json.loads((run_dir / f"probe-{task}-{restart}.json").read_text())


@pytest.mark.parametrize("plain", [False, True], ids=["submitit", "plain"])
def test_colocated_job(work, plain):
    job_id, run_dir = submit("run.name=colo", *(["--plain"] if plain else []))
    assert wait_state(job_id) == "COMPLETED", (run_dir / "submission.sbatch").read_text()
    p = probe(run_dir)
    assert p["env"]["SLURM_JOB_ID"] == job_id and p["env"]["HPCRL_RUN_DIR"] == str(run_dir)
    assert "SLURM_HET_SIZE" not in p["env"] and p["attempt"] == "attempt-0"
    status = hpcrl("status", str(run_dir))
    assert status.returncode == 0
    assert status.stdout.splitlines()[1].split()[:6] == ["colo", job_id, "COMPLETED", "-/2", "-", "1"]
    logs = hpcrl("logs", str(run_dir))
    assert logs.returncode == 0
    assert entry.ATTEMPT_MARKER in logs.stdout and "probe in attempt-0" in logs.stdout


def test_gpus_come_from_slurm(work):
    job_id, run_dir = submit("run.name=gpu", "slurm.gpus_per_node=2", "train.micro_batch_size=32")
    assert wait_state(job_id) == "COMPLETED"
    seen = [probe(run_dir, task) for task in (0, 1)]  # one task per GPU
    assert sorted(p["env"]["SLURM_PROCID"] for p in seen) == ["0", "1"]
    assert all(p["env"]["CUDA_VISIBLE_DEVICES"] == "0,1" for p in seen)  # Slurm's, per node


@pytest.mark.parametrize("plain", [False, True], ids=["submitit", "plain"])
def test_disaggregated_het_job_over_two_nodes(work, plain):
    job_id, run_dir = submit("run.name=het", "run.placement=disaggregate", "slurm.gpus_per_node=1",
                             "train.micro_batch_size=64",
                             "slurm.rollout={nodes: 1, gpus_per_node: 2, cpus_per_task: 1}",
                             *(["--plain"] if plain else []))
    assert json.loads((run_dir / "job.json").read_text())["het"] is True
    assert wait_state(job_id) == "COMPLETED"
    env = probe(run_dir)["env"]
    assert env["SLURM_HET_SIZE"] == "2" and env["SLURM_JOB_ID"] == job_id
    nodes = {env["SLURM_JOB_NODELIST_HET_GROUP_0"], env["SLURM_JOB_NODELIST_HET_GROUP_1"]}
    assert nodes == {"n1", "n2"}
    assert env["SLURM_GPUS_PER_NODE_HET_GROUP_1"] == "2" and env["CUDA_VISIBLE_DEVICES"] == "0"
    deadline = time.monotonic() + 30  # sacct shows one row "<id>" for a moment, then "<id>+0", "<id>+1"
    while True:
        sacct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "-j", job_id], capture_output=True,
                               text=True, timeout=30).stdout.split()
        if f"{job_id}+1" in sacct or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert f"{job_id}+0" in sacct and f"{job_id}+1" in sacct
    assert query_states([job_id]) == {job_id: "COMPLETED"}
    if not plain:  # submitit's own view of the job, through the het watcher
        from hpcrl.slurm.executor import HetSlurmJob

        job = HetSlurmJob(folder=run_dir / "submitit", job_id=job_id, tasks=[0])
        assert job.watcher.get_state(job_id, mode="force") == "COMPLETED"
        assert job.result() == 0


@pytest.mark.parametrize("plain", [False, True], ids=["submitit", "plain"])
def test_preemption_signal_requeues_and_resumes(work, monkeypatch, plain):
    monkeypatch.setenv(entry.BOOTSTRAP_ENV, "tests.integration.slurm_probe.sleep_first_attempt")
    job_id, run_dir = submit("run.name=preempt", *(["--plain"] if plain else []))
    wait_file(run_dir / "sleeping")
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    wait_file(run_dir / "probe-0-1.json", timeout=150)
    assert wait_state(job_id) == "COMPLETED"
    rows = state.collect_status([run_dir])
    assert rows[0].attempts == 2 and rows[0].state == "COMPLETED"
    logs = hpcrl("logs", str(run_dir)).stdout
    assert logs.count(entry.ATTEMPT_MARKER) == 1 and "restart 1" in logs and "probe in attempt-1" in logs


def test_cancel(work, monkeypatch):
    monkeypatch.setenv(entry.BOOTSTRAP_ENV, "tests.integration.slurm_probe.sleep_first_attempt")
    job_id, run_dir = submit("run.name=cancel")
    wait_file(run_dir / "sleeping")
    again = hpcrl("submit", "run.yaml", *BASE, "run.name=cancel")
    assert again.returncode == 2 and f"already has job {job_id}" in again.stderr  # one live job per run
    out = hpcrl("cancel", "cancel", "--output-dir", "runs")
    assert out.returncode == 0 and f"cancelled job {job_id}" in out.stdout
    assert wait_state(job_id) == "CANCELLED"


def test_sbatch_refusal_exit_1(work):
    out = hpcrl("submit", "run.yaml", *BASE, "run.name=bad", "slurm.partition=nope")
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1 and "nope" in out.stderr
    assert not (work / "runs" / "bad" / "job.json").exists()
