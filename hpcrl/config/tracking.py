"""The ``wandb`` section: Weights & Biases tracking of a run, with its check (``check_wandb``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from hpcrl.config.checks import require


@dataclass
class WandbSection:
    """Weights & Biases (the ``wandb`` package: ``pip install hpcrl[wandb]``); off by default.

    The controller sends every ``metrics.jsonl`` row as it is written, the resolved config and ``curves.png``
    (:mod:`hpcrl.tracking`); the W&B run id is kept in the run folder's ``wandb.json``, so every attempt of a
    requeued or resumed run continues the same W&B run. After a resume, each step's last attempt wins: rows
    carry ``rollout_id`` and ``attempt``, and :func:`hpcrl.tracking.last_attempt_rows` reads W&B's history
    back to ``metrics.jsonl``'s rows."""

    mode: Literal["disabled", "online", "offline"] = "disabled"
    """``disabled``: no W&B; ``online``: send as the run goes; ``offline``: write under the run folder
    (``wandb/offline-run-*``, one per attempt), to be uploaded later from a login node with ``hpcrl logs RUN
    --wandb-sync`` (compute nodes often have no internet)."""
    project: Optional[str] = None
    """W&B project (default: the run's ``run.name``)."""
    entity: Optional[str] = None
    """W&B entity (user or team; default: the account's default)."""
    group: Optional[str] = None
    """W&B group (a sweep's points default to the sweep's name)."""
    tags: list[str] = field(default_factory=list)
    """W&B tags of the run."""


def check_wandb(cfg: Config, check_files: bool) -> None:
    """With ``check_files``: raises ConfigError on ``wandb.mode`` when it is not ``disabled`` and the
    ``wandb`` package is not installed."""
    w = cfg.wandb
    if w.mode != "disabled" and check_files:
        try:
            import wandb  # noqa: F401
        except ImportError:
            require(False, "wandb.mode", w.mode, "needs the wandb package, which is not installed",
                    "pip install 'hpcrl[wandb]', or set wandb.mode=disabled")
