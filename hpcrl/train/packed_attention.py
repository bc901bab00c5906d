"""Core attention over packed (THD) micro-batches, per segment: megatron-core's local layer spec with
:class:`PackedDotProductAttention` in place of its ``DotProductAttention``.

megatron-core 0.16.1's ``DotProductAttention`` (the local spec, what runs on CPU) asserts
``packed_seq_params is None``; TransformerEngine's THD attention needs TE and a GPU, and knows nothing of shared
prompts. :class:`PackedDotProductAttention` is megatron's ``DotProductAttention`` (unchanged, bitwise, for
padded ``[s, b, ...]`` input) that also takes THD input ``[T, heads, dim]`` with :class:`SharedPrefixSeqParams`:

- a segment without prefix attends causally to itself;
- a segment with a prefix (a response of a shared prompt, :mod:`hpcrl.train.packing`) attends to all of the
  prefix and causally to itself: keys and values are the prefix's followed by its own, the causal mask aligned
  bottom-right.

Cost is per segment (``L x (p + L)`` scores), never a block-diagonal mask over the whole pack. On CPU (or
without flash-attn) the segments are gathered into (at most two) padded batches, one
``torch.nn.functional.scaled_dot_product_attention`` call each; on a GPU
with ``flash_attn`` installed, one ``flash_attn_varlen_func`` call over all segments with the prefixes'
keys/values gathered in front of each response (bottom-right causal). The GPU path is unverified until run on
one (docs/gpu-verification.md).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor


@dataclasses.dataclass
class SharedPrefixSeqParams(PackedSeqParams):
    """megatron-core's ``PackedSeqParams`` plus, per segment, the segment it also attends to."""

    prefix_of: tuple[int, ...] = ()
    """``[S]``: index of the prefix segment of segment ``s`` (its group's shared prompt), or -1."""
    plan: Optional[tuple] = None
    """:func:`plan_segments` of this layout, made by the first layer and reused by the others."""
    plan_window: Optional[int] = None
    """The sliding window :attr:`plan` was made for (None: full causal attention)."""
    cp_rows: Optional[tuple[Tensor, ...]] = None
    """Under context parallelism, every CP rank's pack rows (:func:`hpcrl.train.context_parallel.local_rows`,
    rank order); the attention input holds this rank's. None: the whole pack is here."""


def _kv_rows(cu: list[int], prefix_of: tuple[int, ...], s: int) -> tuple[int, int, int, int]:
    """``(prefix_start, prefix_end, start, end)`` rows of segment ``s`` (an empty prefix when it has none)."""
    a, b = cu[s], cu[s + 1]
    k = prefix_of[s] if s < len(prefix_of) else -1
    return (cu[k], cu[k + 1], a, b) if k >= 0 else (a, a, a, b)


@dataclasses.dataclass
class _SegmentBatch:
    """Segments of one kind (with or without a prefix) gathered into a padded batch of ``n`` segments."""

    q_index: Tensor
    """``[n, Lq]`` pack rows of each segment's queries (0 where padded)."""
    q_valid: Tensor
    """``[n, Lq]`` bool: a real query row."""
    kv_index: Tensor
    """``[n, Lk]`` pack rows of its keys/values: the prefix's, then its own (0 where padded)."""
    mask: Tensor
    """``[n, 1, Lq, Lk]`` bool: which keys each query sees (prefix, then causal; a padded query row sees key 0
    only, so that no softmax row is empty; its output is dropped)."""


