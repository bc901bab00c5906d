"""What every loop needs around its ``for`` loop, built and torn down in one place: :class:`RunSession`.

The loops (:func:`hpcrl.loop.train_main`, :func:`hpcrl.loop_async.train_async_main`,
:func:`hpcrl.loop_fully_async.train_fully_async_main`) open one with ``with
RunSession(...) as s:`` and are then their step loop. Entering it does, in this order (every trainer rank; the
controller is global rank 0):

1. quiet logs, freed memory returned eagerly (:func:`hpcrl.procs.release_freed_memory_eagerly`), the
   preemption watch installed (before any child process: :mod:`hpcrl.preempt`);
2. the rollout manager (:func:`hpcrl.rollout.manager.rollout_manager`: the real one on the controller, its
   twin elsewhere), whose engines start loading (``launch(early=True)``) before torch is imported;
3. the trainer (:func:`build_trainer`: process groups, actor, datasets, data source, trained rows and a
   checkpoint manager that has loaded the newest checkpoint);
4. engines up (``rollout.start``), the run log (:class:`RunLog`), with ``offload_engines_first`` the engines'
   memory given back (the colocated sync loop), the weight syncer and the first weight sync (after a resume
   the engines hold older weights), and for a new run the eval before the first step (``last``).

Leaving it, also on an error (in entering too, once step 2 is done): the run log closed (its bar ended, its
curves drawn), the rollout manager stopped, the watch uninstalled, the process groups destroyed.

The controller writes when each of these happened to ``timeline.json`` in the attempt's log folder
(:data:`TIMELINE_FILENAME`, :class:`Timeline`): where a run's start-up and end go
(``benchmarks/startup.py`` prints the split).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from hpcrl.procs import env_rank, release_freed_memory_eagerly
from hpcrl.run_setup import quiet_logs

if TYPE_CHECKING:
    from hpcrl.checkpoint.manager import CheckpointManager, Stateful
    from hpcrl.config import Config
    from hpcrl.data.buffer import TrainedRows
    from hpcrl.data.source import DataSource
    from hpcrl.data.datasets import Datasets
    from hpcrl.preempt import PreemptionWatch
    from hpcrl.rollout.manager import EngineLauncher, FollowerRollout, RolloutManager
    from hpcrl.train.actor import Actor
    from hpcrl.train.critic_group import CriticGroup, CriticLauncher
    from hpcrl.train.parallel import CollectiveTimeout
    from hpcrl.weights.sync import WeightSyncer

log = logging.getLogger("hpcrl.loop")

TIMELINE_FILENAME = "timeline.json"
"""In an attempt's log folder: ``{event: wall-clock seconds}`` of the controller's session (:class:`Timeline`)."""


class Timeline:
    """When the controller's session reached each stage, as wall-clock seconds (``time.time()``): ``process``
    (this process started), ``session`` (entered), ``engines_launched``, ``trainer_built``, ``engines_up``,
    ``first_sync``, ``first_eval`` (the eval before the first step, a new run only), then ``loop_end`` (the
    loop finished or stopped), ``log_closed`` (files closed, curves drawn), ``rollout_stopped`` (engines and
    router down) and ``closed``. Written to :data:`TIMELINE_FILENAME` by :meth:`write`."""

    def __init__(self) -> None:
        self.events: dict[str, float] = {}
        try:
            import psutil

            self.events["process"] = psutil.Process(os.getpid()).create_time()
        except Exception:  # noqa: BLE001 - the start of the process is only informative
            pass
        self.mark("session")

    def mark(self, event: str) -> None:
        self.events[event] = time.time()

    def write(self, folder: Optional[Path]) -> None:
        """Write the events to ``folder/timeline.json`` (atomically); nothing without a folder."""
        if folder is None:
            return
        tmp = folder / f".{TIMELINE_FILENAME}.tmp"
        tmp.write_text(json.dumps(self.events, indent=1) + "\n")
        os.replace(tmp, folder / TIMELINE_FILENAME)


@dataclass
class Trainer:
    """The trainer side both loops build before the first step (:func:`build_trainer`)."""

    actor: "Actor"
    """The Megatron model and optimizer."""
    datasets: "Datasets"
    """Train items, eval items, the task."""
    data_source: "DataSource"
    """The rollout's data source (``rollout.data_source``), resumed."""
    trained: Optional["TrainedRows"]
    """Every sample trained so far, resumed (None for SFT, whose position is its data source's)."""
    ckpt: "CheckpointManager"
    """The checkpoint manager holding all of the above."""
    start: int
    """The first rollout id to run (0 for a new run)."""
    multiple: int
    """Groups per step must be a multiple of this (data-parallel ranks x optimizer steps per rollout)."""


