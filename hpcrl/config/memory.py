"""Per-GPU memory estimate of a run on GPU nodes, and the layout checks that go with it
(``slurm.gpu_memory_gb``).

:func:`check_memory` (part of :func:`hpcrl.config.validate`, so of ``hpcrl validate``, ``submit`` and
``sweep`` on the login node) refuses, in one line naming the field, a layout whose trainer or engine cannot
fit in the GPU memory ``slurm.gpu_memory_gb`` states, or whose engines do not tile the GPUs;
:func:`memory_lines` is what ``hpcrl validate`` and ``hpcrl submit`` print. Parameter counts come from the
model's ``config.json`` (:func:`hpcrl.models.params.count_parameters`, no torch, reached through the
:class:`~hpcrl.config.environment.Environment` the caller passes); nothing is estimated before that file exists.

**Trainer** (Megatron-core, as hpcrl builds it in :func:`hpcrl.train.model.wrap_model_and_optimizer`), bytes
per parameter a GPU holds:

* weights: 2 (``train.bf16``) or 4 (fp32);
* gradients: 4, the fp32 ``main_grad`` buffer of megatron's DDP (hpcrl sets ``grad_reduce_in_fp32=True``;
  ``megatron.grad_reduce_in_fp32: false`` makes them the weights' dtype). The buffer is whole on every rank
  even with the distributed optimizer (it reduce-scatters into it);
* Adam: with bf16 weights megatron keeps an fp32 main copy plus fp32 ``exp_avg`` and ``exp_avg_sq`` = 12
  bytes; with fp32 weights the weights are the main copy = 8 bytes. ``train.use_distributed_optimizer`` shards
  these over data parallel (ZeRO-1): dense parameters over ``DP x CP`` (``DP = world / (TP x PP x CP)``;
  megatron's data-parallel group with context parallelism), expert parameters
  over the expert-data-parallel group ``EDP = world / (ETP x EP x PP)`` (``train.expert_tensor_parallel_size``,
  1 by default as in slime's scripts: each routed expert whole on its rank, attention and dense layers split by
  TP with sequence parallelism). ``megatron.optimizer_cpu_offload: true`` with
  ``megatron.optimizer_offload_fraction: f`` (megatron-core 0.16.1's ``HybridDeviceOptimizer``; the fraction
  defaults to 0.0, i.e. nothing moves) keeps a fraction f of those states (and an fp32 copy of their
  gradients) in host memory instead.

With LoRA (``model.lora``) the base weights are frozen: they have no gradient buffer and no Adam state; the
adapters (:func:`hpcrl.config.lora.lora_parameters`, split over TP as the trainer splits them) have weights,
gradients and Adam states by the rules above (sharded as dense parameters).

With a critic (``algorithm.advantage_estimator: gae``, PPO's value model) the trainer holds a second model
with the actor's layout in the same processes: the same weights, gradients and Adam states again, less the
output layer (the critic's is a ``hidden_size -> 1`` value head, not counted). Its parameters are counted from
``critic.path``'s ``config.json`` when it is set (a critic may be smaller or larger than the actor), else they
are the actor's (:func:`critic_parameters`). A critic on ranks of its own (``critic.nprocs > 0``,
``slurm.critic`` on GPU nodes) is not in the trainer's processes: it is estimated on its own GPUs instead, at
its own layout (``critic.tensor_parallel_size`` over ``slurm.critic.nodes x gpus_per_node``, the actor's
precision and optimizer settings), against ``slurm.critic.gpu_memory_gb`` (default ``slurm.gpu_memory_gb``)
(:func:`critic_memory`).

Megatron's own ``theoretical_memory_usage`` gives the same ``6 + 12/DP`` bytes per parameter for bf16 with the
distributed optimizer. Activations are not estimated: :data:`RESERVED_GB` per GPU is kept back for them, the
CUDA context, NCCL buffers and allocator fragmentation, and what is left is printed.

Per GPU, TP divides the embedding, output layer and dense matrices; norms, routers and MLA's down-projections
are whole on every rank; routed experts are divided by ETP x EP (``train.expert_tensor_parallel_size`` x
``train.expert_parallel_size``). Sequence parallelism changes activations only, which are not estimated.

**Engines** (SGLang): weights per GPU = attention matrices over the attention-TP size (``tp_size /
attn_dp_size``: with DP attention they are replicated over the DP groups), embedding, output, dense MLPs and
shared experts over ``tp_size``, routed experts over ``tp_size`` (EP ranks hold ``1/ep_size`` of the experts,
each split over ``tp_size / ep_size``), norms, routers and MLA's down-projections whole; in ``model.dtype``
(``sglang.dtype`` wins), 1 byte for the attention/MLP/expert matrices with ``sglang.quantization: fp8`` or
``weights.rollout_dtype: fp8`` (their block scales, 1/16384 of it, are not counted). They
must fit in the static pool, ``mem_fraction_static`` x GPU memory (SGLang's key,
``sglang.mem_fraction_static``; unset, SGLang sizes it itself and :data:`SGLANG_DEFAULT_FRACTION` is assumed);
what is left of the pool is the KV cache, which must hold at least one response of ``rollout.max_new_tokens``
tokens (:func:`hpcrl.models.params.kv_cache_elements_per_token`).
Colocated, trainer and engines take turns (:mod:`hpcrl.offload`: the trainer's memory is paused while the
engines generate, the engines' released while it trains), so each must fit on its own.

**Layout** (GPU nodes): hpcrl starts one engine task per node that sees every GPU of it
(:mod:`hpcrl.slurm.rollout_step`), so an engine's ``tp_size x pp_size`` must equal the node's GPUs, a
colocated run has one engine per node (``rollout.num_engines = slurm.nodes``), ``ep_size`` and
``attn_dp_size`` divide ``tp_size`` and the engine's ``ep_size`` divides the expert count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpcrl.config.checks import require
from hpcrl.config.environment import Environment
from hpcrl.config.errors import ConfigError
from hpcrl.config.lora import lora_parameters
from hpcrl.config.rollout import sglang_engines_by_config
from hpcrl.config.train import sequence_parallel, stage_layer_counts, stage_overrides

if TYPE_CHECKING:
    from hpcrl.config.schema import Config

ParamCount = Any
"""A :class:`hpcrl.models.params.ParamCount` (``Environment.count_parameters``), not imported: config is the bottom
layer."""

GB = 10 ** 9
"""``slurm.gpu_memory_gb`` is in GB (10^9 bytes), the unit GPU vendors state (H100: 80 GB)."""

RESERVED_GB = 4.0
"""GPU memory per process kept back from the trainer's states and the engine's check: CUDA context (~0.5-1
GB), NCCL buffers, allocator fragmentation, and at least some activations."""

SGLANG_DEFAULT_FRACTION = 0.85
"""``mem_fraction_static`` assumed when ``sglang.mem_fraction_static`` is unset (SGLang 0.5 picks about
0.8-0.9 on 80-141 GB GPUs, less with small GPUs or large CUDA graphs)."""


@dataclass(frozen=True)
class TrainerMemory:
    """The trainer's memory on one GPU, in bytes (see the module doc for the rules)."""

    params: float
    """Parameters this GPU holds (elements)."""
    weights: float
    grads: float
    adam: float
    """Adam states on the GPU (after sharding and CPU offload)."""
    adam_no_offload: float
    """Adam states on the GPU without the CPU offload."""
    adam_host: float
    """Adam states (and their fp32 gradient copy) this GPU's rank keeps in host memory."""
    layout: str
    """``tp1 pp1 ep8 dp8 edp1 over 8 GPUs``."""
    critic: float = 0.0
    """Bytes of the critic (``advantage_estimator: gae``) on the GPU: its weights, gradients and Adam states,
    included in ``weights``, ``grads`` and ``adam`` (and its host Adam in ``adam_host``); 0 without one."""
    activations: float = 0.0
    """Activations held for backward on the GPU of the fullest pipeline stage (:func:`activation_bytes`); 0
    where not estimated (padded micro-batches, or no ``config.json``)."""
    stage: int = 0
    """The pipeline stage the figures are of: the one with the most bytes (0 without pipelines)."""

    @property
    def total(self) -> float:
        """Weights + gradients + Adam + activations on the GPU."""
        return self.weights + self.grads + self.adam + self.activations


