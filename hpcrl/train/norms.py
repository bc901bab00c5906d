"""torch RMSNorm / LayerNorm for megatron-core's local layer spec, with sequence parallelism allowed.

megatron-core's local spec builds its norms with ``WrappedTorchNorm``, which asserts that
``config.sequence_parallel`` is off; its fused alternatives need apex (LayerNorm only) or TransformerEngine,
i.e. CUDA. A norm needs nothing else for sequence parallelism: it acts on each token on its own, so it runs
unchanged on the rank's shard of the sequence, and only its weight's gradient is partial (each tensor-parallel
rank sees its tokens only). megatron-core sums the gradients of parameters tagged ``sequence_parallel`` over
the tensor-parallel group in ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``, which
:func:`hpcrl.train.model.train_step` calls), as it does for TransformerEngine's and apex's norms
(``TENorm`` / ``FusedLayerNorm`` set the same attribute). So these classes build the same torch modules as
``WrappedTorchNorm`` (bitwise the same model without sequence parallelism) and tag their weights.
"""

from __future__ import annotations

from typing import Any

import torch


def _torch_norm(config: Any, hidden_size: int, eps: float) -> torch.nn.Module:
    """``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm`` of ``[..., hidden_size]`` as ``config.normalization``
    says. Raises ValueError for another normalization and for megatron options torch's norms lack."""
    for option in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
        if getattr(config, option, False):
            raise ValueError(f"megatron.{option}=true is not supported by the torch norms of the local layer spec; "
                             f"unset it")
    if config.normalization == "RMSNorm":
        return torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
    if config.normalization == "LayerNorm":
        return torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
    raise ValueError(f"normalization {config.normalization!r} is not supported (RMSNorm or LayerNorm)")


class SequenceParallelNorm:
    """A norm over the hidden size of a token (``[seq, batch, hidden]`` in, same shape out): the layers'
    input and pre-MLP norms and the final norm. With ``config.sequence_parallel`` its input is this rank's
    ``seq / TP`` tokens and its weight (and bias) are tagged ``sequence_parallel``, so megatron-core sums their
    gradients over the tensor-parallel ranks. Takes megatron's norm arguments (``config``, ``hidden_size``,
    ``eps``; the others are ignored as ``WrappedTorchNorm`` ignores them)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        norm = _torch_norm(config, hidden_size, eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class HeadNorm:
    """A norm over each attention head (Qwen3's and GLM's q/k norms, ``[..., head_dim]``): it runs after the
    qkv projection has gathered the sequence, on this rank's heads, so it is never sequence-parallel (megatron
    sums its gradient over the tensor-parallel ranks by name, ``q_layernorm`` / ``k_layernorm``)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        return _torch_norm(config, hidden_size, eps)
