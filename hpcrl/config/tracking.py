"""The ``wandb`` section: Weights & Biases tracking of a run, with its check (``check_wandb``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

from hpcrl.config.checks import require

if TYPE_CHECKING:
    from hpcrl.config.schema import Config


@dataclass
class WandbSection:
    """Weights & Biases (the ``wandb`` package: ``pip install hpcrl[wandb]``); off by default."""

    mode: Literal["disabled", "online", "offline"] = "disabled"
    """``disabled``: no W&B; ``online``: send as the run goes; ``offline``: write under the run folder, to be
    uploaded later from a login node (compute nodes often have no internet)."""
    project: Optional[str] = None
    """W&B project (default: the run's ``run.name``)."""
    entity: Optional[str] = None
    """W&B entity (user or team; default: the account's default)."""
    group: Optional[str] = None
    """W&B group (a sweep's points default to the sweep's name)."""
    tags: list[str] = field(default_factory=list)


def check_wandb(cfg: Config, check_files: bool) -> None:
    w = cfg.wandb
    if w.mode != "disabled" and check_files:
        try:
            import wandb  # noqa: F401
        except ImportError:
            require(False, "wandb.mode", w.mode, "needs the wandb package, which is not installed",
                    "pip install 'hpcrl[wandb]', or set wandb.mode=disabled")