@dataclass(frozen=True)
class EngineMemory:
    """One engine's static memory on one GPU, in bytes."""

    weights: float
    pool: float
    """``mem_fraction_static`` x GPU memory: weights + KV cache."""
    fraction: float
    fraction_set: bool
    layout: str
    kv_per_token: float = 0.0
    """KV-cache bytes of one token on one GPU (``sglang.kv_cache_dtype`` fp8: 1 byte an element)."""

    @property
    def kv_tokens(self) -> float:
        """Tokens the KV cache left in the static pool holds on one GPU (inf when unknown)."""
        return (self.pool - self.weights) / self.kv_per_token if self.kv_per_token else float("inf")


def read_model_config(cfg: Config) -> Optional[dict]:
    """The policy model's ``config.json`` as a dict, or None when ``model.path`` has none (not downloaded yet,
    or created at run start) or it does not parse (:func:`hpcrl.config.run.check_model` names that)."""
    return _config_json(cfg.model.path)


def _config_json(folder: Optional[str]) -> Optional[dict]:
    """``folder/config.json`` as a dict, or None when ``folder`` is unset, has none, or it does not parse."""
    path = Path(folder or "", "config.json")
    if not folder or not path.is_file():
        return None
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return hf if isinstance(hf, dict) else None


def _trainer_world(cfg: Config) -> int:
    s = cfg.slurm
    return s.nodes * s.gpus_per_node if s.gpus_per_node > 0 else cfg.train.nprocs


