"""Loading stages (:func:`read_config_file`, :func:`apply_overrides`, :func:`build`, :func:`validate`, :func:`resolve`;
:func:`load_config` runs them all), the resolved config's text, and the sweep section's checks.

The checks that read the model or import plug-ins need an :class:`~hpcrl.config.environment.Environment`
(``env``); :func:`hpcrl.validate.load_and_check` passes hpcrl's, as every command of a run does."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import yaml

from hpcrl.config.environment import Environment
from hpcrl.config.errors import FILE_FIELD, ConfigError
from hpcrl.config.yaml_io import parse_yaml, YamlDumper
from hpcrl.config.checks import non_negative, positive, require
from hpcrl.config.run import check_data, check_model, check_run, check_sft
from hpcrl.config.rollout import check_rollout
from hpcrl.config.critic import check_critic, check_critic_model
from hpcrl.config.lora import check_lora
from hpcrl.config.train import (check_algorithm, check_checkpoint, check_heads, check_moe, check_stages,
                                check_train)
from hpcrl.config.weights import check_sglang_fp8, check_weights
from hpcrl.config.slurm import check_slurm
from hpcrl.config.memory import check_memory, read_model_config
from hpcrl.config.evaluation import check_eval
from hpcrl.config.tracking import check_wandb
from hpcrl.config.schema import Config
from hpcrl.config.coerce import (apply_overrides, convert_dataclass, convert_value, schema_lookup,
                                  unwrap_optional, value_kind)


def read_config_file(path: str | os.PathLike) -> dict:
    """Read a YAML config file into a plain dict (empty file -> ``{}``), untyped and unvalidated.

    Raises ConfigError (field :data:`FILE_FIELD`) when the file is missing or unreadable, is not valid YAML
    (value ``file:line``), has a duplicate key, or its top level is not a mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(FILE_FIELD, str(p), "no such config file" if not p.exists() else "not a file",
                          "check the path")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(FILE_FIELD, str(p), f"cannot read the file ({e})", "check the file") from None
    data = parse_yaml(text, str(p))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(FILE_FIELD, str(p),
                          f"the top level must be a mapping of sections, got {value_kind(data)}",
                          "start the file with sections such as 'run:', 'model:', 'rollout:'")
    return data


def load_config(path: str | os.PathLike | None, overrides: Iterable[str] = (), check_files: bool = True,
                env: Optional[Environment] = None) -> Config:
    """Load a run config: YAML file, ``key=value`` overrides, type checks, :func:`validate`, :func:`resolve`.

    Args:
        path: YAML file; ``None`` starts from the defaults.
        overrides: dotted ``key=value`` strings applied in order; values are parsed as YAML
            (``rollout.batch_size=16``, ``slurm.extra_sbatch=[--a,--b]``,
            ``sglang.enable_memory_saver=true``).
            Keys below ``sglang``/``megatron``/``data.task_kwargs``/``sweep.grid`` are created. A number or
            boolean given to a string field is kept as its text (``run.name=2024``); ``key=`` sets a string
            field to ``""`` and an optional field to null.
        check_files: also check the environment: that files exist (model, data, GGUF, container), that
            reasoning-gym task names exist and, with ``env``, that plug-in paths import, that the model folder
            can be trained, teachers share its tokenizer and the run fits ``slurm.gpu_memory_gb``. ``False``
            checks only the config itself.
        env: what those checks read the model and plug-ins with (:data:`hpcrl.validate.ENVIRONMENT`; call
            :func:`hpcrl.validate.load_and_check` for every check a run makes); None skips them.

    Returns:
        The validated, resolved :class:`Config` (derived defaults filled in).

    Raises:
        ConfigError: for any bad input; ``str()`` is one line naming the dotted field, the value and the fix.

    The stages are public for callers that need one of them: :func:`read_config_file`, :func:`apply_overrides`,
    :func:`build`, :func:`validate`, :func:`resolve` (:func:`load_raw` is the last three).
    """
    raw = {} if path is None else read_config_file(path)
    return load_raw(apply_overrides(raw, overrides), check_files=check_files, env=env)