def plan_segments(cu_seqlens: Tensor, prefix_of: tuple[int, ...],
                  window: Optional[int] = None, q_rows: Optional[Tensor] = None
                  ) -> tuple[list[_SegmentBatch], Tensor]:
    """Gather plan of :func:`segment_attention`: one :class:`_SegmentBatch` for the segments without a prefix and
    one for those with (each padded to its own longest), and the inverse permutation ``[Tq]`` that puts their
    real query rows back in the query tensor's order. Built with whole-tensor ops (no per-segment loop): a pack
    holds up to hundreds of segments and the plan is made once per forward. ``window``: sliding-window
    attention (Mistral's ``sliding_window``, HF's ``kv_idx > q_idx - window`` in positions): a query at
    position ``p + i`` (a response continues its prefix's positions) sees keys at positions ``> p + i -
    window`` only. ``q_rows``: the pack rows ``[Tq]`` (ascending) the queries are, under context parallelism
    (:mod:`hpcrl.train.context_parallel`; keys and values are then the whole pack's); None: every row, in
    order."""
    cu = cu_seqlens.tolist()
    device = cu_seqlens.device
    total = int(cu[-1])
    rows_q = torch.arange(total) if q_rows is None else q_rows.cpu()
    kinds: dict[bool, list[tuple[int, int, int, int]]] = {}
    for s in range(len(cu) - 1):
        rows = _kv_rows(cu, prefix_of, s)
        if rows[3] > rows[2]:
            kinds.setdefault(rows[1] > rows[0], []).append(rows)
    batches, order = [], []
    for segs in kinds.values():
        pa, pb, a, b = torch.tensor(segs, dtype=torch.long).unbind(1)  # each [n]
        p, L = (pb - pa)[:, None], (b - a)[:, None]  # [n, 1]
        # the query rows of each segment: a contiguous run of the ascending rows_q (all L of them without CP)
        lo = torch.searchsorted(rows_q, a)[:, None]
        nq = torch.searchsorted(rows_q, b)[:, None] - lo  # [n, 1]
        if int(nq.max()) == 0:
            continue
        lq, lk = int(nq.max()), int((p + L).max())
        t = torch.arange(lq)[None, :]  # the segment's t-th query, [1, Lq]
        j = torch.arange(lk)[None, :]  # key row: the prefix's (j < p), then its own
        q_valid = t < nq  # [n, Lq]
        q_index = torch.where(q_valid, lo + t, 0)  # into the query tensor
        i = torch.where(q_valid, rows_q[q_index] - a[:, None], 0)  # the query's row within its segment
        own = (j >= p) & (j < p + L)
        kv_index = torch.where(j < p, pa[:, None] + j, torch.where(own, a[:, None] + j - p, 0))
        qi, kj = i[:, :, None], j[:, None, :]  # [n, Lq, 1], [1, 1, Lk]
        valid = q_valid[:, :, None]
        mask = valid & ((kj < p[:, :, None]) | (own[:, None, :] & (kj - p[:, :, None] <= qi)))
        if window is not None:  # key row j is at position j (prefix, then own rows), query row i at p + i
            mask &= kj > p[:, :, None] + qi - window
        mask |= ~valid & (kj == 0)  # a padded query row sees key 0 only: no empty softmax row
        order.append(q_index[q_valid])
        batches.append(_SegmentBatch(q_index.to(device), q_valid.to(device), kv_index.to(device),
                                     mask[:, None].to(device)))
    inverse = torch.empty(rows_q.numel(), dtype=torch.long)
    inverse[torch.cat(order)] = torch.arange(rows_q.numel())
    return batches, inverse.to(device)