def critic_parameters(cfg: Config, p: ParamCount, env: Environment) -> ParamCount:
    """The critic's parameter count: from ``critic.path``'s ``config.json`` when it is set, readable and of
    a family ``env`` counts, else the actor's ``p`` (``critic.path`` null: the critic is the actor's model)."""
    hf = _config_json(cfg.critic.path)
    if hf is None or hf.get("model_type") not in env.counted_model_types:
        return p
    return env.count_parameters(hf)


def trainer_memory(cfg: Config, p: ParamCount, offload: Optional[bool] = None,
                   critic: Optional[ParamCount] = None, hf: Optional[dict] = None) -> TrainerMemory:
    """The trainer's per-GPU memory for the parameters ``p`` under ``cfg``'s parallel sizes and precision.

    ``offload``: override ``megatron.optimizer_cpu_offload`` (with fraction 1.0 when forced on), for the
    what-if lines. The world is ``slurm.nodes x slurm.gpus_per_node`` on GPU nodes, else ``train.nprocs``.
    With ``algorithm.advantage_estimator: gae`` the critic (``critic``'s parameters, default ``p``, less the
    output layer; the actor's layout and precision) is added to every field but ``params`` and ``layout``
    (``critic``: its GPU bytes). ``hf``: the model's ``config.json``, for the pipeline stages' layers and the
    activations (:func:`activation_bytes`; the critic's, which it trains after the actor's steps, are not
    added); without it the layers are spread evenly and activations are not estimated.
    """
    actor = _model_memory(cfg, p, offload, hf=hf)
    if cfg.algorithm.advantage_estimator != "gae" or cfg.critic.nprocs > 0:  # (its own ranks: critic_memory)
        return actor
    c = _model_memory(cfg, replace(critic or p, output=0), offload)
    return TrainerMemory(params=actor.params, weights=actor.weights + c.weights, grads=actor.grads + c.grads,
                         adam=actor.adam + c.adam, adam_no_offload=actor.adam_no_offload + c.adam_no_offload,
                         adam_host=actor.adam_host + c.adam_host, layout=actor.layout, critic=c.total,
                         activations=actor.activations, stage=actor.stage)


def critic_memory(cfg: Config, critic: ParamCount, offload: Optional[bool] = None) -> Optional[TrainerMemory]:
    """Per-GPU memory of a critic on ranks of its own (``critic.nprocs > 0`` with ``slurm.critic`` on GPU
    nodes): ``critic``'s parameters less the output layer, at ``critic.tensor_parallel_size`` over its het
    group's GPUs, with the actor's precision and optimizer settings; None for any other run."""
    g = cfg.slurm.critic
    if cfg.algorithm.advantage_estimator != "gae" or cfg.critic.nprocs <= 0 or g is None or g.gpus_per_node <= 0:
        return None
    from hpcrl.config.critic import critic_tensor_parallel_size

    return _model_memory(cfg, replace(critic, output=0), offload, tp=critic_tensor_parallel_size(cfg),
                         world=g.nodes * g.gpus_per_node)


