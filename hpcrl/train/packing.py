"""Packed micro-batches: samples back to back in one sequence (THD), no padding, one prompt per group.

The padded micro-batch (:func:`hpcrl.train.actor.build_micro_batch`) is ``[b, T]`` with every sample padded to
the longest; a GRPO group's ``n`` samples also carry ``n`` copies of the same prompt. A :class:`Pack` holds the
same samples as one row of ``T = sum of real tokens`` (slime ``--use-dynamic-batch-size``), in *segments*:

- a sample on its own is one segment (prompt + response), positions ``0 .. L-1``, causal attention inside it;
- a sample made of several sequences (``Sample.segments``: an agent episode split into chains) is one segment
  per sequence, positions restarting at 0 in each; it never shares its prompt;
- with ``share_prompt``, the samples of a micro-batch whose prompt tokens are identical (a group) become one
  *prefix segment* (the prompt once, positions ``0 .. p-1``) and one segment per response (positions
  ``p .. p+r-1``) that attends to the prefix and causally to itself ("Prefix Grouper", arXiv 2506.05433). The
  log-prob of a response's first token is read from the prefix's last row, shared by the group; gradients
  reach the prompt from every response, exactly as through ``n`` copies.

Attention never spans two samples (or two groups): :mod:`hpcrl.train.packed_attention` runs it per segment,
with megatron-core's ``PackedSeqParams`` (``qkv_format="thd"``, ``cu_seqlens`` of the segments) carried
through ``GPTModel``; rotary positions come from :attr:`Pack.positions` (:func:`packed_response_log_probs`).

:func:`plan_micro_batches` splits each optimizer step's samples into micro-batches of at most
``train.max_tokens_per_microbatch`` tokens (slime ``--max-tokens-per-gpu``), the same number on every
data-parallel rank and balanced over them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch
from torch import Tensor

if TYPE_CHECKING:
    from hpcrl.data.sample import Sample


@dataclasses.dataclass
class Pack:
    """The token layout of one packed micro-batch (``T`` tokens in ``S`` segments, ``K`` response tokens)."""

    tokens: Tensor
    """``[1, T]`` token ids, segments back to back (then padding, if any, as a last segment of its own)."""
    positions: Tensor
    """``[T]`` rotary position of each token (restarting per sample; a shared prompt's responses continue
    from the prompt length)."""
    cu_seqlens: Tensor
    """``[S + 1]`` int32 segment boundaries (``cu_seqlens[s] .. cu_seqlens[s+1]``)."""
    prefix_of: tuple[int, ...]
    """``[S]``: the segment whose tokens segment ``s`` also attends to (its group's shared prompt), or -1."""
    logit_rows: Tensor
    """``[K]`` the row whose logits predict each response token, in the order of the micro-batch's
    ``[b, R]`` mask (sample-major)."""
    labels: Tensor
    """``[K]`` the response tokens."""
    num_tokens: int
    """Real tokens ``T`` (without padding)."""
    padded_tokens: int
    """Tokens of the padded layout of the same samples (``b x`` longest sample), for comparison."""
    sources: Optional[Tensor] = None
    """``[T, 2]`` int64: the ``(row, token index)`` each pack token comes from (a shared prompt's from the
    group's first row), ``(-1, -1)`` for padding; used by routing replay."""

    @property
    def max_seqlen(self) -> int:
        """Length of the longest segment (tokens)."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


def prompt_of(sample: "Sample") -> tuple[int, ...]:
    """The sample's prompt tokens (all tokens before the response)."""
    return tuple(sample.tokens[: len(sample.tokens) - sample.response_length])


def _prompt_key(sample: "Sample", i: int, share_prompt: bool) -> tuple:
    """What groups samples that share one prompt segment: the prompt tokens, or ``("own", i)`` for a sample
    that shares nothing (sharing off, or a sample of several segments)."""
    return prompt_of(sample) if share_prompt and len(sample.segments) <= 1 else ("own", i)


def build_pack(rows: Sequence["Sample"], share_prompt: bool = True, pad_to_multiple: int = 1,
               device: torch.device | str = "cpu") -> Pack:
    """Lay out ``rows`` as one :class:`Pack`, in the order of ``rows`` (a group's shared prompt where its first
    sample is, its responses in the order of its samples).

    ``share_prompt``: samples with identical prompt tokens share one prefix segment (only when at least two
    do). ``pad_to_multiple``: pad ``T`` to a multiple of it (sequence parallelism splits the sequence over TP
    ranks) with a segment of zeros that no response reads. Raises ValueError for a sample without a prompt
    token, and what :meth:`~hpcrl.data.sample.Sample.segment_bounds` raises.
    """
    by_prompt: dict[tuple, list[int]] = {}
    keys = []
    for i, s in enumerate(rows):
        if s.response_length >= len(s.tokens) or s.response_length < 0:
            raise ValueError(f"sample {s.index}: response_length {s.response_length} leaves no prompt token in "
                             f"{len(s.tokens)} tokens")
        keys.append(_prompt_key(s, i, share_prompt))
        by_prompt.setdefault(keys[-1], []).append(i)
    tokens: list[int] = []
    sources: list[tuple[int, int]] = []
    positions: list[int] = []
    bounds = [0]
    prefix_of: list[int] = []
    first_row: dict[int, int] = {}  # sample -> pack row of its first response token's prediction
    resp_start: dict[int, int] = {}  # sample -> pack row of its first response token
    done: set[int] = set()
    for i in range(len(rows)):
        if i in done:
            continue
        members = by_prompt[keys[i]]
        done.update(members)
        if len(members) == 1:
            s = rows[i]
            start, p = len(tokens), len(s.tokens) - s.response_length
            sources.extend((i, j) for j in range(len(s.tokens)))
            tokens.extend(s.tokens)
            for a, b in s.segment_bounds():  # one segment per sequence, positions from 0 in each
                positions.extend(range(b - a))
                bounds.append(start + b)
                prefix_of.append(-1)
            first_row[i], resp_start[i] = start + p - 1, start + p
            continue
        prompt = prompt_of(rows[i])
        p = len(prompt)
        sources.extend((i, j) for j in range(p))
        tokens.extend(prompt)
        positions.extend(range(p))
        bounds.append(len(tokens))
        prefix_of.append(-1)
        prefix_seg, last_prompt_row = len(prefix_of) - 1, len(tokens) - 1
        for m in members:
            s = rows[m]
            first_row[m], resp_start[m] = last_prompt_row, len(tokens)
            if s.response_length == 0:
                continue
            sources.extend((m, j) for j in range(p, len(s.tokens)))
            tokens.extend(s.tokens[p:])
            positions.extend(range(p, p + s.response_length))
            bounds.append(len(tokens))
            prefix_of.append(prefix_seg)
    num_tokens = len(tokens)
    pad = (-num_tokens) % pad_to_multiple
    if pad:
        sources.extend([(-1, -1)] * pad)
        tokens.extend([0] * pad)
        positions.extend(range(pad))
        bounds.append(len(tokens))
        prefix_of.append(-1)
    logit_rows, labels = [], []
    for i, s in enumerate(rows):
        for j in range(s.response_length):
            logit_rows.append(first_row[i] if j == 0 else resp_start[i] + j - 1)
            labels.append(s.tokens[len(s.tokens) - s.response_length + j])
    width = max(len(s.tokens) for s in rows)
    t = dict(device=device)
    return Pack(tokens=torch.tensor([tokens], dtype=torch.long, **t),
                positions=torch.tensor(positions, dtype=torch.long, **t),
                cu_seqlens=torch.tensor(bounds, dtype=torch.int32, **t), prefix_of=tuple(prefix_of),
                logit_rows=torch.tensor(logit_rows, dtype=torch.long, **t),
                labels=torch.tensor(labels, dtype=torch.long, **t),
                num_tokens=num_tokens, padded_tokens=width * len(rows),
                sources=torch.tensor(sources, dtype=torch.long, **t).reshape(-1, 2))


def unit_tokens(rows: Sequence["Sample"], share_prompt: bool) -> int:
    """Tokens :func:`build_pack` lays out for ``rows`` of one group (prompt once when shared by >= 2)."""
    if share_prompt and len(rows) > 1 and len({_prompt_key(s, i, True) for i, s in enumerate(rows)}) == 1:
        return len(rows[0].tokens) - rows[0].response_length + sum(s.response_length for s in rows)
    return sum(len(s.tokens) for s in rows)


def plan_micro_batches(samples: Sequence["Sample"], positions: Sequence[int], dp_rank: int, dp_size: int,
                       max_tokens: int, share_prompt: bool = True) -> list[list[int]]:
    """This data-parallel rank's micro-batches (lists of positions into ``samples``) of one optimizer step
    whose samples are ``positions``: each at most ``max_tokens`` tokens as :func:`build_pack` lays them out,
    and **the same number on every rank** (:func:`plan_step_micro_batches` is the whole step's plan).

    Raises ValueError when a sample alone exceeds ``max_tokens`` (names the sample, its length and the
    budget) or when the step has fewer samples than ``dp_size``.
    """
    return plan_step_micro_batches(samples, positions, dp_size, max_tokens, share_prompt)[dp_rank]


def plan_step_micro_batches(samples: Sequence["Sample"], positions: Sequence[int], dp_size: int,
                            max_tokens: int, share_prompt: bool = True) -> list[list[list[int]]]:
    """Every data-parallel rank's micro-batches of one optimizer step (``plan[rank][k]``: positions into
    ``samples``), each at most ``max_tokens`` tokens as :func:`build_pack` lays them out, with **the same
    number of micro-batches on every rank**: a rank with one micro-batch more than another would wait forever
    in the collectives of its extra forward and backward (with expert parallelism every MoE layer is an
    all-to-all over ranks that are data-parallel to each other; megatron-core's schedule needs equal counts
    too).

    Pack first, distribute second, as slime's ``build_dp_schedule`` (``slime/utils/dp_schedule.py``):

    1. Units: with ``share_prompt``, each run of adjacent samples with identical prompts (a group), split into
       chunks that fit ``max_tokens``; otherwise single samples.
    2. The step's units fill micro-batches first-fit, longest first (one rank: the plan it always had).
    3. While the count is not a multiple of ``dp_size``, the micro-batch with the most tokens that holds more
       than one sample is split in two (its units between the halves, longest first to the lighter; a single
       group chunk by its samples). This always succeeds when the step's sample count is a multiple of
       ``dp_size`` (an RL step's is: ``rollout.batch_size`` groups of ``n_samples_per_prompt``, checked against
       the ranks; SFT's ``sft.batch_size`` too): single samples are a multiple. Otherwise it may, or it raises.
    4. Micro-batches go to ranks longest first, each to the least-loaded rank that has fewer than its share
       (ties: the lowest rank), so ranks get about equal tokens (within one micro-batch).

    The plan depends only on the samples' lengths and prompts, so every rank computes the same one. The
    step-wide loss reductions do not depend on it (their denominators are the step's, not a micro-batch's).
    Raises ValueError as :func:`plan_micro_batches`, and when no split is left and the count is still not a
    multiple of ``dp_size`` (names the samples, the budget and the fix).
    """
    if len(positions) < dp_size:
        raise ValueError(f"{len(positions)} samples per optimizer step cannot feed {dp_size} data-parallel ranks")
    units: list[list[int]] = []
    for p in positions:
        s = samples[p]
        if len(s.tokens) > max_tokens:
            raise ValueError(f"sample {s.index} has {len(s.tokens)} tokens (prompt + response), more than "
                             f"train.max_tokens_per_microbatch={max_tokens}")
        last = units[-1] if units else None
        if (share_prompt and last and _prompt_key(samples[last[0]], last[0], True) == _prompt_key(s, p, True)
                and unit_tokens([samples[q] for q in last + [p]], True) <= max_tokens):
            last.append(p)
        else:
            units.append([p])

    def cost(unit: list[int]) -> int:
        return unit_tokens([samples[q] for q in unit], share_prompt)

    # 2. first-fit, longest unit first
    bins: list[list[list[int]]] = []  # each micro-batch as its units
    fill: list[int] = []
    for unit in sorted(units, key=lambda u: (-cost(u), u[0])):
        c = cost(unit)
        for b in range(len(bins)):
            if fill[b] + c <= max_tokens:
                bins[b].append(unit)
                fill[b] += c
                break
        else:
            bins.append([unit])
            fill.append(c)
    # 3. split the fullest splittable micro-batch until every rank can have the same count
    while len(bins) % dp_size:
        splittable = [b for b in range(len(bins)) if sum(len(u) for u in bins[b]) > 1]
        if not splittable:  # one sample a micro-batch and still no multiple: the step's count is not one
            raise ValueError(f"{len(positions)} samples in {len(bins)} micro-batches of at most {max_tokens} "
                             f"tokens cannot be shared equally by {dp_size} data-parallel ranks; make the "
                             f"samples per optimizer step a multiple of {dp_size}")
        b = max(splittable, key=lambda k: (fill[k], -min(u[0] for u in bins[k])))
        parts = bins[b] if len(bins[b]) > 1 else [bins[b][0][:len(bins[b][0]) // 2],
                                                    bins[b][0][len(bins[b][0]) // 2:]]
        halves: list[list[list[int]]] = [[], []]
        loads = [0, 0]
        for unit in sorted(parts, key=lambda u: (-cost(u), u[0])):
            h = 0 if loads[0] <= loads[1] else 1
            halves[h].append(unit)
            loads[h] += cost(unit)
        bins[b:b + 1] = halves
        fill[b:b + 1] = loads
    # 4. equal counts, balanced tokens
    share = len(bins) // dp_size
    plan: list[list[list[int]]] = [[] for _ in range(dp_size)]
    rank_load = [0] * dp_size
    for b in sorted(range(len(bins)), key=lambda k: (-fill[k], min(u[0] for u in bins[k]))):
        r = min((k for k in range(dp_size) if len(plan[k]) < share), key=lambda k: (rank_load[k], k))
        plan[r].append(sorted(p for unit in bins[b] for p in unit))
        rank_load[r] += fill[b]
    return [sorted(mbs, key=lambda mb: mb[0]) for mbs in plan]


@contextlib.contextmanager
def rotary_positions(model: torch.nn.Module, positions: Tensor) -> Iterator[None]:
    """While active, ``model.rotary_pos_emb`` (megatron-core's ``RotaryEmbedding``; with multi-latent attention
    each layer's ``self_attention.rotary_pos_emb``, YaRN's table with its mscale) returns the embedding of
    each token's own position, ``[T, 1, 1, dim]`` rows of its usual table: with ``T == cu_seqlens[-1]``,
    megatron's THD rotary path maps token ``t`` to row ``t`` (its "exact mapping with offsets"), so positions
    may restart per sample or continue after a shared prompt. The table is megatron's own (``get_emb`` of
    ``max(positions) + 1``), so a position gets the very values it would in a padded forward."""
    # multi-latent attention (hpcrl.train.mla) has no model-level table: each layer's attention holds its own
    rotaries = ([model.rotary_pos_emb] if getattr(model, "rotary_pos_emb", None) is not None
                else [layer.self_attention.rotary_pos_emb for layer in model.decoder.layers])

    def per_token(module, args, output):
        table = output[0] if isinstance(output, tuple) else output  # YaRN returns (table, mscale)
        if table.shape[0] <= int(positions.max()):
            raise RuntimeError(f"rotary table of {table.shape[0]} rows for position {int(positions.max())}")
        rows = table.index_select(0, positions.to(table.device))
        return (rows, *output[1:]) if isinstance(output, tuple) else rows

    handles = [rotary.register_forward_hook(per_token) for rotary in rotaries]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def packed_seq_params(pack: Pack):
    """megatron-core ``PackedSeqParams`` (``thd``) for ``pack``, with ``prefix_of`` attached for
    :class:`~hpcrl.train.packed_attention.PackedDotProductAttention`. ``max_seqlen_q/kv`` is the largest
    position + 1: megatron sizes its rotary table by it (see :func:`rotary_positions`).

    ``cu_seqlens_q/kv_padded`` (which megatron's attention prefers for rotary embedding, and nothing else reads
    in our layer spec) span the pack as one sequence ``[0, T]``: the rotary rows are already per token, so
    megatron's THD rotary path applies them in one call instead of slicing them segment by segment in Python
    (the same values; a pack holds up to hundreds of segments, and the slices cost ~5% of the tiny model's
    training step). Attention reads the segments from ``cu_seqlens_q``."""
    from hpcrl.train.packed_attention import SharedPrefixSeqParams

    span = int(pack.positions.max()) + 1
    whole = torch.tensor([0, int(pack.cu_seqlens[-1])], dtype=pack.cu_seqlens.dtype, device=pack.cu_seqlens.device)
    return SharedPrefixSeqParams(qkv_format="thd", cu_seqlens_q=pack.cu_seqlens, cu_seqlens_kv=pack.cu_seqlens,
                                 cu_seqlens_q_padded=whole, cu_seqlens_kv_padded=whole,
                                 max_seqlen_q=span, max_seqlen_kv=span, prefix_of=pack.prefix_of)


def packed_response_log_probs(model: torch.nn.Module, pack: Pack, response_lengths: Tensor, temperature: float,
                              with_entropy: bool = False, vocab_size: Optional[int] = None):
    """Per-token log-probs (and entropy) of the response tokens of a packed micro-batch, as a
    :class:`~hpcrl.train.model.StagedLoss`: the model's output and what makes the
    :class:`~hpcrl.train.logprobs.ResponseLogProbs` from the last pipeline stage's.

    ``model``: the (wrapped) GPTModel, built with :func:`hpcrl.train.packed_attention.layer_spec`.
    ``response_lengths``: ``[b]`` of the pack's samples, in order (``K`` tokens in all). The decoder runs once over the pack; the output
    layer, log-softmax and entropy only over the ``K`` rows that predict response tokens (no logits for prompt
    positions; under sequence parallelism the rows are gathered first: :func:`hpcrl.train.logprobs.
    output_layer_rows`). The result's tensors are ``[b, R]`` float32, 0 beyond each response.
    ``vocab_size`` defaults to ``hf_config.vocab_size`` of a model built by :mod:`hpcrl.train.bridge` (padded
    vocab columns get probability 0, as in :func:`~hpcrl.train.logprobs.response_log_probs`). Under context
    parallelism the rank runs its rows of the pack and makes its share of the predictions; the result is the
    whole micro-batch's on every CP rank (:mod:`hpcrl.train.context_parallel`).
    """
    from hpcrl.train.bridge import unwrap_model
    from hpcrl.train.deepseek_moe import padding_kwargs
    from hpcrl.train.logprobs import ResponseLogProbs, compute_entropy, compute_log_probs, output_layer_rows
    from hpcrl.train.model import StagedLoss

    from hpcrl.train import context_parallel as cpar

    bare = unwrap_model(model)
    if vocab_size is None and getattr(bare, "hf_config", None) is not None:
        vocab_size = bare.hf_config.vocab_size
    params = packed_seq_params(pack)
    local = cpar.local_pack(pack, params)  # this CP rank's rows and response predictions (all without CP)
    rows = local.rows
    labels = pack.labels if local.where is None else pack.labels[local.where[local.rank]]
    with output_layer_rows(getattr(bare, "output_layer", None), lambda hidden: hidden.index_select(0, rows)), \
            rotary_positions(bare, pack.positions):
        output = model(input_ids=local.tokens, position_ids=local.positions.unsqueeze(0), attention_mask=None,
                       packed_seq_params=params, **padding_kwargs(model, local.valid))

    def finish(logits: Tensor) -> ResponseLogProbs:
        width = int(response_lengths.max()) if response_lengths.numel() else 0
        mask = (torch.arange(width, device=rows.device).unsqueeze(0)
                < response_lengths.to(rows.device).unsqueeze(1))
        flat_lp = compute_log_probs(logits, labels.unsqueeze(0), temperature, vocab_size)[0]  # [K] or [K_rank]
        flat_ent = compute_entropy(logits, temperature, vocab_size)[0] if with_entropy else None
        k = pack.logit_rows.numel()  # every CP rank's predictions, in the micro-batch's order
        flat_lp, flat_ent = local.gathered(flat_lp, k), local.gathered(flat_ent, k)
        zeros = torch.zeros(mask.shape, dtype=flat_lp.dtype, device=flat_lp.device)
        log_probs = zeros.masked_scatter(mask, flat_lp)
        entropy = zeros.masked_scatter(mask, flat_ent) if with_entropy else None
        return ResponseLogProbs(log_probs=log_probs, entropy=entropy, mask=mask)

    return StagedLoss(output, finish)
