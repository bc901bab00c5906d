"""The DeepSeek-style MoE block (GLM-4.5 ``glm4_moe``; shared with DeepSeek-V3 ``deepseek_v3``) as
megatron-core 0.16.1 ``TransformerConfig`` fields, and the update of its expert bias.

HF config (``Glm4MoeTopkRouter`` / ``DeepseekV3TopkRouter``, ``Glm4MoeMoE``) -> ``TransformerConfig``:

- ``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size`` -> ``num_moe_experts``,
  ``moe_router_topk``, ``moe_ffn_hidden_size``;
- ``sigmoid(logits)``, top-k chosen on ``scores + e_score_correction_bias`` ->
  ``moe_router_score_function="sigmoid"``, ``moe_router_enable_expert_bias=True`` (its ``expert_bias``);
- ``norm_topk_prob`` (renormalise the k sigmoid scores): always done by megatron for k > 1;
- ``routed_scaling_factor`` -> ``moe_router_topk_scaling_factor``;
- ``n_group`` / ``topk_group`` (HF scores a group by its top 2) -> ``moe_router_num_groups`` /
  ``moe_router_group_topk`` (megatron: by its top ``k // topk_group``);
- ``n_shared_experts * moe_intermediate_size`` (one SwiGLU MLP, no gate) ->
  ``moe_shared_expert_intermediate_size``;
- ``first_k_dense_replace`` (dense layers of ``intermediate_size``) -> ``moe_layer_freq = [0] * k + [1] * n``.

What megatron-core cannot express (group scorings that differ, ``norm_topk_prob: false``) is refused by
:func:`hpcrl.models.support.deepseek_router_problem` before this runs.

**The expert bias in RL** (aux-loss-free load balancing, https://arxiv.org/abs/2408.15664). Megatron keeps
``e_score_correction_bias`` as the router's ``expert_bias`` buffer and moves it outside the optimizer, in
``finalize_model_grads``: ``bias += rate * sign(mean(tokens_per_expert) - tokens_per_expert)`` over the step's
tokens summed on the tensor x data-parallel ranks. slime's GLM-4.5 / 4.7, DeepSeek-V3, Kimi-K2 and Moonlight
scripts (``scripts/models/*.sh``) all pass ``--moe-router-enable-expert-bias``
``--moe-router-bias-update-rate 0``:
the pre-trained bias routes, and RL never moves it. hpcrl follows: :data:`DEFAULT_BIAS_UPDATE_RATE` is 0 (the
bias stays bitwise as loaded, so the engines' routing, which uses the same bias, stays the trainer's between
weight syncs, and a few RL steps of skewed prompts do not retune a balance learnt over pre-training). The run
config's ``megatron: {moe_router_bias_update_rate: R}`` turns megatron's update on: megatron's own
``finalize_model_grads`` applies it after each step's gradient reduction (:func:`hpcrl.train.model.train_step`
runs megatron's schedule), from the tokens :func:`_count_tokens` counted (padding excluded) since
:func:`reset_token_counts`. The bias is a persistent buffer: it is in the model's
(sharded) state dict, so checkpoints save and resume it, and :mod:`hpcrl.train.bridge` exports it as
``mlp.gate.e_score_correction_bias``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

DEEPSEEK_STYLE_MODEL_TYPES = ("glm4_moe",)
"""HF ``model_type`` values whose MoE block :func:`moe_kwargs` builds (``deepseek_v3`` joins with MLA)."""

DEFAULT_BIAS_UPDATE_RATE = 0.0
"""``moe_router_bias_update_rate`` unless ``megatron:`` sets it: 0, the bias is frozen in RL (as slime)."""


def moe_layer_freq(hf_config: Any) -> list[int]:
    """Megatron's per-layer MoE pattern: 0 (dense MLP of ``intermediate_size``) for the first
    ``first_k_dense_replace`` layers, 1 (MoE) after, ``num_hidden_layers`` entries."""
    n, k = hf_config.num_hidden_layers, int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    return [0] * min(k, n) + [1] * max(n - k, 0)


def moe_kwargs(hf_config: Any) -> dict[str, Any]:
    """``TransformerConfig`` MoE fields of a GLM-4.5 / DeepSeek-V3 config (see the module table).

    No load-balancing loss (HF's ``Glm4MoeForCausalLM`` adds none; the expert bias balances), fp32 router,
    ``allgather`` dispatcher (``alltoall`` above EP=1, set by
    :func:`hpcrl.train.hf_config.mcore_config_from_hf`), expert bias on with
    :data:`DEFAULT_BIAS_UPDATE_RATE`. ``megatron:`` keys override any of these.
    """
    experts = int(hf_config.n_routed_experts)
    groups = int(getattr(hf_config, "n_group", 1) or 1)
    scaling = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
    shared = int(getattr(hf_config, "n_shared_experts", 0) or 0) * hf_config.moe_intermediate_size
    return dict(
        num_moe_experts=experts,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_overlap=False,
        moe_layer_freq=moe_layer_freq(hf_config),
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,  # unused by megatron's sigmoid scoring
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=DEFAULT_BIAS_UPDATE_RATE,
        moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=int(hf_config.topk_group) if groups > 1 else None,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_permute_fusion=False,
    )


def glm4_moe_kwargs(hf_config: Any) -> dict[str, Any]:
    """``TransformerConfig`` fields of a GLM-4.5 config beyond the dense ones: q/k/v bias from
    ``attention_bias`` (``o_proj`` has none in HF), q/k RMSNorm from ``use_qk_norm``, ``intermediate_size``
    for the dense first layers, and :func:`moe_kwargs`. Partial RoPE is a ``GPTModel`` argument
    (:func:`hpcrl.train.hf_config.rotary_percent`)."""
    return dict(add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
                qk_layernorm=bool(getattr(hf_config, "use_qk_norm", False)),
                ffn_hidden_size=hf_config.intermediate_size, **moe_kwargs(hf_config))


def check_bias_update_rate(value: Any) -> float:
    """``megatron.moe_router_bias_update_rate`` as a float >= 0, else ValueError naming the field and fix."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value >= 0):
        raise ValueError(f"megatron.moe_router_bias_update_rate: {value!r} must be a number >= 0 (0 keeps "
                         "the expert bias frozen, as slime's GLM-4.5 / DeepSeek-V3 scripts do; megatron's "
                         "default for pre-training is 1e-3)")
    return float(value)


def routers_with_expert_bias(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of a (possibly DDP-wrapped) megatron-core model that carry an ``expert_bias``."""
    return [m for m in model.modules() if getattr(m, "expert_bias", None) is not None
            and getattr(m, "local_tokens_per_expert", None) is not None]


@contextlib.contextmanager
def fp32_expert_bias(model: torch.nn.Module) -> Iterator[None]:
    """Keep the routers' ``expert_bias`` of ``model`` fp32 and bitwise across a cast of the whole model in
    the ``with`` block (megatron's ``Float16Module`` calls ``module.bfloat16()``, which rounds buffers too;
    megatron turns it back to fp32 only after the rounding). HF keeps ``e_score_correction_bias`` fp32 in
    bf16 models (``_keep_in_fp32_modules_strict``), and so do the engines."""
    saved = [(router, router.expert_bias.detach().clone()) for router in routers_with_expert_bias(model)]
    yield
    for router, bias in saved:
        router.expert_bias.data = bias


def padding_kwargs(model: torch.nn.Module, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"padding_mask": ~valid}`` for the ``GPTModel`` forward of a model whose routers carry an expert
    bias, else ``{}``. ``valid``: [batch, seq] bool, True at real tokens. Megatron then leaves padding
    positions out of ``local_tokens_per_expert`` (the counts the bias update reads; with
    :func:`fix_padding_in_token_counts`) and of its router losses; routing and logits do not change.
    Right-padded and packed micro-batches of the same samples thus count the same tokens (a shared group
    prompt, :mod:`hpcrl.train.packing`, is one forward and counts once)."""
    if not routers_with_expert_bias(model):
        return {}
    fix_padding_in_token_counts()
    return {"padding_mask": ~valid.bool()}


def _count_tokens(self: Any, routing_map: torch.Tensor, padding_mask: Any = None) -> None:
    """megatron-core 0.16.1's ``TopKRouter._apply_expert_bias`` with the padding mask [tokens] broadcast over
    the experts of ``routing_map`` [tokens, experts] (megatron's ``routing_map & ~padding_mask`` raises a
    shape error for any padding mask)."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def fix_padding_in_token_counts() -> None:
    """Install :func:`_count_tokens` as ``TopKRouter._apply_expert_bias`` (idempotent; the method only counts
    tokens for the bias update, so nothing else changes)."""
    from megatron.core.transformer.moe.router import TopKRouter

    TopKRouter._apply_expert_bias = _count_tokens


@torch.no_grad()
def reset_token_counts(model: torch.nn.Module) -> None:
    """Zero every router's ``local_tokens_per_expert`` (so a step counts only its own training forwards, not
    a grad-enabled forward run before it)."""
    for router in routers_with_expert_bias(model):
        router.local_tokens_per_expert.zero_()


def block_spec(config: Any, dense_layer: Any, moe_layer: Any) -> Any:
    """megatron-core ``TransformerBlockSubmodules`` with ``dense_layer`` (a layer ``ModuleSpec``) where
    ``config.moe_layer_freq`` is 0 and ``moe_layer`` where it is 1, and the final norm
    :class:`hpcrl.train.norms.SequenceParallelNorm`; ``moe_layer_freq`` a list of ``num_layers`` entries
    (:func:`moe_layer_freq`).
    Raises ValueError for a list of another length."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from hpcrl.train.norms import SequenceParallelNorm

    pattern = list(config.moe_layer_freq)
    if len(pattern) != config.num_layers:
        raise ValueError(f"moe_layer_freq has {len(pattern)} entries for {config.num_layers} layers")
    return TransformerBlockSubmodules(layer_specs=[moe_layer if f else dense_layer for f in pattern],
                                      layer_norm=SequenceParallelNorm)
