"""Loss reductions: how a step's per-token values ``[B, T]`` become one scalar, additive over micro-batches.

slime: ``get_sum_of_sample_mean`` (``slime/backends/megatron_utils/loss.py``; ``--calculate-per-token-loss``);
veRL: ``agg_loss`` (``loss_agg_mode``: ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``
with ``loss_scale_factor``). ``algorithm.loss_reduction`` picks one (:func:`step_reducers`). Every reduction
takes step-wide denominators (the step's sample count, token count, per-rollout token counts, a constant),
so the reductions of a step's micro-batches, and of its data-parallel ranks, sum to the reduction of the
whole step: the gradient does not depend on how the step is split. Re-exported by
:mod:`hpcrl.train.algorithms`.

Shapes: ``B`` samples, ``T`` the padded response length; ``mask`` is the loss mask (1.0 on tokens that train).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from hpcrl.names import LOSS_REDUCTIONS, LossReduction

if TYPE_CHECKING:
    from hpcrl.config import Config

Tensor = torch.Tensor
Reducer = Callable[[Tensor], Tensor]
"""A reduction of one (micro-)batch: ``[B, T] -> scalar``."""
ReductionKind = LossReduction


def compute_rollout_mask_sums(masks: Union[Sequence[Tensor], Tensor],
                              rollout_ids: Sequence[int]) -> dict[int, float]:
    """Total mask tokens per rollout id, over every sample of the step (slime's ``rollout_mask_sums``).

    Compute once per step, before splitting into micro-batches. masks: list of ``[len_i]`` or ``[B, T]``;
    rollout_ids: ``B`` ints (samples split from one trajectory share an id; otherwise one id per sample).
    """
    sums: dict[int, float] = {}
    for m, rid in zip(masks, rollout_ids, strict=True):
        sums[int(rid)] = sums.get(int(rid), 0.0) + float(m.sum())
    return sums


def rollout_token_mean(values: Tensor, mask: Tensor, rollout_ids: Union[Sequence[int], Tensor],
                       rollout_mask_sums: dict[int, float]) -> Tensor:
    """Per-rollout token mean, averaged over the step's rollouts (slime's default reduction).

    slime: ``get_sum_of_sample_mean`` with per-rollout ``sample_denoms``: each sample's masked sum is divided
    by the total mask tokens of all samples sharing its rollout id (``rollout_mask_sums``, precomputed
    step-wide) and these are summed. That sum is then divided by ``len(rollout_mask_sums)``, the number of
    rollouts in the step, which plays the part of slime's ``num_microbatches / step_global_batch_size`` loss
    scale (identical when each rollout is one sample, slime's default; slime divides by samples, not rollouts,
    otherwise). The result is the mean over the step's rollouts of each rollout's token mean.

    Micro-batches: both denominators are step-wide constants, so the function is a plain sum over samples;
    splitting a step into micro-batches (any split, even one that separates a rollout's samples) and summing
    the micro-batch results gives exactly the full-batch value. Gradient accumulation with ``loss.backward()``
    per micro-batch, with no division by the number of micro-batches, therefore equals one big batch. With
    data parallelism, pass each rank its own rollouts' sums; DDP's gradient average then weighs ranks equally
    (multiply by the DP size, as slime does, to get a sum over ranks instead).

    values, mask: ``[B, T]``; rollout_ids: ``B`` ints, each a key of ``rollout_mask_sums``. Returns a scalar.
    """
    ids = rollout_ids.tolist() if isinstance(rollout_ids, Tensor) else list(rollout_ids)
    denom = torch.tensor([rollout_mask_sums[int(r)] for r in ids], dtype=values.dtype, device=values.device)
    per_sample = (values * mask.to(values.dtype)).sum(-1) / denom.clamp_min(1.0)
    return per_sample.sum() / max(len(rollout_mask_sums), 1)


def sequence_mean(values: Tensor, mask: Tensor, num_samples: Optional[int] = None) -> Tensor:
    """Mean over samples of each sample's masked token mean (slime's legacy ``get_sum_of_sample_mean``).

    Each sample: ``sum(v * m) / max(sum(m), 1)``; summed and divided by ``num_samples`` (default ``B``). Pass
    the step's sample count when reducing a micro-batch: the micro-batch results then add up to the full-batch
    one. values, mask: ``[B, T]``. Returns a scalar.
    """
    mask = mask.to(values.dtype)
    per_sample = (values * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    return per_sample.sum() / (values.shape[0] if num_samples is None else num_samples)


def token_mean(values: Tensor, mask: Tensor, num_tokens: Optional[float] = None) -> Tensor:
    """Mean over all mask tokens: ``sum(v * m) / num_tokens`` (slime's ``--calculate-per-token-loss``).

    ``num_tokens`` defaults to ``sum(m)``; pass the step's mask-token total when reducing a micro-batch so
    that the micro-batch results add up to the full-batch one. values, mask: ``[B, T]``. Returns a scalar.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum()
    if num_tokens is None:
        return total / mask.sum().clamp_min(1.0)
    return total / max(float(num_tokens), 1.0)


def seq_mean_token_sum(values: Tensor, mask: Tensor, num_samples: Optional[int] = None,
                       loss_scale_factor: float = 1.0) -> Tensor:
    """Mean over samples of each sample's masked token *sum*, divided by a constant number of tokens.

    Each sample: ``sum(v * m)``; summed and divided by ``num_samples * loss_scale_factor`` (``num_samples``
    defaults to ``B``). ``loss_scale_factor == 1``: veRL's ``loss_agg_mode: seq-mean-token-sum``; a constant
    generation budget (``algorithm.loss_scale_factor``, default ``rollout.max_new_tokens``): veRL's
    ``seq-mean-token-sum-norm`` (``loss_scale_factor``), Dr. GRPO's unbiased normaliser (Liu et al. 2025,
    "Understanding R1-Zero-Like Training", arXiv 2503.20783: no ``1/|o_i|`` length bias). Pass the step's
    sample count when reducing a micro-batch: the micro-batch results then add up to the full-batch one.
    values, mask: ``[B, T]``. Returns a scalar. Raises ValueError for ``loss_scale_factor <= 0``.
    """
    if not loss_scale_factor > 0:
        raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
    total = (values * mask.to(values.dtype)).sum()
    count = values.shape[0] if num_samples is None else num_samples
    return total / (max(count, 1) * float(loss_scale_factor))


def make_reducer(kind: ReductionKind, mask: Tensor, *, rollout_ids: Union[Sequence[int], Tensor, None] = None,
                 rollout_mask_sums: Optional[dict[int, float]] = None, num_samples: Optional[int] = None,
                 num_tokens: Optional[float] = None, loss_scale_factor: Optional[float] = None) -> Reducer:
    """A function ``[B, T] -> scalar`` for one (micro-)batch, like the closure slime's
    ``get_sum_of_sample_mean`` returns. The same reducer serves the loss terms and the metrics.

    kind (``algorithm.loss_reduction``): ``rollout_token_mean`` (default in slime; needs ``rollout_ids`` and
    the step-wide ``rollout_mask_sums``), ``sequence_mean`` (``num_samples``: the step's sample count),
    ``token_mean`` (``num_tokens``: the step's mask-token count), ``seq_mean_token_sum`` (``num_samples``) or
    ``seq_mean_token_sum_norm`` (``num_samples`` and the constant ``loss_scale_factor``, required). With the
    step-wide denominators given, the reductions of the micro-batches of a step sum to the reduction of the
    whole step (see :func:`rollout_token_mean`); :func:`step_reducers` derives them. Raises ValueError for an
    unknown kind or a missing argument.
    """
    if kind == "rollout_token_mean":
        if rollout_ids is None or rollout_mask_sums is None:
            raise ValueError("rollout_token_mean needs rollout_ids and rollout_mask_sums")
        return lambda v: rollout_token_mean(v, mask, rollout_ids, rollout_mask_sums)
    if kind == "sequence_mean":
        return lambda v: sequence_mean(v, mask, num_samples)
    if kind == "token_mean":
        return lambda v: token_mean(v, mask, num_tokens)
    if kind == "seq_mean_token_sum":
        return lambda v: seq_mean_token_sum(v, mask, num_samples)
    if kind == "seq_mean_token_sum_norm":
        if loss_scale_factor is None:
            raise ValueError("seq_mean_token_sum_norm needs loss_scale_factor")
        return lambda v: seq_mean_token_sum(v, mask, num_samples, loss_scale_factor)
    raise ValueError(f"unknown reduction {kind!r}; expected one of {', '.join(LOSS_REDUCTIONS)}")


def step_reducers(cfg: "Config", mask: Tensor, rollout_ids: Union[Sequence[int], Tensor],
                  rollout_mask_sums: dict[int, float]) -> tuple[Reducer, Reducer]:
    """``(loss, metrics)`` reducers of one micro-batch of a step, every denominator step-wide.

    ``loss`` is ``cfg.algorithm.loss_reduction`` (:func:`make_reducer`); ``metrics`` is always
    ``rollout_token_mean`` (each sample's token mean, averaged), so logged values such as ``pg_clipfrac`` keep
    their meaning whatever the loss reduction (with the default they are the same reducer). The denominators
    come from ``rollout_mask_sums`` (:func:`compute_rollout_mask_sums` over all samples of the step, on every
    data-parallel rank): the sample count is its number of entries (the actor gives each sample its own
    rollout id) and the token count the sum of its values; ``seq_mean_token_sum_norm``'s constant is
    ``cfg.algorithm.loss_scale_factor`` or else ``cfg.rollout.max_new_tokens``. Summed over the micro-batches
    and data-parallel ranks of a step (the actor's ``loss * dp_size`` under DDP's gradient average), each
    reduction gives the whole step's value, however the step is split.

    mask: ``[b, T]``; rollout_ids: ``b`` keys of ``rollout_mask_sums``.
    """
    alg = cfg.algorithm
    metrics = make_reducer("rollout_token_mean", mask, rollout_ids=rollout_ids,
                           rollout_mask_sums=rollout_mask_sums)
    if alg.loss_reduction == "rollout_token_mean":
        return metrics, metrics
    scale = alg.loss_scale_factor if alg.loss_scale_factor is not None else cfg.rollout.max_new_tokens
    loss = make_reducer(alg.loss_reduction, mask, rollout_ids=rollout_ids,
                        rollout_mask_sums=rollout_mask_sums, num_samples=len(rollout_mask_sums),
                        num_tokens=sum(rollout_mask_sums.values()), loss_scale_factor=scale)
    return loss, metrics
