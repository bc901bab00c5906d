"""PPO with a critic (``algorithm.advantage_estimator: gae``, issue #38 point 2) as a local ``hpcrl run``: the
run of tests/integration/test_preemption_local.py (deterministic, over-sampling, nonzero-std filter) with a
critic beside the actor.

- Sync: the critic's metrics are logged every step and every checkpoint holds its model and optimizer
  (``dist_critic/``); resuming that run folder without a critic is refused in one line. A run stopped by USR2, run again, SIGKILLed inside a later step and run again ends with
  the actor's weights, the critic's model and Adam states and every step's critic metrics bitwise equal to
  the uninterrupted run's (one test for both interruptions: one reference, three starts).
- The one-step-off (``async``) and fully asynchronous loops run PPO for a few steps, critic metrics logged.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.integration.test_preemption_local import finish, start, steps_done, wait_steps, weights

pytestmark = pytest.mark.integration

STEPS = 5
PPO = ("algorithm.advantage_estimator=gae", f"run.num_rollout={STEPS}")
CRITIC_METRICS = ("critic/value_loss", "critic/explained_variance", "critic/value_clipfrac", "critic/seconds")


def metric_rows(tmp_path: Path, name: str) -> list[dict]:
    """The training steps' rows of run ``name``'s ``metrics.jsonl``."""
    rows = [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] >= 0]


def critic_state(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of the critic's distributed checkpoint (model and Adam states) in run ``name``'s newest
    checkpoint, read with torch DCP's converter (no process group, no model)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hpcrl.checkpoint import find_latest_checkpoint

    ckpt = find_latest_checkpoint(tmp_path / "runs" / name)
    assert ckpt is not None and ckpt.name == f"iter_{STEPS - 1:07d}"
    out = tmp_path / f"{name}-critic.pt"
    dcp_to_torch_save(ckpt / "dist_critic", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v)}


def critic_values(rows: list[dict]) -> list[list[float]]:
    """Each step's critic metrics but its seconds (timing)."""
    return [[r[k] for k in CRITIC_METRICS if k != "critic/seconds"] for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted PPO run: its exported actor weights, the critic's tensors and its metric rows."""
    tmp = tmp_path_factory.mktemp("ppo-ref")
    proc = start(tmp, "ref", *PPO)
    assert finish(proc) == 0, (tmp / "ref.log").read_text()[-3000:]
    return tmp, weights(tmp, "ref"), critic_state(tmp, "ref"), metric_rows(tmp, "ref")


def test_ppo_logs_the_critic_and_checkpoints_it(reference):
    tmp, _, critic, rows = reference
    assert len(rows) == STEPS
    assert all(all(k in r for k in CRITIC_METRICS) for r in rows), rows[0].keys()
    assert any(r["critic/value_loss"] > 0 for r in rows)
    from hpcrl.checkpoint import find_latest_checkpoint, read_marker

    marker = read_marker(find_latest_checkpoint(tmp / "runs" / "ref"))
    assert marker["models"]["critic"]["optimizer"] == "saved"
    assert any(k.startswith("optimizer") for k in critic) and any(k.startswith("decoder.") for k in critic)
    # the same run folder resumed without the critic (GRPO): refused in one line naming the checkpoint and fix
    proc = start(tmp, "ref", f"run.num_rollout={STEPS + 1}")
    assert finish(proc) == 1
    last = (tmp / "ref.log").read_text().strip().splitlines()[-1]
    assert last.startswith("hpcrl run: error: CheckpointError: checkpoint ") and "holds a critic model" in last
    assert "start a new run in another run folder" in last


def test_ppo_usr2_then_sigkill_resume_bitwise(tmp_path, reference):
    """USR2 after 2 steps (exit 75, checkpoint at the step boundary), the same command again, SIGKILL 0.1 s
    after its first step's metrics row (inside its checkpoint save or the next step: either way the rerun
    redoes what was lost), the same command again: actor, critic (model and Adam) and every step's critic
    metrics equal the uninterrupted run's."""
    _, ref_weights, ref_critic, ref_rows = reference
    run_dir = tmp_path / "runs" / "ppo"
    args = (*PPO, "checkpoint.save_interval=1")
    proc = start(tmp_path, "ppo", *args)
    wait_steps(proc, run_dir, 2)
    os.kill(proc.pid, signal.SIGUSR2)
    assert finish(proc) == 75, (tmp_path / "ppo.log").read_text()[-3000:]
    stopped = steps_done(run_dir)
    assert stopped < STEPS - 1, "the run ended before the kill could land"
    proc = start(tmp_path, "ppo", *args)
    wait_steps(proc, run_dir, stopped + 1)
    time.sleep(0.1)  # inside the next step
    proc.kill()
    proc.wait()
    proc = start(tmp_path, "ppo", *args)
    assert finish(proc) == 0, (tmp_path / "ppo.log").read_text()[-3000:]
    assert (tmp_path / "ppo.log").read_text().count("resumed from") == 2
    rows = metric_rows(tmp_path, "ppo")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert critic_values(rows) == critic_values(ref_rows)
    got = weights(tmp_path, "ppo")
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "the resumed actor diverged"
    critic = critic_state(tmp_path, "ppo")
    assert critic.keys() == ref_critic.keys()
    assert all(critic[k].equal(v) for k, v in ref_critic.items()), "the resumed critic diverged"


@pytest.mark.parametrize("mode", ["async", "fully_async"])
def test_ppo_runs_in_the_asynchronous_loops(tmp_path, mode):
    """A few PPO steps one step off policy and fully asynchronously (disaggregated): every step logs the
    critic's metrics and trains it (its value loss is computed on each step's rollout)."""
    extra = ("run.deterministic=false", "algorithm.use_tis=true") if mode == "fully_async" else ()
    proc = start(tmp_path, mode, "algorithm.advantage_estimator=gae", "run.num_rollout=2", f"run.mode={mode}",
                 "run.placement=disaggregate", *extra)
    assert finish(proc) == 0, (tmp_path / f"{mode}.log").read_text()[-3000:]
    rows = metric_rows(tmp_path, mode)
    assert len(rows) == 2 and all(all(k in r for k in CRITIC_METRICS) for r in rows), rows[-1].keys()
