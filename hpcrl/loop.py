"""The RL loop, written out top to bottom like slime's ``train.py``: :func:`train_main`.

Synchronous mode, one rollout step::

    rollout (engines, over-sampling + dynamic filter, rewards) -> broadcast -> advantages + train (Megatron)
    -> weight sync -> metrics -> eval -> checkpoint -> preemption check

Every trainer rank runs :func:`train_main`; global rank 0 is the controller. Its
:class:`~hpcrl.rollout.manager.RolloutManager` starts engines and router and drives the rollout; the other ranks
hold a :class:`~hpcrl.rollout.manager.NullRolloutManager` and receive the samples by broadcast, so the loop never
branches on the rank. How the engines start is the caller's choice (``launch_engines``): local processes for
``hpcrl run`` (:mod:`hpcrl.launch_local`), a Slurm job step inside a job (:mod:`hpcrl.slurm.entry`).
Colocated runs move device memory between trainer and engines in the order :mod:`hpcrl.rollout.manager`
documents (no-op adapters on CPU). The run folder is described in :mod:`hpcrl.run_setup`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hpcrl.config import Config
from hpcrl.rollout.manager import EngineLauncher, rollout_manager
from hpcrl.procs import env_rank, release_freed_memory_eagerly
from hpcrl.run_setup import quiet_logs

log = logging.getLogger("hpcrl.loop")


def train_main(cfg: Config, run_dir: Path, model_path: Path, ci_checks: Optional[bool] = None,
               launch_engines: Optional[EngineLauncher] = None) -> dict[str, Any]:
    """One trainer rank's whole run; returns the last step's metrics (on the controller the rollout and eval
    ones too), plus ``"preempted": reason`` when it stopped early with a checkpoint.

    ``launch_engines`` starts the engines on the controller (default
    :func:`hpcrl.rollout.engines.launch_local_engines`). Raises what a step raises, after checkpointing the
    last finished step when the weights had not changed yet (rollout, reward, filter, a dead engine).
    """
    from hpcrl.preempt import PreemptionWatch
    from hpcrl.rollout.engines import launch_local_engines

    # --- preemption watch; the engines start loading (not on GPUs shared with the trainer) --------------
    quiet_logs()
    release_freed_memory_eagerly()  # freed activations and sync buffers leave the RSS (hpcrl.procs)
    controller = env_rank() == 0
    watch = PreemptionWatch.from_config(cfg, controller)
    watch.install()  # before any child process: the signal sets a flag and is blocked for them; hpcrl.preempt
    rollout = rollout_manager(controller, cfg, run_dir, model_path, launch_engines or launch_local_engines,
                              watch.job_ending)
    rollout.launch(early=True)  # they load while the trainer imports Megatron and builds its model
    from hpcrl.train.parallel import destroy  # imports torch: after the engines started loading
    stopped: Optional[str] = None
    last: dict[str, Any] = {}
    metrics: Optional[RunLog] = None
    try:
        from hpcrl.weights import WeightSyncer

        # --- processes, model, optimizer, data, resume state -----------------------------------------
        t = build_trainer(cfg, run_dir, model_path, watch, controller, ci_checks)
        actor, data_source, trained, ckpt, start_rollout_id = t.actor, t.data_source, t.trained, t.ckpt, t.start
        # --- engines up, router, client (a twin that does nothing on the other ranks) ----------------
        rollout.start(t.datasets)
        ckpt.on_device = rollout.trainer_onloaded  # colocated on GPUs: saves run with the trainer onloaded
        metrics = RunLog(run_dir, cfg.run.num_rollout, start_rollout_id, controller, cfg=cfg)
        rollout.offload()  # colocated: the engines give their memory back before the first sync and train
        syncer = WeightSyncer.from_config(rollout.client, cfg.weights, is_sender=controller,
                                          engine_tp_sizes=rollout.engine_tp_sizes, hf_checkpoint=str(model_path),
                                          disk_dir=str(run_dir / "weights"))
        sync_weights(actor, syncer, rollout, version=start_rollout_id)  # after a resume engines hold older ones
        if start_rollout_id == 0:
            last = rollout.evaluate(-1)
            metrics.log(-1, last, advance=False)

        # --- the loop --------------------------------------------------------------------------------
        for rollout_id in range(start_rollout_id, cfg.run.num_rollout):
            t_step = time.perf_counter()
            before = data_source.state_dict()  # the data as the last finished step left it (copies)
            try:
                samples, step = rollout.generate(rollout_id, data_source, t.multiple)
                rollout.offload()
            except Exception as e:  # noqa: BLE001 - every rank learns of it below, then it is re-raised
                samples, step = StepFailed(f"rollout {rollout_id} failed on the controller: "
                                            f"{type(e).__name__}: {e}", e), {}
            samples = broadcast(samples)
            if isinstance(samples, StepFailed):  # before the weights changed: keep the last finished step
                data_source.load_state_dict(before)
                rollout.onload_trainer()
                ckpt.save_before_failing(samples.message)
                raise samples.error or RuntimeError(samples.message)
            rollout.onload_trainer()
            step.update(actor.train(rollout_id, samples))
            trained.extend(rollout_id, samples)
            step.update(sync_weights(actor, syncer, rollout, version=rollout_id + 1))
            if due(rollout_id, cfg.rollout.eval_interval, cfg.run.num_rollout):
                step.update(rollout.evaluate(rollout_id))
            step["timing/step_seconds"] = time.perf_counter() - t_step
            watch.record_step(step["timing/step_seconds"])
            metrics.log(rollout_id, step)  # before the checkpoint: a resume truncates the lines after its step
            last = step
            # Saved at the interval and the last step; preemption or the time limit: every rank stops at
            # this same step boundary, with a checkpoint.
            stopped = ckpt.end_step(rollout_id)
            if stopped is not None:
                break
        metrics.finish(stopped)
    finally:
        if metrics is not None:  # a run stopped by an error: its bar ends and its curves are drawn too
            metrics.close()
        rollout.stop()
        watch.uninstall()
        destroy()
    return dict(last, preempted=stopped) if stopped is not None else last


@dataclass
class Trainer:
    """The trainer side both loops build before the first step (:func:`build_trainer`)."""

    actor: Any
    """:class:`hpcrl.train.actor.Actor`: the Megatron model and optimizer."""
    datasets: Any
    """:class:`hpcrl.data.sources.Datasets`: train items, eval items, the task."""
    data_source: Any
    """The rollout's data source (``rollout.data_source``), resumed."""
    trained: Any
    """:class:`hpcrl.data.buffer.TrainedRows`, resumed."""
    ckpt: Any
    """:class:`hpcrl.checkpoint.manager.CheckpointManager` holding all of the above."""
    start: int
    """The first rollout id to run (0 for a new run)."""
    multiple: int
    """Groups per step must be a multiple of this (data-parallel ranks x optimizer steps per rollout)."""


