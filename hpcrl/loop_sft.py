"""The SFT loop (``run.mode: sft``, and the warm start of an RL run, :mod:`hpcrl.sft`), beside the RL loops
like slime's ``train.py`` with ``--loss-type sft_loss``: :func:`train_sft_main`.

One step::

    next batch of demonstrations -> one Megatron optimizer step -> (eval due: weight sync, eval through the
    engines) -> metrics -> checkpoint -> preemption check

Everything around it is an RL run's (:class:`hpcrl.run_session.RunSession`): the run folder, the trainer's
ranks and layout, the engines (they serve the evals: the eval path of the rollout, greedy by default,
``eval.*``), the weight sync before each eval, ``metrics.jsonl`` / TensorBoard / ``curves.png`` / W&B, the
checkpoint manager (model, optimizer, RNG, the demonstrations' position, the eval schedule: a preempted or
killed run resumes bitwise) and the preemption watch. The trainer side is :func:`build_sft_trainer`.

The recipe ends on accuracy when ``sft.target_accuracy`` is set (the warm start's rule, :mod:`hpcrl.sft`):
evals every ``sft.eval_interval`` steps, every ``sft.eval_interval_near_target`` once an eval reached a
quarter of the target (:class:`EvalSchedule`), and the run stops, checkpointed, at the first eval at or above
it, or whose mean with the evals before it (``sft.target_window`` of them) is (``"target"`` in the result);
with ``sft.anneal_steps`` it trains that many more steps with the lr decayed linearly towards 0 first and
stops after their eval; ``sft.steps`` is a cap.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from hpcrl.config import Config
from hpcrl.run_session import RunSession, Trainer, broadcast, sync_weights
from hpcrl.sft_recipe import NEAR_TARGET_FRACTION

if TYPE_CHECKING:
    from hpcrl.preempt import PreemptionWatch
    from hpcrl.rollout.manager import EngineLauncher
    from hpcrl.train.critic_group import CriticLauncher

ACCURACY_KEY = "eval/accuracy"


class EvalSchedule:
    """When the SFT loop evaluates and whether it reached ``sft.target_accuracy``: a stateful object of the
    checkpoint (``state.json`` ``sft_eval``), so a resumed run keeps its interval.

    ``sft``: the recipe (``eval_interval``, ``eval_interval_near_target``, ``target_accuracy``,
    ``target_window``: the target is met when the mean of the last ``target_window`` evals meets it;
    ``anneal_steps``: then that many steps of lr decay and one eval end the recipe, ``reached``)."""

    def __init__(self, sft: Any) -> None:
        self.sft = sft
        self.interval = sft.eval_interval
        self.last_eval = -1
        self.accuracy: Optional[float] = None
        self.recent: list[float] = []  # the last ``target_window`` eval accuracies, oldest first
        self.anneal_from: Optional[int] = None  # the first step of the lr decay (``sft.anneal_steps``)
        self.reached = False

    @property
    def anneal_end(self) -> Optional[int]:
        """The last step of the lr decay (None before the target is met or without ``sft.anneal_steps``)."""
        return None if self.anneal_from is None else self.anneal_from + self.sft.anneal_steps - 1

    def due(self, step: int, num_steps: int) -> bool:
        """Whether to evaluate after step ``step`` (0-based): ``interval`` steps after the last eval, and the
        last step; during the lr decay only after its last step."""
        if self.anneal_end is not None:
            return step == self.anneal_end or step == num_steps - 1
        return step - self.last_eval >= self.interval or step == num_steps - 1

    def lr_scale(self, step: int) -> float:
        """The factor on the recipe's lr at ``step``: 1, and during the lr decay ``(K - i) / (K + 1)`` at its
        ``i``-th step of ``K`` (``sft.anneal_steps``): linear from just under 1 to ``1 / (K + 1)``."""
        if self.anneal_from is None or step < self.anneal_from:
            return 1.0
        k = self.sft.anneal_steps
        return max(k - (step - self.anneal_from), 0) / (k + 1)

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """Record the eval after ``step`` (-1: before the first) from its metrics (``eval/accuracy``). Every
        trainer rank must observe the same accuracy (the controller's, broadcast), or they disagree on the
        next eval, a collective."""
        acc = metrics.get(ACCURACY_KEY)
        if acc is None:
            return
        self.last_eval, self.accuracy = step, float(acc)
        window = self.sft.target_window
        self.recent = [*self.recent, float(acc)][-window:]
        target, near = self.sft.target_accuracy, self.sft.eval_interval_near_target
        if target is None:
            return
        if near and self.interval != near and acc >= NEAR_TARGET_FRACTION * target:
            self.interval = near
        if self.anneal_end is not None:  # the eval after the lr decay ends the recipe, whatever its accuracy
            self.reached = step >= self.anneal_end
            return
        met = len(self.recent) == window and sum(self.recent) / window >= target
        if met and self.sft.anneal_steps:
            self.anneal_from = step + 1
        else:
            self.reached = met

    def state_dict(self) -> dict[str, Any]:
        return {"interval": self.interval, "last_eval": self.last_eval, "accuracy": self.accuracy,
                "recent": list(self.recent), "reached": self.reached, "anneal_from": self.anneal_from}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.interval, self.last_eval = int(state["interval"]), int(state["last_eval"])
        self.accuracy, self.reached = state.get("accuracy"), bool(state.get("reached"))
        self.anneal_from = state.get("anneal_from")
        self.recent = [float(a) for a in state.get("recent", [] if self.accuracy is None else [self.accuracy])]


def sft_data_config(cfg: Config) -> Config:
    """``cfg`` with the demonstrations' data section as ``data`` (``sft.data`` when set)."""
    import dataclasses

    return dataclasses.replace(cfg, data=cfg.sft.data) if cfg.sft.data is not None else cfg


def build_sft_trainer(cfg: Config, run_dir: Path, model_path: Path, watch: "PreemptionWatch", controller: bool,
                      ci_checks: Optional[bool] = None, on_device: Optional[Callable[[], Any]] = None,
                      critic_group: Any = None, **states: Any) -> Trainer:
    """The SFT run's trainer side on every rank (:func:`hpcrl.run_session.build_trainer`'s counterpart):
    process groups, :class:`~hpcrl.train.supervised.SupervisedTrainer`, the demonstrations (every train item
    of the demonstrations' data section, :mod:`hpcrl.data.demonstrations`) in their seeded order
    (:class:`~hpcrl.data.demonstrations.DemonstrationSource`, ``sft.batch_size`` a step), and a checkpoint
    manager holding them and ``states`` that has loaded the newest checkpoint. Raises what those raise
    (DataError, DemonstrationError, CheckpointError)."""
    import contextlib

    from transformers import AutoTokenizer

    from hpcrl.checkpoint.manager import CheckpointManager, RolloutCounter
    from hpcrl.data.datasets import load_datasets
    from hpcrl.data.demonstrations import DemonstrationSource, demonstration
    from hpcrl.metrics import MetricsPosition
    from hpcrl.train.parallel import setup_parallel
    from hpcrl.train.supervised import SupervisedTrainer

    setup_parallel(cfg)
    trainer = SupervisedTrainer(cfg, model_path)
    data_cfg = sft_data_config(cfg)
    datasets = load_datasets(data_cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    samples = [demonstration(tokenizer, it, data_cfg.data.apply_chat_template, index=i)
               for i, it in enumerate(datasets.train)]
    source = DemonstrationSource(samples, cfg.sft.batch_size, cfg.run.seed)
    ckpt = CheckpointManager.from_config(cfg, run_dir, trainer, watch=watch, states={
        "progress": RolloutCounter(), "demonstrations": source, "metrics": MetricsPosition(run_dir, controller),
        **states}, on_device=on_device or contextlib.nullcontext)
    start = ckpt.load()
    return Trainer(trainer, datasets, source, None, ckpt, start, 1)


def export_model(trainer: Any, dest: Path, base: Path, dtype: str) -> None:
    """Write the trainer's model as an HF folder at ``dest`` (atomically; the tensors in ``dtype``, the
    config and tokenizer files of ``base``), collectively: every rank iterates the export (TP gathers), the
    controller writes. Raises OSError when writing fails."""
    import torch

    from hpcrl.procs import env_rank
    from hpcrl.weights.disk import write_hf_folder
    from hpcrl.weights.sync import iterate_for_sync

    named = iterate_for_sync(trainer.ddp_model, getattr(torch, dtype))
    if env_rank() == 0:
        write_hf_folder(named, dest, bucket_bytes=EXPORT_SHARD_BYTES, hf_checkpoint=base)
    else:
        for _ in named:
            pass


EXPORT_SHARD_BYTES = 4 << 30
"""Largest safetensors file of an exported model (bytes)."""


def train_sft_main(cfg: Config, run_dir: Path, model_path: Path, ci_checks: Optional[bool] = None,
                   launch_engines: Optional["EngineLauncher"] = None,
                   launch_critic: Optional["CriticLauncher"] = None,
                   export: Optional[Path] = None) -> dict[str, Any]:
    """One trainer rank's whole SFT run; returns the last step's metrics (on the controller the eval ones
    too) plus ``"preempted": reason`` when it stopped early with a checkpoint, ``"target": True`` when it
    stopped at ``sft.target_accuracy``. Arguments as :func:`hpcrl.loop.train_main` (``launch_critic``
    unused: SFT has no critic); ``export``: when the run ends (not preempted), the model is written there as
    an HF folder in ``model.dtype`` (:func:`export_model`; the warm start). Raises what a step raises."""
    schedule = EvalSchedule(cfg.sft)
    num_steps = cfg.run.num_rollout
    with RunSession(cfg, run_dir, model_path, ci_checks, launch_engines, offload_engines_first=True,
                    states={"sft_eval": schedule}, build=build_sft_trainer) as s:
        t, rollout, syncer = s.trainer, s.rollout, s.syncer
        trainer, demos, ckpt = t.actor, t.data_source, t.ckpt
        stopped: Optional[str] = None
        def observe(step: int, metrics: dict[str, Any]) -> None:
            # the controller's accuracy on every rank: each one decides the next eval and the stop the same way
            schedule.observe(step, {ACCURACY_KEY: broadcast(metrics.get(ACCURACY_KEY), s.handoff)})

        if t.start == 0:
            observe(-1, s.last)  # the eval before the first step (RunSession's)
        rollout.offload()  # colocated: the engines give the devices back to the trainer
        rollout.onload_trainer()
        for step in range(t.start, num_steps):
            if schedule.reached:
                break
            t_step = time.perf_counter()
            metrics = trainer.train(step, demos.next_batch(), lr_scale=schedule.lr_scale(step))
            if schedule.due(step, num_steps):
                metrics.update(sync_weights(trainer, syncer, rollout, version=step + 1))
                metrics.update(rollout.evaluate(step))
                observe(step, metrics)
                rollout.offload()
                rollout.onload_trainer()
            metrics["timing/step_seconds"] = time.perf_counter() - t_step
            s.watch.record_step(metrics["timing/step_seconds"])
            s.log(step, metrics)
            if schedule.reached:  # the recipe's end: saved whatever the interval
                if ckpt.last_saved != step:
                    ckpt.save(step)
                break
            stopped = ckpt.end_step(step)
            if stopped is not None:
                break
        if export is not None and stopped is None:
            export_model(trainer, export, model_path, cfg.model.dtype)
        s.finish(stopped)
    out = s.result()
    if schedule.reached:
        out["target"] = True
    return out
