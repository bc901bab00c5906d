"""KV-cache helpers of the scheduler (:mod:`hpcrl.engine.scheduler`): an empty cache for a model, the left
padding that lets rows of different lengths share one batch, and rows joining and leaving a batch."""

from __future__ import annotations

import torch


def new_cache(config):
    """An empty KV cache for ``config``; a sliding-window model's (Mistral, Mixtral) has whole-length layers:
    transformers' attention mask applies the window whatever the cache holds, and whole layers can be merged
    and trimmed (continuous batching), where its sliding-window layers could not."""
    from transformers import DynamicCache

    sliding = getattr(config, "model_type", None) in ("mistral", "mixtral") and config.sliding_window
    return DynamicCache() if sliding else DynamicCache(config=config)


def pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad ``[batch, heads, len, dim]`` with zeros to ``width`` along ``len``."""
    extra = width - x.shape[2]
    if extra <= 0:
        return x
    pad = torch.zeros((x.shape[0], x.shape[1], extra, x.shape[3]), dtype=x.dtype, device=x.device)
    return torch.cat([pad, x], dim=2)


def pad_mask(m: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad a ``[rows, len]`` attention mask with zeros to ``width`` columns."""
    extra = width - m.shape[1]
    if extra <= 0:
        return m
    return torch.cat([torch.zeros((m.shape[0], extra), dtype=m.dtype), m], dim=1)


def append_rows(cache, mask: torch.Tensor, more_cache, more_mask: torch.Tensor) -> torch.Tensor:
    """Append the rows of ``more_cache`` (its ``[rows, len]`` mask ``more_mask``) to ``cache`` in place, the
    shorter of the two left-padded to the longer; returns the joined mask."""
    width = max(mask.shape[1], more_mask.shape[1])
    for mine, theirs in zip(cache.layers, more_cache.layers):
        k1, v1 = pad_left(mine.keys, width), pad_left(mine.values, width)
        k2, v2 = pad_left(theirs.keys, width), pad_left(theirs.values, width)
        mine.keys, mine.values = torch.cat([k1, k2], 0), torch.cat([v1, v2], 0)
    return torch.cat([pad_mask(mask, width), pad_mask(more_mask, width)], 0)


def keep_rows(cache, mask: torch.Tensor, keep: list[int], trim: bool) -> torch.Tensor:
    """Keep rows ``keep`` of ``cache`` in place and, with ``trim``, drop the leading columns no kept row uses
    (all padding); returns the kept rows' mask."""
    sel = torch.tensor(keep, dtype=torch.long)
    cache.batch_select_indices(sel)
    mask = mask.index_select(0, sel)
    used = mask.any(dim=0).nonzero()
    first = int(used[0].item()) if used.numel() else 0
    if first > 0 and trim:
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, first:, :]
            layer.values = layer.values[:, :, first:, :]
        mask = mask[:, first:]
    return mask