def build(raw: Mapping[str, Any]) -> Config:
    """The typed :class:`Config` of a raw dict (file plus overrides): every value converted to its field's type,
    unknown keys refused; not validated across fields and not resolved. Raises ConfigError."""
    return convert_dataclass(raw, Config, "")


def load_raw(raw: Mapping[str, Any], check_files: bool = True, env: Optional[Environment] = None) -> Config:
    """:func:`build`, :func:`validate` and :func:`resolve` of a raw dict: the stages of :func:`load_config` after
    the file is read, for callers that change the raw dict first (``hpcrl submit``, ``hpcrl sweep``).
    Raises ConfigError."""
    cfg = build(raw)
    validate(cfg, check_files=check_files, env=env)
    return resolve(cfg)


def config_to_dict(cfg: Config) -> dict:
    """The config as plain nested dicts/lists/scalars (a deep copy), in field order; inverse of loading."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML in field order (block style, strings quoted where YAML 1.1 would misread them), the
    text of ``run_dir/config.yaml`` and of ``hpcrl validate --print-config``."""
    return yaml.dump(config_to_dict(cfg), Dumper=YamlDumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=1000)


def resolve(cfg: Config) -> Config:
    """Return a copy of ``cfg`` with every derived default filled in (the one place they are computed).

    * ``model.path``: ``.cache/models/<create>`` (``create: tiny-qwen2`` / ``tiny-qwen3-moe`` /
      ``tiny-glm4-moe`` / ``tiny-deepseek-v3``) or
      ``.cache/models/<gguf stem>``
      (``create: gguf``) when empty;
    * ``rollout.over_sampling_batch_size``: ``rollout.batch_size``;
    * ``train.global_batch_size``: ``batch_size * n_samples_per_prompt // num_steps_per_rollout``;
    * ``train.lr_decay_steps``: ``run.num_rollout * train.num_steps_per_rollout``;
    * ``algorithm.eps_clip_high``: ``eps_clip``;
    * ``weights.method: auto``: ``tensor`` when colocated, ``distributed`` when disaggregated;
    * ``run.num_rollout``: ``sft.steps`` in ``run.mode: sft``.

    Idempotent. Expects a config that passed :func:`validate`; ``cfg`` itself is not modified.
    """
    out = copy.deepcopy(cfg)
    if out.run.mode == "sft":  # an SFT run's steps are the recipe's
        out.run.num_rollout = out.sft.steps
    m = out.model
    if not m.path and m.create in ("tiny-qwen2", "tiny-qwen3-moe", "tiny-glm4-moe", "tiny-deepseek-v3"):
        m.path = f".cache/models/{m.create}"
    elif not m.path and m.create == "gguf" and m.gguf_file:
        m.path = f".cache/models/{Path(m.gguf_file).stem}"
    r = out.rollout
    if r.over_sampling_batch_size is None:
        r.over_sampling_batch_size = r.batch_size
    t = out.train
    if t.global_batch_size is None:
        t.global_batch_size = r.batch_size * r.n_samples_per_prompt // max(t.num_steps_per_rollout, 1)
    if t.lr_decay_steps is None:
        t.lr_decay_steps = max(out.run.num_rollout * t.num_steps_per_rollout, 1)
    a = out.algorithm
    if a.eps_clip_high is None:
        a.eps_clip_high = a.eps_clip
    if out.weights.method == "auto":
        out.weights.method = "tensor" if out.run.placement == "colocate" else "distributed"
    return out


def resolved_text(cfg: Config, version: str) -> str:
    """The text of ``run_dir/config.yaml``: a comment naming hpcrl ``version``, then the resolved ``cfg`` as
    YAML (:func:`config_to_yaml` of :func:`resolve`); :func:`hpcrl.validate.save_resolved` writes it."""
    body = config_to_yaml(resolve(cfg))
    return f"# Resolved config written by hpcrl {version}; load it with hpcrl.config.load_config.\n{body}"


