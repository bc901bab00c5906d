"""PPO with a critic (``algorithm.advantage_estimator: gae``, issue #38 point 2) as a local ``hpcrl run``: the
run of tests/integration/test_preemption_local.py (deterministic, over-sampling, nonzero-std filter) with a
critic beside the actor.

- Sync: the critic's metrics are logged every step and every checkpoint holds its model and optimizer
  (``dist_critic/``); resuming that run folder without a critic is refused in one line. A run stopped by USR2,
  run again, SIGKILLed inside a later step and run again ends with the actor's weights, the critic's model and
  Adam states and every step's critic metrics bitwise equal to the uninterrupted run's (one test for both
  interruptions: one reference, three starts), with the critic on the actor's ranks and on ranks of its own.
- The critic on ranks of its own (``critic.nprocs``, its own processes and Megatron world): the same run as
  with the critic on the actor's ranks (metrics, actor and critic weights), also at another layout of its own
  (DP=2, TP=2); a critic rank that dies ends the run in one line naming it, with no process left behind.
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
PLACEMENTS = {"shared": (), "own": ("critic.nprocs=1",)}
"""The critic on the actor's ranks, or on one process of its own."""
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


def uninterrupted(tmp_path_factory, placement: str):
    """An uninterrupted PPO run with the critic at ``placement``: its exported actor weights, the critic's
    tensors and its metric rows."""
    tmp = tmp_path_factory.mktemp(f"ppo-ref-{placement}")
    proc = start(tmp, "ref", *PPO, *PLACEMENTS[placement])
    assert finish(proc) == 0, (tmp / "ref.log").read_text()[-3000:]
    return tmp, weights(tmp, "ref"), critic_state(tmp, "ref"), metric_rows(tmp, "ref")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted PPO run, the critic on the actor's ranks (:func:`uninterrupted`)."""
    return uninterrupted(tmp_path_factory, "shared")


@pytest.fixture(scope="module")
def reference_own(tmp_path_factory):
    """The uninterrupted PPO run, the critic on a process of its own (:func:`uninterrupted`)."""
    return uninterrupted(tmp_path_factory, "own")


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-3)


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


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_ppo_usr2_then_sigkill_resume_bitwise(tmp_path, request, placement):
    """USR2 after 2 steps (exit 75, checkpoint at the step boundary), the same command again, SIGKILL 0.1 s
    after its first step's metrics row (inside its checkpoint save or the next step: either way the rerun
    redoes what was lost), the same command again: actor, critic (model and Adam) and every step's critic
    metrics equal the uninterrupted run's, with the critic on the actor's ranks or on its own (whose process
    is stopped with the run, killed with it, and started again with each rerun)."""
    _, ref_weights, ref_critic, ref_rows = request.getfixturevalue(
        "reference" if placement == "shared" else "reference_own")
    run_dir = tmp_path / "runs" / "ppo"
    args = (*PPO, "checkpoint.save_interval=1", *PLACEMENTS[placement])
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
    assert wait_gone(critic_workers(tmp_path)), "a critic process outlived the SIGKILLed run"
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
    """A few PPO steps one step off policy (the critic on the actor's ranks) and fully asynchronously (the
    critic on a process of its own), disaggregated: every step logs the critic's metrics and trains it (its
    value loss is computed on each step's rollout)."""
    extra = (("run.deterministic=false", "algorithm.use_tis=true", *PLACEMENTS["own"]) if mode == "fully_async"
             else ())
    proc = start(tmp_path, mode, "algorithm.advantage_estimator=gae", "run.num_rollout=2", f"run.mode={mode}",
                 "run.placement=disaggregate", *extra)
    assert finish(proc) == 0, (tmp_path / f"{mode}.log").read_text()[-3000:]
    rows = metric_rows(tmp_path, mode)
    assert len(rows) == 2 and all(all(k in r for k in CRITIC_METRICS) for r in rows), rows[-1].keys()


