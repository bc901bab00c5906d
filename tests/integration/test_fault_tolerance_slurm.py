"""Engines that die are replaced on the local Slurm cluster too (issue #12 point 3): the engine of a run's
rollout job step is killed (colocated on n1, and in a het job on n2), and a new one-engine job step on that
node takes its place, at the current weight version; the run completes with every group trained once. And
when the het job's rollout node goes down, Slurm requeues the job (SIGTERM to its steps): the run checkpoints
the step it is at, waits in the queue while the node is out, and completes once it is back.

The run of tests/integration/test_fault_tolerance.py (tiny model, heartbeat 1 s / timeout 3 s), submitted with
``hpcrl submit``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.slurm.state import FINAL_STATES, query_states
from tests.integration.test_fault_tolerance import assert_each_group_once, metrics, write_config
from tests.integration.test_preemption_local import steps_done

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.timeout(900)]

HPCRL = Path(sys.executable).with_name("hpcrl")
STEPS = 40


@pytest.fixture
def work(tmp_path, monkeypatch, slurm_cluster):
    """The run config and the reward module (on the job's PYTHONPATH)."""
    write_config(tmp_path, STEPS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    yield tmp_path
    queued = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True, timeout=30).stdout
    left = [line.split()[0] for line in queued.splitlines() if line.split()[1:] == [str(tmp_path)]]
    if left:
        subprocess.run(["scancel", *left], timeout=30)


def submit(work: Path, name: str, *overrides: str) -> tuple[str, Path]:
    out = subprocess.run([str(HPCRL), "submit", "run.yaml", f"run.name={name}",                           "slurm.cpus_per_task=2", "slurm.time=00:10:00", *overrides], cwd=work,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    return words[words.index("job") + 1], Path(words[words.index("job") + 3])


def rollout_steps(job_id: str, name: str) -> list[str]:
    """The job's rollout job steps (a het job's group 1 is listed under its own job id, JOB + 1)."""
    out = subprocess.run(["squeue", "-h", "-s", "-o", "%i %j"], capture_output=True, text=True,
                         timeout=30).stdout.splitlines()
    return [line.split()[0] for line in out
            if line.endswith(f" {name}-rollout")
            and int(line.split()[0].split(".")[0].split("+")[0]) in (int(job_id), int(job_id) + 1)]


def job_log(run_dir: Path) -> str:
    logs = sorted((run_dir / "submitit").glob("*")) + sorted((run_dir / "logs").rglob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in logs if p.is_file())


def kill_the_engine_step_and_complete(work: Path, name: str, *overrides: str) -> Path:
    """Submit run ``name``, cancel its engine's job step after 5 steps, and check the job completes with the
    engine replaced once on the node of the one it replaced, every group trained once."""
    job_id, run_dir = submit(work, name, *overrides)
    assert run_dir == work / "runs" / name
    deadline = time.monotonic() + 300
    while steps_done(run_dir) < 5:
        assert time.monotonic() < deadline and query_states([job_id])[job_id] not in FINAL_STATES, job_log(run_dir)
        time.sleep(0.5)
    first = rollout_steps(job_id, name)
    assert len(first) == 1, subprocess.run(["squeue", "-s", "-o", "%i %j %N"], capture_output=True, text=True,
                                           timeout=30).stdout
    subprocess.run(["scancel", first[0]], check=True, timeout=30)  # the engine's job step dies
    while query_states([job_id])[job_id] not in FINAL_STATES:
        assert time.monotonic() < deadline + 300, job_log(run_dir)
        time.sleep(1)
    assert query_states([job_id])[job_id] == "COMPLETED", job_log(run_dir)
    assert steps_done(run_dir) == STEPS
    rows = metrics(work, name)
    assert sum(m["rollout/engine_restarts"] for m in rows) == 1, job_log(run_dir)
    engines = run_dir / "logs" / "attempt-0" / "engines"
    new = json.loads((engines / "engine-0.restart-1.json").read_text())
    node = json.loads((engines / "engine-0.json").read_text())["node"]  # whichever node Slurm gave the job
    assert new["node"] == node and new["url"].startswith(f"http://{node}:")
    off = 1 if "run.mode=async" in overrides else 0
    assert [m["rollout/weight_version"] for m in rows] == [str(max(k - off, 0)) for k in range(STEPS)]
    assert_each_group_once(work, name, STEPS)
    return run_dir


def test_colocated_engine_step_killed_is_replaced(work):
    kill_the_engine_step_and_complete(work, "colo")


def test_het_job_engine_step_killed_is_replaced(work):
    kill_the_engine_step_and_complete(work, "het", "run.placement=disaggregate", "train.nprocs=1",
                                      "slurm.cpus_per_task=1", "slurm.rollout={nodes: 1, cpus_per_task: 2}")


def test_het_job_rollout_node_down_checkpoints_requeues_and_completes(work):
    """``scontrol update nodename=n2 state=down`` under a running het job (engines on n2): Slurm requeues the
    job and SIGTERMs its steps; the trainer checkpoints the step it is at within KillWait (no periodic
    checkpoint here) and restarts no engine. The node is held out (``state=drain``: this cluster's
    ReturnToService=2 would take it back at once), the job waits; ``state=resume``, the run resumes from that
    checkpoint and completes, every group trained once."""
    steps = 150
    write_config(work, steps)
    job_id, run_dir = submit(work, "down", "run.placement=disaggregate", "train.nprocs=1", "slurm.cpus_per_task=1",
                             "slurm.rollout={nodes: 1, cpus_per_task: 2}")
    scontrol = lambda *a: subprocess.run(["scontrol", "update", "nodename=n2", *a], timeout=30,  # noqa: E731
                                         capture_output=True, text=True)
    try:
        deadline = time.monotonic() + 300
        while steps_done(run_dir) < 5:
            assert time.monotonic() < deadline and query_states([job_id])[job_id] not in FINAL_STATES, job_log(run_dir)
            time.sleep(0.2)
        down = scontrol("state=down", "reason=hpcrl-test")
        assert down.returncode == 0, down.stderr
        scontrol("state=drain", "reason=hpcrl-test")
        while query_states([job_id])[job_id] != "PENDING":
            assert time.monotonic() < deadline, job_log(run_dir)
            time.sleep(0.5)
        whole = "".join(f.read_text(errors="replace") for f in (run_dir / "submitit").glob("*_0_log.err"))
        # at a step boundary ("stopping after rollout K (signal)") or, SIGTERM mid-rollout, the last finished
        # step (EnginesLost "... the job is ending (SIGTERM) ...; saving the checkpoint of rollout K first")
        stopped = re.search(r"stopping after rollout (\d+) \(signal\): checkpoint saved|EnginesLost: no engine "
                            r"left: [^\n]*the job is ending \(SIGTERM\)[^\n]*; saving the checkpoint of rollout "
                            r"(\d+) first", whole)
        assert stopped, job_log(run_dir)
        k = int(stopped.group(1) or stopped.group(2))
        assert (run_dir / "checkpoints" / f"iter_{k:07d}" / "COMPLETE").exists() and 4 <= k < steps - 1, k
        assert "got SIGTERM: Slurm is ending the job" in whole
        time.sleep(15)  # longer than a requeued job takes to start again here (~12 s): it waits for n2
        assert query_states([job_id])[job_id] == "PENDING"
        assert scontrol("state=resume").returncode == 0
        while query_states([job_id])[job_id] not in FINAL_STATES:
            assert time.monotonic() < deadline + 300, job_log(run_dir)
            time.sleep(1)
    finally:
        scontrol("state=resume")
    assert query_states([job_id])[job_id] == "COMPLETED", job_log(run_dir)
    assert steps_done(run_dir) == steps
    whole = "".join(f.read_text(errors="replace") for f in sorted((run_dir / "submitit").glob("*_0_log.err")))
    assert re.search(rf"resumed from \S+iter_{k:07d}: next rollout {k + 1} ", whole), job_log(run_dir)
    assert_each_group_once(work, "down", steps)