def segment_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor,
                      prefix_of: tuple[int, ...], scale: float, dropout_p: float = 0.0,
                      plan: Optional[tuple[list[_SegmentBatch], Tensor]] = None,
                      window: Optional[int] = None) -> Tensor:
    """Attention of THD tensors per segment, with :class:`SharedPrefixSeqParams` semantics.

    ``query``, ``key``: ``[T, heads, dim]``, ``[T, groups, dim]``; ``value``: ``[T, groups, v_dim]``
    (grouped-query attention: ``heads`` a multiple of ``groups``; ``v_dim`` may differ from ``dim``, as in
    multi-latent attention); ``cu_seqlens``: ``[S + 1]``. Returns ``[T, heads, v_dim]``. The segments
    of each kind (with, without a prefix) run as one batched ``scaled_dot_product_attention`` of
    ``[segments, heads, longest, longest keys]`` scores: the cost is per segment, padded to the longest segment
    of its kind, never ``T x T``. ``plan``: :func:`plan_segments` of the same layout and ``window`` (reused
    across layers); ``window``: sliding-window size (:func:`plan_segments`), None for full causal attention.
    """
    batches, inverse = plan if plan is not None else plan_segments(cu_seqlens, prefix_of, window)
    heads, groups, dim = query.shape[1], key.shape[1], query.shape[2]
    v_dim = value.shape[2]  # multi-latent attention: v heads narrower than q/k heads
    rep = heads // groups
    outs = []
    for sb in batches:
        n, lq = sb.q_index.shape
        # Grouped-query attention without copying keys/values per head: the ``rep`` query heads of a key/value
        # group are folded into the query length ([n, groups, rep * Lq, dim]; megatron orders a group's query
        # heads next to each other), so each query row meets its group's keys once; the mask is tiled over rep.
        q = query[sb.q_index].view(n, lq, groups, rep, dim).permute(0, 2, 3, 1, 4).reshape(n, groups, rep * lq, dim)
        k = key[sb.kv_index].transpose(1, 2)  # [n, groups, Lk, dim]
        v = value[sb.kv_index].transpose(1, 2)
        mask = sb.mask if rep == 1 else sb.mask.repeat(1, 1, rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        o = o.view(n, groups, rep, lq, v_dim).permute(0, 3, 1, 2, 4).reshape(n, lq, heads, v_dim)
        outs.append(o[sb.q_valid])  # [real rows, heads, dim]
    return torch.cat(outs).index_select(0, inverse)


def _flash_varlen(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, prefix_of: tuple[int, ...],
                  scale: float, dropout_p: float, window: Optional[int] = None) -> Tensor:
    """:func:`segment_attention` with flash-attn's varlen kernel (GPU; unverified): keys/values of each
    segment are its prefix's followed by its own, ``cu_seqlens_k`` over that gathered layout."""
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.tolist()
    index, cu_k = [], [0]
    for s in range(len(cu) - 1):
        pa, pb, a, b = _kv_rows(cu, prefix_of, s)
        index.extend(range(pa, pb))
        index.extend(range(a, b))
        cu_k.append(len(index))
    idx = torch.tensor(index, device=key.device)
    k, v = key.index_select(0, idx), value.index_select(0, idx)
    v_dim = v.shape[-1]
    if v_dim < query.shape[-1]:  # flash-attn 2 needs one head size: pad v, cut the output (as TE does)
        v = F.pad(v, (0, query.shape[-1] - v_dim))
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=key.device)
    lens_q = [cu[s + 1] - cu[s] for s in range(len(cu) - 1)]
    lens_k = [cu_k[s + 1] - cu_k[s] for s in range(len(cu_k) - 1)]
    out = flash_attn_varlen_func(query, k, v, cu_seqlens.to(torch.int32), cu_k_t, max(lens_q), max(lens_k),
                                 dropout_p=dropout_p, softmax_scale=scale, causal=True,
                                 window_size=(-1, -1) if window is None else (window - 1, 0))
    return out[..., :v_dim]


