"""Per-token log-probs and entropy from tensor-parallel (vocab-sharded) logits, as slime computes them.

megatron-core's ``GPTModel`` returns logits ``[batch, seq, padded_vocab / tp]``: each tensor-parallel rank holds a
contiguous slice of the (padded) vocab. Nothing here gathers the full vocab; the softmax statistics are
all-reduced over the TP group instead (megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy`` for
log-probs, a fused autograd function for entropy). Logits are divided by the sampling temperature first, as
slime does (``logits.div(args.rollout_temperature)`` before its log-prob and entropy), so the trainer's
log-probs are those of the distribution the engine sampled from. Vocab padding: with ``vocab_size`` given,
columns at or beyond it get probability 0.

All results are float32 and differentiable; every TP rank gets the same values. Model parallelism must be
initialised (:func:`hpcrl.train.parallel.initialize_model_parallel`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch


def _prepare(logits: torch.Tensor, temperature: float,
             vocab_size: Optional[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fp32 logits / temperature (a new tensor) with padded vocab columns at -inf, and the padding mask."""
    from megatron.core import parallel_state

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x = logits.float() / temperature  # a fresh tensor: safe for vocab_parallel_cross_entropy's in-place ops
    if vocab_size is None:
        return x, None
    part = x.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    if start + part <= vocab_size:
        return x, None
    mask = torch.arange(start, start + part, device=x.device) >= vocab_size
    return x.masked_fill(mask, float("-inf")), mask


def compute_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                      vocab_size: Optional[int] = None) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)`` over the TP-sharded vocab.

    ``logits``: this rank's shard ``[batch, seq, vocab / tp]`` (any float dtype; computed in fp32).
    ``labels``: token ids ``[batch, seq]`` (the same on every TP rank), each < ``vocab_size``.
    ``vocab_size``: the true (HF) vocab; padded columns beyond it are excluded. Returns ``[batch, seq]``
    float32 (natural log). Uses megatron-core's ``vocab_parallel_cross_entropy`` (on a fresh copy of the
    logits, since it works in place); gradients flow to ``logits``.
    """
    from megatron.core import tensor_parallel

    x, _ = _prepare(logits, temperature, vocab_size)
    return -tensor_parallel.vocab_parallel_cross_entropy(x, labels)


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy over a vocab split across the TP group, with its analytic gradient.

    Forward: ``m`` = global max, ``Z = sum_v exp(x_v - m)`` (all-reduced), ``log p_v = x_v - m - log Z``,
    ``H = -sum_v p_v log p_v`` (all-reduced). Backward: ``dH/dx_v = -p_v (log p_v + H)``, local to each shard,
    so no communication is needed (slime fuses the same computation in ``_VocabParallelLogProbEntropy``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        import torch.distributed as dist
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        m = x.amax(dim=-1, keepdim=True)
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = x - m
        z = shifted.exp().sum(dim=-1, keepdim=True)
        if tp > 1:
            dist.all_reduce(z, group=group)
        log_p = shifted - z.log()
        if mask is not None:  # p is 0 there; keep log p finite so that 0 * log p is 0
            log_p = log_p.masked_fill(mask, 0.0)
        p = log_p.exp()
        if mask is not None:
            p = p.masked_fill(mask, 0.0)
        entropy = -(p * log_p).sum(dim=-1)
        if tp > 1:
            dist.all_reduce(entropy, group=group)
        ctx.save_for_backward(p, log_p, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor):
        p, log_p, entropy = ctx.saved_tensors
        return -(grad_entropy * entropy).unsqueeze(-1) * p - grad_entropy.unsqueeze(-1) * p * log_p, None


def compute_entropy(logits: torch.Tensor, temperature: float = 1.0,
                    vocab_size: Optional[int] = None) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` of ``softmax(logits / temperature)`` over the TP-sharded vocab.

    ``logits``: this rank's shard ``[batch, seq, vocab / tp]``. Returns ``[batch, seq]`` float32 in nats, the
    same on every TP rank. The max, the normaliser and the entropy sum are all-reduced over the TP group; the
    gradient ``dH/dx_v = -p_v (log p_v + H)`` is local to each shard and flows back to ``logits`` (each rank
    gets its shard's part of the gradient of the replicated result, the Megatron convention).
    """
    x, mask = _prepare(logits, temperature, vocab_size)
    return _VocabParallelEntropy.apply(x, mask)


@dataclass
class ResponseLogProbs:
    """Per-token values of the response positions, right-padded to the longest response."""

    log_probs: torch.Tensor
    """``[batch, max_response_len]`` float32; 0 beyond each response."""
    entropy: Optional[torch.Tensor]
    """``[batch, max_response_len]`` float32 or None; 0 beyond each response."""
    mask: torch.Tensor
    """``[batch, max_response_len]`` bool: True on response tokens."""


