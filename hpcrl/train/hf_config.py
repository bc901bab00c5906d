"""HF config -> megatron-core ``TransformerConfig`` for the families :mod:`hpcrl.train.bridge` builds.

Split from the bridge so that each family's config fields live in one place: RoPE (:func:`rope_theta`,
:func:`rope_scaling`), head size, experts, the refusal of what Megatron cannot express
(:func:`check_supported`, the login node's :func:`hpcrl.models.support.unsupported_feature`), and the
MoE router fields (:func:`moe_kwargs`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from hpcrl.models.support import LLAMA3_ROPE, rope_settings, unsupported_feature  # the login node's, the same
from hpcrl.train import deepseek_moe, mla

# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------

def rope_theta(hf_config: Any) -> float:
    """The RoPE base of an HF config: ``rope_parameters["rope_theta"]`` (transformers 5) or ``rope_theta``."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    if getattr(hf_config, "rope_theta", None) is not None:
        return float(hf_config.rope_theta)
    raise ValueError(f"{type(hf_config).__name__} has no rope_theta (neither rope_parameters nor rope_theta)")


def config_fields(hf_config: Any) -> dict[str, Any]:
    """An HF config object as the ``config.json`` dict the login-node checks read (``to_dict()``)."""
    return hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))


def rope_scaling(hf_config: Any) -> Optional[float]:
    """Llama-3 RoPE scaling factor, None for plain RoPE; NotImplementedError for any other scaling. The RoPE
    fields are read where :func:`hpcrl.models.support.rope_settings` reads them, the standard Llama-3
    constants are :data:`hpcrl.models.support.LLAMA3_ROPE`."""
    params = rope_settings(config_fields(hf_config))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "llama3" and all(float(params.get(k, -1)) == v for k, v in LLAMA3_ROPE.items()):
        return float(params["factor"])
    raise NotImplementedError(f"RoPE scaling {params} is not supported (plain RoPE, or llama3 with "
                              f"{LLAMA3_ROPE}, is)")


