"""The megatron-core modules of :mod:`hpcrl.train.mla` (split off so that :mod:`hpcrl.train.mla`, which the
login node's :mod:`hpcrl.models.support` reads, imports neither torch nor megatron-core): the MLA layer spec
with a core attention taking q/k and v head sizes apart, HF's fixed latent-norm epsilon, and the whole
``kv_a_proj_with_mqa`` with its rope key's gradient all-reduced over the tensor-parallel group.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from hpcrl.train.mla import LATENT_NORM_EPS


class LatentRMSNorm:
    """:class:`hpcrl.train.norms.SequenceParallelNorm` (a ``torch.nn.RMSNorm`` over ``hidden_size``, the
    latent) with HF's fixed latent-norm epsilon (:data:`hpcrl.train.mla.LATENT_NORM_EPS`) whatever ``eps``
    megatron passes (its ``layernorm_epsilon``, HF's ``rms_norm_eps``). Under sequence parallelism megatron's
    MLA normalises the latents of this rank's tokens only (``[s / TP, b, rank]``), so the weight is tagged for
    megatron's sum over TP like the layer norms."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = LATENT_NORM_EPS, **kwargs: Any):
        from hpcrl.train.norms import SequenceParallelNorm

        return SequenceParallelNorm(config=config, hidden_size=hidden_size, eps=LATENT_NORM_EPS)


class AllReduceRopeKeyGrad(torch.autograd.Function):
    """Identity on ``kv_a_proj_with_mqa``'s output ``[..., kv_lora_rank + qk_rope_head_dim]``; its backward
    all-reduces the rope key's columns of the gradient over ``group`` (each tensor-parallel rank's heads give
    a part of it; the latent columns' gradient is already whole on every rank)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, kv_lora_rank: int, group: Any) -> torch.Tensor:
        ctx.kv_lora_rank, ctx.group = kv_lora_rank, group
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        rope = grad[..., ctx.kv_lora_rank:].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        grad[..., ctx.kv_lora_rank:] = rope
        return grad, None, None


class LatentAttention(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` whose whole (duplicated) ``linear_kv_down_proj`` gets its rope
    key's gradient all-reduced over the tensor-parallel group at TP > 1 (:mod:`hpcrl.train.mla`'s docstring:
    with megatron's local spec the shared rope key's weight gradient lost the other ranks' heads); otherwise
    megatron's, unchanged. Shapes as megatron's: ``[s, b, hidden]`` in and out (``[s / TP, b, hidden]`` under
    sequence parallelism).

    Under sequence parallelism megatron's MLA runs ``linear_kv_down_proj`` on this rank's tokens and gathers the
    rope key over the sequence, whose backward (a reduce-scatter) already sums the rope key's gradient over
    the ranks' heads: the all-reduce above would count it TP times, so it is not added; instead the whole
    projection's weight gradient (this rank's tokens only) is tagged ``sequence_parallel`` for megatron's sum
    over TP."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        group = self.pg_collection.tp
        if self.config.sequence_parallel:
            for p in self.linear_kv_down_proj.parameters():
                p.sequence_parallel = True
        elif group is not None and group.size() > 1:
            rank = self.config.kv_lora_rank

            def reduce_rope_key_grad(module, args, output):
                out, bias = output
                return AllReduceRopeKeyGrad.apply(out, rank, group), bias

            self.linear_kv_down_proj.register_forward_hook(reduce_rope_key_grad)


def layer_spec(num_experts: Optional[int] = None):
    """megatron-core's local MLA layer spec (``get_gpt_layer_local_spec(multi_latent_attention=True)``,
    RMSNorm) with :class:`~hpcrl.train.packed_attention.PackedDotProductAttention` as core attention (q/k
    and v head sizes apart; padded and packed THD input), :class:`LatentRMSNorm` latent norms, and
    :class:`LatentAttention` with megatron's duplicated ``Linear`` as ``linear_kv_down_proj``. With
    ``num_experts`` the MLP is megatron-core's MoE layer with ``SequentialMLP`` experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.post_training.modelopt.layers import Linear  # megatron's duplicated (whole) linear

    from hpcrl.train import cpu_compat
    from hpcrl.train.packed_attention import PackedDotProductAttention, use_sequence_parallel_norms

    cpu_compat.mark_te_absent_for_mla()  # TE's stand-ins break MLA's build without TE
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    multi_latent_attention=True, normalization="RMSNorm")
    spec.submodules.self_attention.module = LatentAttention
    attention = spec.submodules.self_attention.submodules
    attention.linear_kv_down_proj = Linear
    attention.core_attention = PackedDotProductAttention
    attention.q_layernorm = LatentRMSNorm
    attention.kv_layernorm = LatentRMSNorm
    use_sequence_parallel_norms(spec)  # the input and pre-MLP norms (the latent ones above stay)
    return spec