def build_trainer(cfg: "Config", run_dir: Path, model_path: Path, watch: "PreemptionWatch", controller: bool,
                  ci_checks: Optional[bool] = None, on_device: Optional[Callable[[], Any]] = None,
                  critic_group: Optional["CriticGroup"] = None, **states: "Stateful") -> Trainer:
    """Processes, model, optimizer, data and resume state of a run, on every trainer rank: process groups
    (:func:`hpcrl.train.parallel.setup_parallel`), the actor (slime's ``--ci-test`` gates with
    ``run.deterministic`` unless ``ci_checks`` says otherwise; with a critic on ranks of its own,
    ``critic.nprocs > 0``, its :class:`~hpcrl.train.critic_group.RemoteCritic`, whose ranks ``critic_group``
    started on the controller and which load beside the actor), the datasets and data source, and a checkpoint
    manager holding them (plus the extra stateful ``states``, e.g. the async loop's ``pending``; saves run
    inside ``on_device()``) that has loaded the newest checkpoint. Raises what those raise (ConfigError,
    DataError, CheckpointError, :class:`~hpcrl.train.critic_group.CriticError`)."""
    import contextlib

    from hpcrl.checkpoint.manager import CheckpointManager, RolloutCounter
    from hpcrl.data.buffer import TrainedRows
    from hpcrl.data.datasets import load_datasets
    from hpcrl.metrics import MetricsPosition
    from hpcrl.rollout.plugins import make_data_source
    from hpcrl.rollout.rollout import group_multiple
    from hpcrl.train.actor import Actor
    from hpcrl.train.parallel import setup_parallel

    setup_parallel(cfg)
    remote = None
    if own_critic_ranks(cfg):
        from hpcrl.train.critic_group import remote_critic

        remote = lambda: remote_critic(controller, cfg, critic_group, model_path)  # noqa: E731
    actor = Actor(cfg, model_path, ci_checks=cfg.run.deterministic if ci_checks is None else ci_checks,
                  critic=remote)
    datasets = load_datasets(cfg)
    # rollout.data_source: by default hpcrl.data.source.DataSource (prompts -> groups of samples)
    data_source = make_data_source(cfg, datasets.train)
    trained = TrainedRows()
    ckpt = CheckpointManager.from_config(cfg, run_dir, actor, watch=watch, states={
        "progress": RolloutCounter(), "data_source": data_source, "trained": trained,
        "metrics": MetricsPosition(run_dir, controller), **states},
        on_device=on_device or contextlib.nullcontext)
    start = ckpt.load()
    multiple = group_multiple(cfg.rollout.n_samples_per_prompt, actor.dp_size,
                              cfg.train.num_steps_per_rollout)
    if remote is not None:  # the samples split over the critic's data-parallel ranks too
        multiple = math.lcm(multiple, group_multiple(cfg.rollout.n_samples_per_prompt, actor.critic.dp_size,
                                                     cfg.train.num_steps_per_rollout))
    return Trainer(actor, datasets, data_source, trained, ckpt, start, multiple)


def own_critic_ranks(cfg: "Config") -> bool:
    """Whether the run's critic has ranks of its own (PPO, ``critic.nprocs > 0``)."""
    return cfg.algorithm.advantage_estimator == "gae" and cfg.critic.nprocs > 0


SETUP_PHASE = "the run's set-up: the controller's engine start, the first weight sync"
"""The phase a :class:`~hpcrl.train.parallel.CollectiveTimeout` names for a wait in :meth:`RunSession.__enter__`."""
LOOP_FUNCTIONS = ("train_main", "train_async_main", "train_fully_async_main", "train_sft_main")
"""The loops that run inside a :class:`RunSession` (:func:`hpcrl.loop.loop_of`)."""
LOOP_PHASES = {"broadcast": "the rollout's samples sent to every rank", "train": "training",
               "sync_weights": "weight sync", "evaluate": "eval", "end_step": "checkpoint",
               "save_before_failing": "checkpoint", "generate": "rollout"}
