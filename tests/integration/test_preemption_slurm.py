"""Preemption on the real local Slurm cluster (issue #5 point 4): a run submitted with ``hpcrl submit`` is
interrupted five ways - preempted by a job in the higher-priority ``urgent`` partition, ``scancel --signal=USR2``,
its time limit (with requeue), ``scontrol requeue`` and SIGKILL of the trainer step - and each time it resumes
from its run folder and completes. The first four are checked for exactness against an uninterrupted local run
of the same config (bitwise-equal weights, the same samples trained in the same steps, each once): Slurm's
signal, the checkpoint and the requeue lose nothing. The time-limit run is longer and checked for "every step
once, every group once".

The run is the deterministic over-sampling config of ``test_preemption_local.py`` (12 groups submitted for 4,
nonzero-std filter: the data buffer holds finished and aborted groups across the restart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpcrl.slurm.state import FINAL_STATES, query_states
from tests.integration.test_preemption_local import (STEPS, finish, start, steps_done, trained, weights,
                                                     write_config)

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.timeout(900)]

HPCRL = Path(sys.executable).with_name("hpcrl")
SLURM = ["slurm.cpus_per_task=2", "slurm.time=00:10:00", "slurm.signal=USR2@60", "slurm.requeue=true"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, locally (``hpcrl run``): exported weights and trained-sample rows."""
    tmp = tmp_path_factory.mktemp("slurm-preempt-ref")
    proc = start(tmp, "ref")
    assert finish(proc) == 0, (tmp / "ref.log").read_text()[-3000:]
    return weights(tmp, "ref"), trained(tmp, "ref")


@pytest.fixture
def work(tmp_path, monkeypatch, slurm_cluster):
    """Submit directory with the run config and the reward module; the job inherits PYTHONPATH and
    OMP_NUM_THREADS=1 (the same threads as the reference run)."""
    write_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def submit(work: Path, name: str, *overrides: str) -> tuple[str, Path]:
    out = subprocess.run([str(HPCRL), "submit", "run.yaml", f"run.name={name}", *SLURM, *overrides], cwd=work,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()  # "submitted job ID (launcher): RUN_DIR"
    return words[words.index("job") + 1], Path(words[words.index("job") + 3])


def job_log(run_dir: Path, tail: int = 3000) -> str:
    """The task logs of every attempt (Slurm appends on requeue), the last ``tail`` characters of each."""
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                     for p in sorted((run_dir / "submitit").glob("*_log.*")))


def wait_steps(job_id: str, run_dir: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(run_dir) < n:
        assert query_states([job_id])[job_id] not in FINAL_STATES, job_log(run_dir)
        assert time.monotonic() < deadline, f"no {n} steps in {timeout} s\n{job_log(run_dir)}"
        time.sleep(0.2)


def wait_final(job_id: str, run_dir: Path, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while (state := query_states([job_id])[job_id]) not in FINAL_STATES:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=30)
            pytest.fail(f"job {job_id} still {state} after {timeout} s\n{job_log(run_dir)}")
        time.sleep(0.5)
    return state


def attempts(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "logs").glob("attempt-*"))


def node_of(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def check_exact(work: Path, name: str, reference) -> None:
    ref_weights, ref_rows = reference
    rows = trained(work, name)
    np.testing.assert_array_equal(rows, ref_rows)  # the same samples, in the same steps, each once
    got = weights(work, name)
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "the resumed run diverged"


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"step": -1' not in line]


def finish_and_check(work: Path, job_id: str, run_dir: Path, reference, min_attempts: int = 2) -> None:
    assert wait_final(job_id, run_dir) == "COMPLETED", job_log(run_dir)
    assert len(attempts(run_dir)) >= min_attempts, (attempts(run_dir), job_log(run_dir))
    assert metric_steps(run_dir) == list(range(STEPS))  # one metrics line per step, none repeated
    check_exact(work, run_dir.name, reference)


def test_scancel_usr2_checkpoints_requeues_and_resumes_exactly(work, reference):
    job_id, run_dir = submit(work, "usr2")
    wait_steps(job_id, run_dir, 2)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    finish_and_check(work, job_id, run_dir, reference)
    log = job_log(run_dir, tail=10**6)
    assert "(signal)" in log and "requeueing job" in log


def test_preempted_by_urgent_partition_resumes_exactly(work, reference):
    job_id, run_dir = submit(work, "preempted")
    wait_steps(job_id, run_dir, 2)
    node = node_of(job_id)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", node, "-c", "2", "-t", "1",
                             "-o", str(work / "urgent.out"), "--wrap", "sleep 5"],
                            capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    finish_and_check(work, job_id, run_dir, reference)
    assert wait_final(urgent, work) == "COMPLETED"
    states = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-o", "State", "-j", job_id], capture_output=True,
                            text=True, timeout=30).stdout.split()
    assert "PREEMPTED" in states or "REQUEUED" in states, states  # Slurm's preemption, not our own requeue
    assert "(signal)" in job_log(run_dir, tail=10**6)  # preempt_send_user_signal: USR2 came first, we checkpointed


def test_scontrol_requeue_without_signal_resumes_from_last_checkpoint(work, reference):
    """``scontrol requeue`` sends no USR2 (SIGTERM, then SIGKILL after KillWait): the steps since the last
    checkpoint are lost and redone exactly."""
    job_id, run_dir = submit(work, "requeued", "checkpoint.save_interval=2")
    wait_steps(job_id, run_dir, 3)
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
    finish_and_check(work, job_id, run_dir, reference)


def test_sigkill_of_trainer_step_then_requeue_resumes_exactly(work, reference):
    job_id, run_dir = submit(work, "killed", "checkpoint.save_interval=1")
    wait_steps(job_id, run_dir, 3)
    subprocess.run(["scancel", "--signal=KILL", f"{job_id}.0"], check=True, timeout=30)  # step 0: the trainer
    assert wait_final(job_id, run_dir, timeout=120) == "FAILED"
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)  # what the user (or a site) does
    time.sleep(1)
    finish_and_check(work, job_id, run_dir, reference)


def test_time_limit_requeues_and_completes(work):
    """A 2-minute limit with ``USR2@40`` (Slurm may send it up to 60 s early) on a run that needs more than
    one such allocation (no filter, so late steps, all correct, still train): each attempt checkpoints before
    its limit (signal, or our own deadline) and is requeued."""
    steps = 400  # ~3.5 steps/s here: ~2 min of work, so at least one limit is hit
    job_id, run_dir = submit(work, "timelimit", f"run.num_rollout={steps}", "slurm.time=00:02:00",
                             "slurm.signal=USR2@40", "rollout.dynamic_filter=null")  # the filter runs dry late
    assert wait_final(job_id, run_dir, timeout=840) == "COMPLETED", job_log(run_dir)
    assert len(attempts(run_dir)) >= 2, job_log(run_dir)
    assert metric_steps(run_dir) == list(range(steps))
    rows = trained(work, "timelimit", steps)
    assert sorted(set(rows[:, 0].tolist())) == list(range(steps))
    assert len(set(rows[:, 2].tolist())) == len(rows)  # each sample trained once
    sacct = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-o", "State", "-j", job_id], capture_output=True,
                           text=True, timeout=30).stdout.split()
    assert "TIMEOUT" not in sacct, sacct  # it left before the limit each time
