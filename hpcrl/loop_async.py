"""The one-step-off-policy RL loop (``run.mode: async``), written out beside the synchronous one like slime's
``train_async.py`` beside ``train.py``: :func:`train_async_main`.

While the trainer trains step k on rollout k, the engines generate rollout k+1 with the weights of step k-1::

    trainer:  train k ------------| wait | sync k+1 | eval | ckpt | train k+1 -----------| wait | sync ...
    engines:  generate k+1 ---------|                          generate k+2 ---------|

At the step boundary the loop waits for the rollout in flight ("sync generate before update weights",
slime), so the weights change only while the engines are idle, and the checkpoint of step k holds rollout k+1
finished (:class:`PendingRollout`): a resumed run trains on exactly what the uninterrupted one would have. The
samples are one step off policy, so the trainer recomputes the old log-probs with its current weights
(:class:`hpcrl.train.actor.Actor`; TIS against the rollout log-probs with ``algorithm.use_tis``), and each
sample's lag (:func:`hpcrl.rollout.stats.sample_lag`) is logged as ``rollout/lag_mean`` / ``rollout/lag_max``.
``timing/rollout_wait_seconds`` is how long the trainer waited for the engines at the boundary.

Trainer and engines need their own devices (``run.placement: disaggregate``: a het job on Slurm, disjoint CPU
sets on one machine, :mod:`hpcrl.placement`); colocated async is refused at validation.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from hpcrl.config import Config
from hpcrl.run_setup import due
from hpcrl.run_session import RunLog, RunSession, StepFailed, broadcast, sync_weights

if TYPE_CHECKING:
    from concurrent.futures import Future

    from hpcrl.checkpoint.manager import CheckpointManager
    from hpcrl.data.source import DataSource
    from hpcrl.rollout.manager import EngineLauncher, FollowerRollout, RolloutManager
    from hpcrl.train.critic_group import CriticLauncher


def train_async_main(cfg: Config, run_dir: Path, model_path: Path, ci_checks: Optional[bool] = None,
                     launch_engines: Optional["EngineLauncher"] = None,
                     launch_critic: Optional["CriticLauncher"] = None) -> dict[str, Any]:
    """One trainer rank's whole async run; returns the last step's metrics (on the controller the rollout and
    eval ones too), plus ``"preempted": reason`` when it stopped early with a checkpoint.

    Arguments as :func:`hpcrl.loop.train_main`. Raises what a step raises; a rollout that fails is reported
    after the last trained step is checkpointed (without the failed rollout: a rerun generates it again).
    """
    # --- watch, engines, model, data, resume state (with the next rollout, finished), first sync, eval -1 --
    pending = PendingRollout()
    with RunSession(cfg, run_dir, model_path, ci_checks, launch_engines, states={"pending": pending},
                    launch_critic=launch_critic) as s:
        t, rollout, syncer = s.trainer, s.rollout, s.syncer
        actor, data_source, trained, ckpt = t.actor, t.data_source, t.trained, t.ckpt
        stopped: Optional[str] = None
        if pending.rollout_id != t.start:  # a new run (or a checkpoint without it): generate it now
            before = data_source.state_dict()
            finish_rollout(rollout, rollout.generate_async(t.start, data_source, t.multiple),
                           t.start, pending, data_source, before, ckpt.save_before_failing, s.handoff)

        # --- the loop: rollout k+1 is generated while step k trains ----------------------------------
        for rollout_id in range(t.start, cfg.run.num_rollout):
            t_step = time.perf_counter()
            samples, step = pending.take(rollout_id)
            has_next = rollout_id + 1 < cfg.run.num_rollout
            before = data_source.state_dict()  # the data as step k-1 left it, in case rollout k+1 fails
            future = rollout.generate_async(rollout_id + 1, data_source, t.multiple) if has_next else None
            step.update(actor.train(rollout_id, samples))
            trained.extend(rollout_id, samples)
            t_wait = time.perf_counter()
            if has_next:  # the rollout in flight finishes before the weights change (slime train_async.py)
                finish_rollout(rollout, future, rollout_id + 1, pending, data_source, before,
                               lambda message: keep_step(ckpt, s.metrics, rollout_id, step, message), s.handoff)
            step["timing/rollout_wait_seconds"] = time.perf_counter() - t_wait
            step.update(sync_weights(actor, syncer, rollout, version=rollout_id + 1))
            if due(rollout_id, cfg.rollout.eval_interval, cfg.run.num_rollout):
                step.update(rollout.evaluate(rollout_id))
            step["timing/step_seconds"] = time.perf_counter() - t_step
            s.watch.record_step(step["timing/step_seconds"])
            s.log(rollout_id, step)
            stopped = ckpt.end_step(rollout_id)  # the checkpoint holds rollout k+1 (pending)
            if stopped is not None:
                break
        s.finish(stopped)
    return s.result()


def finish_rollout(rollout: "RolloutManager | FollowerRollout", future: "Future", rollout_id: int,
                   pending: "PendingRollout", data_source: "DataSource", before: dict,
                   on_error: Callable[[str], None], handoff: Any = None) -> None:
    """Wait for rollout ``rollout_id`` (:func:`collect`, over the session's ``handoff`` group) and make it the
    pending one on every rank. When it failed: the data source back to ``before`` (its state when the rollout
    started), ``on_error(message)`` (which checkpoints what is finished), then the error is raised
    (RuntimeError on the other ranks)."""
    out = collect(rollout, future, rollout_id, handoff)
    if isinstance(out, StepFailed):
        data_source.load_state_dict(before)
        on_error(out.message)
        raise out.error or RuntimeError(out.message)
    pending.put(rollout_id, *out)


def keep_step(ckpt: "CheckpointManager", metrics: RunLog, rollout_id: int, step: dict[str, Any],
              message: str) -> None:
    """Step ``rollout_id`` is trained but the next rollout failed: log the step and checkpoint it (without a
    pending rollout; a rerun generates it again, from these weights)."""
    metrics.log(rollout_id, step)
    ckpt.save_before_failing(message, finished=rollout_id)


def collect(rollout: "RolloutManager | FollowerRollout", future: "Future", rollout_id: int,
            handoff: Any = None) -> Any:
    """Wait for a rollout started with ``generate_async`` and hand ``(samples, metrics)`` to every trainer rank
    (over the session's ``handoff`` group: :func:`hpcrl.run_session.broadcast`); a
    :class:`~hpcrl.run_session.StepFailed` instead when it raised on the controller."""
    try:
        out = rollout.result(future)
    except Exception as e:  # noqa: BLE001 - every rank learns of it, then it is re-raised
        out = StepFailed(f"rollout {rollout_id} failed on the controller: {type(e).__name__}: {e}", e)
    return broadcast(out, handoff)


class PendingRollout:
    """The next rollout of an async run, finished at the step boundary: its id, samples (flat, group after
    group) and ``rollout/*`` metrics. The checkpoint manager's ``pending`` state, which keeps its samples in
    files (:class:`hpcrl.checkpoint.manager.FileStateful`: the buffer file's ``pending/``; the rest in
    ``state.json``), so a checkpoint at step k holds rollout k+1."""

    file_keys = ("groups",)

    def __init__(self) -> None:
        self.rollout_id: Optional[int] = None
        self.samples: Optional[list] = None
        self.metrics: dict[str, Any] = {}

    def put(self, rollout_id: int, samples: Optional[list], metrics: dict[str, Any]) -> None:
        self.rollout_id, self.samples, self.metrics = rollout_id, samples, dict(metrics)

    def take(self, rollout_id: int) -> tuple[Optional[list], dict[str, Any]]:
        """The samples and metrics of rollout ``rollout_id`` (emptied). Raises RuntimeError when another
        rollout is pending (a bug: the loop always puts the next one before it takes it)."""
        if self.rollout_id != rollout_id:
            raise RuntimeError(f"rollout {rollout_id} is due but the pending rollout is {self.rollout_id}")
        out = (self.samples, self.metrics)
        self.rollout_id, self.samples, self.metrics = None, None, {}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "metrics": dict(self.metrics),
                "groups": [list(self.samples)] if self.samples else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        groups = state.get("groups") or []
        self.rollout_id = state.get("rollout_id")
        self.samples = [s for g in groups for s in g] if self.rollout_id is not None else None
        self.metrics = dict(state.get("metrics") or {})

    def save_files(self, state: dict[str, Any], folder: Path) -> None:
        """Write ``state["groups"]`` as the buffer file's ``pending/`` in checkpoint folder ``folder``."""
        from hpcrl.data.buffer import BUFFER_FILE, write_groups_part

        write_groups_part(Path(folder) / BUFFER_FILE, "pending", state["groups"])

    def load_files(self, state: dict[str, Any], folder: Path) -> dict[str, Any]:
        """``state`` with ``"groups"`` from the buffer file's ``pending/`` in ``folder`` (none without it)."""
        from hpcrl.data.buffer import BUFFER_FILE, read_groups_part

        return {**state, "groups": read_groups_part(Path(folder) / BUFFER_FILE, "pending") or []}