class PackedDotProductAttention(DotProductAttention):
    """megatron-core ``DotProductAttention`` that also runs packed THD micro-batches (module docstring).

    Padded input (``packed_seq_params`` None) goes to megatron's own forward, unchanged. THD input:
    ``query`` ``[T, heads/tp, dim]``, ``key``/``value`` ``[T, groups/tp, dim]``, ``packed_seq_params`` a
    :class:`SharedPrefixSeqParams` (or a plain ``PackedSeqParams``: no prefixes); returns ``[T, heads/tp * dim]``.
    Raises ValueError for a ``qkv_format`` other than ``thd``.

    ``k_channels`` / ``v_channels`` (megatron-core's MLA passes them, its local ``DotProductAttention`` takes
    neither): the q/k and v head sizes when they differ; the output is ``heads/tp * v_channels`` wide.
    """

    def __init__(self, config, *args, k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 **kwargs):
        # megatron's DotProductAttention refuses context parallelism (only TransformerEngine's has it); this
        # class has its own (packed micro-batches: hpcrl.train.context_parallel), so it is built from a copy
        # of the config that says 1, then keeps the real one
        one = copy.copy(config)
        one.context_parallel_size = 1
        super().__init__(one, *args, **kwargs)
        self.config = config
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type=None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention needs qkv_format 'thd', got {packed_seq_params.qkv_format!r}")
        prefix_of = getattr(packed_seq_params, "prefix_of", ())
        dropout_p = self.attention_dropout.p if self.training else 0.0
        window = self._window()
        q_rows = None
        if getattr(packed_seq_params, "cp_rows", None) is not None:
            # context parallelism: this rank's queries against the whole pack's keys and values
            key, value, q_rows = self._gather_context(key, value, packed_seq_params)
        if query.is_cuda and _has_flash_attn() and q_rows is None:
            out = _flash_varlen(query, key, value, packed_seq_params.cu_seqlens_q, prefix_of, self.softmax_scale,
                                dropout_p, window)
        else:
            plan = getattr(packed_seq_params, "plan", None)
            if plan is None or getattr(packed_seq_params, "plan_window", None) != window:
                plan = plan_segments(packed_seq_params.cu_seqlens_q, prefix_of, window, q_rows=q_rows)
                if isinstance(packed_seq_params, SharedPrefixSeqParams):
                    packed_seq_params.plan, packed_seq_params.plan_window = plan, window  # the next layers'
            out = segment_attention(query, key, value, packed_seq_params.cu_seqlens_q, prefix_of,
                                    self.softmax_scale, dropout_p, plan=plan, window=window)
        return out.reshape(out.shape[0], -1)

    @staticmethod
    def _gather_context(key: Tensor, value: Tensor, params: "SharedPrefixSeqParams"
                        ) -> tuple[Tensor, Tensor, Tensor]:
        """Under context parallelism: the keys and values of every CP rank gathered into pack order
        (:func:`hpcrl.train.context_parallel.gather_rows`, their gradient summed back over the ranks), ``[T,
        groups/tp, dim]`` each, and this rank's query rows ``[T / CP]`` (the masks are on global rows:
        :func:`plan_segments` with ``q_rows``)."""
        from hpcrl.train.context_parallel import context_parallel, gather_rows

        _, rank, group = context_parallel()
        total = int(params.cu_seqlens_q[-1])
        return (gather_rows(key, params.cp_rows, rank, total, group, reduce_grad=True),
                gather_rows(value, params.cp_rows, rank, total, group, reduce_grad=True), params.cp_rows[rank])

    def _window(self) -> Optional[int]:
        """This layer's sliding window in HF's terms (keys within ``window`` positions, itself included), from
        megatron's ``window_size`` ``(left, right)`` as :func:`hpcrl.train.hf_config.mcore_config_from_hf`
        sets it (``(window - 1, 0)``); None without one. Raises NotImplementedError for a ``right`` other
        than 0 (keys after the query)."""
        from megatron.core.transformer.utils import is_layer_window_attention

        size = self.config.window_size
        if not is_layer_window_attention(size, self.config.window_attn_skip_freq, self.layer_number):
            return None
        left, right = size
        if right != 0:
            raise NotImplementedError(f"window_size={tuple(size)}: packed attention is causal (right must be "
                                      "0)")
        return None if left < 0 else int(left) + 1


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(qk_layernorm: bool, num_experts: Optional[int] = None):
    """megatron-core's local GPT layer spec (RMSNorm) with :class:`PackedDotProductAttention` as core
    attention: padded forwards are megatron's own, packed ones run per segment. With ``num_experts`` the MLP
    is megatron-core's MoE layer with ``SequentialMLP`` experts (no grouped GEMM, no TransformerEngine). Its
    norms are :mod:`hpcrl.train.norms`' (the same torch modules as megatron's ``WrappedTorchNorm``, which
    refuses sequence parallelism)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                    normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    use_sequence_parallel_norms(spec)
    return spec


def use_sequence_parallel_norms(spec: Any) -> None:
    """Swap the torch norms of a megatron-core layer ``spec`` (local layer spec: ``WrappedTorchNorm``) for
    :class:`hpcrl.train.norms.SequenceParallelNorm` (input and pre-MLP norms) and
    :class:`hpcrl.train.norms.HeadNorm` (q/k norms), in place; ``IdentityOp`` entries stay."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from hpcrl.train.norms import HeadNorm, SequenceParallelNorm

    sub = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, name, None) is WrappedTorchNorm:
            setattr(sub, name, SequenceParallelNorm)
    attention = sub.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name, None) is WrappedTorchNorm:
            setattr(attention, name, HeadNorm)
