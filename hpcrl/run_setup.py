"""What every launcher does around the loop: the run folder and its attempt folders (their numbering), the
base model, the stages every trainer rank runs (:func:`run_stages`: the warm start, then the loop of
``run.mode``), quiet logs; and the step schedule the loops and the checkpoint manager follow (:func:`due`).
Used by :mod:`hpcrl.launch_local` (``hpcrl run``), :mod:`hpcrl.slurm.entry` (the job) and :mod:`hpcrl.loop`.

Run folder (``run.output_dir/run.name``): ``config.yaml`` (resolved), ``secret`` (0600, the engines' key),
``logs/attempt-N/`` (engine, router and phase logs of each attempt), ``checkpoints/iter_XXXXXXX/``,
``metrics.jsonl``, ``tensorboard/``, ``curves.png``, ``warm_start.json`` (the warm start the loop started
from, when there is one).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from hpcrl.config import Config
    from hpcrl.rollout.manager import EngineLauncher
    from hpcrl.train.critic_group import CriticLauncher


def run_dir_of(cfg: Config) -> Path:
    """The run folder ``run.output_dir/run.name``."""
    return Path(cfg.run.output_dir) / cfg.run.name


ATTEMPT_PREFIX = "attempt-"
"""Each start of a run (an attempt) logs into ``run_dir/logs/attempt-N`` (N from 0)."""


def attempt_dir(run_dir: str | os.PathLike, n: int) -> Path:
    """``run_dir/logs/attempt-N``, the log folder of attempt ``n`` (not created)."""
    return Path(run_dir) / "logs" / f"{ATTEMPT_PREFIX}{n}"


def attempt_number(name: str) -> Optional[int]:
    """N of a folder named ``attempt-N``, None for other names."""
    m = re.fullmatch(rf"{ATTEMPT_PREFIX}(\d+)", name)
    return int(m.group(1)) if m else None


def attempt_numbers(run_dir: str | os.PathLike) -> list[int]:
    """The N of every ``run_dir/logs/attempt-N`` folder, sorted."""
    logs = Path(run_dir) / "logs"
    if not logs.is_dir():
        return []
    return sorted(n for p in logs.iterdir() if (n := attempt_number(p.name)) is not None)


def next_attempt(run_dir: str | os.PathLike) -> int:
    """The number the next ``logs/attempt-N`` folder will get (one more than the newest, 0 for none)."""
    nums = attempt_numbers(run_dir)
    return nums[-1] + 1 if nums else 0


def new_attempt_dir(run_dir: Path) -> Path:
    """Create ``logs/attempt-N`` with N one more than the last attempt's (0 for a new run)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    n = 0
    while True:
        try:
            attempt_dir(run_dir, n).mkdir()
            return attempt_dir(run_dir, n)
        except FileExistsError:
            n += 1


def due(rollout_id: int, interval: int, num_rollout: int) -> bool:
    """True at every ``interval``-th step and at the last step (interval 0: only the last): when the loop
    evaluates (``rollout.eval_interval``) and the checkpoint manager saves (``checkpoint.save_interval``)."""
    last = rollout_id == num_rollout - 1
    return last or (interval > 0 and (rollout_id + 1) % interval == 0)


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
        init_distributed(megatron=False)  # the warm start's lock is held by rank 0 for all ranks
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


def quiet_logs() -> None:
    """hpcrl at INFO; megatron-core's start-up chatter (configs, parameter lists, missing-TE warnings) off."""
    import warnings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|cuda_graph_scope).*")
