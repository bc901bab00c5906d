"""The run's checkpoint manager: one owner of the resume state and of when it is saved (torchtitan's
``CheckpointManager`` is the model).

The loop hands it, once, the Megatron model and optimizer and a dict of *stateful* objects (anything with
``state_dict()`` / ``load_state_dict(state)``):

=================  ==================================================  ==========================================
name               object                                              where it is written
=================  ==================================================  ==========================================
``progress``       :class:`RolloutCounter` (last finished rollout id)   ``state.json`` ``rollout_id``
``data_source``    :class:`hpcrl.data.source.DataSource`                ``state.json`` ``data_source`` (position);
                   (position, held-back groups)                         ``buffer.h5`` ``groups`` (held-back groups)
``trained``        :class:`hpcrl.data.buffer.TrainedRows`               ``buffer.h5`` ``trained``
``metrics``        :class:`hpcrl.metrics.MetricsPosition`               ``state.json`` ``metrics`` (rows so far)
``pending``        async runs: :class:`hpcrl.loop_async.PendingRollout`  ``buffer.h5`` ``pending`` (its groups);
                   (the next rollout, finished)                         ``state.json`` ``pending`` (the rest)
any other name     a stateful whose state is plain JSON                 ``state.json`` under its name
=================  ==================================================  ==========================================

and the manager decides when to save (:meth:`CheckpointManager.end_step`): every ``checkpoint.save_interval``
steps, at the last step, and when a preemption signal or the job's deadline stops the run (agreed by every
trainer rank, :mod:`hpcrl.preempt`); :meth:`~CheckpointManager.save_before_failing` keeps the last finished
step when a step fails before the weights changed. The files and the atomic save are
:func:`hpcrl.checkpoint.save_checkpoint`'s (stage, write, verify, publish, prune); the buffer format is
:mod:`hpcrl.data.buffer`'s. ``state.json`` keeps the layout of older checkpoints, which load unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol

from hpcrl.checkpoint.layout import find_latest_checkpoint
from hpcrl.checkpoint.load import load_checkpoint
from hpcrl.checkpoint.save import save_checkpoint

log = logging.getLogger("hpcrl.checkpoint")

REQUIRED_STATES = ("progress", "data_source", "trained", "metrics")
PENDING = "pending"
"""The optional state whose ``"groups"`` (lists of samples) go to the buffer file's ``pending/``."""


class Stateful(Protocol):
    """What the checkpoint manager saves and restores (torch's ``Stateful``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RolloutCounter:
    """The rollout counter: the id of the last finished rollout step (-1 before the first)."""

    def __init__(self) -> None:
        self.rollout_id = -1

    @property
    def next_rollout_id(self) -> int:
        """The first rollout step still to run (0 for a new run)."""
        return self.rollout_id + 1

    def state_dict(self) -> dict[str, int]:
        return {"rollout_id": self.rollout_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollout_id = int(state["rollout_id"])


def pack_states(states: Mapping[str, dict[str, Any]], config: Optional[dict] = None) -> tuple[dict, list, Any]:
    """Split the states' dicts into the checkpoint's files: ``(state.json content, held-back groups as
    samples, trained rows int64 [n, 3])``. Raises KeyError when a :data:`REQUIRED_STATES` name is missing."""
    from hpcrl.data.sample import Sample

    data_source = dict(states["data_source"])
    groups = [[s if isinstance(s, Sample) else Sample.from_dict(s) for s in g] for g in data_source.pop("buffer", [])]
    extra = {"rollout_id": states["progress"]["rollout_id"], "data_source": data_source,
             "metrics": states["metrics"]["rows"], "config": config or {}}
    extra.update({k: v for k, v in states.items() if k not in REQUIRED_STATES})
    return extra, groups, states["trained"]["rows"]


def unpack_states(extra: Mapping[str, Any], groups: list, trained: Any, names) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`pack_states` for the stateful objects ``names``: each one's ``load_state_dict``
    argument (a name the checkpoint does not have is left out: that state keeps its fresh value).
    ``groups`` / ``trained`` are ``[]`` / ``[]`` for a checkpoint without a buffer file."""
    out = {"progress": {"rollout_id": extra["rollout_id"]},
           "data_source": {**extra["data_source"], "buffer": groups},
           "trained": {"rows": trained},
           "metrics": {"step": extra["rollout_id"], "rows": extra.get("metrics", [])}}
    out.update({k: extra[k] for k in names if k not in REQUIRED_STATES and k in extra})
    return out


