"""Rollout routing replay (R3): the trainer's MoE forward routes each token to the experts the engine chose.

A MoE policy's router is a discontinuous function of the hidden state: a rounding difference between the
rollout engine (another precision, other kernels) and the trainer flips some tokens' top-k choice, and the
trainer then computes the log-prob of a different network than the one that sampled. Rollout routing replay
(slime ``--use-rollout-routing-replay``; "R3" in the papers) takes the experts the engine returned for every
token (SGLang's ``return_routed_experts``, :mod:`hpcrl.engine.routing`) and makes the trainer's routers use
them: the routing weights are still the trainer's own softmax, over the replayed experts, so gradients reach the
router as before.

This module uses megatron-core's own mechanism (``transformer.moe.router_replay.RouterReplay``, built when
``moe_enable_routing_replay`` is set): one instance per MoE layer in a class-level list (megatron's global
state), target indices ``[tokens, top_k]`` per layer in the router's token order, which is the decoder's
sequence-first order: position-major over the batch (``s * b + i``) for padded ``[b, s]`` input, the pack's
token order for packed (THD) input.

- :func:`padded_indices` / :func:`packed_indices`: the replay tensor ``[tokens, layers, top_k]`` of a micro-batch
  from its samples' routed experts (each ``[len(tokens) - 1, layers, top_k]``: every token but the last, which
  the engine never fed; the last token and padding get experts ``0..top_k-1``, whose outputs no response
  log-prob depends on).
- :func:`replaying`: a context manager that sets the targets and the replay action for one forward.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor


def moe_layer_count(config) -> int:
    """MoE layers of a megatron-core ``TransformerConfig``: the 1s of ``moe_layer_freq`` when it is a list
    (GLM-4.5's first ``first_k_dense_replace`` layers are dense), every ``moe_layer_freq``-th layer when it is
    an int; 0 for a dense model. The routed experts' ``layers`` axis has this many entries, in layer order."""
    return sum(moe_layer_flags(config))


def moe_layer_flags(config) -> list[bool]:
    """Whether each of the model's ``num_layers`` decoder layers is a MoE layer (:func:`moe_layer_count`'s
    rule); all False for a dense model."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, list):
        return [bool(f) for f in freq]
    return [i % int(freq) == 0 for i in range(config.num_layers)]


def filler(tokens: int, layers: int, top_k: int) -> Tensor:
    """int64 ``[tokens, layers, top_k]`` of experts ``0..top_k-1``: the routing of positions nothing reads."""
    return torch.arange(top_k, dtype=torch.long).expand(tokens, layers, top_k).clone()


def _rows(routed: Tensor, n: int, layers: int, top_k: int) -> Tensor:
    """``[n, layers, top_k]`` for a sample of ``n`` tokens: its routed experts for tokens ``0..n-2``, filler for
    the last. Raises ValueError for a routing of another shape."""
    if tuple(routed.shape) != (n - 1, layers, top_k):
        raise ValueError(f"routed experts of shape {tuple(routed.shape)} for a sample of {n} tokens; "
                         f"expected {(n - 1, layers, top_k)}")
    out = filler(n, layers, top_k)
    out[: n - 1] = routed.to(torch.long)
    return out


def padded_indices(routed: Sequence[Tensor], lengths: Sequence[int], width: int, layers: int,
                   top_k: int) -> Tensor:
    """The replay tensor of a right-padded ``[b, width]`` batch: int64 ``[width * b, layers, top_k]`` in
    megatron's sequence-first order (position-major). ``routed[i]``: sample i's ``[lengths[i] - 1, layers,
    top_k]``. Raises ValueError for a routing whose shape does not fit its sample."""
    b = len(lengths)
    out = filler(b * width, layers, top_k).view(width, b, layers, top_k)
    for i, (r, n) in enumerate(zip(routed, lengths, strict=True)):
        out[:n, i] = _rows(r, n, layers, top_k)
    return out.reshape(width * b, layers, top_k)


def packed_indices(routed: Sequence[Tensor], sources: Tensor, layers: int, top_k: int) -> Tensor:
    """The replay tensor of a pack: int64 ``[T, layers, top_k]`` where ``sources`` ``[T, 2]`` gives, per pack
    token, ``(sample, token index)`` in ``routed`` (``(-1, -1)`` for padding). ``routed[i]``: sample i's
    ``[len(tokens_i) - 1, layers, top_k]``; a token index past its routing (the last token) gets filler."""
    out = filler(sources.shape[0], layers, top_k)
    for i, r in enumerate(routed):
        r = r.to(torch.long)
        rows = ((sources[:, 0] == i) & (sources[:, 1] < r.shape[0])).nonzero().squeeze(1)
        out[rows] = r[sources[rows, 1]]
    return out


def sequence_shard(indices: Tensor, rank: int, size: int) -> Tensor:
    """The rows of a replay tensor ``[tokens, layers, top_k]`` that tensor-parallel rank ``rank`` of ``size``
    routes under sequence parallelism: megatron scatters the decoder's ``[s, b, h]`` input along ``s`` in
    ``size`` equal parts, so in the sequence-first token order (position-major, or the pack's order) each
    rank's tokens are one contiguous ``tokens / size`` block. Raises ValueError when ``tokens`` is not a
    multiple of ``size`` (micro-batches are padded to one: :func:`hpcrl.train.actor.build_steps`)."""
    if indices.shape[0] % size:
        raise ValueError(f"{indices.shape[0]} tokens cannot be split over {size} sequence-parallel ranks")
    return indices.chunk(size, dim=0)[rank]


@contextlib.contextmanager
def replaying(indices: Optional[Tensor], config=None) -> Iterator[None]:
    """Within the block, every MoE router of the model (built with ``moe_enable_routing_replay``) routes the
    forward's tokens to ``indices`` int64 ``[tokens, layers, top_k]`` (layer order of the model). None: nothing
    replayed. ``config``: the model's ``TransformerConfig``; each rank then replays its own part
    (:func:`local_indices`: its pipeline stage's MoE layers, its context-parallel rows of a pack, its
    sequence-parallel block). Raises ValueError when the model has another number of MoE layers."""
    if indices is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    if config is not None:
        indices = local_indices(indices, config)

    RouterReplay.set_replay_data([indices[:, layer].contiguous() for layer in range(indices.shape[1])])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()


def stage_moe_layers(config) -> list[int]:
    """The indices, on the routed experts' ``layers`` axis (every MoE layer of the model in order), of this
    pipeline stage's MoE layers (:func:`hpcrl.train.parallel.stage_layers`); all of them without pipelines."""
    from hpcrl.train.parallel import stage_layers

    first, count = stage_layers(config)
    moe_layers = [layer for layer, is_moe in enumerate(moe_layer_flags(config)) if is_moe]
    return [index for index, layer in enumerate(moe_layers) if first <= layer < first + count]


def local_indices(indices: Tensor, config) -> Tensor:
    """The part of a micro-batch's replay tensor ``[tokens, layers, top_k]`` this rank's routers route: the
    MoE layers of its pipeline stage (:func:`stage_moe_layers`), the pack rows of its context-parallel rank
    (:func:`hpcrl.train.context_parallel.local_rows`, the pack's tokens in order), then its sequence-parallel
    block (:func:`sequence_shard`). Everything without those parallelisms."""
    from megatron.core import parallel_state

    if config.pipeline_model_parallel_size > 1:
        indices = indices[:, stage_moe_layers(config)]
    cp = config.context_parallel_size
    if cp > 1:
        from hpcrl.train.context_parallel import local_rows

        indices = indices[local_rows(indices.shape[0], cp, parallel_state.get_context_parallel_rank())]
    if getattr(config, "sequence_parallel", False):
        indices = sequence_shard(indices, parallel_state.get_tensor_model_parallel_rank(),
                                 parallel_state.get_tensor_model_parallel_world_size())
    return indices


def reset() -> None:
    """Forget megatron-core's router-replay instances of earlier models in this process (call before building
    a model with ``moe_enable_routing_replay``: the class-level list must hold exactly its layers)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