"""Names for what a loop calls, as a :class:`~hpcrl.train.parallel.CollectiveTimeout` says where it waited."""


def loop_phase(tb: Any) -> str:
    """The phase of the loop a traceback ``tb`` went through: what the loop function (:data:`LOOP_FUNCTIONS`)
    called, named by :data:`LOOP_PHASES` (else the callee's own name); ``"the loop"`` when none is in it."""
    import traceback

    frames = traceback.extract_tb(tb) if tb is not None else []
    for here, callee in zip(frames, frames[1:]):
        if here.name in LOOP_FUNCTIONS:
            return LOOP_PHASES.get(callee.name, callee.name)
    return "the loop"


@dataclass
class RunSession:
    """Set-up and tear-down of one trainer rank's run around a loop (the order is in the module doc); use as
    ``with RunSession(cfg, run_dir, model_path, ...) as s:``. Entering raises what the set-up raises, after
    tearing down what was built.

    ``ci_checks``, ``launch_engines`` and ``launch_critic`` as :func:`hpcrl.loop.train_main`; ``states``:
    extra stateful objects for the checkpoint manager (the async loop's ``pending``); ``build``: what builds
    the trainer side (default :func:`build_trainer`);
    ``offload_engines_first``: the engines give their memory back before the first sync (the sync loop, which
    trains right after; the async loop keeps them generating)."""

    cfg: "Config"
    run_dir: Path
    model_path: Path
    ci_checks: Optional[bool] = None
    launch_engines: Optional["EngineLauncher"] = None
    states: Mapping[str, "Stateful"] = field(default_factory=dict)
    offload_engines_first: bool = False
    launch_critic: Optional["CriticLauncher"] = None
    build: Optional[Callable[..., Trainer]] = None
    """What builds the trainer side (:func:`build_trainer`'s signature; default it: RL; the SFT loop's
    :func:`hpcrl.loop_sft.build_sft_trainer`)."""
    controller: bool = field(init=False, default=False)
    """Whether this rank is the controller (global rank 0)."""
    watch: "PreemptionWatch" = field(init=False)
    rollout: "RolloutManager | FollowerRollout" = field(init=False)
    trainer: Trainer = field(init=False)
    syncer: Optional["WeightSyncer"] = field(init=False, default=None)
    """The weight syncer, once built."""
    critic_group: Optional["CriticGroup"] = field(init=False, default=None)
    """The critic's own ranks (PPO with ``critic.nprocs > 0``), on the controller; None elsewhere."""
    metrics: Optional["RunLog"] = field(init=False, default=None)
    """The run log, once built (None when the set-up failed before it)."""
    last: dict[str, Any] = field(init=False, default_factory=dict)
    """The newest step's metrics (the eval before the first step until a step finished)."""
    stopped: Optional[str] = field(init=False, default=None)
    """Why the run stopped early with a checkpoint (``"signal"``, ``"deadline"``), None otherwise."""
    timeline: Timeline = field(init=False, default_factory=Timeline)
    """When each stage of the set-up and tear-down happened (written by the controller)."""
    logged_step: Optional[int] = field(init=False, default=None)
    """The newest step the loop logged (every rank), None before the first."""
    handoff: Any = field(init=False, default=None)
    """The hand-off group (:func:`hpcrl.train.parallel.handoff_group`): where the ranks wait for the
    controller (the loops' :func:`broadcast` of a step's samples, the checkpoint manager's step end); None
    with one rank."""

    def __enter__(self) -> "RunSession":
        from hpcrl.preempt import PreemptionWatch
        from hpcrl.rollout.engines import launch_local_engines
        from hpcrl.rollout.manager import rollout_manager

        cfg, run_dir, model_path = self.cfg, self.run_dir, self.model_path
        # --- preemption watch; the engines start loading (not on GPUs shared with the trainer) ------------
        quiet_logs()
        release_freed_memory_eagerly()  # freed activations and sync buffers leave the RSS (hpcrl.procs)
        controller = self.controller = env_rank() == 0
        watch = self.watch = PreemptionWatch.from_config(cfg, controller)
        watch.install()  # before any child process: the signal sets a flag, blocked for them; hpcrl.preempt
        launcher = self.launch_engines or launch_local_engines
        engine_model = model_path
        if controller and cfg.weights.rollout_dtype == "fp8":  # the engines start from a block-fp8 copy
            from hpcrl.weights.fp8 import rollout_model_path

            engine_model = rollout_model_path(model_path, run_dir)
        rollout = self.rollout = rollout_manager(controller, cfg, run_dir, engine_model, launcher,
                                                 watch.job_ending)
        rollout.launch(early=True)  # they load while the trainer imports Megatron and builds its model
        self.timeline.mark("engines_launched")
        # (imports torch: after the engines started loading)
        from hpcrl.train.parallel import destroy, handoff_group, wait_for_controller
        import torch.distributed as dist

        # a default group formed before the session (the warm start's stages, the Slurm bootstrap) outlives
        # it; one the session forms is destroyed with it
        self._destroy = functools.partial(destroy, default_group=not dist.is_initialized())
        try:
            from hpcrl.rollout.engines import engine_dtype, sglang_engines
            from hpcrl.weights.adapter import adapter_sync_config
            from hpcrl.weights.sync import WeightSyncer

            if controller and own_critic_ranks(cfg):  # the critic's own ranks load beside the actor
                from hpcrl.train.critic_group import CriticGroup

                self.critic_group = CriticGroup.launch(cfg, run_dir, rollout.attempt_dir, self.launch_critic)
            # --- processes, model, optimizer, data, resume state -------------------------------------
            # colocated on GPUs: saves run with the trainer onloaded (rollout.trainer_onloaded)
            t = self.trainer = (self.build or build_trainer)(cfg, run_dir, model_path, watch, controller,
                                                             self.ci_checks, on_device=rollout.trainer_onloaded,
                                                             critic_group=self.critic_group, **self.states)
            self.timeline.mark("trainer_built")
            # the ranks wait for the controller's work alone (engines, rollouts, evals) in a group of their own
            self.handoff = handoff_group(cfg.train.collective_timeout_s, cfg.train.rollout_wait_timeout_s)
            t.ckpt.wait_for_controller = functools.partial(wait_for_controller, self.handoff)
            # --- engines up, router, client (a twin that does nothing on the other ranks); weights -----
            rollout.start(t.datasets)
            self.timeline.mark("engines_up")
            self.metrics = RunLog(run_dir, cfg.run.num_rollout, t.start, controller, cfg=cfg)
            if self.offload_engines_first:
                rollout.offload()  # colocated: the engines give their memory back before the first sync
            wait_for_controller(self.handoff)  # its engines are up: the first sync's collectives start together
            self.syncer = WeightSyncer.from_config(rollout.client, cfg.weights, cfg.run.mode,
                                                   sglang_engines=sglang_engines(cfg),
                                                   is_sender=controller,
                                                   engine_tp_sizes=rollout.engine_tp_sizes,
                                                   hf_checkpoint=str(model_path),
                                                   disk_dir=str(run_dir / "weights"),
                                                   # (with fp8 rollout weights the stream arrives cast)
                                                   engine_dtype=(engine_dtype(cfg) if cfg.weights.rollout_dtype
                                                                 is None else None),
                                                   adapter_config=adapter_sync_config(cfg, model_path))
            # after a resume the engines hold older weights
            sync_weights(t.actor, self.syncer, rollout, version=t.start)
            self.timeline.mark("first_sync")
            if t.start == 0:
                self.last = rollout.evaluate(-1)
                self.metrics.log(-1, self.last, advance=False)
                self.timeline.mark("first_eval")
        except BaseException as e:
            # a rank that waited past its bound in the set-up (the controller's engine start, the first sync):
            # the same one line as in the loop
            timeout = (self._collective_timeout(e, e.__traceback__, SETUP_PHASE)
                       if isinstance(e, Exception) else None)
            self.close()
            if timeout is not None:
                raise timeout from e
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        """Tear down (:meth:`close`). A loop that stopped because a collective waited past
        ``train.collective_timeout_s`` raises :class:`hpcrl.train.parallel.CollectiveTimeout` instead (one line:
        this rank, the step it was in, the loop's phase, the last checkpoint)."""
        try:
            timeout = self._collective_timeout(exc, tb) if exc is not None else None
        finally:
            self.close()
        if timeout is not None:
            raise timeout from exc

    def _collective_timeout(self, exc: BaseException, tb: Any, phase: Optional[str] = None
                            ) -> Optional["CollectiveTimeout"]:
        """The :class:`~hpcrl.train.parallel.CollectiveTimeout` to raise for ``exc``, None when ``exc`` is not a
        collective's timeout (or is one already). The step is the one after the last logged (that one when it
        timed out in its checkpoint); the phase the loop's (:func:`loop_phase` of ``tb``) unless given."""
        from hpcrl.checkpoint.layout import find_latest_checkpoint
        from hpcrl.train.parallel import (CollectiveTimeout, ControllerWaitTimeout, exception_chain,
                                          is_collective_timeout)

        if isinstance(exc, CollectiveTimeout) or not is_collective_timeout(exc):
            return None
        phase = phase or loop_phase(tb)
        if self.logged_step is None:
            step = getattr(getattr(self, "trainer", None), "start", 0)
        else:
            step = self.logged_step if phase == "checkpoint" else self.logged_step + 1
        try:
            latest = find_latest_checkpoint(self.run_dir)
        except OSError:  # the message is still worth more than the file system's error
            latest = None
        for_controller = any(isinstance(e, ControllerWaitTimeout) for e in exception_chain(exc))
        timeout_s = self.cfg.train.rollout_wait_timeout_s if for_controller else self.cfg.train.collective_timeout_s
        return CollectiveTimeout(env_rank(), step, phase, timeout_s, latest.name if latest is not None else None,
                                 for_controller=for_controller)

    def log(self, rollout_id: int, step: dict[str, Any]) -> None:
        """Log step ``rollout_id``'s metrics (before its checkpoint: a resume truncates the lines after its
        step) and make them :attr:`last`."""
        self.metrics.log(rollout_id, step)
        self.last = step
        self.logged_step = rollout_id

    def finish(self, stopped: Optional[str]) -> None:
        """The loop ended (``stopped``: why early, or None): the run log says how, and closes."""
        self.stopped = stopped
        self.timeline.mark("loop_end")
        self.metrics.finish(stopped)

    def result(self) -> dict[str, Any]:
        """What the loop returns: the last step's metrics (on the controller the rollout and eval ones too),
        plus ``"preempted": reason`` when it stopped early with a checkpoint."""
        return dict(self.last, preempted=self.stopped) if self.stopped is not None else self.last

    def close(self) -> None:
        """Tear down in order: run log (a run stopped by an error: its bar ends and its curves are drawn
        too), the critic's own ranks, the weight syncer's group, rollout manager, preemption watch,
        model-parallel groups and the default process group when the session formed it."""
        if self.metrics is not None:
            self.metrics.close()
        self.timeline.mark("log_closed")
        if self.critic_group is not None:
            self.critic_group.stop()
        if self.syncer is not None:  # while the engines are up: they drop their side of the group too
            self.rollout.release_weight_sync(self.syncer)
        self.rollout.stop()
        self.timeline.mark("rollout_stopped")
        self.watch.uninstall()
        from hpcrl.train.parallel import destroy_group

        destroy_group(self.handoff)  # (a default group formed before the session outlives it; this one not)
        self.handoff = None
        self._destroy()
        self.timeline.mark("closed")
        if self.controller:
            try:
                self.timeline.write(getattr(self.rollout, "attempt_dir", None))
            except OSError as e:  # informative only: never fails a run
                log.warning("could not write %s: %s", TIMELINE_FILENAME, e)