def prediction_columns(total_lengths: torch.Tensor, response_lengths: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a right-padded batch predicts its response tokens: ``(index, mask)``, both ``[batch, R]`` (``R``
    the longest response). Response token ``j`` of row ``i`` sits at column ``total_i - resp_i + j``; the
    output at the column before predicts it, so ``index[i, j] = total_i - resp_i + j - 1`` (0 where
    ``mask`` is False, beyond row ``i``'s response). ``total_lengths``, ``response_lengths``: ``[batch]``
    long tensors on one device."""
    width = int(response_lengths.max()) if response_lengths.numel() else 0
    j = torch.arange(width, device=response_lengths.device).unsqueeze(0)
    mask = j < response_lengths.unsqueeze(1)
    index = (total_lengths - response_lengths - 1).unsqueeze(1) + j
    return torch.where(mask, index, torch.zeros_like(index)), mask


def response_log_probs(model: torch.nn.Module, tokens: torch.Tensor,
                       total_lengths: Union[torch.Tensor, Sequence[int]],
                       response_lengths: Union[torch.Tensor, Sequence[int]], temperature: float = 1.0,
                       with_entropy: bool = False, vocab_size: Optional[int] = None) -> ResponseLogProbs:
    """Run ``model`` on prompt+response sequences and return per-token log-probs of the response tokens.

    ``model``: a megatron-core GPTModel, possibly wrapped in DDP / Float16Module. ``tokens``: ``[batch, seq]``
    ids, each row ``prompt + response`` starting at column 0 and right-padded (any pad id) after
    ``total_lengths[i]`` tokens; the last ``response_lengths[i]`` of those are the response. Right padding
    needs no attention mask (the causal mask hides later columns) and positions are ``0..seq-1``.
    The log-prob of the token at position t is read from the logits at position t-1, so each response
    needs a non-empty prompt. ``vocab_size`` defaults to ``model.hf_config.vocab_size`` when the model was
    built by :mod:`hpcrl.train.bridge`. Raises ValueError for inconsistent lengths. The pipeline-stage form
    is :func:`staged_response_log_probs`.
    """
    staged = staged_response_log_probs(model, tokens, total_lengths, response_lengths, temperature, with_entropy,
                                       vocab_size)
    return staged.finish(staged.output)


def staged_response_log_probs(model: torch.nn.Module, tokens: torch.Tensor,
                              total_lengths: Union[torch.Tensor, Sequence[int]],
                              response_lengths: Union[torch.Tensor, Sequence[int]], temperature: float = 1.0,
                              with_entropy: bool = False, vocab_size: Optional[int] = None):
    """:func:`response_log_probs` as a :class:`~hpcrl.train.model.StagedLoss`: the model's output (the logits
    ``[batch, seq, vocab / tp]`` on the last pipeline stage, hidden states on the others) and the function
    that makes the :class:`ResponseLogProbs` from the last stage's."""
    from hpcrl.train.bridge import unwrap_model
    from hpcrl.train.deepseek_moe import padding_kwargs
    from hpcrl.train.model import StagedLoss

    batch, seq = tokens.shape
    device = tokens.device
    total = torch.as_tensor(total_lengths, device=device, dtype=torch.long)
    resp = torch.as_tensor(response_lengths, device=device, dtype=torch.long)
    if total.shape != (batch,) or resp.shape != (batch,):
        raise ValueError(f"total_lengths and response_lengths need shape ({batch},), got "
                         f"{tuple(total.shape)} and {tuple(resp.shape)}")
    if bool((resp < 0).any()) or bool((total - resp < 1).any()) or bool((total > seq).any()):
        raise ValueError("need 0 <= response_length < total_length <= seq (every response needs a prompt)")
    if vocab_size is None:
        hf_config = getattr(unwrap_model(model), "hf_config", None)
        vocab_size = hf_config.vocab_size if hf_config is not None else None

    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    padding = padding_kwargs(model, position_ids < total.unsqueeze(1))  # MoE expert-bias token counts only
    output = model(input_ids=tokens, position_ids=position_ids, attention_mask=None, **padding)

    def finish(logits: torch.Tensor) -> ResponseLogProbs:
        # Predictions for positions 1..seq-1 come from logits at 0..seq-2.
        lp_all = compute_log_probs(logits[:, :-1], tokens[:, 1:], temperature, vocab_size)  # [batch, seq-1]
        index, mask = prediction_columns(total, resp)
        log_probs = torch.gather(lp_all, 1, index).masked_fill(~mask, 0.0)
        entropy = None
        if with_entropy:
            ent_all = compute_entropy(logits[:, :-1], temperature, vocab_size)
            entropy = torch.gather(ent_all, 1, index).masked_fill(~mask, 0.0)
        return ResponseLogProbs(log_probs=log_probs, entropy=entropy, mask=mask)

    return StagedLoss(output, finish)


def logits_window_start(model: torch.nn.Module, mb: Any) -> int:
    """The first sequence column whose logits the micro-batch needs: its earliest response prediction
    (column ``total - response - 1`` of a row; the columns before it only predict prompt tokens). 0 (all
    columns) when the model has no ``output_layer`` (a pipeline stage before the last: its decoder runs the
    whole rows whatever the window)."""
    layer = getattr(model, "output_layer", None)
    if layer is None or mb.tokens.shape[0] == 0:
        return 0
    return max(0, int((mb.total_lengths - mb.response_lengths - 1).min()))


@contextlib.contextmanager
def output_layer_rows(layer: Optional[torch.nn.Module], select: Callable[[torch.Tensor], torch.Tensor]
                      ) -> Iterator[None]:
    """Within the block, the output layer (megatron's ``ColumnParallelLinear``) computes logits only for
    ``select(hidden)``: ``hidden`` its whole ``[s, b, h]`` input, ``select`` slicing or indexing dim 0 (the
    positions that predict response tokens), so logits and their log-softmax are not made for prompt rows.

    Under sequence parallelism the layer's input is this rank's ``s / TP`` positions: the hook gathers the whole
    sequence first (its gradient split back to the rank's positions, not summed) and the layer runs this call
    as a non-sequence-parallel column-parallel layer (``allreduce_dgrad``: its input gradient, partial per rank's
    vocab columns, is summed over TP instead of reduce-scattered), which gives each rank the same gradient for
    its positions as the sequence-parallel layer would."""
    if layer is None:  # a pipeline stage before the last: no output layer
        yield
        return
    sp = bool(getattr(layer, "sequence_parallel", False))

    def keep_rows(module, args, kwargs):
        hidden = args[0]
        if sp:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=layer.tp_group)
        return (select(hidden), *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(keep_rows, with_kwargs=True)
    saved = (layer.sequence_parallel, layer.allreduce_dgrad) if sp else None
    if sp:
        layer.sequence_parallel, layer.allreduce_dgrad = False, True
    try:
        yield
    finally:
        handle.remove()
        if saved is not None:
            layer.sequence_parallel, layer.allreduce_dgrad = saved


def windowed_response_log_probs(model: torch.nn.Module, output_layer: Optional[torch.nn.Module], mb: Any,
                                start: int, temperature: float, with_entropy: bool, vocab_size: int):
    """:func:`hpcrl.train.logprobs.response_log_probs` of a micro-batch with the output layer, log-softmax and
    entropy run only on the columns ``start .. seq-2`` (those that predict response tokens), as a
    :class:`~hpcrl.train.model.StagedLoss` (the model's output, and what makes the :class:`ResponseLogProbs`
    from the last pipeline stage's; ``output_layer`` None on the stages before the last).

    The whole rows still go through the decoder; the output layer gets only the hidden states of those
    columns (``[seq, batch, hidden]`` sliced on the sequence, gathered first under sequence parallelism:
    :func:`output_layer_rows`), so the logits are
    ``[b, seq - 1 - start, vocab]`` instead of ``[b, seq, vocab]``: the same values for the response tokens,
    for a fraction of the time and memory when prompts are long and the vocab large.
    """
    from hpcrl.train import deepseek_moe
    from hpcrl.train.model import StagedLoss

    tokens = mb.tokens
    batch, seq = tokens.shape

    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, -1)
    valid = position_ids < mb.total_lengths.to(tokens.device).unsqueeze(1)
    padding = deepseek_moe.padding_kwargs(model, valid)  # MoE expert-bias token counts only
    with output_layer_rows(output_layer, lambda hidden: hidden[start:seq - 1]):
        output = model(input_ids=tokens, position_ids=position_ids, attention_mask=None, **padding)

    def finish(logits: torch.Tensor) -> ResponseLogProbs:
        # Column start + c predicts token start + c + 1.
        lp_all = compute_log_probs(logits, tokens[:, start + 1:], temperature, vocab_size)
        resp = mb.response_lengths
        width = int(resp.max())
        j = torch.arange(width, device=tokens.device).unsqueeze(0)
        mask = j < resp.unsqueeze(1)
        index = (mb.total_lengths - resp - 1 - start).unsqueeze(1) + j
        index = torch.where(mask, index, torch.zeros_like(index))
        log_probs = torch.gather(lp_all, 1, index).masked_fill(~mask, 0.0)
        entropy = None
        if with_entropy:
            entropy = torch.gather(compute_entropy(logits, temperature, vocab_size), 1, index)
            entropy = entropy.masked_fill(~mask, 0.0)
        return ResponseLogProbs(log_probs=log_probs, entropy=entropy, mask=mask)

    return StagedLoss(output, finish)