def _check_space(cfg: Config, name: str, space: dict[str, list[Any]]) -> None:
    for key, values in space.items():
        f = f"sweep.{name}.{key}"
        tp, n = schema_lookup(key, f, values)
        require(key.split(".")[0] != "sweep", f, values, "cannot sweep the sweep section",
                 "sweep run fields such as train.lr")
        inner = unwrap_optional(tp)
        require(not (n == len(key.split(".")) and dataclasses.is_dataclass(inner)), f, values,
                 f"{key} is a section, not one field", f"sweep one field of it, e.g. {key}.<field>")
        require(isinstance(values, list) and len(values) > 0, f, values,
                 "must be a non-empty list of values",
                 f"write e.g. {key}: [a, b]")
        for i, v in enumerate(values):
            convert_value(v, tp, f"{f}[{i}]")


def check_sweep(cfg: Config) -> None:
    """The ``sweep:`` section's checks (part of :func:`validate`; ``hpcrl sweep`` runs them alone on a base
    config that need not be valid as it stands). Raises ConfigError."""
    w = cfg.sweep
    _check_space(cfg, "grid", w.grid)
    _check_space(cfg, "random_space", w.random_space)
    non_negative(cfg, "sweep.num_random", "sweep.random_seed")
    positive(cfg, "sweep.array_parallelism")
    require(not (w.num_random > 0 and not w.random_space), "sweep.num_random", w.num_random,
             "random search needs sweep.random_space", "add sweep.random_space or set num_random=0")
    require(not (w.random_space and w.num_random == 0), "sweep.random_space", w.random_space,
             "is ignored while sweep.num_random is 0", "set sweep.num_random to the number of random points")
    require(len(set(w.seeds)) == len(w.seeds), "sweep.seeds", w.seeds, "has duplicate seeds",
             "list each seed once")


def validate(cfg: Config, check_files: bool = True, env: Optional[Environment] = None) -> None:
    """Check a config: the types of every field, then ranges and cross-field rules.

    Checks include: ``model.path`` present (unless ``model.create``) and, with ``check_files``, an HF folder;
    ``create: gguf`` needs ``gguf_file``; async needs disaggregate; batch sizes and parallel sizes consistent
    (global batch a multiple of the group size and the micro batch, model parallel size divides ``nprocs``);
    sampling ranges; clip ranges; KL settings; data source and plug-in paths; Slurm time/signal/memory
    formats; with ``slurm.gpu_memory_gb`` the engines' layout and the per-GPU memory estimate
    (:mod:`hpcrl.config.memory`); sweep keys are real fields and their values have the field's type. Unset
    derived fields (``None``) are accepted; :func:`resolve` fills them.

    Args:
        cfg: the config to check (not modified).
        check_files: also check the environment (files exist, reasoning-gym tasks exist; with ``env`` also
            plug-ins import, the model folder's support, teachers' tokenizers, the memory estimate).
        env: the readers of those last checks (:data:`hpcrl.validate.ENVIRONMENT`); None skips them.

    Raises:
        ConfigError: at the first problem, naming the dotted field.
    """
    if not isinstance(cfg, Config):
        raise TypeError(f"validate expects a hpcrl.config.Config, got {type(cfg).__name__}")
    convert_dataclass(config_to_dict(cfg), Config, "")  # types, also for configs built in code
    check_run(cfg)
    check_model(cfg, check_files, env)
    check_data(cfg, check_files)
    check_rollout(cfg, check_files, env)
    check_sft(cfg, check_files)
    check_train(cfg)
    check_heads(cfg, check_files)
    check_stages(cfg, check_files)
    check_moe(cfg, check_files, env)
    check_lora(cfg, check_files, env)
    check_algorithm(cfg, check_files, env)
    check_critic(cfg)
    check_critic_model(cfg, check_files, env)
    check_weights(cfg)
    check_sglang_fp8(cfg, lambda: read_model_config(cfg) if check_files and env is not None else None, env)
    check_checkpoint(cfg)
    check_slurm(cfg, check_files)
    check_memory(cfg, check_files, env)
    check_sweep(cfg)
    check_eval(cfg, check_files)
    check_wandb(cfg, check_files)
