"""KV-cache helpers of the scheduler (:mod:`hpcrl.engine.scheduler`): an empty cache for a model, and the left
padding that lets rows of different lengths share one batch."""

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