def build_trainer(cfg: Config, run_dir: Path, model_path: Path, watch, controller: bool,
                  ci_checks: Optional[bool] = None, **states) -> Trainer:
    """Processes, model, optimizer, data and resume state of a run, on every trainer rank: process groups
    (:func:`hpcrl.train.parallel.setup_parallel`), the actor (slime's ``--ci-test`` gates with
    ``run.deterministic`` unless ``ci_checks`` says otherwise), the datasets and data source, and a checkpoint
    manager holding them (plus the extra stateful ``states``, e.g. the async loop's ``pending``) that has
    loaded the newest checkpoint. Raises what those raise (ConfigError, DataError, CheckpointError)."""
    from hpcrl.checkpoint.manager import CheckpointManager, RolloutCounter
    from hpcrl.data.buffer import TrainedRows
    from hpcrl.data.sources import load_datasets
    from hpcrl.metrics import MetricsPosition
    from hpcrl.rollout.plugins import make_data_source
    from hpcrl.rollout.rollout import group_multiple
    from hpcrl.train.actor import Actor
    from hpcrl.train.parallel import setup_parallel

    setup_parallel(cfg)
    actor = Actor(cfg, model_path, ci_checks=cfg.run.deterministic if ci_checks is None else ci_checks)
    datasets = load_datasets(cfg)
    data_source = make_data_source(cfg, datasets.train)  # rollout.data_source, hpcrl.rollout.plugins
    trained = TrainedRows()
    ckpt = CheckpointManager.from_config(cfg, run_dir, actor, watch=watch, states={
        "progress": RolloutCounter(), "data_source": data_source, "trained": trained,
        "metrics": MetricsPosition(run_dir, controller), **states})
    start = ckpt.load()
    multiple = group_multiple(cfg.rollout.n_samples_per_prompt, actor.dp_size, cfg.train.num_steps_per_rollout)
    return Trainer(actor, datasets, data_source, trained, ckpt, start, multiple)


def due(rollout_id: int, interval: int, num_rollout: int) -> bool:
    """True at every ``interval``-th step and at the last step (interval 0: only the last)."""
    last = rollout_id == num_rollout - 1
    return last or (interval > 0 and (rollout_id + 1) % interval == 0)


@dataclass
class StepFailed:
    """What the controller broadcasts instead of the samples when a step's rollout failed (every rank then
    checkpoints the last finished step and raises: the controller its ``error``, the others RuntimeError)."""

    message: str
    error: Optional[BaseException] = None

    def __getstate__(self) -> dict:  # the exception stays on the controller; only the message is broadcast
        return {"message": self.message, "error": None}


def broadcast(obj: Any) -> Any:
    """Send the controller's object to every trainer rank (a no-op with one rank)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sync_weights(actor, syncer, rollout, version: int) -> dict[str, Any]:
    """Weight sync in the colocated phase order: trainer off and engine weights on, sync, engine KV on.

    Every trainer rank iterates the exported weights (TP all-gathers); only the controller sends. Colocated on
    GPUs, offloading the trainer unmaps its parameters, so the exported weights are first copied to host
    memory (as slime syncs from its pinned CPU copies); otherwise they stream from the trainer's tensors.
    Returns the sync metrics (seconds, bytes, GB/s) prefixed ``sync/``.
    """
    from hpcrl.weights import iterate_for_sync

    named = iterate_for_sync(actor.ddp_model)
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
                 cfg: Optional[Config] = None) -> None:
        from hpcrl.metrics import MetricsLogger
        from hpcrl.tracking import WandbTracker

        self.run_dir = run_dir
        self.logger = MetricsLogger(run_dir, total_steps, start_step) if controller else None
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