def activation_bytes(cfg: Config, hf: Optional[dict], layers: int, stage: int, tp: int) -> float:
    """Activations one GPU of pipeline stage ``stage`` holds for backward (bytes), from the model's
    ``config.json`` ``hf``, for packed micro-batches of ``train.max_tokens_per_microbatch`` tokens (0 for
    padded ones, or without ``hf``).

    Per layer and token of the micro-batch on this rank (``max_tokens / CP``): ``34 h`` bytes at 2-byte
    activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
    ``sbh(34 + 5as/h)``, whose attention-score term a fused attention kernel does not store), divided by TP
    (sequence parallelism splits all of them), doubled for fp32 training; with megatron's full recomputation
    (``megatron.recompute_granularity: full``) only each layer's input (``2 h`` bytes, over TP) plus one layer's
    whole set while it is recomputed. A MoE layer's experts hold ``top_k x moe_intermediate_size`` per token
    where a dense MLP holds ``4h``-ish: the dense figure is used for every layer (GLM-4.5 and DeepSeek-V3's
    experts hold less). Under 1F1B stage ``s`` of ``P`` keeps ``P - s`` micro-batches in flight. The last
    stage also holds the fp32 logits of the response predictions and their gradient (at most every token:
    ``8 x vocab / TP`` bytes a token)."""
    t, meg = cfg.train, dict(cfg.megatron or {})
    if hf is None or t.max_tokens_per_microbatch is None:
        return 0.0
    h = int(hf.get("hidden_size") or 0)
    vocab = int(hf.get("vocab_size") or 0)
    tokens = t.max_tokens_per_microbatch / t.context_parallel_size
    a_bytes = 2 if meg.get("bf16", t.bf16) else 4
    split = tp if sequence_parallel(t, tp) else 1
    full = 17 * a_bytes * tokens * h / split
    if meg.get("recompute_granularity") == "full":
        per_stage = layers * a_bytes * tokens * h / split + full
    else:
        per_stage = layers * full
    pp = t.pipeline_parallel_size
    logits = 8 * tokens * vocab / tp if stage == pp - 1 else 0.0
    return (pp - stage) * per_stage + logits


