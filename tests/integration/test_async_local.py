"""One-step-off async training on one machine (issue #11): ``run.mode: async`` with ``run.placement:
disaggregate`` as a local ``hpcrl run``, the trainer and the engine on disjoint CPU sets.

The run of tests/integration/test_preemption_local.py (deterministic, over-sampling and the nonzero-std filter,
so groups are held back between steps), in async mode: two runs of one seed end bitwise equal; a run stopped by
USR2, or SIGKILLed, and run again ends bitwise equal to the uninterrupted one with the same trained rows (the
checkpoint at step k holds rollout k+1, generated with the weights of step k-1); every sample after the first
rollout is one step off policy (``rollout/lag_*``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.integration.run_utils import engine_log as engine_log_of
from tests.integration.test_preemption_local import (STEPS, _alive, _cmdline, descendants, finish, start,
                                                     steps_done, trained, wait_steps, weights)

pytestmark = pytest.mark.integration

ASYNC = ("run.mode=async", "run.placement=disaggregate")


def run_async(tmp_path: Path, name: str, *overrides: str):
    return start(tmp_path, name, *ASYNC, *overrides)


def cpus_allowed(pid: int) -> set[int]:
    """The CPUs process ``pid`` may run on (``Cpus_allowed_list`` in /proc)."""
    from hpcrl.placement import parse_cpu_list

    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return set(parse_cpu_list(line.split(":", 1)[1].strip()))
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted async run: its exported weights, trained rows and metrics rows."""
    tmp = tmp_path_factory.mktemp("async-ref")
    proc = run_async(tmp, "ref")
    assert finish(proc) == 0, (tmp / "ref.log").read_text()[-3000:]
    rows = trained(tmp, "ref")
    assert rows.shape == (STEPS * 16, 3) and len(set(rows[:, 2].tolist())) == len(rows)  # each sample once
    metrics = [json.loads(line) for line in (tmp / "runs" / "ref" / "metrics.jsonl").read_text().splitlines()]
    return tmp, weights(tmp, "ref"), rows, [m for m in metrics if m["step"] >= 0]


def test_async_run_is_one_step_off_and_deterministic(tmp_path, reference):
    """Rollout 0 comes from the initial weights (lag 0); every later rollout k from the weights of step k-1
    (lag 1), and the trainer recomputes the old log-probs (they differ from the rollout's). A second run of the
    same seed ends bitwise equal, and the trainer and the engine each ran on their own CPU."""
    _, ref_weights, ref_rows, metrics = reference
    assert [m["rollout/lag_max"] for m in metrics] == [0] + [1] * (STEPS - 1)
    assert [m["rollout/weight_version"] for m in metrics] == ["0"] + [str(k - 1) for k in range(1, STEPS)]
    assert all(m["train/train_rollout_logprob_abs_diff"] > 0 for m in metrics[1:])  # off policy
    assert all("timing/rollout_wait_seconds" in m for m in metrics)
    config = (reference[0] / "runs" / "ref" / "config.yaml").read_text()
    assert "mode: async" in config and "placement: disaggregate" in config

    proc = run_async(tmp_path, "again")
    run_dir = tmp_path / "runs" / "again"
    wait_steps(proc, run_dir, 2)
    # placement: the trainer on train.cpus, the engine and the router on rollout.cpus, disjoint
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    from hpcrl.placement import parse_cpu_list

    train_cpus, rollout_cpus = set(parse_cpu_list(cfg["train"]["cpus"])), set(parse_cpu_list(cfg["rollout"]["cpus"]))
    assert train_cpus and rollout_cpus and not train_cpus & rollout_cpus
    assert train_cpus | rollout_cpus == os.sched_getaffinity(0)  # the even split of what the run may use
    assert cpus_allowed(proc.pid) == train_cpus
    children = {pid: _cmdline(pid) for pid in descendants(proc.pid) if _alive(pid)}
    engines = [pid for pid, cmd in children.items() if "hpcrl.engine.server" in cmd]
    routers = [pid for pid, cmd in children.items() if "router" in cmd and pid not in engines]
    assert len(engines) == 1 and routers, children
    assert all(cpus_allowed(pid) == rollout_cpus for pid in engines + routers)
    assert finish(proc) == 0, (tmp_path / "again.log").read_text()[-3000:]
    engine_log = engine_log_of(run_dir / "logs" / "attempt-0")
    assert f", {len(rollout_cpus)} torch thread(s)" in engine_log  # one engine thread per CPU
    # disaggregated: every sync went over the distributed group inside a weight-update session (SGLang 0.5.23
    # refuses that update outside one: hpcrl.engine.state), the first one and one per step
    assert cfg["weights"]["method"] == "distributed"
    assert engine_log.count("weight-update session opened") \
        == engine_log.count("weight-update session closed") == STEPS + 1
    np.testing.assert_array_equal(trained(tmp_path, "again"), ref_rows)
    got = weights(tmp_path, "again")
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "two async runs of one seed differ"


