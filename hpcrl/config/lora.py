"""The ``model.lora`` section (LoRA adapters on the actor, issue #56: :mod:`hpcrl.train.lora`), its checks and
its parameter count for the memory estimate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from hpcrl.config.checks import positive, require
from hpcrl.config.environment import Environment
from hpcrl.config.errors import ConfigError
from hpcrl.names import PEFT_TARGETS

LORA_SYNCS = ("adapter", "merged")
"""``model.lora.sync``'s values."""


@dataclass
class LoraSection:
    """LoRA adapters on the actor (Hu et al. 2021; PEFT's ``LoraConfig`` fields ``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules``): the base weights are frozen and get no gradient nor optimizer
    state, each target linear gets ``lora_A`` [rank, in] and ``lora_B`` [out, rank] and adds
    ``alpha / rank * B @ A @ dropout(x)`` to its output. The engines are sent the adapters alone (``sync:
    adapter``) or the adapters merged into the base (``sync: merged``, a full weight sync); the KL reference is
    the base, the adapters off (no copy of the weights). Dense families only for now (not MoE experts,
    multi-latent attention or context parallelism)."""

    rank: int = 8
    """The adapters' rank r (PEFT ``r``)."""
    alpha: float = 16.0
    """PEFT's ``lora_alpha``: the adapters' output is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (PEFT ``lora_dropout``), in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: list(PEFT_TARGETS))
    """PEFT module names to adapt in every decoder layer (:data:`PEFT_TARGETS`)."""
    sync: str = "adapter"
    """What a weight sync sends the engines (:mod:`hpcrl.weights.adapter`): ``adapter``, the adapters' tensors
    alone, loaded as a LoRA adapter (SGLang's ``--enable-lora``, set on the engines) that the rollout's requests
    name; ``merged``, every weight with the adapters folded in (a full sync, for engines without LoRA)."""


def check_lora(cfg: Config, check_files: bool, env: Optional[Environment] = None) -> None:
    """``model.lora``'s fields, and the runs it cannot take yet: a MoE model, multi-latent attention (read from
    the model's ``config.json`` when the login node can, else ``model.create``'s tiny keys), context
    parallelism. Raises ConfigError naming the field."""
    from hpcrl.config.train import model_config_json, model_experts

    lora = cfg.model.lora
    if lora is None:
        return
    positive(cfg, "model.lora.rank", "model.lora.alpha")
    require(0.0 <= lora.dropout < 1.0, "model.lora.dropout", lora.dropout, "must be in [0, 1)",
            "set a dropout probability below 1 (0: none)")
    targets = list(lora.target_modules)
    require(bool(targets), "model.lora.target_modules", targets, "must name at least one module",
            f"use PEFT's names: {', '.join(PEFT_TARGETS)}")
    unknown = [t for t in targets if t not in PEFT_TARGETS]
    require(not unknown, "model.lora.target_modules", targets, f"unknown module(s) {', '.join(unknown)}",
            f"use PEFT's names: {', '.join(PEFT_TARGETS)}")
    require(len(set(targets)) == len(targets), "model.lora.target_modules", targets, "names a module twice",
            "name each module once")
    require(lora.sync in LORA_SYNCS, "model.lora.sync", lora.sync, "is not a way to sync adapters",
            f"use one of {', '.join(LORA_SYNCS)}")
    require(lora.sync != "adapter" or not cfg.weights.delta, "weights.delta", cfg.weights.delta,
            "a delta sync is of whole weights; model.lora.sync=adapter sends the adapters alone",
            "set weights.delta=false, or model.lora.sync=merged")
    dp = int((cfg.sglang or {}).get("dp_size") or 1)
    require(lora.sync != "adapter" or dp == 1, "sglang.dp_size", dp, "SGLang loads no LoRA adapter at run time into "
            "data-parallel replicas (\"data-parallel replicas are not supported for dynamic lora loading\")",
            "set sglang.dp_size=1 (more engines: rollout.num_engines), or model.lora.sync=merged")
    cp = cfg.train.context_parallel_size
    require(cp == 1, "train.context_parallel_size", cp, "LoRA adapters are not split over context-parallel "
            "ranks yet (issue #56)", "set train.context_parallel_size=1 with model.lora, or remove model.lora")
    hf = model_config_json(cfg, check_files)
    if (hf is not None and hf.get("kv_lora_rank")) or cfg.model.create == "tiny-deepseek-v3":
        raise ConfigError("model.lora", "set", "the model has multi-latent attention (DeepSeek-V3's), whose "
                          "projections LoRA does not adapt yet (issue #56)",
                          "train a model with grouped-query attention with model.lora, or remove model.lora")
    experts = model_experts(cfg, check_files, env)
    if experts is not None and experts[0]:
        raise ConfigError("model.lora", "set", f"the model is a mixture of experts ({experts[0]} routed experts "
                          "a layer) and LoRA on experts is not implemented yet (issue #56)",
                          "train a dense model with model.lora, or remove model.lora")


def lora_parameters(hf: Mapping, lora: LoraSection, tp: int = 1) -> float:
    """Adapter elements one tensor-parallel rank holds for a dense model's ``config.json`` ``hf`` (every decoder
    layer, all pipeline stages together): per target, ``lora_A`` [r, in] and ``lora_B`` [out, r], split as
    :class:`hpcrl.train.lora.LoraAdapter` splits them (column-parallel q/k/v/gate/up: A whole, B by rows; row-
    parallel o/down: A by columns, B whole)."""
    h = int(hf.get("hidden_size") or 0)
    heads = int(hf.get("num_attention_heads") or 1)
    kv = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or (h // heads if heads else 0))
    inter = int(hf.get("intermediate_size") or 0)
    layers = int(hf.get("num_hidden_layers") or 0)
    r = lora.rank
    shapes = {  # PEFT module -> (in, out, column-parallel)
        "q_proj": (h, heads * head_dim, True), "k_proj": (h, kv * head_dim, True),
        "v_proj": (h, kv * head_dim, True), "o_proj": (heads * head_dim, h, False),
        "gate_proj": (h, inter, True), "up_proj": (h, inter, True), "down_proj": (inter, h, False)}
    per_layer = 0.0
    for t in lora.target_modules:
        fan_in, fan_out, column = shapes[t]
        per_layer += r * fan_in + r * fan_out / tp if column else r * fan_in / tp + r * fan_out
    return per_layer * layers