def head_dim(hf_config: Any) -> int:
    """Per-head size: ``hf_config.head_dim`` when set (Qwen3), else ``hidden_size // num_attention_heads``."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_experts(hf_config: Any) -> int:
    """Routed experts per MoE layer of an HF config (``num_experts``, or transformers 5's
    ``num_local_experts``); 0 for a dense model."""
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
               or getattr(hf_config, "n_routed_experts", None) or 0)


def rotary_percent(hf_config: Any) -> float:
    """Fraction of each head that RoPE rotates (megatron's ``rotary_percent``): ``partial_rotary_factor`` from
    ``rope_parameters`` (transformers 5) or the top level (published GLM-4.5 configs), else 1. HF rotates the
    first ``int(head_dim * factor)`` dims with rotate-half and passes the rest, as megatron's
    ``apply_rotary_pos_emb`` does with ``rotary_percent`` (non-interleaved)."""
    return float(rope_settings(config_fields(hf_config)).get("partial_rotary_factor") or 1.0)


def sliding_window(hf_config: Any) -> Optional[int]:
    """Mistral's / Mixtral's ``sliding_window`` (each query sees itself and the ``sliding_window - 1`` keys
    before it: HF's ``sliding_window_overlay``, ``kv_idx > q_idx - sliding_window``), None when unset or for
    other families (Qwen2's ``use_sliding_window`` is refused by :func:`check_supported`)."""
    if getattr(hf_config, "model_type", None) not in ("mistral", "mixtral"):
        return None
    window = getattr(hf_config, "sliding_window", None)
    return int(window) if window else None


def check_supported(hf_config: Any) -> None:
    """NotImplementedError naming the first setting the bridge cannot build: the login node's check
    (:func:`hpcrl.models.support.unsupported_feature`) on the config's fields, so both refuse the same."""
    bad = unsupported_feature(config_fields(hf_config))
    if bad is not None:
        field, value, what = bad
        raise NotImplementedError(f"{field}={value!r} {what}")


def mcore_config_from_hf(hf_config: Any, tp: int = 1, dtype: torch.dtype = torch.float32, ep: int = 1,
                         sequence_parallel: bool = False, etp: Optional[int] = None, pp: int = 1, cp: int = 1,
                         **overrides: Any):
    """Return the megatron-core ``TransformerConfig`` equivalent to an HF Qwen2 / Qwen3 / Llama / Qwen3-MoE /
    GLM-4.5 config (GLM-4.5's fields: :func:`hpcrl.train.deepseek_moe.glm4_moe_kwargs`).

    RMSNorm with the HF epsilon, SwiGLU (``gated_linear_unit`` + silu), GQA (``num_query_groups``), head size
    from ``head_dim``, qkv bias for Qwen2, q/k RMSNorm for Qwen3, no other biases, HF dropouts (0 for these
    families). ``dtype`` is ``torch.float32`` or ``torch.bfloat16`` (sets ``params_dtype`` and ``bf16``).
    Without CUDA: ``use_cpu_initialization=True`` and every fusion off. ``overrides`` are further
    ``TransformerConfig`` fields and win over the derived ones. ``ep``: the expert-parallel size the model is
    built for (megatron-core's layers read it from the config to keep expert gradients out of the
    data-parallel all-reduce; a MoE model built with the wrong one sums different experts' gradients).
    ``sequence_parallel``: megatron's sequence parallelism (only at ``tp`` > 1; :mod:`hpcrl.train.norms`).
    ``etp``: the expert-tensor-parallel size the groups were made with (None: megatron's default, ``tp``).
    ``pp``: the pipeline-parallel size (each stage builds its share of the layers; uneven first/last stages
    through the ``num_layers_in_first/last_pipeline_stage`` overrides). ``cp``: the context-parallel size
    (:mod:`hpcrl.train.context_parallel`).
    Raises NotImplementedError for unsupported architectures, ValueError for an unsupported dtype,
    TypeError for unknown override names.
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    check_supported(hf_config)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype {dtype} is not supported (torch.float32 or torch.bfloat16)")
    kwargs: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2",
        qk_layernorm=hf_config.model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_tensor_parallel_size=etp if etp is not None else tp,
        sequence_parallel=bool(sequence_parallel) and tp > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        attention_softmax_in_fp32=True,
    )
    window = sliding_window(hf_config)
    if window is not None:  # megatron keeps keys j with i - left <= j <= i + right; HF's window is left W - 1
        # the fused (bf16, GPU) causal softmax kernel ignores the window: the torch softmax applies it
        kwargs.update(window_size=(window - 1, 0), masked_softmax_fusion=False)
    config_class = TransformerConfig
    if mla.is_mla(hf_config):  # multi-latent attention: its ranks, head sizes and RoPE (hpcrl.train.mla)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_class = MLATransformerConfig
        kwargs.update(mla.config_kwargs(hf_config, rope_theta(hf_config)))
        if not mla.all_layers_dense(hf_config):  # DeepSeek-style MoE layers (hpcrl.train.deepseek_moe)
            kwargs.update(mla.moe_kwargs(hf_config), expert_model_parallel_size=ep)
    elif hf_config.model_type == "glm4_moe":
        kwargs.update(deepseek_moe.glm4_moe_kwargs(hf_config), expert_model_parallel_size=ep)
    elif num_experts(hf_config):
        kwargs.update(moe_kwargs(hf_config), expert_model_parallel_size=ep)
    if num_experts(hf_config):
        # allgather needs equal token counts on the expert groups' ranks; where they span data-parallel ranks
        # (EP > 1, or ETP above TP) their micro-batches differ
        if ep > 1 or (etp is not None and etp > tp):
            kwargs["moe_token_dispatcher_type"] = "alltoall"
    if not torch.cuda.is_available():
        kwargs.update(use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
                      persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                      gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False)
    kwargs.update(overrides)
    if kwargs.get("moe_router_enable_expert_bias"):
        deepseek_moe.check_bias_update_rate(kwargs.get("moe_router_bias_update_rate"))
    return config_class(**kwargs)


def moe_kwargs(hf_config: Any) -> dict[str, Any]:
    """``TransformerConfig`` MoE fields for a Qwen3-MoE or Mixtral config (every layer MoE, no shared experts;
    Mixtral's experts are ``intermediate_size`` wide, its ``MixtralTopKRouter`` is Qwen3-MoE's with
    ``norm_topk_prob``).

    Routing as HF's ``Qwen3MoeSparseMoeBlock``: softmax of the router logits in fp32, top-k, renormalised over
    the k when ``norm_topk_prob`` (megatron: top-k of the logits, then softmax over the k, which is the same
    thing) or not (``moe_router_pre_softmax``: softmax over all experts, then top-k). The load-balancing loss is
    HF's: megatron's ``aux_loss`` with ``router_aux_loss_coef`` when the config has ``output_router_logits``
    (HF adds it only then), else none; token dispatcher ``allgather`` at EP=1 and ``alltoall`` above (the
    all-gather one needs the same number of tokens on every expert-parallel rank, which data-parallel
    micro-batches of different lengths do not have); ``megatron:`` keys of the run config override any of these
    (e.g. ``moe_token_dispatcher_type``, ``moe_z_loss_coeff``).
    """
    aux = bool(getattr(hf_config, "output_router_logits", False))
    return dict(
        num_moe_experts=num_experts(hf_config),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
        moe_router_pre_softmax=not getattr(hf_config, "norm_topk_prob", True),
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0) if aux else 0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_permute_fusion=False,
    )


def padded_vocab_size(vocab_size: int, tp: int = 1, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron-LM's vocab padding: the next multiple of ``make_vocab_size_divisible_by * tp``."""
    multiple = make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


