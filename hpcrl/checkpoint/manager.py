"""The run's checkpoint manager: one owner of the resume state and of when it is saved (torchtitan's
``CheckpointManager`` is the model).

The session (:mod:`hpcrl.run_session`) hands it, once, the Megatron model and optimizer, a dict of named
*stateful* objects (anything with ``state_dict()`` / ``load_state_dict(state)``) and the context a save runs
in. The manager knows none of them by name but its own counter (``progress``); each one's ``state_dict()``
goes to ``state.json`` under its name, except where the object says otherwise:

* ``flat_state = True``: its keys sit at the top of ``state.json``, and it loads from the whole file
  (:class:`RolloutCounter`: ``rollout_id``; :class:`hpcrl.metrics.MetricsPosition`: ``metrics``).
* ``file_keys``, ``save_files(state, folder)``, ``load_files(state, folder)`` (:class:`FileStateful`): those
  keys of its state live in files of the checkpoint folder, which it writes (rank 0) and reads itself; the
  rest goes to ``state.json``, under its name when not empty.
* ``start_fresh()``: called when there is no checkpoint to resume.

A run's objects and where they are written:

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
``stream``         fully-async runs: the stream's last snapshot         ``buffer.h5`` ``finished``, ``inflight``,
                   (:class:`hpcrl.rollout.fully_async.StreamState`;    ``stream_ledger``; ``state.json``
                   it also stands in for ``data_source``)               ``stream`` (counters)
any other name     a stateful whose state is plain JSON                 ``state.json`` under its name
=================  ==================================================  ==========================================

The Megatron models are not statefuls: the actor's model and optimizer go to ``dist/``, and each further
named model (``models``: a PPO run's critic, ``{"critic": (ddp_model, optimizer)}``, built by
:class:`hpcrl.train.critic.Critic` when ``algorithm.advantage_estimator`` is ``gae``) to its own
``dist_<name>/`` (``dist_critic/``), all in the same atomic save; the critic's learning-rate schedule, like the
actor's, is a pure function of the optimizer step and needs no state.

=================  ==================================================  ==========================================
model              object                                              where it is written
=================  ==================================================  ==========================================
(the actor)        ``actor.ddp_model``, ``actor.optimizer``             ``dist/``; ``COMPLETE`` ``optimizer``
``critic``         ``actor.critic.ddp_model``, ``.optimizer`` (PPO)     ``dist_critic/``; ``COMPLETE`` ``models``
``critic``         ``actor.critic``, a ``RemoteCritic`` (PPO, its own   ``dist_critic/`` written by the critic's
                   ranks: ``critic.nprocs > 0``)                         ranks; ``COMPLETE`` ``models``
=================  ==================================================  ==========================================

and the manager decides when to save (:meth:`CheckpointManager.end_step`): every ``checkpoint.save_interval``
steps, at the last step (:func:`hpcrl.run_setup.due`), and when a preemption signal or the job's deadline
stops the run (agreed by every trainer rank, :mod:`hpcrl.preempt`);
:meth:`~CheckpointManager.save_before_failing` keeps the last finished step when a step fails before the
weights changed. The files and the atomic save are
:func:`hpcrl.checkpoint.save_checkpoint`'s (stage, write, verify, publish, prune); the buffer format is
:mod:`hpcrl.data.buffer`'s. ``state.json`` keeps the layout of older checkpoints, which load unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Optional, Protocol

from hpcrl.checkpoint.layout import find_latest_checkpoint
from hpcrl.checkpoint.load import load_checkpoint
from hpcrl.checkpoint.save import save_checkpoint
from hpcrl.run_setup import due

if TYPE_CHECKING:
    from hpcrl.preempt import PreemptionWatch

log = logging.getLogger("hpcrl.checkpoint")

PROGRESS = "progress"
"""The name of the manager's own :class:`RolloutCounter` among the states (made when not given)."""

CRITIC = "critic"
"""The critic's name among a run's checkpointed models (its folder: ``dist_critic/``)."""