def test_async_usr2_resumes_exactly_with_the_next_rollout(tmp_path, reference):
    """USR2: the run stops at a step boundary with a checkpoint that holds the finished next rollout
    (``buffer.h5`` ``pending/``); the same command again ends bitwise equal to the uninterrupted run."""
    from hpcrl.checkpoint import find_latest_checkpoint
    from hpcrl.data.buffer import BUFFER_FILE, read_pending

    _, ref_weights, ref_rows, _ = reference
    run_dir = tmp_path / "runs" / "usr2"
    proc = run_async(tmp_path, "usr2")
    wait_steps(proc, run_dir, 3)
    os.kill(proc.pid, signal.SIGUSR2)
    assert finish(proc) == 75, (tmp_path / "usr2.log").read_text()[-3000:]
    done = steps_done(run_dir)
    assert 3 <= done < STEPS
    ckpt = find_latest_checkpoint(run_dir)
    assert ckpt.name == f"iter_{done - 1:07d}"
    pending = read_pending(ckpt / BUFFER_FILE)
    assert pending and {s.rollout_id for g in pending for s in g} == {done}  # rollout k+1, finished
    assert {s.weight_versions[0] for g in pending for s in g} == {str(done - 1)}  # weights of step k-1
    state = json.loads((ckpt / "state.json").read_text())
    assert state["pending"]["rollout_id"] == done and "rollout/reward_mean" in state["pending"]["metrics"]
    proc = run_async(tmp_path, "usr2")
    assert finish(proc) == 0, (tmp_path / "usr2.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "usr2.log").read_text()
    assert steps_done(run_dir) == STEPS
    np.testing.assert_array_equal(trained(tmp_path, "usr2"), ref_rows)
    got = weights(tmp_path, "usr2")
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "resumed async run diverged"


def test_async_sigkill_then_rerun_resumes_exactly(tmp_path, reference):
    """SIGKILL somewhere inside a step (checkpoint every step): the rerun redoes the lost steps exactly."""
    _, ref_weights, ref_rows, _ = reference
    run_dir = tmp_path / "runs" / "kill"
    proc = run_async(tmp_path, "kill", "checkpoint.save_interval=1")
    wait_steps(proc, run_dir, 3)
    time.sleep(0.2)
    proc.kill()
    proc.wait()
    proc = run_async(tmp_path, "kill", "checkpoint.save_interval=1")
    assert finish(proc) == 0, (tmp_path / "kill.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "kill.log").read_text()
    np.testing.assert_array_equal(trained(tmp_path, "kill"), ref_rows)
    got = weights(tmp_path, "kill")
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "rerun async run diverged"


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_async_het_job_preempted_by_usr2_resumes_exactly(tmp_path, monkeypatch, slurm_cluster, reference):
    """The same async run as a het job on the local Slurm cluster (trainer on n1, engine on n2, one thread
    each like the local reference), USR2 mid-run: it checkpoints with the next rollout, requeues, resumes and
    ends bitwise equal to the uninterrupted local run, every sample trained once."""
    from tests.integration.test_preemption_local import write_config
    from tests.integration.test_preemption_slurm import job_log, metric_steps, submit, wait_final
    from tests.integration.test_preemption_slurm import wait_steps as wait_job_steps

    _, ref_weights, ref_rows, _ = reference
    write_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the engine's threads, as in the local run
    job_id, run_dir = submit(tmp_path, "het", *ASYNC, "slurm.cpus_per_task=1",
                             "slurm.rollout={nodes: 1, cpus_per_task: 1}")
    try:
        wait_job_steps(job_id, run_dir, 3)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        assert wait_final(job_id, run_dir) == "COMPLETED", job_log(run_dir)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    log = job_log(run_dir, tail=10**6)
    assert "(signal)" in log and "requeueing job" in log
    assert metric_steps(run_dir) == list(range(STEPS))
    engine = json.loads((run_dir / "logs" / "attempt-0" / "engines" / "engine-0.json").read_text())
    assert engine["node"] == "n2"  # het group 1
    np.testing.assert_array_equal(trained(tmp_path, "het"), ref_rows)
    got = weights(tmp_path, "het")
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "the resumed async het job diverged"
