"""The ``train``, ``algorithm``, ``weights`` and ``checkpoint`` sections, each with its checks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from hpcrl.config.environment import Environment
from hpcrl.config.checks import get_field, non_negative, positive, require
from hpcrl.names import Estimator, KLKind, LossReduction, MISLevel, PolicyLoss


@dataclass
class TrainSection:
    """The Megatron trainer: parallelism and optimisation."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    """How many ranks split each routed expert's matrices (megatron-core's expert-tensor parallelism); the
    experts' data-parallel size is what remains of the ranks after ``expert_tensor_parallel_size x
    expert_parallel_size x pipeline_parallel_size``. 1, slime's default in every script for a large MoE
    (TP 4-8 with sequence parallelism for attention, whole experts spread by EP); megatron-core's own default
    would be ``tensor_parallel_size``. Only for mixture-of-experts models."""
    sequence_parallel: Optional[bool] = None
    """Megatron's sequence parallelism: with ``tensor_parallel_size`` > 1 the activations outside attention
    and the MLP (norms, residuals, dropout) are split along the sequence over the tensor-parallel ranks
    instead of repeated on each (slime ``--sequence-parallel``, in every one of its scripts with TP > 1).
    null: on when ``tensor_parallel_size`` > 1 (a mixture-of-experts model at TP > 1 needs it: megatron-core's
    MoE layer trains under tensor parallelism only with it); it has no effect at TP=1."""
    nprocs: int = 1
    """Trainer processes for local runs (Slurm runs take it from the allocation)."""
    collective_timeout_s: float = 600.0
    """Seconds a trainer rank waits in a collective for the other ranks before the run stops with one line
    naming the rank, the step and the phase (gloo; on GPUs NCCL's watchdog ends the process at the same bound
    with its own message): 10 minutes, slime's ``--distributed-timeout-minutes``. Where the ranks wait for the
    controller's work alone (its engines' start, each step's rollout, eval and weight send) they wait in a
    group of their own under :attr:`rollout_wait_timeout_s` instead (:func:`hpcrl.train.parallel.handoff_group`;
    the warm start's hashing of the base model too). Not yet there, so under this bound: a dead engine replaced
    in the middle of a weight sync at TP > 1 (the other ranks wait in the export's gathers) and a PPO critic on
    ranks of its own loading its model; raise it if those take longer at your scale. megatron-core's groups
    take it in whole minutes, rounded up."""
    rollout_wait_timeout_s: float = 10800.0
    """Seconds a trainer rank other than the controller waits for the controller to hand over a step (its
    rollout, reward, filter, eval and weight send; its engines' start) before the run stops with one line:
    3 hours, as a step of a large model with long responses takes tens of minutes (slime's trainers wait on
    Ray for rollouts, unbounded). The controller itself waits for the other ranks there at most
    :attr:`collective_timeout_s`."""
    cpus: Optional[Union[int, str]] = None
    """Local runs with ``run.placement: disaggregate``: the trainer's CPUs (``"0-1"``; default: the first
    half of this machine's CPUs); torch uses one thread per CPU (shared by ``nprocs`` processes). Ignored on
    Slurm, where the trainer's het group is the trainer's."""
    micro_batch_size: int = 64
    """Samples per micro-batch, padded to the longest (ignored with ``max_tokens_per_microbatch``)."""
    max_tokens_per_microbatch: Optional[int] = None
    """Pack samples back to back (no padding) into micro-batches of at most this many tokens, balanced over
    data-parallel ranks (slime ``--use-dynamic-batch-size --max-tokens-per-gpu``); null: fixed
    ``micro_batch_size`` micro-batches, padded. Must hold the longest possible sample (prompt +
    ``rollout.max_new_tokens``)."""
    share_group_prompt: bool = True
    """With ``max_tokens_per_microbatch``: samples of a micro-batch with identical prompt tokens (a group) run
    the prompt once and every response attends to it ("Prefix Grouper", arXiv 2506.05433); exact, it only
    saves compute. Off: each sample carries its prompt."""
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
class TeacherSection:
    """One on-policy distillation teacher (``algorithm.opd.teachers``)."""

    path: str = ""
    """HF folder of the teacher model; its tokenizer must be the student's (token ids must mean the same)."""
    name: str = ""
    """Names its logs (``logs/attempt-N/teacher-<name>/``) and lets a data row pick it (``metadata.teacher``);
    default ``t<index>``."""
    num_engines: int = 1
    """Engines serving this teacher (started like the student's, never weight-synced)."""
    sft_target_accuracy: Optional[float] = None
    """Create ``path`` when it is missing (or was made by another recipe): the run's ``sft`` recipe from
    ``model.path``, stopped at this greedy accuracy instead of ``sft.target_accuracy`` (cached like the
    student's warm start). Null: ``path`` must exist."""


@dataclass
class OPDSection:
    """On-policy distillation (GLM-5's last stage; slime ``--use-opd --opd-type sglang``): the per-token
    advantage gains ``coef * (log pi_teacher - log pi_student)`` on the student's own samples. On when
    ``teachers`` names at least one teacher."""

    teachers: list[TeacherSection] = field(default_factory=list)
    coef: float = 1.0
    """slime ``--opd-kl-coef``: weight of the distillation advantage, added to the estimator's advantage (with
    ``rollout.n_samples_per_prompt: 1`` the group advantage is 0 and distillation is the only signal)."""


@dataclass
class AlgorithmSection:
    """Advantage estimator and policy loss (slime's definitions and flag names)."""

    advantage_estimator: Estimator = "grpo"
    grpo_std_normalization: bool = True
    policy_loss: PolicyLoss = "ppo_clip"
    """``ppo_clip``: PPO's clipped surrogate (with ``eps_clip_high``, ``eps_clip_c``, GSPO's ratio).
    ``cispo``: MiniMax-M1's clipped, detached importance weight times ``A * logp``, no token dropped
    (arXiv 2506.13585; ``eps_clip`` is its ``eps_low``, up to 1.0 = no lower bound, ``eps_clip_high`` its
    ``eps_high``)."""
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None
    """Upper clip; default ``eps_clip`` (DAPO recipes use 0.28)."""
    eps_clip_c: Optional[float] = None
    """Dual-clip constant (> 1) for negative advantages; off when null."""
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: KLKind = "k1"
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    mis_level: Optional[MISLevel] = None
    """Masked importance sampling (MIS; slime's ``mis.py`` mask mode, veRL's rollout rejection sampling): a
    token (``token``), or a whole sample (``sequence``: the product of its token ratios; ``geometric``: their
    geometric mean) whose ratio pi_old / pi_rollout leaves [``mis_low``, ``mis_high``] gets no gradient.
    Applied after TIS. null: off. Needs the engines' log-probs (as ``use_tis``)."""
    mis_low: float = 0.5
    """Lower bound of the kept ratios, in [0, 1) (0: no lower bound)."""
    mis_high: float = 2.0
    """Upper bound of the kept ratios, > 1 (a band without 1 would mask exactly on-policy tokens)."""
    gamma: float = 1.0
    """Discount over response tokens (slime ``--gamma``): REINFORCE++ returns and GAE."""
    lam: float = 1.0
    """GAE's lambda (slime ``--lambd``; Schulman et al. 2016), in [0, 1]: 1 = Monte-Carlo returns minus the
    value, 0 = one-step TD errors. Only with ``advantage_estimator: gae``."""
    kl_coef: float = 0.0
    """KL penalty in the reward (slime ``--kl-coef``): each response token's reward gains
    ``-kl_coef * KL(pi_old || pi_ref)`` (``kl_loss_type``'s estimator; the reference weights are kept as for
    the KL loss), for ``gae`` and the REINFORCE++ estimators. 0: off. Exclusive with ``use_kl_loss``."""
    normalize_advantages: Optional[bool] = None
    """Whiten the advantages over the step's response tokens (slime ``--normalize-advantages``). null: on
    for ``gae`` and the REINFORCE++ estimators, off for the group estimators (``grpo``, ``gspo``, ``rloo``)."""
    loss_reduction: LossReduction = "rollout_token_mean"
    """How per-token losses become the step's loss, each additive over micro-batches and data-parallel ranks
    (step-wide denominators): ``rollout_token_mean`` (slime's default: each sample's token mean, averaged
    over samples), ``token_mean`` (over all the step's tokens, slime ``--calculate-per-token-loss``, veRL
    ``token-mean``), ``sequence_mean`` (= rollout_token_mean here), ``seq_mean_token_sum`` (each sample's
    token sum, averaged over samples; veRL ``seq-mean-token-sum``), ``seq_mean_token_sum_norm`` (token sums
    divided by the constant ``loss_scale_factor`` and the sample count: Dr. GRPO, arXiv 2503.20783)."""
    loss_scale_factor: Optional[int] = None
    """``seq_mean_token_sum_norm``'s constant normaliser in tokens (veRL ``loss_scale_factor``); default
    ``rollout.max_new_tokens`` (Dr. GRPO's generation budget)."""
    routing_replay: bool = False
    """Rollout routing replay for MoE policies (R3, slime ``--use-rollout-routing-replay``): the engines return
    the experts each token was routed to (``return_routed_experts``) and the trainer's forwards of those
    samples (old, reference and training log-probs) route the same way (megatron-core's router replay)."""
    opd: OPDSection = field(default_factory=OPDSection)


@dataclass
class CheckpointSection:
    """Checkpoints of model, optimizer, RNG, data position and buffer."""

    save_interval: int = 0
    """Save every N rollout steps (0: only at the end and on preemption)."""
    keep_last: int = 2
    resume: bool = True
    """Resume from the newest complete checkpoint in the run folder if there is one."""


GROUP_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline", "rloo")
"""Advantage estimators whose baseline is the group: they need ``n_samples_per_prompt >= 2``."""


SCHEDULE_REFUSED = ("calculate_per_token_loss", "overlap_moe_expert_parallel_comm")
"""``megatron:`` keys hpcrl's use of megatron-core's schedule does not support (:func:`check_train` refuses them,
:func:`hpcrl.train.model.train_step` too): the first would skip the schedule's division that ``train_step`` relies
on and scale the gradients again in ``finalize_model_grads``; the second switches to megatron's combined 1F1B
path, which hpcrl does not test."""


def sequence_parallel(train: Any, tp: Optional[int] = None) -> bool:
    """Whether a model at tensor-parallel size ``tp`` (default ``train.tensor_parallel_size``; a critic on ranks
    of its own has its own) runs sequence-parallel: ``train.sequence_parallel`` (null: on when TP > 1), and never
    at TP=1 (there is no sequence to split over)."""
    tp = int(tp or getattr(train, "tensor_parallel_size", 1) or 1)
    sp = getattr(train, "sequence_parallel", None)
    return tp > 1 and (sp is None or bool(sp))


def check_train(cfg: Config) -> None:
    t, r = cfg.train, cfg.rollout
    positive(cfg, "train.tensor_parallel_size", "train.pipeline_parallel_size",
              "train.context_parallel_size", "train.expert_parallel_size", "train.expert_tensor_parallel_size",
              "train.nprocs",
              "train.micro_batch_size", "train.global_batch_size", "train.num_steps_per_rollout", "train.lr",
              "train.max_tokens_per_microbatch")
    if t.max_tokens_per_microbatch is not None:
        check_microbatch_budget(cfg, r.max_new_tokens + 1, "a 1-token prompt")
        require(not (cfg.megatron or {}).get("apply_rope_fusion"), "megatron.apply_rope_fusion", True,
                "the fused THD rotary kernel ignores the per-token positions that packed micro-batches "
                "(train.max_tokens_per_microbatch) need", "leave megatron.apply_rope_fusion unset (false)")
    non_negative(cfg, "train.min_lr", "train.weight_decay", "train.clip_grad", "train.lr_warmup_steps")
    meg = cfg.megatron or {}
    for key, own in (("sequence_parallel", "train.sequence_parallel"),
                     ("tensor_model_parallel_size", "train.tensor_parallel_size"),
                     ("pipeline_model_parallel_size", "train.pipeline_parallel_size"),
                     ("context_parallel_size", "train.context_parallel_size"),
                     ("expert_model_parallel_size", "train.expert_parallel_size"),
                     ("expert_tensor_parallel_size", "train.expert_tensor_parallel_size")):
        require(key not in meg, f"megatron.{key}", meg.get(key), f"is hpcrl's own {own} (the trainer's groups, "
                "the micro-batch padding and the memory estimate follow it; a megatron override would "
                "contradict them)", f"set {own} instead and remove megatron.{key}")
    for key in SCHEDULE_REFUSED:
        require(not meg.get(key), f"megatron.{key}", meg.get(key), "is not supported by hpcrl's use of "
                "megatron-core's schedule (its losses are normalised over the whole step already; the combined "
                "1F1B path is untested)", f"remove megatron.{key}")
    require(not (meg.get("optimizer_cpu_offload") and not meg.get("use_distributed_optimizer",
                                                                     t.use_distributed_optimizer)),
            "megatron.optimizer_cpu_offload", True, "without the distributed optimizer writes checkpoints that "
            "megatron-core 0.16.1 cannot load (its HybridDeviceOptimizer's load hook fails: seen on an H200, "
            "2026-11-27), so the run could not resume", "set train.use_distributed_optimizer=true as well "
            "(as configs/cluster/*.yaml do), or megatron.optimizer_cpu_offload=false")
    require(not (meg.get("optimizer_cpu_offload") and not meg.get("bf16", t.bf16)),
            "megatron.optimizer_cpu_offload", True, "with fp32 parameters (train.bf16=false) megatron-core "
            "0.16.1's distributed optimizer hands its HybridDeviceOptimizer views of the parameters, which torch "
            "refuses at build (\"can't optimize a non-leaf Tensor\": seen on an H100, 2026-12-06; with bf16 it "
            "builds)", "set train.bf16=true as well (as configs/cluster/*.yaml do), or "
            "megatron.optimizer_cpu_offload=false")
    rate = (cfg.megatron or {}).get("moe_router_bias_update_rate")
    number = isinstance(rate, (int, float)) and not isinstance(rate, bool)
    require(rate is None or (number and 0 <= rate < math.inf),
            "megatron.moe_router_bias_update_rate", rate, "must be a number >= 0 (the aux-loss-free step of "
            "the expert bias of GLM-4.5-style routers; 0, the default, keeps it frozen as slime does)",
            "set it to 0 or a small rate such as 1e-3 (megatron's pre-training default)")
    require(t.context_parallel_size == 1 or t.max_tokens_per_microbatch is not None,
            "train.context_parallel_size", t.context_parallel_size,
            "needs packed micro-batches (context parallelism splits a pack's tokens over the ranks; padded "
            "micro-batches run megatron's own attention, which has none)",
            "set train.max_tokens_per_microbatch (e.g. 16384, slime's --max-tokens-per-gpu) or "
            "train.context_parallel_size=1")
    for field in ("train.pipeline_parallel_size", "train.context_parallel_size"):
        if get_field(cfg, field) > 1:
            a = cfg.algorithm
            require(a.advantage_estimator != "gae" or cfg.critic.nprocs == 0, "critic.nprocs", cfg.critic.nprocs,
                    f"(PPO's critic on ranks of its own) is not yet supported with {field} > 1",
                    f"set critic.nprocs=0 (the critic on the actor's ranks and layout) or {field}=1")
    if t.lr_decay_steps is not None:
        positive(cfg, "train.lr_decay_steps")
    decay_steps = (t.lr_decay_steps if t.lr_decay_steps is not None
                   else cfg.run.num_rollout * t.num_steps_per_rollout)
    require(t.lr_warmup_steps < max(decay_steps, 1) or t.lr_warmup_steps == 0 or cfg.run.mode == "sft",
            "train.lr_warmup_steps", t.lr_warmup_steps,
            f"must be smaller than train.lr_decay_steps={decay_steps} (default: run.num_rollout x "
            "train.num_steps_per_rollout)", "lower lr_warmup_steps or raise lr_decay_steps")
    model_par = t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size
    require(t.nprocs % model_par == 0, "train.nprocs", t.nprocs,
             f"must be a multiple of tensor x pipeline x context parallel size = {model_par}",
             f"use nprocs={model_par * max(t.nprocs // model_par, 1)} or smaller parallel sizes")
    expert_par = t.expert_tensor_parallel_size * t.expert_parallel_size * t.pipeline_parallel_size
    require(t.nprocs % expert_par == 0, "train.expert_parallel_size", t.expert_parallel_size,
             f"x train.expert_tensor_parallel_size={t.expert_tensor_parallel_size} x pipeline parallel size = "
             f"{expert_par} must divide train.nprocs={t.nprocs} (megatron-core's expert groups tile the ranks)",
             "lower expert_parallel_size or expert_tensor_parallel_size, or raise nprocs")
    require(t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must be <= train.lr={t.lr}", "lower min_lr")
    require(t.collective_timeout_s > 0, "train.collective_timeout_s", t.collective_timeout_s, "must be > 0",
            "set it to the longest a rank may wait for the others, e.g. 600")
    require(t.rollout_wait_timeout_s > 0, "train.rollout_wait_timeout_s", t.rollout_wait_timeout_s,
            "must be > 0", "set it to the longest a step's rollout and eval may take, e.g. 10800")
    for f in ("train.adam_beta1", "train.adam_beta2"):
        v = get_field(cfg, f)
        require(0 <= v < 1, f, v, "must be in [0, 1)", "e.g. 0.9 / 0.98")
    per_rollout = r.batch_size * r.n_samples_per_prompt
    if t.global_batch_size is None:
        require(per_rollout % t.num_steps_per_rollout == 0, "train.num_steps_per_rollout",
                 t.num_steps_per_rollout,
                 f"must divide the {per_rollout} samples per rollout (batch_size x n_samples_per_prompt)",
                 "pick a divisor")
        gbs, gbs_field = per_rollout // t.num_steps_per_rollout, "train.micro_batch_size"
    else:
        gbs, gbs_field = t.global_batch_size, "train.global_batch_size"
        require(gbs % r.n_samples_per_prompt == 0, gbs_field, gbs,
                 f"must be a multiple of rollout.n_samples_per_prompt={r.n_samples_per_prompt} "
                 "(whole groups)",
                 f"use a multiple of {r.n_samples_per_prompt}, or leave it unset")
        require(gbs * t.num_steps_per_rollout == per_rollout, gbs_field, gbs,
                 f"x train.num_steps_per_rollout={t.num_steps_per_rollout} must equal the {per_rollout} "
                 "samples per rollout (rollout.batch_size x n_samples_per_prompt)",
                 "leave train.global_batch_size unset to derive it")
    if t.max_tokens_per_microbatch is not None:  # micro-batches by tokens: micro_batch_size is not used
        dp = max(t.nprocs // model_par, 1)
        batch_field = gbs_field if gbs_field == "train.global_batch_size" else "rollout.batch_size"
        require(gbs % dp == 0, batch_field, get_field(cfg, batch_field),
                 f"gives {gbs} samples an optimizer step, not a multiple of the {dp} data-parallel ranks: "
                 "with train.max_tokens_per_microbatch every rank runs the same number of micro-batches, "
                 "which needs it (hpcrl.train.packing.plan_step_micro_batches)",
                 f"make batch_size x n_samples_per_prompt / num_steps_per_rollout a multiple of {dp}")
        return
    if gbs_field == "train.micro_batch_size":
        require(gbs % t.micro_batch_size == 0, gbs_field, t.micro_batch_size,
                 f"must divide the global batch of {gbs} samples", f"use a divisor of {gbs}")
    else:
        require(gbs % t.micro_batch_size == 0, gbs_field, gbs,
                 f"must be a multiple of train.micro_batch_size={t.micro_batch_size}",
                 "change the global or the micro batch size")


def model_config_json(cfg: Config, check_files: bool) -> Optional[dict]:
    """The policy folder's ``config.json`` as a dict, or None when it cannot be read on the login node (no
    folder yet, ``check_files`` off, or unreadable: :func:`hpcrl.config.run.check_model` names that)."""
    import json

    m = cfg.model
    if not (check_files and m.path and Path(m.path, "config.json").is_file()):
        return None
    try:
        hf = json.loads(Path(m.path, "config.json").read_text())
    except (OSError, ValueError):
        return None
    return hf if isinstance(hf, dict) else None


def check_heads(cfg: Config, check_files: bool) -> None:
    """``train.tensor_parallel_size`` divides the policy's attention heads and key/value heads (megatron-core
    splits whole heads and whole query groups over TP ranks; multi-latent attention has one group per head),
    read from ``config.json`` or, before the folder exists, ``model.create``'s ``tiny_*`` keys."""
    tp = cfg.train.tensor_parallel_size
    hf = model_config_json(cfg, check_files)
    if hf is None and cfg.model.create in ("tiny-qwen2", "tiny-qwen3-moe", "tiny-glm4-moe"):
        m = cfg.model
        hf = {"num_attention_heads": m.tiny_num_heads, "num_key_value_heads": m.tiny_num_kv_heads}
    if hf is None or tp <= 1:
        return
    heads = int(hf.get("num_attention_heads") or 0)
    groups = heads if hf.get("kv_lora_rank") else int(hf.get("num_key_value_heads") or heads)
    for field, n in (("num_attention_heads", heads), ("num_key_value_heads", groups)):
        require(n % tp == 0, "train.tensor_parallel_size", tp,
                f"must divide the model's {field}={n} (megatron-core splits whole heads over TP ranks)",
                f"use a tensor_parallel_size that divides {n}")


def stage_layer_counts(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None
                       ) -> Optional[list[int]]:
    """Decoder layers of each of ``pp`` pipeline stages, as megatron-core splits them: ``first`` / ``last``
    (``megatron.num_layers_in_first/last_pipeline_stage``, slime's ``--decoder-first/last-pipeline-num-layers``)
    on the first / last stage and the rest evenly over the others; None where megatron refuses the split (a
    remainder, or a stage left without a layer)."""
    if pp == 1:
        return [num_layers]
    counts: list[Optional[int]] = [first] + [None] * (pp - 2) + [last]
    free = [s for s, c in enumerate(counts) if c is None]
    rest = num_layers - sum(c for c in counts if c is not None)
    if (rest != 0 if not free else rest < len(free) or rest % len(free)):
        return None
    return [c if c is not None else rest // len(free) for c in counts]


def stage_overrides(cfg: Config) -> tuple[Optional[int], Optional[int]]:
    """``megatron.num_layers_in_first/last_pipeline_stage`` of the run config (None where unset)."""
    meg = cfg.megatron or {}
    return meg.get("num_layers_in_first_pipeline_stage"), meg.get("num_layers_in_last_pipeline_stage")


def check_stages(cfg: Config, check_files: bool) -> None:
    """Under pipeline parallelism the model's decoder layers split over the stages as megatron-core splits
    them: ``megatron.num_layers_in_first/last_pipeline_stage`` (slime's ``--decoder-first/last-pipeline-num-
    layers``) where set, and the rest evenly over the other stages (megatron refuses a remainder), read from
    ``config.json`` or, before the folder exists, ``model.tiny_num_layers``."""
    pp = cfg.train.pipeline_parallel_size
    if pp <= 1:
        return
    hf = model_config_json(cfg, check_files)
    if hf is None and cfg.model.create and cfg.model.create.startswith("tiny-"):
        hf = {"num_hidden_layers": cfg.model.tiny_num_layers}
    layers = int((hf or {}).get("num_hidden_layers") or 0)
    if not layers:
        return
    fixed = stage_overrides(cfg)
    rest, free = layers - sum(f or 0 for f in fixed), pp - sum(f is not None for f in fixed)
    require(stage_layer_counts(layers, pp, *fixed) is not None, "train.pipeline_parallel_size", pp,
            f"does not split the model's num_hidden_layers={layers} into stages (megatron gives each stage an "
            f"equal share after megatron.num_layers_in_first/last_pipeline_stage={fixed[0]}/{fixed[1]}: {rest} "
            f"layers over {free} stage(s))",
            "pick a pipeline_parallel_size that divides the layers, or set megatron.num_layers_in_first_"
            "pipeline_stage / num_layers_in_last_pipeline_stage so that the rest divides")


def model_experts(cfg: Config, check_files: bool, env: Optional[Environment] = None
                  ) -> Optional[tuple[int, int]]:
    """``(routed experts per layer, experts per token)`` of the policy model, ``(0, 0)`` for a dense one, or
    None when it cannot be known on the login node (the folder does not exist yet, or ``check_files`` is
    off, or the folder's ``config.json`` is to be read without an ``env``). Read from ``model.create``'s
    ``tiny_*`` keys or the folder's ``config.json`` (``env.routed_experts``; no transformers)."""
    m = cfg.model
    created = m.path and Path(m.path, "config.json").is_file()
    if m.create in ("tiny-qwen3-moe", "tiny-glm4-moe", "tiny-deepseek-v3") and not created:
        return m.tiny_num_experts, m.tiny_moe_top_k
    if m.create == "tiny-qwen2" and not created:
        return 0, 0
    hf = model_config_json(cfg, check_files)
    if hf is None or env is None:
        return None
    experts = env.routed_experts(hf)
    return experts, int(hf.get("num_experts_per_tok") or 0) if experts else 0


def check_moe(cfg: Config, check_files: bool, env: Optional[Environment] = None) -> None:
    """Expert parallelism fits the model: a MoE model whose expert count ``train.expert_parallel_size``
    divides and whose top-k is at most that count; a dense model only with EP=1 and without routing replay."""
    t = cfg.train
    known = model_experts(cfg, check_files, env)
    if cfg.algorithm.routing_replay:
        require(known is None or known[0] > 0, "algorithm.routing_replay", True,
                f"the model at model.path={cfg.model.path!r} is dense: it has no routing to replay",
                "set algorithm.routing_replay=false, or train a mixture-of-experts model")
        require(not cfg.rollout.router, "rollout.router", cfg.rollout.router,
                "sglang-router drops the return_routed_experts field that routing replay needs (its request type "
                "has no such field: measured with sglang-router 0.3)", "set rollout.router=false")
        recompute = (cfg.megatron or {}).get("recompute_granularity")
        require(recompute is None, "megatron.recompute_granularity", recompute,
                "activation recompute re-runs the routers in backward, which routing replay does not cover yet",
                "leave megatron.recompute_granularity unset with algorithm.routing_replay")
    if known is None:
        return  # checked when the model is built (hpcrl.train.bridge)
    experts, top_k = known
    if not experts:
        for f in ("train.expert_parallel_size", "train.expert_tensor_parallel_size"):
            require(get_field(cfg, f) == 1, f, get_field(cfg, f),
                    f"the model at model.path={cfg.model.path!r} is dense (no experts)",
                    f"set {f}=1, or train a mixture-of-experts model")
        return
    require(t.tensor_parallel_size == 1 or sequence_parallel(t), "train.sequence_parallel", t.sequence_parallel,
            f"with a mixture-of-experts model ({experts} experts per layer) at train.tensor_parallel_size="
            f"{t.tensor_parallel_size}: megatron-core trains MoE layers under tensor parallelism only with "
            "sequence parallelism", "set train.sequence_parallel=true (the default with TP > 1)")
    require(experts % t.expert_parallel_size == 0, "train.expert_parallel_size", t.expert_parallel_size,
            f"must divide the model's {experts} experts per layer",
            f"use a divisor of {experts}")
    dispatcher = (cfg.megatron or {}).get("moe_token_dispatcher_type")
    spans_dp = t.expert_parallel_size > 1 or t.expert_tensor_parallel_size > t.tensor_parallel_size
    require(not (dispatcher == "allgather" and spans_dp), "megatron.moe_token_dispatcher_type",
            dispatcher, "needs the same number of tokens on every rank of the expert groups, which span "
            "data-parallel ranks here (expert parallelism, or expert-tensor parallelism above the tensor-parallel "
            "size) whose micro-batches differ in length", "use alltoall (the default there)")
    from hpcrl.config.critic import critic_tensor_parallel_size

    critic_tp = critic_tensor_parallel_size(cfg) if cfg.algorithm.advantage_estimator == "gae" else 1
    require(critic_tp == 1 or sequence_parallel(t, critic_tp), "train.sequence_parallel", t.sequence_parallel,
            f"with a mixture-of-experts critic at tensor-parallel size {critic_tp}: megatron-core trains MoE "
            "layers under tensor parallelism only with sequence parallelism", "set train.sequence_parallel=true "
            "(the default with TP > 1)")
    require(top_k <= experts, "model.path", cfg.model.path,
            f"routes each token to num_experts_per_tok={top_k} of only {experts} experts",
            "fix the model's config.json (num_experts_per_tok <= num_experts)")


def check_microbatch_budget(cfg: Config, longest: int, what: str) -> None:
    """``train.max_tokens_per_microbatch`` holds the longest possible sample, ``longest`` tokens (``what``:
    where the prompt length comes from), else ConfigError naming both numbers."""
    budget = cfg.train.max_tokens_per_microbatch
    if budget is None:
        return
    m = cfg.rollout.max_new_tokens
    require(budget >= longest, "train.max_tokens_per_microbatch", budget,
            f"is smaller than the longest possible sample: {longest} tokens ({what} of {longest - m} tokens + "
            f"rollout.max_new_tokens={m})", f"set it to at least {longest}")


def check_algorithm(cfg: Config, check_files: bool = True, env: Optional[Environment] = None) -> None:
    a = cfg.algorithm
    if a.policy_loss == "cispo":
        require(0 < a.eps_clip <= 1, "algorithm.eps_clip", a.eps_clip,
                "is CISPO's eps_low and must be in (0, 1]", "1.0 (no lower bound, as in the paper) or 0.2")
        require(a.advantage_estimator != "gspo", "algorithm.policy_loss", a.policy_loss,
                "does not take GSPO's sequence-level ratio (advantage_estimator: gspo)",
                "use advantage_estimator=grpo with cispo, or policy_loss=ppo_clip with gspo")
        require(a.eps_clip_c is None, "algorithm.eps_clip_c", a.eps_clip_c,
                "is PPO's dual clip; CISPO clips the weight, not the loss", "set algorithm.eps_clip_c=null")
    else:
        require(0 < a.eps_clip < 1, "algorithm.eps_clip", a.eps_clip, "must be in (0, 1)", "0.2 is common")
    if a.eps_clip_high is not None:
        require(a.eps_clip_high > 0, "algorithm.eps_clip_high", a.eps_clip_high, "must be > 0",
                 "e.g. 0.28 (DAPO), or null for eps_clip")
    if a.eps_clip_c is not None:
        require(a.eps_clip_c > 1, "algorithm.eps_clip_c", a.eps_clip_c, "the dual-clip constant must be > 1",
                 "e.g. 3.0, or null to disable dual clip")
    non_negative(cfg, "algorithm.kl_loss_coef", "algorithm.entropy_coef", "algorithm.tis_clip_low")
    require(not (a.kl_loss_coef > 0 and not a.use_kl_loss), "algorithm.kl_loss_coef", a.kl_loss_coef,
             "has no effect unless algorithm.use_kl_loss is true",
             "set algorithm.use_kl_loss=true or algorithm.kl_loss_coef=0")
    positive(cfg, "algorithm.tis_clip")
    require(a.tis_clip_low < a.tis_clip, "algorithm.tis_clip_low", a.tis_clip_low,
             f"must be < algorithm.tis_clip={a.tis_clip}", "lower tis_clip_low")
    require(0 <= a.mis_low < 1, "algorithm.mis_low", a.mis_low,
            "must be in [0, 1): MIS keeps the ratios in [mis_low, mis_high], which must hold the on-policy "
            "ratio 1", "0.5 is usual (0: no lower bound)")
    require(a.mis_high > 1, "algorithm.mis_high", a.mis_high,
            "must be > 1: MIS keeps the ratios in [mis_low, mis_high], which must hold the on-policy ratio 1",
            "2.0 is usual")
    require(0 <= a.gamma <= 1, "algorithm.gamma", a.gamma, "must be in [0, 1]", "1.0 is usual for LLM RL")
    check_ppo_terms(cfg)
    check_opd(cfg, check_files, env)


KL_REWARD_ESTIMATORS = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""The advantage estimators that take the KL penalty in the reward (``algorithm.kl_coef``), as in slime."""


def check_ppo_terms(cfg: Config) -> None:
    """Issue #38's algorithm fields: ``lam`` (GAE only), ``kl_coef`` (KL in the reward, exclusive with the KL
    loss, only where the estimator takes per-token rewards), ``loss_scale_factor`` (only with
    ``seq_mean_token_sum_norm``). The ``critic`` fields are checked by
    :func:`hpcrl.config.critic.check_critic`. ``policy_loss: cispo`` with ``gae`` is allowed: CISPO weighs any
    per-token advantage."""
    a = cfg.algorithm
    est = a.advantage_estimator
    require(0 <= a.lam <= 1, "algorithm.lam", a.lam, "must be in [0, 1] (GAE's lambda)",
            "1.0 (Monte-Carlo returns) or e.g. 0.95")
    require(a.lam == 1 or est == "gae", "algorithm.lam", a.lam,
            f"has no effect with advantage_estimator={est} (only GAE has a lambda)",
            "set algorithm.advantage_estimator=gae (PPO with a critic), or algorithm.lam=1.0")
    non_negative(cfg, "algorithm.kl_coef")
    if a.kl_coef > 0:
        require(not a.use_kl_loss, "algorithm.kl_coef", a.kl_coef,
                "(the KL penalty in the reward) and algorithm.use_kl_loss (the KL loss) are exclusive, as in "
                "slime",
                "keep one: algorithm.kl_coef=0, or algorithm.use_kl_loss=false")
        require(est in KL_REWARD_ESTIMATORS, "algorithm.kl_coef", a.kl_coef,
                f"has no effect with advantage_estimator={est} (its advantages come from the scalar reward "
                "only)",
                "use the KL loss (algorithm.use_kl_loss=true, kl_loss_coef) or an estimator with per-token "
                f"rewards ({', '.join(KL_REWARD_ESTIMATORS)})")
    if a.loss_scale_factor is not None:
        positive(cfg, "algorithm.loss_scale_factor")
        require(a.loss_reduction == "seq_mean_token_sum_norm", "algorithm.loss_scale_factor",
                a.loss_scale_factor, f"has no effect with loss_reduction={a.loss_reduction}",
                "set algorithm.loss_reduction=seq_mean_token_sum_norm, or algorithm.loss_scale_factor=null")


_TEACHER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_opd(cfg: Config, check_files: bool, env: Optional[Environment] = None) -> None:
    """On-policy distillation: teachers named with a folder (or a way to make one), a positive
    coefficient, and, when the folders exist (and with an ``env``), the student's tokenizer."""
    o = cfg.algorithm.opd
    require(o.coef > 0, "algorithm.opd.coef", o.coef, "must be > 0 (it weighs log pi_teacher - log pi_student)",
            "e.g. algorithm.opd.coef=1.0 (slime's default)")
    if not o.teachers:
        require(o.coef == 1.0, "algorithm.opd.teachers", [], f"is empty, so algorithm.opd.coef={o.coef:g} has no "
                "teacher to distil from", "name a teacher: algorithm.opd.teachers=[{path: FOLDER}]")
        return
    names = []
    for i, t in enumerate(o.teachers):
        f = f"algorithm.opd.teachers[{i}]"
        require(bool(t.path), f"{f}.path", t.path, "is required", "set it to the teacher's HF model folder")
        name = t.name or f"t{i}"
        require(bool(_TEACHER_NAME_RE.fullmatch(name)), f"{f}.name", t.name,
                "must be letters, digits and ._- (it names a log folder)", "e.g. name: math")
        require(name not in names, f"{f}.name", name, "is used by another teacher", "give each a unique name")
        names.append(name)
        require(t.num_engines >= 1, f"{f}.num_engines", t.num_engines, "must be >= 1", "e.g. 1")
        if t.sft_target_accuracy is not None:
            require(0 < t.sft_target_accuracy <= 1, f"{f}.sft_target_accuracy", t.sft_target_accuracy,
                    "must be in (0, 1]", "e.g. 0.7, or null when the teacher folder exists")
            require(t.path not in (cfg.model.path, cfg.sft.output), f"{f}.path", t.path,
                    "is the student's model or SFT folder, which a teacher made by SFT would overwrite",
                    "give the teacher its own folder")
        elif check_files:
            require((Path(t.path) / "config.json").is_file(), f"{f}.path", t.path,
                    "is not an HF model folder (no config.json)",
                    f"fix the path, or set {f}.sft_target_accuracy to make it by SFT")
    if check_files and env is not None:
        check_teacher_tokenizers(cfg, env)


def check_teacher_tokenizers(cfg: Config, env: Environment) -> None:
    """Every existing teacher folder has the student's tokenizer (same vocabulary and special tokens,
    ``env.tokenizer_difference``), when the student's folder exists too (else
    :func:`hpcrl.sft.warm_starts` checks at start). Raises ConfigError naming the teacher."""
    student = Path(cfg.model.path)
    if not (student / "config.json").is_file():
        return
    for i, t in enumerate(cfg.algorithm.opd.teachers):
        if (Path(t.path) / "config.json").is_file():
            why = env.tokenizer_difference(student, Path(t.path))
            require(why is None, f"algorithm.opd.teachers[{i}].path", t.path,
                    f"has another tokenizer than the student's model.path ({why}), so its log-probs would be "
                    "of other tokens", "use a teacher of the student's model family (same tokenizer)")


def check_checkpoint(cfg: Config) -> None:
    non_negative(cfg, "checkpoint.save_interval")
    positive(cfg, "checkpoint.keep_last")
