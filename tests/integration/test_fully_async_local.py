"""Fully asynchronous training on one machine (issue #37 points 1, 3 and 5): ``run.mode: fully_async``,
disaggregated on disjoint CPU sets, the tiny model, the engine the bottleneck (two running requests, 48-token
answers) so that groups are always in flight, weight updates land on them in place (the mode's default
``weights.pause_mode``), every step's checkpoint takes their partial responses (an abort, then they are
continued), and ``rollout.stale_policy: drop`` with ``max_staleness: 1``.

One run, interrupted twice: USR2 after 3 steps (stops with a checkpoint, exit 75), the same command again
(resumes), SIGKILL inside a step after two more, the same command again until the end. Timing decides what
is trained, so nothing is compared bitwise; the checks are the accounting: every drawn group is trained,
filtered, dropped, finished-and-waiting, in flight or pushed back, exactly once; no sample is trained twice;
the partial responses a checkpoint holds are continued (their tokens kept) after the resume.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.test_preemption_local import finish, start, steps_done, wait_steps

pytestmark = pytest.mark.integration

STEPS = 8
K = 1
FULLY_ASYNC = ("run.mode=fully_async", "run.placement=disaggregate", "run.deterministic=false",
               f"run.num_rollout={STEPS}", "data.num_train=24", "rollout.max_new_tokens=48",
               "sglang.max_running_requests=2", f"rollout.max_staleness={K}",
               "rollout.stale_policy=drop", "checkpoint.save_interval=1", "checkpoint.keep_last=20",
               "algorithm.use_tis=true")


def checkpoint_parts(folder: Path) -> dict:
    """A checkpoint's stream: trained rows, ledger, finished / in-flight / pushed-back groups, data source."""
    import h5py

    from hpcrl.data.buffer import BUFFER_FILE, read_groups_part, read_trained

    path = folder / BUFFER_FILE
    with h5py.File(path, "r") as f:
        ledger = f["stream_ledger"][()].reshape(-1, 3).tolist()
    state = json.loads((folder / "state.json").read_text())
    return {"trained": read_trained(path), "ledger": ledger, "finished": read_groups_part(path, "finished"),
            "inflight": read_groups_part(path, "inflight"), "pushed": read_groups_part(path, "groups") or [],
            "data_source": state["data_source"], "rollout_id": state["rollout_id"]}


