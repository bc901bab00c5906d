"""Multi-latent attention (MLA) for the Megatron bridge: DeepSeek-V3 (``deepseek_v3``) and GLM-4.7-Flash-style
``glm4_moe_lite``, whose attention is HF's ``DeepseekV3Attention`` / ``Glm4MoeLiteAttention`` (the same code).

megatron-core 0.16.1's ``MLASelfAttention`` computes what HF does, given the local layer spec with three
changes (:func:`hpcrl.train.mla_layers.layer_spec`, which holds the megatron-core side; this module stays
torch-free for the login node): the core attention takes separate q/k and v head sizes
(:class:`hpcrl.train.packed_attention.PackedDotProductAttention`, padded and packed), the two latent norms use
HF's fixed epsilon of 1e-6 (HF builds ``q_a_layernorm`` / ``kv_a_layernorm`` with their default ``eps``, not
``rms_norm_eps``), and ``kv_a_proj_with_mqa`` is whole on every rank (below). YaRN's module needs the CPU
patches of :mod:`hpcrl.train.cpu_compat`.

Names and layouts (``decoder.layers.{i}.self_attention.`` / ``model.layers.{i}.self_attn.`` prefixes):

==================================  ===========================  =======================================
megatron-core                       HF                           layout (TP: megatron's parallel linear)
==================================  ===========================  =======================================
``linear_q_proj.weight``            ``q_proj.weight`` (no q LoRA) column (dim 0 split, whole heads)
``linear_q_down_proj.weight``       ``q_a_proj.weight``           column (split, output all-gathered)
``q_layernorm.weight``              ``q_a_layernorm.weight``      replicated
``linear_q_up_proj.weight``         ``q_b_proj.weight``           column (whole heads)
``linear_kv_down_proj.weight``      ``kv_a_proj_with_mqa.weight`` replicated (whole on every rank)
``kv_layernorm.weight``             ``kv_a_layernorm.weight``     replicated
``linear_kv_up_proj.weight``        ``kv_b_proj.weight``          column (whole heads)
``linear_proj.weight``              ``o_proj.weight``             row
==================================  ===========================  =======================================

``kv_a_proj_with_mqa`` is whole on every tensor-parallel rank (megatron-core's duplicated ``Linear``, as its
TransformerEngine spec has it), because of the shared rope key it makes: each rank uses that key for its own
heads only, so its gradient is a partial sum per rank, and megatron's local spec (a ``ColumnParallelLinear``
whose output is all-gathered) keeps only the rank's own slice of the gradient in the gather's backward: at
TP=2 the rope rows' weight gradient lost the other rank's heads (measured: grad norm off by 1e-5 relative,
weights after one AdamW step by 4e-4). :class:`~hpcrl.train.mla_layers.LatentAttention` all-reduces the rope
key's gradient over the tensor-parallel group instead, so the replicated weight gets the full gradient on
every rank.

Every tensor keeps HF's row order: a head's q rows are ``[nope; rope]`` in both, ``kv_b_proj``'s are
``[k nope; v]`` per head, ``kv_a_proj_with_mqa``'s ``[kv latent; shared rope key]``. megatron-core's MLA RoPE
reads the rope dimensions as interleaved pairs (it de-interleaves before rotating), which is HF's
``rope_interleave=True`` (the default of both configs); ``rope_interleave: false`` is refused
(:func:`unsupported_feature`).

Scores: HF scales by ``qk_head_dim ** -0.5``, times ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` with YaRN
and ``mscale_all_dim`` set; cos/sin are multiplied by YaRN's ``attention_factor``
(``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`` when both are set, else
``get_mscale(factor)``). megatron-core computes the same two numbers from its ``mscale`` / ``mscale_all_dim``
fields, set by :func:`config_kwargs` so that they agree; the one HF case megatron cannot express
(``mscale_all_dim`` without ``mscale``) is refused, as are an explicit ``attention_factor`` and
``truncate: false``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite")
"""HF ``model_type`` values whose attention is multi-latent attention."""

LATENT_NORM_EPS = 1e-6
"""HF's ``q_a_layernorm`` / ``kv_a_layernorm`` epsilon (``DeepseekV3RMSNorm``'s default, not
``rms_norm_eps``)."""

LAYER_RULES = {
    # megatron suffix of ``decoder.layers.{i}.`` -> (HF suffixes of ``model.layers.{i}.``, layout)
    "self_attention.linear_q_proj.weight": (("self_attn.q_proj.weight",), "column"),
    "self_attention.linear_q_down_proj.weight": (("self_attn.q_a_proj.weight",), "column"),
    "self_attention.q_layernorm.weight": (("self_attn.q_a_layernorm.weight",), "replicated"),
    "self_attention.linear_q_up_proj.layer_norm_weight": (("self_attn.q_a_layernorm.weight",), "replicated"),
    "self_attention.linear_q_up_proj.weight": (("self_attn.q_b_proj.weight",), "column"),
    "self_attention.linear_kv_down_proj.weight": (("self_attn.kv_a_proj_with_mqa.weight",), "replicated"),
    "self_attention.kv_layernorm.weight": (("self_attn.kv_a_layernorm.weight",), "replicated"),
    "self_attention.linear_kv_up_proj.layer_norm_weight": (
        ("self_attn.kv_a_layernorm.weight",), "replicated"),
    "self_attention.linear_kv_up_proj.weight": (("self_attn.kv_b_proj.weight",), "column"),
}
"""MLA names (module docstring table), to be laid over the bridge's dense rules for an MLA model (the
bridge's ``self_attention.q_layernorm`` is Qwen3's ``q_norm`` otherwise)."""

Problem = tuple[str, Any, str]


def is_mla(hf_config: Any) -> bool:
    """True for an HF config (object or ``config.json`` dict) of a multi-latent-attention family."""
    model_type = hf_config.get("model_type") if isinstance(hf_config, Mapping) else getattr(
        hf_config, "model_type", None)
    return model_type in MLA_MODEL_TYPES


def all_layers_dense(hf_config: Any) -> bool:
    """True when an MLA config's every decoder layer has a dense MLP (DeepSeek-V3's ``first_k_dense_replace``
    at least ``num_hidden_layers``, or GLM-lite's ``mlp_layer_types`` all ``dense``), whatever its expert
    fields say."""
    get = hf_config.get if isinstance(hf_config, Mapping) else (lambda k, d=None: getattr(hf_config, k, d))
    layers = int(get("num_hidden_layers", 0) or 0)
    types = get("mlp_layer_types", None)
    if types is not None:
        return all(t == "dense" for t in types)
    return int(get("first_k_dense_replace", 0) or 0) >= layers


def unsupported_feature(hf: Mapping[str, Any], rope: Mapping[str, Any]) -> Optional[Problem]:
    """The first MLA setting of ``config.json`` (``hf``; ``rope``: its RoPE parameters, from
    ``rope_parameters`` or ``rope_scaling``) megatron-core's MLA cannot express, or None.

    Refused: ``rope_interleave: false``; RoPE scalings other than plain and YaRN; YaRN with an explicit
    ``attention_factor``, with ``truncate: false``, or with ``mscale_all_dim`` but no ``mscale``;
    ``num_key_value_heads`` other than ``num_attention_heads``."""
    if hf.get("rope_interleave", True) is False:
        return ("rope_interleave", False, "is not supported for multi-latent attention (megatron-core "
                "rotates interleaved rope pairs, HF's rope_interleave: true)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn", None):
        return ("rope_parameters", dict(rope), f"RoPE scaling {kind!r} is not supported for multi-latent "
                "attention (plain RoPE or yarn is)")
    if kind == "yarn":
        if rope.get("attention_factor") is not None:
            return ("rope_parameters.attention_factor", rope["attention_factor"],
                    "is not supported (YaRN's factor from mscale / mscale_all_dim is)")
        if rope.get("truncate", True) is False:
            return ("rope_parameters.truncate", False, "is not supported (YaRN with truncate: true is)")
        if rope.get("mscale_all_dim") and not rope.get("mscale"):
            return ("rope_parameters.mscale", rope.get("mscale"), "must be set when mscale_all_dim is "
                    f"({rope['mscale_all_dim']}): megatron-core cannot express HF's YaRN scale then")
    heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if kv_heads is not None and heads is not None and kv_heads != heads:
        return ("num_key_value_heads", kv_heads, f"must equal num_attention_heads ({heads}) for multi-latent "
                "attention")
    return None


def config_kwargs(hf_config: Any, rope_theta: float) -> dict[str, Any]:
    """megatron-core ``MLATransformerConfig`` fields for an MLA HF config (module docstring): ranks, head
    sizes, RoPE (``rope_type`` ``rope`` or ``yarn`` with HF's factor, original length, betas and the mscales
    that reproduce HF's score and cos/sin scales). ``rope_theta``: the config's RoPE base. ``kv_channels`` is
    ``v_head_dim`` (what megatron's attention output is made of), query groups equal heads."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    kwargs: dict[str, Any] = dict(
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        kv_channels=hf_config.v_head_dim,
        num_query_groups=hf_config.num_attention_heads,
        rotary_base=rope_theta,
        rope_type="rope",
        rotary_scaling_factor=1.0,  # plain RoPE: megatron's score scale mscale(1, .) is 1, as HF's
        mscale=1.0,
        mscale_all_dim=0.0,
    )
    if rope.get("rope_type", rope.get("type", "default")) == "yarn":
        original = int(rope.get("original_max_position_embeddings")
                       or getattr(hf_config, "original_max_position_embeddings", None)
                       or hf_config.max_position_embeddings)
        factor = rope.get("factor")
        factor = float(factor) if factor is not None else hf_config.max_position_embeddings / original
        both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))
        kwargs.update(rope_type="yarn", rotary_scaling_factor=factor,
                      original_max_position_embeddings=original, beta_fast=float(rope.get("beta_fast") or 32),
                      beta_slow=float(rope.get("beta_slow") or 1),
                      mscale=float(rope["mscale"]) if both else 1.0,
                      mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    return kwargs


def moe_kwargs(hf_config: Any) -> dict[str, Any]:
    """``TransformerConfig`` MoE fields of an MLA config with MoE layers: the DeepSeek-style router and shared
    experts of :func:`hpcrl.train.deepseek_moe.moe_kwargs` (the same HF router code), dense layers of
    ``intermediate_size`` where DeepSeek-V3's ``first_k_dense_replace`` or GLM-lite's ``mlp_layer_types``
    (``dense`` / ``sparse`` per layer) put them (``moe_layer_freq``)."""
    from hpcrl.train import deepseek_moe

    kwargs = deepseek_moe.moe_kwargs(hf_config)
    kwargs["ffn_hidden_size"] = hf_config.intermediate_size
    types = getattr(hf_config, "mlp_layer_types", None)
    if types is not None:
        kwargs["moe_layer_freq"] = [int(t == "sparse") for t in types]
    return kwargs
