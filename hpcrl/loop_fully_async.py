"""The fully asynchronous RL loop (``run.mode: fully_async``), written out beside the other two like slime's
``examples/fully_async`` and miles' fully-async mode: :func:`train_fully_async_main`.

The engines never wait for the trainer except during a weight update: a producer on the rollout's event loop
(:mod:`hpcrl.rollout.fully_async`) keeps up to ``rollout.max_inflight_groups`` groups generating, filters the
finished ones into a buffer, and starts no group that would be more than ``rollout.max_staleness`` versions
old at the trainer's pace. The trainer takes the next ``rollout.batch_size`` finished groups when it is
ready::

    trainer:  take | train k ---------| sync k+1 | eval | ckpt | take | train k+1 -------| sync ...
    engines:  generate, generate, generate ... (paused only while the weights load) ... generate ...

A weight update lands on in-flight responses (``weights.pause_mode``: ``in_place`` by default here), so a
response may mix versions; the trainer recomputes the old log-probs and corrects against the engines' (TIS /
MIS, docs/algorithms.md). ``timing/rollout_wait_seconds`` is how long the trainer waited for finished groups.

Nothing lost, nothing trained twice: each checkpoint holds one snapshot of the stream, taken on the event loop
(the data source's position, the finished groups, the generating ones as far as their last finished call,
and the ledger of filtered / dropped / regenerated groups; :class:`hpcrl.rollout.fully_async.StreamState`);
a resumed run serves the finished groups first and continues the partial ones. Timing decides what is
trained, so ``run.deterministic`` is refused, as is colocation (the engines generate while the trainer
trains).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpcrl.config import Config
from hpcrl.rollout.fully_async import StreamState
from hpcrl.run_setup import due
from hpcrl.run_session import RunSession, StepFailed, broadcast, sync_weights

if TYPE_CHECKING:
    from hpcrl.rollout.manager import EngineLauncher, FollowerRollout, RolloutManager
    from hpcrl.train.critic_group import CriticLauncher


def train_fully_async_main(cfg: Config, run_dir: Path, model_path: Path, ci_checks: Optional[bool] = None,
                           launch_engines: Optional["EngineLauncher"] = None,
                           launch_critic: Optional["CriticLauncher"] = None) -> dict[str, Any]:
    """One trainer rank's whole fully-async run; returns the last step's metrics (on the controller the
    rollout and eval ones too), plus ``"preempted": reason`` when it stopped early with a checkpoint.

    Arguments as :func:`hpcrl.loop.train_main`. Raises what a step raises; when the stream fails (a
    generation or reward error) the last trained step is checkpointed first (with the stream as it was then).
    """
    # --- watch, engines, model, data, resume state (the stream's snapshot), first sync, eval -1 ----------
    stream = StreamState()  # its data_source_state replaces the data source among the checkpointed states
    with RunSession(cfg, run_dir, model_path, ci_checks, launch_engines,
                    states={"stream": stream, "data_source": stream.data_source_state},
                    launch_critic=launch_critic) as s:
        t, rollout, syncer = s.trainer, s.rollout, s.syncer
        actor, data_source, trained, ckpt = t.actor, t.data_source, t.trained, t.ckpt
        stopped: Optional[str] = None
        stream.attach(data_source)  # the checkpoint's data-source state, from the same snapshot as the stream
        rollout.start_stream(data_source, t.start, stream.restored)  # the producer owns the data source now

        # --- the loop: take what finished, train, publish the weights; the engines keep generating -------
        for rollout_id in range(t.start, cfg.run.num_rollout):
            t_step = time.perf_counter()
            samples, step = take(rollout, rollout_id, t.multiple, s.handoff)
            if isinstance(samples, StepFailed):  # the stream failed: keep the last trained step
                ckpt.save_before_failing(samples.message)
                raise samples.error or RuntimeError(samples.message)
            step["timing/rollout_wait_seconds"] = time.perf_counter() - t_step
            step.update(actor.train(rollout_id, samples))
            trained.extend(rollout_id, samples)
            step.update(sync_weights(actor, syncer, rollout, version=rollout_id + 1))
            if due(rollout_id, cfg.rollout.eval_interval, cfg.run.num_rollout):
                step.update(rollout.evaluate(rollout_id))
            step["timing/step_seconds"] = time.perf_counter() - t_step
            s.watch.record_step(step["timing/step_seconds"])
            s.log(rollout_id, step)
            saving = ckpt.due(rollout_id) or s.watch.local_reason() is not None  # in-flight responses too:
            stream.put(rollout.snapshot(partials=saving))  # one instant of the stream, for the checkpoint
            stopped = ckpt.end_step(rollout_id)
            if stopped is not None:
                break
        rollout.stop_stream()
        s.finish(stopped)
    return s.result()


def take(rollout: "RolloutManager | FollowerRollout", rollout_id: int, multiple: int,
         handoff: Any = None) -> tuple[Any, dict]:
    """The next finished groups for step ``rollout_id`` on every trainer rank (sent over the session's
    ``handoff`` group): ``(samples, metrics)`` (the metrics on the controller only), or ``(StepFailed, {})``
    when the stream failed on the controller."""
    try:
        samples, metrics = rollout.take(rollout_id, multiple)
    except Exception as e:  # noqa: BLE001 - every rank learns of it, then it is re-raised
        samples, metrics = StepFailed(f"rollout {rollout_id} failed on the controller: "
                                      f"{type(e).__name__}: {e}", e), {}
    return broadcast(samples, handoff), metrics
