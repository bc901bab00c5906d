"""Parameter counts of an HF causal LM from its ``config.json`` alone (no torch, no transformers, no tensor),
split by how the trainer and the engines shard them.

:func:`count_parameters` returns a :class:`ParamCount` whose parts are what tensor and expert parallelism
divide: ``embedding`` / ``output`` (vocabulary-parallel), ``dense`` (column/row-parallel matrices of
attention, dense MLPs and shared experts: divided by TP), ``replicated`` (norms, routers, MLA's
down-projections: whole on every TP rank) and ``expert`` (routed experts: divided by EP x expert-TP). The
formulas follow the HF modelling code of transformers 5.24 layer by layer
(``Qwen2/Qwen3/Llama/MistralForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``,
``Glm4MoeForCausalLM``, ``DeepseekV3ForCausalLM`` with multi-latent attention) and equal ``sum(p.numel() for p
in model.parameters())`` of the model transformers builds on the meta device
(``tests/unit/test_memory_estimate.py``). Buffers (GLM/DeepSeek's ``e_score_correction_bias``) and MTP layers
(``num_nextn_predict_layers``: transformers does not build them) are not parameters and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

COUNTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe", "mixtral", "glm4_moe",
                       "deepseek_v3", "glm4_moe_lite")
MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite")
"""Families with multi-latent attention (and DeepSeek-style MoE layers: shared experts, first-k dense)."""
"""HF ``model_type`` values :func:`count_parameters` knows."""


@dataclass(frozen=True)
class ParamCount:
    """Parameters of one model, in elements (not bytes), by how parallelism splits them."""

    embedding: int
    """Input embedding ``[vocab_size, hidden_size]`` (vocabulary-parallel over TP)."""
    output: int
    """Output layer ``lm_head`` ``[vocab_size, hidden_size]``; 0 when tied to the embedding."""
    dense: int
    """Attention, dense-MLP and shared-expert matrices (and their biases): divided by TP."""
    attention: int
    """The attention part of ``dense`` (SGLang's DP attention replicates it over the attention-DP groups)."""
    replicated: int
    """Norm weights, router weights and MLA's q/kv down-projections: a full copy on every TP rank."""
    expert: int
    """Routed experts of every MoE layer: divided by expert parallel x expert-tensor parallel."""

    @property
    def total(self) -> int:
        """All parameters (what ``model.parameters()`` sums to)."""
        return self.embedding + self.output + self.dense + self.replicated + self.expert


def _get(hf: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = hf.get(key)
    return default if value is None else value


def _attention_gqa(hf: Mapping[str, Any], model_type: str) -> tuple[int, int]:
    """``(dense, replicated)`` of one grouped-query attention block: q/k/v/o and their biases, QK norms."""
    h = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    kv = int(_get(hf, "num_key_value_heads", heads))
    hd = int(_get(hf, "head_dim", h // heads))
    q, k = heads * hd, kv * hd
    dense = h * (q + 2 * k) + q * h
    if model_type == "qwen2":  # q/k/v bias always, o_proj without
        dense += q + 2 * k
    elif model_type in ("llama", "qwen3", "qwen3_moe") and hf.get("attention_bias"):  # q/k/v and o_proj
        dense += q + 2 * k + h
    elif model_type == "glm4_moe" and hf.get("attention_bias"):  # q/k/v only
        dense += q + 2 * k
    qk_norm = model_type in ("qwen3", "qwen3_moe") or (model_type == "glm4_moe" and hf.get("use_qk_norm"))
    return dense, 2 * hd if qk_norm else 0


def _attention_mla(hf: Mapping[str, Any]) -> tuple[int, int]:
    """``(dense, replicated)`` of DeepSeek-V3 multi-latent attention (``DeepseekV3Attention``): the q and kv
    down-projections and their norms are replicated over TP (Megatron's MLA keeps them whole), the
    up-projections and ``o_proj`` are split."""
    h, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    nope, rope, v = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"]), int(hf["v_head_dim"])
    kv_rank, q_rank = int(hf["kv_lora_rank"]), hf.get("q_lora_rank")
    bias = bool(hf.get("attention_bias"))
    qk = nope + rope
    replicated = h * (kv_rank + rope) + (kv_rank + rope if bias else 0) + kv_rank  # kv_a_proj_with_mqa, norm
    dense = kv_rank * heads * (nope + v) + heads * v * h + (h if bias else 0)  # kv_b_proj, o_proj
    if q_rank is None:
        dense += h * heads * qk  # q_proj
    else:
        q_rank = int(q_rank)
        replicated += h * q_rank + (q_rank if bias else 0) + q_rank  # q_a_proj, q_a_layernorm
        dense += q_rank * heads * qk  # q_b_proj
    return dense, replicated


def _mlp(hf: Mapping[str, Any], h: int, inter: int) -> int:
    """A SwiGLU MLP (gate, up, down) of width ``inter``, with Llama's optional ``mlp_bias``."""
    return 3 * h * inter + ((2 * inter + h) if hf.get("mlp_bias") else 0)


def _moe_layer(hf: Mapping[str, Any], model_type: str, i: int) -> bool:
    """Whether decoder layer ``i`` has routed experts (each family's rule in its HF decoder layer)."""
    if model_type in ("glm4_moe", *MLA_MODEL_TYPES):
        return i >= int(_get(hf, "first_k_dense_replace", 0))
    if model_type == "qwen3_moe":
        step = int(_get(hf, "decoder_sparse_step", 1))
        return i not in list(_get(hf, "mlp_only_layers", [])) and (i + 1) % step == 0
    return model_type == "mixtral"


def count_parameters(hf: Mapping[str, Any]) -> ParamCount:
    """The parameters of the model a ``config.json`` (``hf``, a dict) describes, split as :class:`ParamCount`.

    Raises ValueError naming the ``model_type`` when the family is not one of :data:`COUNTED_MODEL_TYPES`, and
    KeyError for a config without the fields its family needs (``hidden_size``, ``num_hidden_layers``...).
    """
    model_type = hf.get("model_type")
    if model_type not in COUNTED_MODEL_TYPES:
        raise ValueError(f"no parameter count for model_type {model_type!r} "
                         f"(known: {', '.join(COUNTED_MODEL_TYPES)})")
    h, layers, vocab = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["vocab_size"])
    tied = bool(hf.get("tie_word_embeddings", False))
    if model_type in MLA_MODEL_TYPES:
        attn_dense, attn_repl = _attention_mla(hf)
    else:
        attn_dense, attn_repl = _attention_gqa(hf, model_type)
    # the expert count under its family's name, or transformers 5's num_local_experts (Qwen3-MoE, Mixtral)
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0)
    if model_type not in ("qwen3_moe", "mixtral", "glm4_moe", *MLA_MODEL_TYPES):
        experts = 0
    inter_key = "intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"
    expert_inter = int(hf.get(inter_key) or 0)
    shared = int(_get(hf, "n_shared_experts", 0)) if model_type in ("glm4_moe", *MLA_MODEL_TYPES) else 0
    dense = replicated = expert = 0
    for i in range(layers):
        dense += attn_dense
        replicated += attn_repl + 2 * h  # input and post-attention RMSNorm
        if experts and _moe_layer(hf, model_type, i):
            replicated += experts * h  # router weight (no bias)
            expert += experts * 3 * h * expert_inter
            dense += _mlp(hf, h, shared * expert_inter) if shared else 0
        else:
            dense += _mlp(hf, h, int(hf["intermediate_size"]))
    return ParamCount(embedding=vocab * h, output=0 if tied else vocab * h, dense=dense,
                      attention=layers * attn_dense, replicated=replicated + h,  # + h: the final norm
                      expert=expert)


def kv_cache_elements_per_token(hf: Mapping[str, Any], attn_tp: int = 1) -> int:
    """KV-cache elements one token takes on one GPU of an engine whose attention is split over ``attn_tp``
    ranks (SGLang): ``layers x 2 x max(kv_heads / attn_tp, 1) x head_dim`` for grouped-query attention (KV
    heads are replicated when there are fewer than ranks), ``layers x (kv_lora_rank + qk_rope_head_dim)`` for
    DeepSeek-V3's multi-latent attention (the latent is cached whole on every rank). Raises KeyError for
    missing fields."""
    layers = int(hf["num_hidden_layers"])
    if hf.get("model_type") in MLA_MODEL_TYPES:
        return layers * (int(hf["kv_lora_rank"]) + int(hf["qk_rope_head_dim"]))
    heads = int(hf["num_attention_heads"])
    kv = int(_get(hf, "num_key_value_heads", heads))
    head_dim = int(_get(hf, "head_dim", int(hf["hidden_size"]) // heads))
    return layers * 2 * max(kv // max(attn_tp, 1), 1) * head_dim