class Stateful(Protocol):
    """What the checkpoint manager saves and restores (torch's ``Stateful``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FileStateful(Stateful, Protocol):
    """A stateful object that keeps the keys ``file_keys`` of its ``state_dict()`` in files of the checkpoint
    folder: rank 0 calls ``save_files(state, folder)`` with its whole state inside the save (the files are
    listed and checksummed with the rest); a load calls ``load_files(state, folder)`` with its ``state.json``
    part (``{}`` when it has none) and passes the result to ``load_state_dict``."""

    file_keys: tuple[str, ...]

    def save_files(self, state: dict[str, Any], folder: Path) -> None: ...

    def load_files(self, state: dict[str, Any], folder: Path) -> dict[str, Any]: ...


class RolloutCounter:
    """The rollout counter: the id of the last finished rollout step (-1 before the first); ``state.json``'s
    top-level ``rollout_id``."""

    flat_state = True

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


def pack_states(states: Mapping[str, Stateful], config: Optional[dict] = None
                ) -> tuple[dict[str, Any], list[Callable[[Path], None]]]:
    """The ``state.json`` content of ``states`` (each one's ``state_dict()`` under its name, at the top for a
    ``flat_state`` one, without its ``file_keys``) plus ``config``, and the writers of their files (each
    called with the checkpoint folder on rank 0)."""
    extra: dict[str, Any] = {}
    writers: list[Callable[[Path], None]] = []
    for name, obj in states.items():
        state = obj.state_dict()
        keys = getattr(obj, "file_keys", ())
        if keys:
            writers.append(lambda folder, obj=obj, state=state: obj.save_files(state, folder))
            state = {k: v for k, v in state.items() if k not in keys}
            if not state:
                continue
        if getattr(obj, "flat_state", False):
            extra.update(state)
        else:
            extra[name] = state
    extra["config"] = config or {}
    return extra, writers


def unpack_states(extra: Mapping[str, Any], folder: Path, states: Mapping[str, Stateful]) -> dict[str, Any]:
    """Inverse of :func:`pack_states`: each object's ``load_state_dict`` argument from ``state.json``'s
    content ``extra`` and the files in checkpoint ``folder`` (a name the checkpoint does not have is left out:
    that state keeps its fresh value)."""
    out: dict[str, Any] = {}
    for name, obj in states.items():
        keys = getattr(obj, "file_keys", ())
        if getattr(obj, "flat_state", False):
            state = dict(extra)
        elif name in extra or keys:
            state = dict(extra.get(name) or {})
        else:
            continue
        out[name] = obj.load_files(state, folder) if keys else state
    return out


class CheckpointManager:
    """Saves and restores a run: the Megatron model and optimizer and the stateful ``states`` (see the
    module doc), in ``run_dir/checkpoints/``. Every trainer rank holds one and calls every method together
    (the saves are collective); the controller writes the shared files.

    ``interval``: ``checkpoint.save_interval`` (0: only the last step and stops); ``num_rollout``: the run's
    steps; ``keep_last``: ``checkpoint.keep_last``; ``resume``: ``checkpoint.resume``; ``watch``: the
    :class:`hpcrl.preempt.PreemptionWatch` that says when to stop (it is told how long saves take);
    ``config``: the resolved config as a dict, written beside the state for ``hpcrl convert`` and readers;
    ``on_device``: a context in which the model and optimizer are on the device, entered around every save
    (colocated on GPUs the trainer's memory is offloaded between the weight sync and the next train step:
    :meth:`hpcrl.rollout.manager.RolloutManager.trainer_onloaded`; default: nothing to do); ``models``:
    further Megatron models with their optimizers, ``{name: (ddp_model, optimizer)}``, saved and loaded with
    the main one in the same checkpoint (``dist_<name>/``; a run with a critic: ``{"critic": ...}``, and
    a checkpoint with other models than the run's is refused); ``remote``: such models whose ranks are
    another world's, ``{name: RemotePart}`` (a critic on ranks of its own,
    :class:`hpcrl.train.critic_group.RemoteCritic`), which write and load their ``dist_<name>/`` themselves
    in the same save and load. The counter ``states["progress"]`` is made when not given. The attribute
    ``wait_for_controller`` is what :meth:`end_step` calls first, so that the controller's eval and weight send
    (its work alone) are waited for in the run's hand-off group, not in the save's collectives
    (:class:`hpcrl.run_session.RunSession` sets :func:`hpcrl.train.parallel.wait_for_controller` on it; by
    default nothing).
    """

    def __init__(self, run_dir: Path, model: Any, optimizer: Any, states: Mapping[str, Stateful], *,
                 interval: int, num_rollout: int, keep_last: int, resume: bool, watch: "PreemptionWatch",
                 config: Optional[dict] = None,
                 on_device: Callable[[], ContextManager] = contextlib.nullcontext,
                 models: Optional[Mapping[str, tuple[Any, Any]]] = None,
                 remote: Optional[Mapping[str, Any]] = None) -> None:
        self.run_dir, self.model, self.optimizer = Path(run_dir), model, optimizer
        self.models: dict[str, tuple[Any, Any]] = dict(models or {})
        self.remote: dict[str, Any] = dict(remote or {})
        self.states: dict[str, Stateful] = {PROGRESS: RolloutCounter(), **states}
        self.interval, self.num_rollout, self.keep_last, self.resume = interval, num_rollout, keep_last, resume
        self.watch, self.config, self.on_device = watch, config, on_device
        self.progress: RolloutCounter = self.states[PROGRESS]
        self.last_saved: Optional[int] = None  # rollout id of the newest checkpoint of this run
        self.wait_for_controller: Callable[[], None] = lambda: None

    @classmethod
    def from_config(cls, cfg: Any, run_dir: Path, actor: Any, states: Mapping[str, Stateful],
                    watch: "PreemptionWatch",
                    on_device: Callable[[], ContextManager] = contextlib.nullcontext) -> "CheckpointManager":
        """The manager of a run: ``cfg.checkpoint``'s interval, keep-last and resume, the actor's model and
        optimizer, and its critic's (``actor.critic``: PPO's value model, ``algorithm.advantage_estimator:
        gae``; None otherwise) as the further model ``critic``."""
        from hpcrl.config import config_to_dict

        c = cfg.checkpoint
        critic = getattr(actor, "critic", None)
        models, remote = {}, {}
        if getattr(critic, "remote", False):  # on ranks of its own: it writes and loads its part itself
            remote[CRITIC] = critic
        elif critic is not None:
            models[CRITIC] = (critic.ddp_model, critic.optimizer)
        return cls(run_dir, actor.ddp_model, actor.optimizer, states, interval=c.save_interval,
                   num_rollout=cfg.run.num_rollout, keep_last=c.keep_last, resume=c.resume, watch=watch,
                   config=config_to_dict(cfg), on_device=on_device, models=models, remote=remote)

    def load(self) -> int:
        """Load the newest complete checkpoint into the model, optimizer and every state (with ``resume``)
        and return the first rollout id to run (0 for a new run: the states that can ``start_fresh`` do, e.g.
        the metrics rows of a killed earlier start are dropped). Raises
        :class:`~hpcrl.checkpoint.CheckpointError` for an unreadable checkpoint and what a state's
        ``load_state_dict`` / ``load_files`` raises (ValueError: the data changed since the checkpoint)."""
        path = find_latest_checkpoint(self.run_dir) if self.resume else None
        if path is None:
            for obj in self.states.values():
                if hasattr(obj, "start_fresh"):
                    obj.start_fresh()
            return 0
        extra = load_checkpoint(path, self.model, self.optimizer, models=self.models, remote=self.remote)
        for name, state in unpack_states(extra, path, self.states).items():
            self.states[name].load_state_dict(state)
        self.last_saved = self.progress.rollout_id
        log.info("resumed from %s: next rollout %d (states: %s)", path, self.progress.next_rollout_id,
                 ", ".join(self.states))
        return self.progress.next_rollout_id

    def save(self, rollout_id: int) -> Path:
        """Checkpoint the state after rollout ``rollout_id`` (the counter is set to it), inside
        :attr:`on_device`. Returns the folder; raises what :func:`~hpcrl.checkpoint.save_checkpoint` raises."""
        with self.on_device():
            return self._save(rollout_id)

    def _save(self, rollout_id: int) -> Path:
        t0 = time.perf_counter()
        self.progress.rollout_id = rollout_id
        extra, writers = pack_states(self.states, self.config)
        path = save_checkpoint(self.run_dir, rollout_id, self.model, self.optimizer, extra,
                               keep_last=self.keep_last, write_files=writers, models=self.models,
                               remote=self.remote)
        self.watch.record_save(time.perf_counter() - t0)
        self.last_saved = rollout_id
        return path

    def due(self, rollout_id: int) -> bool:
        """True at every ``interval``-th step and at the last step (:func:`hpcrl.run_setup.due`)."""
        return due(rollout_id, self.interval, self.num_rollout)

    def end_step(self, rollout_id: int) -> Optional[str]:
        """Step ``rollout_id`` finished on every rank: count it, save when :meth:`due`, then ask every rank
        whether to stop (preemption signal or deadline, :func:`hpcrl.preempt.agree`; not after the last
        step) and, if so, make sure this step is saved. Returns the reason to stop (``"signal"``,
        ``"deadline"``) or None."""
        from hpcrl.preempt import agree

        self.wait_for_controller()  # its eval and weight send end the step on the controller alone
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

    def save_before_failing(self, message: str, finished: Optional[int] = None) -> None:
        """The step after the last finished one failed before the weights changed: save the last finished
        step unless it is saved (or there is none). ``finished``: a step that finished without
        :meth:`end_step` (the async loop's step whose next rollout failed), counted first."""
        if finished is not None:
            self.progress.rollout_id = finished
        last = self.progress.rollout_id
        if last >= 0 and self.last_saved != last:
            log.error("%s; saving the checkpoint of rollout %d first, a rerun resumes from it", message, last)
            self.save(last)
