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

        path = run_sft(cfg)
    else:
        path = ensure_model(cfg.model, seed=cfg.run.seed)
    prepare_teachers(cfg)
    return path


def prepare_teachers(cfg: Config) -> None:
    """The on-policy distillation teachers' folders (``algorithm.opd.teachers``): each one with
    ``sft_target_accuracy`` is made (or reused from its cache) by the run's ``sft`` recipe from ``model.path``
    stopped at that accuracy; then every teacher must have the student's tokenizer. Raises ConfigError (a
    missing folder, another tokenizer) and what :func:`hpcrl.sft.run_sft` raises."""
    import dataclasses

    from hpcrl.config import ConfigError
    from hpcrl.validate import check_teacher_tokenizers

    for i, t in enumerate(cfg.algorithm.opd.teachers):
        if t.sft_target_accuracy is not None:
            from hpcrl.sft import run_sft

            sft = dataclasses.replace(cfg.sft, enabled=True, output=t.path, target_accuracy=t.sft_target_accuracy)
            run_sft(dataclasses.replace(cfg, sft=sft))
        elif not (Path(t.path) / "config.json").is_file():
            raise ConfigError(f"algorithm.opd.teachers[{i}].path", t.path, "is not an HF model folder",
                              "fix the path, or set sft_target_accuracy to make it by SFT")
    check_teacher_tokenizers(cfg)


def quiet_logs() -> None:
    """hpcrl at INFO; megatron-core's start-up chatter (configs, parameter lists, missing-TE warnings) off."""
    import warnings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|cuda_graph_scope).*")
