"""What every launcher does around the loop: the run folder and its attempt folders (their numbering), quiet
logs; and the step schedule the loops and the checkpoint manager follow (:func:`due`). Used by
:mod:`hpcrl.launch_local` (``hpcrl run``), :mod:`hpcrl.slurm.entry` (the job), :mod:`hpcrl.loop` and the
modules beside them; it imports none of them (the stages a trainer rank runs are :mod:`hpcrl.stages`).

Run folder (``run.output_dir/run.name``): ``config.yaml`` (resolved), ``secret`` (0600, the engines' key),
``logs/attempt-N/`` (engine, router and phase logs of each attempt), ``checkpoints/iter_XXXXXXX/``,
``metrics.jsonl``, ``tensorboard/``, ``curves.png``, ``warm_start.json`` (the warm start the loop started
from, when there is one: :func:`hpcrl.stages.record_start`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from hpcrl.config import Config


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


def quiet_logs() -> None:
    """hpcrl at INFO; megatron-core's start-up chatter (configs, parameter lists, missing-TE warnings) off."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_import_warnings()


def quiet_import_warnings() -> None:
    """megatron-core's warnings at import that Transformer Engine and Apex are not installed (they are not on a
    CPU machine, and the torch fallbacks are what hpcrl uses there) off, for this process and its forks."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|cuda_graph_scope).*")