def critic_workers(tmp_path: Path) -> list[int]:
    """PIDs of the critic worker processes of runs under ``tmp_path`` (their link's secret lies there)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "hpcrl.train.critic_worker" in cmd and str(tmp_path) in cmd:
                out.append(int(proc.name))
    return out


def wait_gone(pids: list[int], timeout: float = 15.0) -> bool:
    """Whether the processes ``pids`` all exit within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_critic_on_its_own_ranks_trains_as_on_the_actors(reference, reference_own):
    """The critic in a process of its own (its own Megatron world, fed over the link) gives the run the critic
    on the actor's ranks gives: every step's critic and actor metrics, the actor's and the critic's final
    tensors (to float rounding; the same code at the same layout and threads), a ``dist_critic/`` written by its
    own process into the same checkpoint (listed in ``COMPLETE``), and how long the actor waited for it."""
    from hpcrl.checkpoint import find_latest_checkpoint, read_marker

    tmp, ref_weights, ref_critic, ref_rows = reference
    own_tmp, own_weights, own_critic, own_rows = reference_own
    assert [r["step"] for r in own_rows] == list(range(STEPS))
    for ref, own in zip(ref_rows, own_rows, strict=True):
        for key in (*CRITIC_METRICS[:3], "critic/grad_norm", "train/loss", "train/grad_norm"):
            assert close(ref[key], own[key], 1e-5), (own["step"], key, ref[key], own[key])
        assert 0 <= own["critic/wait_seconds"] <= own["train/seconds"]
    assert all((own_weights[k] - v).abs().max() <= 1e-5 for k, v in ref_weights.items())
    assert own_critic.keys() == ref_critic.keys()
    assert all((own_critic[k].float() - v.float()).abs().max() <= 1e-5 for k, v in ref_critic.items())
    marker = read_marker(find_latest_checkpoint(own_tmp / "runs" / "ref"))
    assert marker["models"]["critic"]["optimizer"] == "saved"
    assert any(f.startswith("dist_critic/") for f in marker["files"])
    assert (own_tmp / "runs" / "ref" / "logs" / "attempt-0" / "critic-0.log").is_file()


def test_critic_layout_of_its_own(tmp_path, reference):
    """Four critic processes of their own, two data-parallel ranks of tensor-parallel pairs: the first steps'
    critic metrics are those of the critic on the actor's single rank (to the rounding of another split), and
    the actor trains the same."""
    steps = 2
    proc = start(tmp_path, "layout", *PPO, f"run.num_rollout={steps}", "critic.nprocs=4",
                 "critic.tensor_parallel_size=2")
    assert finish(proc) == 0, (tmp_path / "layout.log").read_text()[-3000:]
    rows = metric_rows(tmp_path, "layout")
    for ref, got in zip(reference[3][:steps], rows, strict=True):
        for key in (*CRITIC_METRICS[:3], "critic/grad_norm", "train/loss"):
            assert close(ref[key], got[key], 1e-3), (got["step"], key, ref[key], got[key])


def test_a_critic_rank_that_dies_ends_the_run_in_one_line(tmp_path):
    """SIGKILL to the critic's process after the first step: the run exits 1 at once with one line naming the
    critic's rank, its exit status and log (the traceback goes to the attempt's log), and leaves no process."""
    run_dir = tmp_path / "runs" / "dies"
    proc = start(tmp_path, "dies", *PPO, "run.num_rollout=50", *PLACEMENTS["own"])
    wait_steps(proc, run_dir, 1)
    pids = critic_workers(tmp_path)
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    assert finish(proc, timeout=120) == 1
    last = (tmp_path / "dies.log").read_text().strip().splitlines()[-1]
    assert last.startswith("hpcrl run: error: CriticError: "), last
    assert "critic rank 0" in last and "exited with status -9" in last and "critic-0.log" in last, last
    assert steps_done(run_dir) < 50