class CheckpointManager:
    """Saves and restores a run: the Megatron model and optimizer and the stateful ``states`` (see the
    module doc), in ``run_dir/checkpoints/``. Every trainer rank holds one and calls every method together
    (the saves are collective); the controller writes the shared files.

    ``interval``: ``checkpoint.save_interval`` (0: only the last step and stops); ``num_rollout``: the run's
    steps; ``keep_last``: ``checkpoint.keep_last``; ``resume``: ``checkpoint.resume``; ``watch``: the
    :class:`hpcrl.preempt.PreemptionWatch` that says when to stop (it is told how long saves take);
    ``config``: the resolved config as a dict, written beside the state for ``hpcrl convert`` and readers.
    Raises KeyError when a :data:`REQUIRED_STATES` name is missing from ``states``.
    """

    def __init__(self, run_dir: Path, model: Any, optimizer: Any, states: Mapping[str, Stateful], *,
                 interval: int, num_rollout: int, keep_last: int, resume: bool, watch: Any,
                 config: Optional[dict] = None) -> None:
        missing = [k for k in REQUIRED_STATES if k not in states]
        if missing:
            raise KeyError(f"checkpoint manager needs the states {list(REQUIRED_STATES)}; missing {missing}")
        self.run_dir, self.model, self.optimizer, self.states = Path(run_dir), model, optimizer, dict(states)
        self.interval, self.num_rollout, self.keep_last, self.resume = interval, num_rollout, keep_last, resume
        self.watch, self.config = watch, config
        self.last_saved: Optional[int] = None  # rollout id of the newest checkpoint of this run
        self.on_device: Callable[[], ContextManager] = contextlib.nullcontext
        """A context in which the model and optimizer are on the device, entered around every save: colocated
        on GPUs the trainer's memory is offloaded between the weight sync and the next train step
        (:meth:`hpcrl.rollout.manager.RolloutManager.trainer_onloaded`)."""

    @classmethod
    def from_config(cls, cfg: Any, run_dir: Path, actor: Any, states: Mapping[str, Stateful],
                    watch: Any) -> "CheckpointManager":
        """The manager of a run: ``cfg.checkpoint``'s interval, keep-last and resume, the actor's model and
        optimizer."""
        from hpcrl.config import config_to_dict

        c = cfg.checkpoint
        return cls(run_dir, actor.ddp_model, actor.optimizer, states, interval=c.save_interval,
                   num_rollout=cfg.run.num_rollout, keep_last=c.keep_last, resume=c.resume, watch=watch,
                   config=config_to_dict(cfg))

    @property
    def progress(self) -> RolloutCounter:
        return self.states["progress"]

    def load(self) -> int:
        """Load the newest complete checkpoint into the model, optimizer and every state (with ``resume``)
        and return the first rollout id to run (0 for a new run, whose metrics rows of a killed earlier start
        are dropped). Raises :class:`~hpcrl.checkpoint.CheckpointError` for an unreadable checkpoint and what
        a state's ``load_state_dict`` raises (ValueError when the data changed since the checkpoint)."""
        from hpcrl.data.buffer import BUFFER_FILE, read_buffer, read_pending

        path = find_latest_checkpoint(self.run_dir) if self.resume else None
        if path is None:
            self.states["metrics"].load_state_dict({"step": -2, "rows": []})
            return 0
        extra = load_checkpoint(path, self.model, self.optimizer)
        buffer = path / BUFFER_FILE
        groups, trained = read_buffer(buffer) if buffer.exists() else ([], [])
        states = unpack_states(extra, groups, trained, self.states)
        if PENDING in states:
            pending = read_pending(buffer) if buffer.exists() else None
            states[PENDING] = {**states[PENDING], "groups": pending or []}
        for name, state in states.items():
            self.states[name].load_state_dict(state)
        self.last_saved = self.progress.rollout_id
        log.info("resumed from %s: next rollout %d (%d held-back groups)", path, self.progress.next_rollout_id,
                 len(groups))
        return self.progress.next_rollout_id

    def save(self, rollout_id: int) -> Path:
        """Checkpoint the state after rollout ``rollout_id`` (the counter is set to it), inside
        :attr:`on_device`. Returns the folder; raises what :func:`~hpcrl.checkpoint.save_checkpoint` raises."""
        with self.on_device():
            return self._save(rollout_id)

    def _save(self, rollout_id: int) -> Path:
        from hpcrl.data.buffer import BUFFER_FILE, write_buffer

        t0 = time.perf_counter()
        self.progress.rollout_id = rollout_id
        states = {k: v.state_dict() for k, v in self.states.items()}
        pending = None
        if PENDING in states:
            states[PENDING] = dict(states[PENDING])
            pending = states[PENDING].pop("groups")
        extra, groups, trained = pack_states(states, self.config)
        path = save_checkpoint(self.run_dir, rollout_id, self.model, self.optimizer, extra,
                               keep_last=self.keep_last,
                               extra_files={BUFFER_FILE: lambda p: write_buffer(p, groups, trained, pending)})
        self.watch.record_save(time.perf_counter() - t0)
        self.last_saved = rollout_id
        return path

    def due(self, rollout_id: int) -> bool:
        """True at every ``interval``-th step and at the last step (interval 0: only the last)."""
        return rollout_id == self.num_rollout - 1 or (self.interval > 0 and (rollout_id + 1) % self.interval == 0)

    def end_step(self, rollout_id: int) -> Optional[str]:
        """Step ``rollout_id`` finished on every rank: count it, save when :meth:`due`, then ask every rank
        whether to stop (preemption signal or deadline, :func:`hpcrl.preempt.agree`; not after the last
        step) and, if so, make sure this step is saved. Returns the reason to stop (``"signal"``,
        ``"deadline"``) or None."""
        from hpcrl.preempt import agree

        self.progress.rollout_id = rollout_id
        saved = self.due(rollout_id)
        if saved:
            self.save(rollout_id)
        if rollout_id + 1 >= self.num_rollout:
            return None
        stopped = agree(self.watch.local_reason())
        if stopped is not None:
            if not saved:
                self.save(rollout_id)
            log.warning("stopping after rollout %d (%s): checkpoint saved, the run resumes from it", rollout_id,
                        stopped)
        return stopped

    def save_before_failing(self, message: str) -> None:
        """The step after the last finished one failed before the weights changed: save the last finished
        step unless it is saved (or there is none)."""
        last = self.progress.rollout_id
        if last >= 0 and self.last_saved != last:
            log.error("%s; saving the checkpoint of rollout %d first, a rerun resumes from it", message, last)
            self.save(last)
