"""Context parallelism without TransformerEngine: a packed micro-batch split over the CP ranks, keys and values
gathered for attention, log-probs gathered for the loss.

megatron-core's context parallelism lives in TransformerEngine's attention (ring or all-gather over the CP
group); its local ``DotProductAttention``, what runs on CPU and what hpcrl's packed attention extends, refuses
it. hpcrl's is the all-gather kind, on its packed (THD) micro-batches (:mod:`hpcrl.train.packing`):

- the pack of ``T`` tokens (padded to a multiple of ``2 x CP``, times TP under sequence parallelism) is cut
  into ``2 x CP`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r`` (:func:`local_rows`):
  megatron's load-balanced ("zigzag") split, made over the whole pack as one sequence. That is the split
  megatron's THD rotary embedding applies when the pack's ``cu_seqlens_q_padded`` is ``[0, T]`` (as
  :func:`hpcrl.train.packing.packed_seq_params` sets it), so each rank's tokens get their own positions' rotary
  rows. A long sample is split over the ranks like one sequence in megatron; many short ones are spread
  evenly;
- every layer runs on the rank's ``T / CP`` tokens; attention gathers the keys and values of all ``T`` tokens
  over the CP group (:func:`gather_rows`, the backward summing each rank's part of their gradient) and
  computes this rank's queries against them with the segments', shared prompts' and sliding windows' masks on
  global rows (:func:`hpcrl.train.packed_attention.plan_segments` with ``q_rows``);
- the output layer makes logits only for the response predictions among the rank's rows; their log-probs (and
  entropy) are gathered in the micro-batch's order (:func:`gather_rows` without the gradient sum: every CP
  rank then computes the same loss, and each back-propagates only its own tokens' part), so the loss
  functions see the whole ``[b, R]`` as without CP. megatron-core's DDP averages gradients over the
  data-parallel x context-parallel ranks: the losses are multiplied by both sizes (:func:`loss_scale`).

Shapes: ``T`` pack rows, ``CP`` context-parallel ranks, ``T / CP`` rows per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


def local_rows(total: int, cp: int, rank: int, device: Any = None) -> Tensor:
    """The pack rows ``[total / cp]`` (ascending) CP rank ``rank`` of ``cp`` holds: chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp`` equal chunks (megatron's load-balanced split). ``arange(total)`` at
    ``cp == 1``. Raises ValueError when ``total`` is not a multiple of ``2 cp``."""
    if cp == 1:
        return torch.arange(total, device=device)
    if total % (2 * cp):
        raise ValueError(f"a pack of {total} tokens cannot be split into {2 * cp} equal chunks for context "
                         f"parallel size {cp}: pad it to a multiple of {2 * cp}")
    c = total // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def context_parallel() -> tuple[int, int, Any]:
    """``(size, rank, group)`` of this rank's context-parallel group (megatron-core's parallel state);
    ``(1, 0, None)`` without one."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0, None
    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return 1, 0, None
    return size, parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_group()


def loss_scale(dp_size: int) -> int:
    """What a loss normalised over the whole step is multiplied by before backward: the data-parallel size
    times the context-parallel size (megatron-core's DDP divides the summed gradients by both; slime's
    ``loss *= dp_size`` with CP inside its data-parallel group). ``dp_size`` without context parallelism."""
    return dp_size * context_parallel()[0]


class _GatherRows(torch.autograd.Function):
    """:func:`gather_rows` with its gradient (see there)."""

    @staticmethod
    def forward(ctx, local: Tensor, rows: tuple[Tensor, ...], rank: int, total: int, group: Any,
                reduce_grad: bool) -> Tensor:
        most = max(int(r.numel()) for r in rows)
        padded = local.new_zeros((most, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded.contiguous(), group=group)
        out = local.new_zeros((total, *local.shape[1:]))
        for part, r in zip(parts, rows):
            out[r] = part[: r.numel()]
        ctx.own, ctx.group, ctx.reduce_grad = rows[rank], group, reduce_grad
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.reduce_grad:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.own], None, None, None, None, None


