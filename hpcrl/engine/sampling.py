"""Log-probs and token sampling for one decode step, following SGLang's sampler.

Log-probs are ``log_softmax(logits / temperature)`` taken before top-k/top-p/min-p filtering, as SGLang
returns them by default; temperature 0 means greedy, and its log-probs use temperature 1. Sampling filters the
temperature-scaled probabilities with top-k, then top-p, then min-p (SGLang's order) and draws one token per
row by inverse CDF from a single uniform number of that row's own ``torch.Generator``, so a seeded row gives
the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

GREEDY_EPS = 1e-6
"""Temperatures below this are greedy (SGLang's ``_SAMPLING_EPS``)."""


def effective_temperature(temperature: float) -> float:
    """The temperature used for log-probs and sampling: 1.0 for greedy requests, else ``temperature``."""
    return 1.0 if temperature < GREEDY_EPS else float(temperature)


def compute_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled log-probs.

    ``logits``: ``[batch, vocab]`` (any float dtype; computed in fp32). ``temperatures``: ``[batch]``
    effective temperatures (> 0, see :func:`effective_temperature`). Returns fp32 ``[batch, vocab]``.
    """
    return torch.log_softmax(logits.float() / temperatures.float().unsqueeze(-1), dim=-1)


def sample_tokens(logprobs: torch.Tensor, greedy: list[bool], top_k: list[int], top_p: list[float],
                  min_p: list[float], generators: list[torch.Generator]) -> list[int]:
    """Draw one token id per row.

    ``logprobs``: ``[batch, vocab]`` from :func:`compute_logprobs`. ``greedy[i]``: take the argmax.
    ``top_k[i]``: keep the k most likely tokens (``>= vocab`` or -1 keeps all). ``top_p[i]``: keep the
    smallest prefix of the sorted distribution whose mass before a token is <= top_p. ``min_p[i]``: drop
    tokens below min_p times the most likely probability. ``generators[i]``: consumed by exactly one
    ``torch.rand`` draw per sampled (non-greedy) row. Returns ``batch`` token ids.
    """
    batch, vocab = logprobs.shape
    out = [0] * batch
    sample_rows = [i for i in range(batch) if not greedy[i]]
    if len(sample_rows) < batch:
        argmax = logprobs.argmax(dim=-1).tolist()
        for i in range(batch):
            if greedy[i]:
                out[i] = argmax[i]
    if not sample_rows:
        return out
    idx = torch.tensor(sample_rows, dtype=torch.long)
    probs = logprobs.index_select(0, idx).exp()
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    cum = probs_sort.cumsum(dim=-1)
    ks = torch.tensor([vocab if (top_k[i] < 0 or top_k[i] >= vocab) else top_k[i] for i in sample_rows])
    ps = torch.tensor([top_p[i] for i in sample_rows], dtype=probs.dtype)
    mps = torch.tensor([min_p[i] for i in sample_rows], dtype=probs.dtype)
    ranks = torch.arange(vocab).unsqueeze(0)
    probs_sort = probs_sort.masked_fill(ranks >= ks.unsqueeze(-1), 0.0)
    probs_sort = probs_sort.masked_fill((cum - probs_sort) > ps.unsqueeze(-1), 0.0)
    if bool((mps > 0).any()):
        thresholds = (probs_sort[:, 0] * mps).unsqueeze(-1)
        probs_sort = probs_sort.masked_fill(probs_sort < thresholds, 0.0)
    kept_cum = probs_sort.cumsum(dim=-1)
    # One uniform per row from its own generator, scaled by the row's kept mass (in double, then rounded to
    # the cumsum's dtype), and all rows' inverse-CDF positions in one searchsorted.
    totals = kept_cum[:, -1].tolist()
    targets = [torch.rand((), generator=generators[i], dtype=torch.float64).item() * totals[j]
               for j, i in enumerate(sample_rows)]
    u = torch.tensor(targets, dtype=kept_cum.dtype).unsqueeze(1)
    pos = torch.searchsorted(kept_cum, u, right=True).clamp_(max=vocab - 1)
    positions = pos.squeeze(1).tolist()
    zero = (probs_sort.gather(1, pos).squeeze(1) == 0).tolist()
    for j in range(len(sample_rows)):
        if zero[j]:  # round-off at the top end: step back to a kept token
            p = positions[j]
            while p > 0 and probs_sort[j, p] == 0:
                p -= 1
            positions[j] = p
    tokens = probs_idx.gather(1, torch.tensor(positions, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
    for j, i in enumerate(sample_rows):
        out[i] = int(tokens[j])
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The ``k`` largest log-probs per row of ``[rows, vocab]``: (values, token ids), each ``rows`` lists of
    ``k``."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])], [[] for _ in range(logprobs.shape[0])]
    vals, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return vals.tolist(), ids.tolist()
