"""The stages every trainer rank of a run goes through (:func:`run_stages`): the warm starts (SFT runs of the
Megatron trainer, :mod:`hpcrl.sft`), then the loop of ``run.mode`` (:mod:`hpcrl.loop`); and the base model they
start from (:func:`prepare_base`). Used by :mod:`hpcrl.launch_local` (``hpcrl run``, ``hpcrl sft``) and
:mod:`hpcrl.slurm.entry` (the job). Kept apart from :mod:`hpcrl.run_setup`, which the loops import: this module
imports the loops.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from hpcrl.config import Config
    from hpcrl.rollout.manager import EngineLauncher
    from hpcrl.train.critic_group import CriticLauncher


def prepare_base(cfg: Config) -> Path:
    """The HF folder a run starts from before any warm start: ``model.path``, created first when
    ``model.create`` asks and it does not exist. On one process (the launcher, or rank 0 of the job).
    Raises what :func:`hpcrl.models.hf.ensure_model` raises."""
    from hpcrl.models.hf import ensure_model

    return Path(ensure_model(cfg.model, seed=cfg.run.seed))


def needs_warm_start(cfg: Config) -> bool:
    """Whether the run trains (or finds cached) a warm start before its loop: ``sft.enabled`` outside
    ``run.mode: sft``, or an on-policy distillation teacher made by SFT."""
    return ((cfg.sft.enabled and cfg.run.mode != "sft")
            or any(t.sft_target_accuracy is not None for t in cfg.algorithm.opd.teachers))


START_FILENAME = "warm_start.json"
"""In the run folder: ``{"model": the HF folder the run started from (its warm start), "time"}``."""


def record_start(run_dir: Path, model: Path) -> None:
    """Write :data:`START_FILENAME` (atomically): which warm start this run's loop started from."""
    import json
    import time

    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{START_FILENAME}.tmp"
    tmp.write_text(json.dumps({"model": str(Path(model).resolve()), "time": time.time()}) + "\n")
    os.replace(tmp, run_dir / START_FILENAME)


def run_stages(cfg: Config, run_dir: Path, base: Path, ci_checks: Optional[bool] = None,
               launch_engines: Optional["EngineLauncher"] = None, launch_critic: Optional["CriticLauncher"] = None,
               warm_start_only: bool = False) -> dict[str, Any]:
    """One trainer rank's whole job: the warm starts (:func:`hpcrl.sft.warm_starts`, SFT runs on the Megatron
    trainer, cached), then the loop of ``run.mode`` (:func:`hpcrl.loop.loop_of`) from the model they made
    (``warm_start_only``: not; ``hpcrl sft``). Every trainer rank calls it with the same ``base``
    (:func:`prepare_base`). With several ranks the default process group forms first and outlives each
    stage's session (it is destroyed at the end when formed here). The controller records the warm start the
    loop starts from in the run folder (:data:`START_FILENAME`). Returns the loop's result
    (``"preempted"`` when a stage stopped early with a checkpoint; ``{"model": path}`` with
    ``warm_start_only``). Raises what the stages raise."""
    import contextlib

    from hpcrl.loop import loop_of
    from hpcrl.procs import env_rank

    formed = False
    if needs_warm_start(cfg) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        from hpcrl.train.parallel import init_distributed

        formed = not dist.is_initialized()
        # the warm start's lock is held by rank 0 for all ranks; this forms the group the run keeps
        init_distributed(megatron=False, timeout_s=cfg.train.collective_timeout_s)
    try:
        model = Path(base)
        if needs_warm_start(cfg):
            from hpcrl.sft import warm_starts

            made = warm_starts(cfg, model, launch_engines, ci_checks)
            if made is None:
                return {"preempted": "warm start"}
            model = made
            if not warm_start_only and env_rank() == 0:
                record_start(run_dir, model)
        if warm_start_only:
            return {"model": str(model)}
        return loop_of(cfg)(cfg, run_dir, model, ci_checks, launch_engines=launch_engines,
                            launch_critic=launch_critic)
    finally:
        if formed:
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                dist.destroy_process_group()
