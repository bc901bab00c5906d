"""``hpcrl eval RUN_OR_CHECKPOINT [CONFIG] [key=value ...]``: evaluate a model outside a training run, with
the code a run evaluates with (:mod:`hpcrl.rollout.evaluate`) on the engines a run would start
(``rollout.engine``: hpcrl's CPU engine or SGLang).

What is evaluated:

- a run folder: its newest complete checkpoint, exported to HF
  (:func:`hpcrl.convert.convert_run_checkpoint`), or the model it starts from when it has none; the config is
  the run's ``config.yaml`` unless CONFIG is given (relative paths in it are relative to the folder the run
  was started from: run ``hpcrl eval`` there);
- a checkpoint folder ``RUN/checkpoints/iter_XXXXXXX``: that checkpoint, with its run's config;
- an HF model folder (``config.json``): that model, with CONFIG (required: its data, eval and rollout sections
  say what to evaluate and how).

The results go to ``OUTPUT/eval.json`` (default ``RUN/eval/<iter_XXXXXXX | model>/``, for an HF folder
``eval/<folder name>/`` under the current folder): ``{"target", "model", "metrics", "sets"}``, with the engine
logs under ``OUTPUT/logs/``; :func:`format_results` prints them as a table.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from hpcrl.config import Config, ConfigError
from hpcrl.validate import load_and_check


@dataclass
class EvalTarget:
    """What ``hpcrl eval`` evaluates: the config, the model (an HF folder, or a checkpoint to export first),
    and the default output folder."""

    cfg: Config
    model: Optional[Path]
    """An HF folder to evaluate as is; None: the run's starting model
    (:func:`hpcrl.launch_local.starting_model`: the warm start when enabled)."""
    checkpoint: Optional[Path]
    """A checkpoint folder (or a run folder: its newest) to export to HF first; None for an HF model."""
    output: Path
    label: str


def _run_config(run_dir: Path, config: Optional[str], overrides: Sequence[str]) -> Config:
    path = Path(config) if config else run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError("CONFIG", str(path), "no such config file", "give the run's config.yaml as CONFIG")
    return load_and_check(path, list(overrides))


def resolve_target(target: str, config: Optional[str] = None, overrides: Sequence[str] = (),
                   output: Optional[str] = None) -> EvalTarget:
    """Tell what ``target`` is (module doc) and load the config to evaluate it with.

    Raises:
        ConfigError: ``target`` is none of a run folder, a checkpoint folder or an HF folder; an HF folder
            without CONFIG; a bad config.
    """
    from hpcrl import checkpoint

    path = Path(target)
    if (path / checkpoint.MARKER_FILE).exists() or path.name.startswith("iter_"):
        run_dir = path.resolve().parents[1]
        cfg = _run_config(run_dir, config, overrides)
        out = Path(output) if output else run_dir / "eval" / path.name
        return EvalTarget(cfg, None, path, out, path.name)
    if (path / "config.yaml").is_file() or (path / "checkpoints").is_dir():
        cfg = _run_config(path, config, overrides)
        latest = checkpoint.find_latest_checkpoint(path)
        label = latest.name if latest is not None else "model"
        return EvalTarget(cfg, None, latest, Path(output) if output else path / "eval" / label, label)
    if (path / "config.json").is_file():
        if not config:
            raise ConfigError("CONFIG", None, f"{target} is an HF model folder, and says nothing of what to "
                              "evaluate it on", "give a run config: hpcrl eval MODEL CONFIG (its data, eval "
                              "and rollout sections are used)")
        cfg = load_and_check(config, [*overrides, f"model.path={path}", "model.create=null",
                                   "sft.enabled=false"])
        return EvalTarget(cfg, path, None, Path(output) if output else Path("eval") / path.name, path.name)
    raise ConfigError("RUN_OR_CHECKPOINT", target, "is not a run folder (config.yaml), a checkpoint folder "
                      "(iter_XXXXXXX) or an HF model folder (config.json)", "give one of those")


def evaluate_target(t: EvalTarget) -> dict[str, Any]:
    """Export the checkpoint (when there is one), start the engines, evaluate every eval set once and stop
    them. Writes and returns ``eval.json``'s content.

    Raises what the export, the data loading and the engines raise (FileNotFoundError, DataError,
    ProcessStartError, RolloutError).
    """
    from hpcrl.data.datasets import load_datasets
    from hpcrl.rollout.engines import launch_local_engines
    from hpcrl.rollout.manager import RolloutManager
    from hpcrl.run_setup import new_attempt_dir

    t.output.mkdir(parents=True, exist_ok=True)
    # the engines only: no teachers, no restarts from a weight snapshot
    cfg = dataclasses.replace(t.cfg, algorithm=dataclasses.replace(
        t.cfg.algorithm, opd=dataclasses.replace(t.cfg.algorithm.opd, teachers=[])),
        rollout=dataclasses.replace(t.cfg.rollout, max_engine_restarts=0))
    if t.checkpoint is not None:
        from hpcrl.convert import convert_run_checkpoint

        model = convert_run_checkpoint(t.checkpoint, t.output / "model")
    else:
        from hpcrl.launch_local import starting_model

        model = t.model if t.model is not None else starting_model(cfg)
    datasets = load_datasets(cfg)
    manager = RolloutManager(cfg, t.output, new_attempt_dir(t.output), Path(model), launch_local_engines)
    try:
        manager.start(datasets)
        metrics = manager.evaluate(-1)
    finally:
        manager.stop()
    result = {"target": str(t.checkpoint or t.model or model), "model": str(model), "metrics": metrics,
              "sets": [{"name": es.name, "prompts": len(es.items), "n_samples": es.n_samples,
                        "params": es.params} for es in manager.eval_sets]}
    tmp = t.output / "eval.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, t.output / "eval.json")
    return result


def format_results(result: dict[str, Any]) -> str:
    """``eval.json`` as a table: one row per set (SET, PROMPTS, SAMPLES, ACCURACY, PASS@k..., LENGTH,
    TRUNCATED)."""
    from hpcrl.rollout.evaluate import metric_prefix

    m = result["metrics"]
    ks = sorted({int(k.rsplit("@", 1)[1]) for k in m if "pass@" in k})
    header = ["SET", "PROMPTS", "SAMPLES", "ACCURACY", *(f"PASS@{k}" for k in ks), "LENGTH", "TRUNCATED"]
    rows = [header]
    for s in result["sets"]:
        p = metric_prefix(s["name"])

        def cell(key: str) -> str:
            return f"{m[p + key]:.3f}" if p + key in m else "-"

        rows.append([s["name"], str(s["prompts"]), str(s["n_samples"]), cell("accuracy"),
                     *(cell(f"pass@{k}") for k in ks), f"{m.get(p + 'response_length', 0):.1f}",
                     cell("truncated")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
