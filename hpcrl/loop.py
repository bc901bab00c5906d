"""The RL loop, written out top to bottom like slime's ``train.py``: :func:`train_main`.

Synchronous mode, one rollout step::

    rollout (engines, over-sampling + dynamic filter, rewards) -> broadcast -> advantages + train (Megatron)
    -> weight sync -> metrics -> eval -> checkpoint -> preemption check

Every trainer rank runs :func:`train_main`; global rank 0 is the controller. Its
:class:`~hpcrl.rollout.manager.RolloutManager` starts engines and router and drives the rollout; the other ranks
hold a :class:`~hpcrl.rollout.manager.FollowerRollout` and receive the samples by broadcast, so the loop never
branches on the rank. How the engines start is the caller's choice (``launch_engines``): local processes for
``hpcrl run`` (:mod:`hpcrl.launch_local`), a Slurm job step inside a job (:mod:`hpcrl.slurm.entry`).
Colocated runs move device memory between trainer and engines in the order :mod:`hpcrl.rollout.phases`
documents (no-op adapters on CPU). What the loop needs around it (watch, rollout manager, trainer, weight
syncer, checkpoint manager, run log) is built and torn down by :class:`hpcrl.run_session.RunSession`. The run
folder is described in :mod:`hpcrl.run_setup`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from hpcrl.config import Config
from hpcrl.run_setup import due
from hpcrl.run_session import RunSession, StepFailed, broadcast, sync_weights

if TYPE_CHECKING:
    from hpcrl.rollout.manager import EngineLauncher
    from hpcrl.train.critic_group import CriticLauncher

__all__ = ["train_main", "loop_of"]


def train_main(cfg: Config, run_dir: Path, model_path: Path, ci_checks: Optional[bool] = None,
               launch_engines: Optional["EngineLauncher"] = None,
               launch_critic: Optional["CriticLauncher"] = None) -> dict[str, Any]:
    """One trainer rank's whole run; returns the last step's metrics (on the controller the rollout and eval
    ones too), plus ``"preempted": reason`` when it stopped early with a checkpoint.

    ``launch_engines`` starts the engines on the controller (default
    :func:`hpcrl.rollout.engines.launch_local_engines`); ``launch_critic`` the ranks of a critic with ranks of
    its own (``critic.nprocs > 0``; default :func:`hpcrl.train.critic_group.launch_local_critic`). Raises what a step raises, after checkpointing the
    last finished step when the weights had not changed yet (rollout, reward, filter, a dead engine).
    """
    # --- watch, engines, model, data, resume state, first sync, eval -1: hpcrl.run_session ------------------
    with RunSession(cfg, run_dir, model_path, ci_checks, launch_engines, offload_engines_first=True,
                    launch_critic=launch_critic) as s:
        t, rollout, syncer = s.trainer, s.rollout, s.syncer
        actor, data_source, trained, ckpt = t.actor, t.data_source, t.trained, t.ckpt
        stopped: Optional[str] = None

        # --- the loop --------------------------------------------------------------------------------
        for rollout_id in range(t.start, cfg.run.num_rollout):
            t_step = time.perf_counter()
            before = data_source.state_dict()  # the data as the last finished step left it (copies)
            try:
                samples, step = rollout.generate(rollout_id, data_source, t.multiple)
                rollout.offload()
            except Exception as e:  # noqa: BLE001 - every rank learns of it below, then it is re-raised
                samples, step = StepFailed(f"rollout {rollout_id} failed on the controller: "
                                            f"{type(e).__name__}: {e}", e), {}
            samples = broadcast(samples, s.handoff)
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
            s.watch.record_step(step["timing/step_seconds"])
            s.log(rollout_id, step)  # before the checkpoint: a resume truncates the lines after its step
            # Saved at the interval and the last step; preemption or the time limit: every rank stops at
            # this same step boundary, with a checkpoint.
            stopped = ckpt.end_step(rollout_id)
            if stopped is not None:
                break
        s.finish(stopped)
    return s.result()


def loop_of(cfg: Config) -> Callable[..., dict[str, Any]]:
    """The loop function of ``run.mode``, for both launchers (``hpcrl run``: :mod:`hpcrl.launch_local`; the
    Slurm job: :mod:`hpcrl.slurm.entry`): :func:`train_main` (sync),
    :func:`hpcrl.loop_async.train_async_main` (async, beside this file like slime's ``train_async.py``) or
    :func:`hpcrl.loop_fully_async.train_fully_async_main` (fully_async) or :func:`hpcrl.loop_sft.train_sft_main`
    (sft); all
    take ``(cfg, run_dir, model_path, ...)`` and return the last step's metrics (``"preempted"`` when stopped
    early with a checkpoint)."""
    if cfg.run.mode == "async":
        from hpcrl.loop_async import train_async_main

        return train_async_main
    if cfg.run.mode == "fully_async":
        from hpcrl.loop_fully_async import train_fully_async_main

        return train_fully_async_main
    if cfg.run.mode == "sft":
        from hpcrl.loop_sft import train_sft_main

        return train_sft_main
    return train_main