def sync_weights(actor: "Actor", syncer: "WeightSyncer", rollout: "RolloutManager | FollowerRollout",
                 version: int) -> dict[str, Any]:
    """Weight sync in the colocated phase order: trainer off and engine weights on, sync, engine KV on.

    Every trainer rank iterates the exported weights (TP all-gathers); only the controller sends. Colocated on
    GPUs, offloading the trainer unmaps its parameters, so the exported weights are first copied to host
    memory (as slime syncs from its pinned CPU copies); otherwise they stream from the trainer's tensors.
    Returns the sync metrics (seconds, bytes, GB/s) prefixed ``sync/``.
    """
    from hpcrl.weights.sync import iterate_for_sync

    named = iterate_for_sync(actor.ddp_model, adapters=syncer.adapter_config is not None)
    if rollout.trainer_paused_during_sync:
        named = iter([(name, tensor.to("cpu", copy=True)) for name, tensor in named])
    rollout.onload_weights()
    m = rollout.update_weights(syncer, named, version)
    rollout.onload_kv()
    return {f"sync/{k}": v for k, v in m.items() if isinstance(v, (int, float))}


class RunLog:
    """The run's metrics (``metrics.jsonl``, TensorBoard, progress bar, ``curves.png``:
    :class:`hpcrl.metrics.MetricsLogger`; W&B when ``cfg.wandb.mode`` is not ``disabled``:
    :class:`hpcrl.tracking.WandbTracker`) on the controller; nothing on the other ranks."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, controller: bool,
                 cfg: Optional["Config"] = None) -> None:
        from hpcrl.metrics import MetricsLogger
        from hpcrl.tracking import WandbTracker

        self.run_dir = run_dir
        desc = "sft" if cfg is not None and cfg.run.mode == "sft" else "rollout"
        self.logger = MetricsLogger(run_dir, total_steps, start_step, desc=desc) if controller else None
        with_wandb = controller and cfg is not None
        self.tracker = WandbTracker.start(cfg, run_dir, start_step) if with_wandb else None
        self.stopped: Optional[str] = None
        self.finished = False

    def log(self, step: int, metrics: dict[str, Any], advance: bool = True) -> None:
        """Append one step's metrics (``advance=False``: the eval before the first step); W&B gets the row."""
        if self.logger is not None:
            row = self.logger.log(step, metrics, advance=advance)
            if self.tracker is not None:
                self.tracker.log(row)

    def finish(self, stopped: Optional[str]) -> None:
        """Close the files, draw ``curves.png``, end the W&B run and say how the run ended."""
        self.stopped, self.finished = stopped, True
        if self.logger is not None:
            png = self.close()
            log.info("%s: %s (curves: %s)", "stopped" if stopped else "done", self.run_dir, png)

    def close(self) -> Optional[Path]:
        """Close the files and the progress bar (ending its line, so that an error printed after it starts a
        line of its own), draw ``curves.png`` and end the W&B run (failed unless :meth:`finish` came first),
        once; later calls do nothing and return None."""
        logger, self.logger = self.logger, None
        if logger is None:
            return None
        png = None
        try:  # every metrics line is already on disk (fsynced): a plot that fails must not fail the run
            png = logger.close()
        except Exception as e:  # noqa: BLE001 - reported, and the run's own outcome (or error) stands
            log.warning("could not draw curves.png: %s: %s", type(e).__name__, e)
        if self.tracker is not None:
            self.tracker.finish(png, stopped=self.stopped is not None, failed=not self.finished)
        return png


@dataclass
class StepFailed:
    """What the controller broadcasts instead of the samples when a step's rollout failed (every rank then
    checkpoints the last finished step and raises: the controller its ``error``, the others RuntimeError)."""

    message: str
    error: Optional[BaseException] = None

    def __getstate__(self) -> dict:  # the exception stays on the controller; only the message is broadcast
        return {"message": self.message, "error": None}


def broadcast(obj: Any, group: Any = None) -> Any:
    """Send the controller's object to every trainer rank (a no-op with one rank), over ``group``: the
    session's hand-off group (:attr:`RunSession.handoff`) where the ranks wait for the controller's rollout or
    eval (its timeout then raises :class:`~hpcrl.train.parallel.ControllerWaitTimeout` on the other ranks),
    None for the default group."""
    import torch.distributed as dist

    from hpcrl.train.parallel import waiting_for_controller

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    with waiting_for_controller(group):
        dist.broadcast_object_list(box, src=0, group=group)
    return box[0]