def gather_rows(local: Tensor, rows: tuple[Tensor, ...], rank: int, total: int, group: Any,
                reduce_grad: bool) -> Tensor:
    """The ``[total, ...]`` tensor whose rows ``rows[r]`` are CP rank ``r``'s ``local`` ``[len(rows[r]),
    ...]`` (an all-gather over ``group``, padded to the longest part: gloo gathers equal sizes only); rows no
    rank holds are 0. Backward: with ``reduce_grad`` (keys and values, which every rank's queries read) the
    gradient is summed over the ranks before each takes its rows; without (log-probs from which every rank
    computes the same loss) each rank takes its rows of its own gradient."""
    return _GatherRows.apply(local, tuple(rows), rank, total, group, reduce_grad)


def split_predictions(logit_rows: Tensor, rows_of: tuple[Tensor, ...], rank: int
                      ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Which response predictions each CP rank makes: ``(local, where)``. ``logit_rows`` ``[K]``: the pack row
    whose logits predict each response token; ``rows_of[r]``: rank ``r``'s pack rows (:func:`local_rows`).
    ``local`` ``[K_rank]``: this rank's predictions as indices into its own rows (the output layer's input);
    ``where[r]``: the indices into ``[K]`` of rank ``r``'s predictions, in the order it makes them."""
    total = int(max(int(r.max()) for r in rows_of if r.numel()) + 1)
    owner = torch.empty(total, dtype=torch.long, device=logit_rows.device)
    position = torch.empty(total, dtype=torch.long, device=logit_rows.device)
    for r, rows in enumerate(rows_of):
        owner[rows] = r
        position[rows] = torch.arange(rows.numel(), device=logit_rows.device)
    who = owner[logit_rows]
    where = tuple(torch.nonzero(who == r).flatten() for r in range(len(rows_of)))
    return position[logit_rows[where[rank]]], where


def all_rows(total: int, cp: int, device: Any = None) -> tuple[Tensor, ...]:
    """Every CP rank's :func:`local_rows` of a ``total``-row pack, rank order."""
    return tuple(local_rows(total, cp, r, device) for r in range(cp))


@dataclass
class LocalPack:
    """A packed micro-batch's forward inputs on this CP rank (:func:`local_pack`): ``T`` pack rows, ``K``
    response predictions; without context parallelism the whole pack."""

    tokens: Tensor
    """``[1, T / CP]`` token ids of this rank's rows."""
    positions: Tensor
    """``[T / CP]`` their rotary positions."""
    valid: Tensor
    """``[1, T / CP]`` bool: a real token (not padding)."""
    rows: Tensor
    """``[K_rank]`` this rank's response predictions, as indices into its rows (the output layer's input)."""
    where: Optional[tuple[Tensor, ...]]
    """Each CP rank's predictions as indices into ``[K]`` (None without context parallelism)."""
    size: int
    rank: int
    group: Any

    def gathered(self, values: Optional[Tensor], k: int) -> Optional[Tensor]:
        """This rank's per-prediction ``values`` ``[K_rank]`` (log-probs, entropy, values) as the micro-batch's
        ``[K]`` on every CP rank (:func:`gather_rows` without the gradient sum); themselves without context
        parallelism; None stays None."""
        if values is None or self.where is None:
            return values
        return gather_rows(values, self.where, self.rank, k, self.group, reduce_grad=False)


def local_pack(pack: Any, params: Any) -> LocalPack:
    """This CP rank's part of ``pack`` (a :class:`hpcrl.train.packing.Pack`), and ``params`` (its
    :func:`~hpcrl.train.packing.packed_seq_params`) told every rank's rows (``cp_rows``, read by the packed
    attention). The whole pack without context parallelism."""
    tokens, positions, valid = pack.tokens, pack.positions, (pack.sources[:, 0] >= 0).unsqueeze(0)
    size, rank, group = context_parallel()
    if size == 1:
        return LocalPack(tokens, positions, valid, pack.logit_rows, None, 1, 0, None)
    params.cp_rows = all_rows(tokens.shape[1], size, tokens.device)
    mine = params.cp_rows[rank]
    rows, where = split_predictions(pack.logit_rows, params.cp_rows, rank)
    return LocalPack(tokens[:, mine], positions[mine], valid[:, mine], rows, where, size, rank, group)
