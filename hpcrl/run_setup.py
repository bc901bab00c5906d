"""What every launcher does before the loop: the run folder and its attempt folders, the model RL starts from,
quiet logs. Used by :mod:`hpcrl.launch_local` (``hpcrl run``), :mod:`hpcrl.slurm.entry` (the job) and
:mod:`hpcrl.loop`.

Run folder (``run.output_dir/run.name``): ``config.yaml`` (resolved), ``secret`` (0600, the engines' key),
``logs/attempt-N/`` (engine, router and phase logs of each attempt), ``checkpoints/iter_XXXXXXX/``,
``metrics.jsonl``, ``tensorboard/``, ``curves.png``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hpcrl.config import Config


def run_dir_of(cfg: Config) -> Path:
    """The run folder ``run.output_dir/run.name``."""
    return Path(cfg.run.output_dir) / cfg.run.name


def new_attempt_dir(run_dir: Path) -> Path:
    """Create ``logs/attempt-N`` with N one more than the last attempt's (0 for a new run)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    n = 0
    while True:
        try:
            (logs / f"attempt-{n}").mkdir()
            return logs / f"attempt-{n}"
        except FileExistsError:
            n += 1


def prepare_model(cfg: Config) -> Path:
    """The HF folder RL starts from: the base model (created if asked), or its SFT warm start when enabled.
    Raises what :func:`hpcrl.models.hf.ensure_model` and :func:`hpcrl.sft.run_sft` raise."""
    from hpcrl.models.hf import ensure_model

    if cfg.sft.enabled:
        from hpcrl.sft import run_sft

        return run_sft(cfg)
    return ensure_model(cfg.model, seed=cfg.run.seed)


def quiet_logs() -> None:
    """hpcrl at INFO; megatron-core's start-up chatter (configs, parameter lists, missing-TE warnings) off."""
    import warnings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|cuda_graph_scope).*")