def _model_memory(cfg: Config, p: ParamCount, offload: Optional[bool], tp: Optional[int] = None,
                  world: Optional[int] = None, hf: Optional[dict] = None) -> TrainerMemory:
    """The trainer's memory on a GPU of its fullest pipeline stage (see the module doc and
    :func:`activation_bytes`)."""
    t, meg = cfg.train, dict(cfg.megatron or {})
    tp, pp = tp or t.tensor_parallel_size, t.pipeline_parallel_size
    cp, ep, etp = t.context_parallel_size, t.expert_parallel_size, t.expert_tensor_parallel_size
    world = world or _trainer_world(cfg)
    dp, edp = max(world // (tp * pp * cp), 1), max(world // (etp * ep * pp), 1)
    bf16 = bool(meg.get("bf16", t.bf16))
    w_bytes = 2 if bf16 else 4
    g_bytes = 4 if meg.get("grad_reduce_in_fp32", True) else w_bytes
    s_bytes = 12 if bf16 else 8
    distributed = bool(meg.get("use_distributed_optimizer", t.use_distributed_optimizer))
    if offload is None:
        on = meg.get("optimizer_cpu_offload")
        fraction = float(meg.get("optimizer_offload_fraction", 0.0)) if on else 0.0
    else:
        fraction = 1.0 if offload else 0.0
    num_layers = int((hf or {}).get("num_hidden_layers") or 0)
    counts = stage_layer_counts(num_layers, pp, *stage_overrides(cfg)) if pp > 1 and num_layers else None
    best: Optional[TrainerMemory] = None
    for stage in range(pp):
        if counts is not None:  # each stage its layers; the embedding on the first, the head on the last
            share = counts[stage] / num_layers
            head = p.output or p.embedding  # a tied head: the last stage's copy of the embedding
            edges = (p.embedding if stage == 0 else 0) + (head if stage == pp - 1 else 0)
        else:  # one stage, or no layer count: everything evenly
            share, edges = 1 / pp, (p.embedding + p.output) / pp
        dense = (edges + p.dense * share) / tp + p.replicated * share
        expert = p.expert * share / (etp * ep)
        params = dense + expert
        lora = cfg.model.lora if hf is not None else None
        if lora is not None:  # LoRA: the base is frozen (no gradient, no Adam); only the adapters train
            dense = lora_parameters(hf, lora, tp) * (counts[stage] / num_layers if counts else 1 / pp)
            expert, params = 0.0, params + dense
        trained = dense + expert
        # megatron's distributed optimizer shards dense states over DP x CP (its data-parallel group with context
        # parallelism), expert states over the expert-data-parallel group
        adam_full = s_bytes * (dense / (dp * cp) + expert / edp) if distributed else s_bytes * trained
        host = fraction * adam_full * (s_bytes + 4) / s_bytes
        m = TrainerMemory(params=params, weights=w_bytes * params, grads=g_bytes * trained,
                          adam=adam_full * (1 - fraction), adam_no_offload=adam_full, adam_host=host,
                          layout=f"tp{tp}{' sp' if sequence_parallel(t, tp) else ''} "
                                 f"pp{pp} cp{cp} ep{ep} etp{etp} dp{dp} edp{edp} over {world} GPUs"
                                 + (f", stage {stage} of {pp} ({counts[stage]} layers)" if counts else ""),
                          activations=activation_bytes(cfg, hf, counts[stage] if counts else num_layers, stage, tp),
                          stage=stage)
        if best is None or m.total > best.total:
            best = m
    return best


def engine_args(cfg: Config) -> dict:
    """The engines' ``sglang`` keys that size them: ``tp_size``, ``pp_size``, ``ep_size``, ``attn_dp_size``
    (also read from ``dp_size`` with ``enable_dp_attention``), ``mem_fraction_static``, ``dtype``,
    ``quantization``."""
    sg = dict(cfg.sglang or {})
    attn_dp = sg.get("attn_dp_size") or (sg.get("dp_size") if sg.get("enable_dp_attention") else None) or 1
    return {"tp_size": int(sg.get("tp_size") or 1), "pp_size": int(sg.get("pp_size") or 1),
            "ep_size": int(sg.get("ep_size") or 1), "attn_dp_size": int(attn_dp),
            "mem_fraction_static": sg.get("mem_fraction_static"),
            "dtype": sg.get("dtype") or cfg.model.dtype, "quantization": sg.get("quantization")}


def engine_memory(cfg: Config, p: ParamCount, gpu_bytes: float, hf: Optional[dict] = None,
                  env: Optional[Environment] = None) -> EngineMemory:
    """One engine's weights per GPU and its static pool on a GPU of ``gpu_bytes`` (module doc: the rules);
    with the model's ``config.json`` ``hf`` and an ``env`` also the KV-cache bytes per token
    (``env.kv_cache_elements_per_token``: :func:`hpcrl.models.params.kv_cache_elements_per_token`)."""
    a = engine_args(cfg)
    tp, pp, attn_tp = a["tp_size"], a["pp_size"], max(a["tp_size"] // a["attn_dp_size"], 1)
    w = 2 if a["dtype"] in ("bfloat16", "float16", "half", "auto") else 4
    m = 1 if str(a["quantization"] or "").startswith("fp8") or cfg.weights.rollout_dtype == "fp8" else w
    weights = (w * (p.embedding + p.output) / tp + m * p.attention / attn_tp
               + m * (p.dense - p.attention) / tp + w * p.replicated + m * p.expert / tp) / pp
    fraction = a["mem_fraction_static"]
    frac = float(fraction) if fraction is not None else SGLANG_DEFAULT_FRACTION
    kv_bytes = 1 if str((cfg.sglang or {}).get("kv_cache_dtype") or "").startswith("fp8") else w
    kv = kv_bytes * env.kv_cache_elements_per_token(hf, attn_tp) / pp if hf is not None and env is not None else 0.0
    return EngineMemory(weights=weights, pool=frac * gpu_bytes, fraction=frac,
                        fraction_set=fraction is not None,
                        layout=f"tp{tp} pp{pp} ep{a['ep_size']} attn_dp{a['attn_dp_size']}", kv_per_token=kv)


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def _engine_gpus(cfg: Config) -> tuple[int, Optional[float], str]:
    """``(GPUs per engine node, GPU memory in GB or None, the field naming that node's GPUs)``."""
    s = cfg.slurm
    if cfg.run.placement == "disaggregate" and s.rollout is not None:
        mem = s.rollout.gpu_memory_gb if s.rollout.gpu_memory_gb is not None else s.gpu_memory_gb
        return s.rollout.gpus_per_node, mem, "slurm.rollout.gpus_per_node"
    return s.gpus_per_node, s.gpu_memory_gb, "slurm.gpus_per_node"


def check_engine_layout(cfg: Config, experts: Optional[int]) -> None:
    """The engines tile the GPUs hpcrl gives them (module doc, "Layout"); ``experts``: the model's routed
    experts (0: dense; None: not known yet). Raises ConfigError naming the field."""
    a = engine_args(cfg)
    gpus, _, gpus_field = _engine_gpus(cfg)
    tp, pp, ep, attn_dp = a["tp_size"], a["pp_size"], a["ep_size"], a["attn_dp_size"]
    require(tp * pp == gpus, "sglang.tp_size", tp,
            f"an engine uses tp_size x pp_size = {tp * pp} GPUs, but hpcrl starts one engine per node on all "
            f"{gpus_field}={gpus} GPUs of it", f"set sglang.tp_size={gpus // pp if gpus % pp == 0 else gpus}")
    require(tp % ep == 0, "sglang.ep_size", ep,
            f"must divide sglang.tp_size={tp} (SGLang's experts use the TP ranks)",
            f"use a divisor of {tp}, e.g. ep_size={tp}")
    require(tp % attn_dp == 0, "sglang.attn_dp_size", attn_dp, f"must divide sglang.tp_size={tp}",
            f"use a divisor of {tp}")
    if experts is None:
        pass
    elif experts:
        require(experts % ep == 0, "sglang.ep_size", ep, f"must divide the model's {experts} experts",
                f"use a divisor of {experts}")
    elif ep > 1:
        raise ConfigError("sglang.ep_size", ep,
                          f"the model at model.path={cfg.model.path!r} is dense (no experts)",
                          "remove sglang.ep_size")
    if cfg.run.placement == "colocate":
        require(cfg.rollout.num_engines == cfg.slurm.nodes, "rollout.num_engines", cfg.rollout.num_engines,
                "colocated on GPU nodes each engine takes every GPU of one node, so "
                f"slurm.nodes={cfg.slurm.nodes} nodes hold that many engines",
                f"set rollout.num_engines={cfg.slurm.nodes}")


def _trainer_fix(cfg: Config, p: ParamCount, budget: float, experts: int = 0,
                 critic: Optional[ParamCount] = None, hf: Optional[dict] = None) -> str:
    """What would make the trainer fit: the CPU offload, the distributed optimizer, or more GPUs; for a MoE
    model (``experts`` routed experts per layer) more tensor parallelism (sequence-parallel, up to a node's
    GPUs) for the rest and more expert parallelism for the experts, or, where even TP at a node's GPUs and one
    expert per GPU with Adam offloaded does not fit, that no layout of hpcrl's trainer does."""
    t, meg = cfg.train, dict(cfg.megatron or {})
    fixes = []
    if not meg.get("use_distributed_optimizer", t.use_distributed_optimizer):
        fixes.append("set train.use_distributed_optimizer=true (Adam sharded over data parallel)")
    offloaded = trainer_memory(cfg, p, offload=True, critic=critic, hf=hf)
    if not (meg.get("optimizer_cpu_offload") and float(meg.get("optimizer_offload_fraction", 0.0)) >= 1.0):
        fits = "fits" if offloaded.total <= budget else "still does not fit"
        fixes.append(f"set megatron.optimizer_cpu_offload=true and megatron.optimizer_offload_fraction=1.0 "
                     f"with the distributed optimizer ({_gb(offloaded.total)}: {fits})")
    if not experts:
        fixes.append("or raise train.tensor_parallel_size with more GPUs (slurm.nodes)")
        return "; ".join(fixes)
    w_bytes = 2 if meg.get("bf16", t.bf16) else 4
    per_param = w_bytes + (4 if meg.get("grad_reduce_in_fp32", True) else w_bytes)
    tp_max = cfg.slurm.gpus_per_node if cfg.slurm.gpus_per_node > 0 else 8  # TP stays within a node
    # TP = a node's GPUs (sequence-parallel), EP = experts with ETP 1, Adam on the host
    floor = per_param * ((p.total - p.expert - p.replicated) / tp_max + p.replicated + p.expert / experts)
    if floor <= budget:
        fixes.append(f"or raise train.tensor_parallel_size (up to {tp_max}, sequence-parallel) and "
                     f"train.expert_parallel_size (up to {experts}) with more GPUs (slurm.nodes)")
    else:
        fixes.append(
            f"no layout of hpcrl's trainer fits: even at train.tensor_parallel_size={tp_max} and "
            f"train.expert_parallel_size={experts} with Adam offloaded each GPU holds {_gb(floor)} of weights "
            "and gradients; use GPUs with more memory (pipeline parallelism would be needed, which hpcrl's "
            "trainer lacks)")
    return "; ".join(fixes)


def check_memory(cfg: Config, check_files: bool, env: Optional[Environment] = None) -> None:
    """With ``slurm.gpu_memory_gb`` on GPU nodes and a readable ``config.json``: the engine layout
    (:func:`check_engine_layout`), the trainer's states within the GPU memory less :data:`RESERVED_GB`, and
    each engine's weights within its static pool. Raises ConfigError (one line: field, value, fix). The memory
    is not checked without ``check_files`` and an ``env`` (the model folder is not read then), without
    ``gpu_memory_gb``, or before the model's ``config.json`` exists."""
    s = cfg.slurm
    if s.gpu_memory_gb is None or s.gpus_per_node <= 0:  # check_slurm refuses gpu_memory_gb on CPU nodes
        return
    hf = read_model_config(cfg) if check_files and env is not None else None
    if sglang_engines_by_config(cfg):
        check_engine_layout(cfg, env.routed_experts(hf) if hf is not None else None)
    if hf is None or hf.get("model_type") not in env.counted_model_types:
        return  # no config.json yet, or a family without a count (check_model refuses what cannot be built)
    p = env.count_parameters(hf)
    gpu = s.gpu_memory_gb * GB
    budget = gpu - RESERVED_GB * GB
    critic = critic_parameters(cfg, p, env)
    tm = trainer_memory(cfg, p, critic=critic, hf=hf)
    experts = env.routed_experts(hf) if p.expert else 0
    acts = f", activations {_gb(tm.activations)}" if tm.activations else ""
    require(tm.total <= budget, "slurm.gpu_memory_gb", s.gpu_memory_gb,
            f"the trainer needs {_gb(tm.total)} per GPU at {tm.layout} (weights {_gb(tm.weights)}, gradients "
            f"{_gb(tm.grads)}, Adam {_gb(tm.adam)}{acts}) plus {RESERVED_GB:g} GB reserved, more than the GPU "
            "has", _trainer_fix(cfg, p, budget, experts, critic, hf))
    cm = critic_memory(cfg, critic)
    if cm is not None:
        critic_gb = cfg.slurm.critic.gpu_memory_gb or s.gpu_memory_gb
        require(cm.total <= (critic_gb - RESERVED_GB) * GB, "slurm.critic.gpu_memory_gb", critic_gb,
                f"the critic on its own ranks needs {_gb(cm.total)} per GPU at {cm.layout} (weights "
                f"{_gb(cm.weights)}, gradients {_gb(cm.grads)}, Adam {_gb(cm.adam)}) plus {RESERVED_GB:g} GB "
                "reserved, more than its GPUs have",
                "give slurm.critic more GPUs (nodes, gpus_per_node) with a larger critic.tensor_parallel_size, "
                "set train.use_distributed_optimizer=true, or use a smaller critic.path")
    if not sglang_engines_by_config(cfg):
        return
    _, engine_gb, _ = _engine_gpus(cfg)
    if engine_gb is None:
        return
    em = engine_memory(cfg, p, engine_gb * GB, hf, env)
    field = "sglang.mem_fraction_static" if em.fraction_set else "sglang.tp_size"
    value = em.fraction if em.fraction_set else engine_args(cfg)["tp_size"]
    assumed = ("" if em.fraction_set else
               f" (mem_fraction_static unset: SGLang's ~{SGLANG_DEFAULT_FRACTION} assumed)")
    require(em.weights < em.pool, field, value,
            f"an engine's weights take {_gb(em.weights)} per GPU at {em.layout}, more than its static pool "
            "of "
            f"{_gb(em.pool)} ({em.fraction:g} x {engine_gb:g} GB){assumed}, leaving no KV cache",
            "raise sglang.mem_fraction_static, use more GPUs per engine, or set sglang.quantization=fp8")
    longest = cfg.rollout.max_new_tokens
    require(em.kv_tokens >= longest, field, value,
            f"an engine's static pool of {_gb(em.pool)} per GPU at {em.layout} leaves "
            f"{_gb(em.pool - em.weights)} of KV cache, {em.kv_tokens:.0f} tokens, fewer than one response of "
            f"rollout.max_new_tokens={longest}"
            f"{assumed}", "raise sglang.mem_fraction_static, or use more GPUs per engine")


def memory_lines(cfg: Config, env: Environment) -> list[str]:
    """What ``hpcrl validate`` and ``submit`` print: the trainer's per-GPU estimate (with and without the CPU
    optimizer offload) and the engines' static memory, against ``slurm.gpu_memory_gb``, the parameters counted
    by ``env`` (:data:`hpcrl.validate.ENVIRONMENT`). Empty on CPU nodes or before the model's ``config.json``
    exists."""
    s = cfg.slurm
    hf = read_model_config(cfg)
    if s.gpus_per_node <= 0 or hf is None:
        return []
    if hf.get("model_type") not in env.counted_model_types:
        return [f"  memory:    no estimate for model_type {hf.get('model_type')!r}"]
    p = env.count_parameters(hf)
    gpu = s.gpu_memory_gb
    of = f" of {gpu:g} GB" if gpu is not None else " (set slurm.gpu_memory_gb to check it)"
    cp = critic_parameters(cfg, p, env)
    tm = trainer_memory(cfg, p, critic=cp, hf=hf)
    off = trainer_memory(cfg, p, offload=False, critic=cp, hf=hf)
    on = trainer_memory(cfg, p, offload=True, critic=cp, hf=hf)
    meg = dict(cfg.megatron or {})
    dt = "bf16" if meg.get("bf16", cfg.train.bf16) else "fp32"
    gdt = "fp32" if meg.get("grad_reduce_in_fp32", True) else dt
    recompute = " with full recompute" if meg.get("recompute_granularity") == "full" else ""
    acts = (f" + activations {_gb(tm.activations)} ({cfg.train.max_tokens_per_microbatch} tokens a micro-batch"
            f"{recompute})" if tm.activations else "")
    lines = [f"  memory:    {p.total / 1e9:.2f}B parameters ({p.expert / 1e9:.2f}B in routed experts), "
             "estimate per GPU" + ("" if tm.activations else " (activations not included: padded micro-batches)"),
             f"  trainer:   {tm.layout}, {tm.params / 1e9:.2f}B parameters per GPU: weights "
             f"{_gb(tm.weights)} ({dt}) + gradients {_gb(tm.grads)} ({gdt}) + Adam {_gb(tm.adam)}{acts} = "
             f"{_gb(tm.total)}{of}"
             + (f" (the critic's {_gb(tm.critic)} included)" if tm.critic else "")
             + (f", {_gb(gpu * GB - RESERVED_GB * GB - tm.total)} left after {RESERVED_GB:g} GB reserved"
                if gpu is not None else ""),
             f"             Adam without CPU offload {_gb(off.adam)} (total {_gb(off.total)}), with "
             f"optimizer_offload_fraction 1.0 {_gb(on.adam)} (total {_gb(on.total)}, "
             f"{_gb(on.adam_host * s.gpus_per_node)} host memory per node)"]
    cm = critic_memory(cfg, cp)
    if cm is not None:
        critic_gb = cfg.slurm.critic.gpu_memory_gb or gpu
        lines.append(f"  critic:    its own ranks, {cm.layout}: weights {_gb(cm.weights)} + gradients "
                     f"{_gb(cm.grads)} + Adam {_gb(cm.adam)} = {_gb(cm.total)}"
                     + (f" of {critic_gb:g} GB" if critic_gb is not None else ""))
    if sglang_engines_by_config(cfg):
        _, engine_gb, _ = _engine_gpus(cfg)
        em = engine_memory(cfg, p, (engine_gb or 0) * GB, hf, env)
        frac = f"{em.fraction:g}" + ("" if em.fraction_set else " (unset: SGLang's default assumed)")
        pool = (f", static pool {_gb(em.pool)} (mem_fraction_static {frac}) -> KV cache "
                f"{_gb(em.pool - em.weights)} ({em.kv_tokens / 1e3:.0f}k tokens per GPU)"
                if engine_gb is not None else "")
        lines.append(f"  engine:    {em.layout}, weights {_gb(em.weights)} per GPU{pool}")
    return lines