def assert_nothing_lost_or_trained_twice(run_dir: Path) -> None:
    """The run's last checkpoint: no sample trained twice, and every drawn group trained, filtered, dropped,
    finished, in flight or pushed back exactly once."""
    from hpcrl.checkpoint import find_latest_checkpoint

    parts = checkpoint_parts(find_latest_checkpoint(run_dir))
    rows = parts["trained"].tolist()
    assert len({(g, i) for _, g, i in rows}) == len(rows)
    waiting = [g[0].group_index for part in ("finished", "inflight", "pushed") for g in parts[part]]
    accounted = sorted({g for _, g, _ in rows}) + [g for _, g, k in parts["ledger"] if k in (0, 1)] + waiting
    ds = parts["data_source"]
    assert sorted(accounted) == list(range(ds["epoch"] * ds["num_items"] + ds["offset"]))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The run, USR2'd, resumed, SIGKILLed and rerun: (tmp, run dir, copy of the USR2 checkpoint, steps done
    at USR2)."""
    from hpcrl.checkpoint import find_latest_checkpoint

    tmp = tmp_path_factory.mktemp("fully-async")
    run_dir = tmp / "runs" / "fa"
    proc = start(tmp, "fa", *FULLY_ASYNC)
    wait_steps(proc, run_dir, 3)
    os.kill(proc.pid, signal.SIGUSR2)
    assert finish(proc) == 75, (tmp / "fa.log").read_text()[-3000:]
    at_usr2 = steps_done(run_dir)
    usr2_ckpt = tmp / "usr2-checkpoint"
    shutil.copytree(find_latest_checkpoint(run_dir), usr2_ckpt)

    proc = start(tmp, "fa", *FULLY_ASYNC)
    wait_steps(proc, run_dir, min(at_usr2 + 2, STEPS - 1))
    time.sleep(0.1)
    proc.kill()
    proc.wait()
    proc = start(tmp, "fa", *FULLY_ASYNC)
    assert finish(proc) == 0, (tmp / "fa.log").read_text()[-3000:]
    return tmp, run_dir, usr2_ckpt, at_usr2


def test_every_drawn_group_is_accounted_for_once_and_no_sample_is_trained_twice(interrupted):
    from hpcrl.checkpoint import find_latest_checkpoint

    tmp, run_dir, _, _ = interrupted
    log = (tmp / "fa.log").read_text()
    assert log.count("resumed from") == 2
    final = find_latest_checkpoint(run_dir)
    assert final.name == f"iter_{STEPS - 1:07d}"
    parts = checkpoint_parts(final)
    rows = parts["trained"]
    assert len({(g, i) for _, g, i in rows.tolist()}) == len(rows)  # no sample trained twice
    assert sorted(set(rows[:, 0].tolist())) == list(range(STEPS))  # every step trained something
    per_group: dict[int, int] = {}
    for _, g, _ in rows.tolist():
        per_group[g] = per_group.get(g, 0) + 1
    assert set(per_group.values()) == {4}  # whole groups
    ledger = {kind: [g for _, g, k in parts["ledger"] if k == kind] for kind in (0, 1, 2)}
    waiting = [g[0].group_index for part in ("finished", "inflight", "pushed") for g in parts[part]]
    accounted = sorted(per_group) + ledger[0] + ledger[1] + waiting
    ds = parts["data_source"]
    drawn = ds["epoch"] * ds["num_items"] + ds["offset"]
    assert ds["epoch"] >= 1  # the run crossed an epoch of its 24 prompts (32 groups trained)
    assert sorted(accounted) == list(range(drawn))  # each drawn group exactly once
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] >= 0]
    assert [m["step"] for m in steps] == list(range(STEPS))  # one line per step, none repeated
    # drop: no token staler than K is trained (per-token versions; the per-call lag also counts calls an
    # update aborted before they sampled a token, so it may read higher)
    assert all(m["rollout/staleness_max"] <= K for m in steps)
    assert all("timing/rollout_wait_seconds" in m for m in steps)
    assert sum(m["rollout/groups_continued"] for m in steps) > 0  # checkpoints took partial responses mid-way


def test_partial_responses_of_a_checkpoint_are_continued_after_the_resume(interrupted):
    """The USR2 checkpoint holds in-flight groups with partial responses (tokens, log-probs, versions); after
    the resume they are all handed back (``rollout/groups_resumed_partial``), and each of those samples is
    trained (whole), filtered or dropped with its group (both only ever happen to a group whose generation
    finished), or still waiting with its saved prefix; nothing of the checkpoint's finished or in-flight
    groups is lost."""
    from hpcrl.checkpoint import find_latest_checkpoint

    _, run_dir, usr2_ckpt, at_usr2 = interrupted
    saved = checkpoint_parts(usr2_ckpt)
    assert saved["rollout_id"] == at_usr2 - 1
    partial = {s.index: s for g in saved["inflight"] for s in g if s.response_length > 0
               and s.status.value == "pending"}
    assert partial, "the checkpoint holds no partial response"
    for s in partial.values():
        assert len(s.rollout_log_probs) == s.response_length == len(s.tokens) - s.prompt_length
        assert s.weight_versions and int(s.weight_versions[-1]) <= at_usr2
    metrics = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    partial_groups = sum(any(s.response_length for s in g) for g in saved["inflight"])
    assert metrics[at_usr2]["rollout/groups_resumed_partial"] == partial_groups  # all handed back
    final = checkpoint_parts(find_latest_checkpoint(run_dir))
    trained = {i for _, _, i in final["trained"].tolist()}
    later = {s.index: s for part in ("finished", "inflight", "pushed") for g in final[part] for s in g}
    filtered_or_dropped = {g for _, g, k in final["ledger"] if k in (0, 1)}
    for i, s in partial.items():
        assert i in trained or i in later or s.group_index in filtered_or_dropped, f"sample {i} was lost"
        if i in later and later[i].response_length:  # still waiting: continued from its saved prefix
            assert later[i].tokens[:len(s.tokens)] == s.tokens
            assert later[i].rollout_log_probs[:s.response_length] == s.rollout_log_probs
    saved_groups = {g[0].group_index for part in ("finished", "inflight") for g in saved[part]}
    final_groups = {g for _, g, _ in final["trained"].tolist()} | {g for _, g, _ in final["ledger"]} | {
        g[0].group_index for part in ("finished", "inflight", "pushed") for g in final[part]}
    assert saved_groups <= final_groups


def test_engine_killed_mid_generation_is_replaced_and_the_stream_goes_on(tmp_path):
    """Point 6: the engine, always busy in this run, SIGKILLed twice mid-generation: the health monitor
    replaces it (weights from the snapshot of the last sync), the streamed responses continue, the run
    completes, and the accounting holds (no sample trained twice, every drawn group once)."""
    from tests.integration.test_fault_tolerance import kill_engine_at

    steps = 10
    proc = start(tmp_path, "kill", *FULLY_ASYNC, f"run.num_rollout={steps}", "checkpoint.save_interval=0",
                 "rollout.heartbeat_interval_s=1", "rollout.heartbeat_timeout_s=3", "rollout.partial_rollout=true",
                 "rollout.max_engine_restarts=5")
    run_dir = tmp_path / "runs" / "kill"
    kill_engine_at(proc, run_dir, (2, 5))
    assert finish(proc) == 0, (tmp_path / "kill.log").read_text()[-3000:]
    steps_logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [m for m in steps_logged if m["step"] >= 0]
    assert [m["step"] for m in steps_logged] == list(range(steps))
    assert sum(m["rollout/engine_restarts"] for m in steps_logged) == 2
    assert sum(m["rollout/kept_partial_tokens"] for m in steps_logged) > 0  # streams cut by a kill, continued
    assert_nothing_lost_or_trained_twice(run_dir)


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_het_job_usr2_requeue_loses_nothing(tmp_path, monkeypatch, slurm_cluster):
    """The fully-async run as a het job on the local Slurm cluster (trainer on n1, engine on n2), USR2
    mid-run: it checkpoints the stream, requeues, resumes and completes; every drawn group once, no sample
    trained twice, one metrics line per step."""
    from tests.integration.test_preemption_local import write_config
    from tests.integration.test_preemption_slurm import job_log, metric_steps, submit, wait_final
    from tests.integration.test_preemption_slurm import wait_steps as wait_job_steps

    write_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    job_id, run_dir = submit(tmp_path, "het", *FULLY_ASYNC, "slurm.cpus_per_task=1",
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
    assert_nothing_lost_or_trained_twice(run_dir)
