"""The parts of a rollout's training that need forward passes before the advantages: the KL penalty in the
reward (``algorithm.kl_coef``, for ``gae`` and the REINFORCE++ estimators) and PPO's critic (``gae``:
values -> GAE advantages and returns -> the critic's optimizer steps).

:meth:`hpcrl.train.actor.Actor.train` builds its micro-batches with zero advantages, recomputes the old and
the reference log-probs, takes every sample's values from its critic (``Critic.sample_values``: on the
actor's ranks, or on ranks of its own through :class:`hpcrl.train.critic_group.RemoteCritic`), then calls
:func:`shaped_advantages`, which fills every micro-batch's ``advantages`` ``[b, R]`` and returns every
sample's GAE returns, the critic's targets (``Critic.begin_train``). The advantages are computed over the
whole rollout on every rank as for the other estimators (whitening uses every sample), so the per-sample KL
of this rank's micro-batches is gathered over the data-parallel ranks first
(:func:`hpcrl.train.parallel.gather_per_sample`).

Sources: slime ``compute_advantages_and_returns`` (``--kl-coef`` with ``compute_approx_kl(log_probs,
ref_log_probs, --kl-loss-type)``, ``--advantage-estimator ppo``), veRL ``apply_kl_penalty`` and
``compute_gae_advantage_return``; the maths are in :mod:`hpcrl.train.gae` and
:mod:`hpcrl.train.algorithms`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from hpcrl.train import algorithms, gae
from hpcrl.train.parallel import gather_per_sample

if TYPE_CHECKING:
    from hpcrl.config import Config

Tensor = torch.Tensor


def _padded(rows: Sequence[Tensor]) -> Tensor:
    """``[N, T]`` of ``[len_i]`` rows, right-padded with 0."""
    width = max((int(r.numel()) for r in rows), default=0)
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def _write_advantages(flat: Sequence[Any], advantages: Sequence[Tensor]) -> None:
    """Copy each sample's ``[len_i]`` advantages into its micro-batch's ``advantages`` row."""
    for mb in flat:
        for i, (p, n) in enumerate(zip(mb.positions, mb.response_lengths.tolist(), strict=True)):
            mb.advantages[i, :n] = advantages[p].to(mb.advantages)


def shaped_advantages(cfg: "Config", flat: Sequence[Any], rewards: Tensor, masks: Sequence[Tensor],
                      values: Optional[Sequence[Tensor]], group: Any, dp_size: int
                      ) -> tuple[dict[str, float], Optional[list[Tensor]]]:
    """Fill each micro-batch's ``advantages`` ``[b, R]`` from rewards, the KL penalty and the critic's values.

    ``flat``: this rank's micro-batches, with ``old_log_probs`` and ``ref_log_probs`` when
    ``algorithm.kl_coef > 0``; ``rewards``: ``[N]`` of all samples; ``masks``: their ``[len_i]`` loss masks;
    ``values``: with a critic, every sample's ``[len_i]`` values before this rollout's critic steps
    (``Critic.sample_values``), else None. KL: ``approx_kl(old, ref, algorithm.kl_loss_type)`` per token.
    Without a critic: :func:`~hpcrl.train.algorithms.compute_advantages` with that KL and ``kl_coef``
    (REINFORCE++). With one: :func:`~hpcrl.train.gae.token_rewards` ->
    :func:`~hpcrl.train.gae.gae_advantages_and_returns` (``gamma``, ``lam``) ->
    :func:`~hpcrl.train.algorithms.masked_whiten` over all samples' mask tokens unless
    ``algorithm.normalize_advantages`` is false. Collective over ``group`` (the KL gather).

    Returns ``(metrics, returns)``: with a critic ``critic/explained_variance`` (of ``values``, over all
    samples), ``critic/values_mean`` and ``critic/returns_mean`` (mask-token means), and every sample's
    ``[len_i]`` GAE returns (the critic's regression targets); without, ``({}, None)``. A sample without
    loss-mask token (an empty response) gets advantage and return 0 (it trains nothing). Raises ValueError
    when the KL penalty lacks log-probs.
    """
    alg = cfg.algorithm
    n = len(masks)
    kl = None
    if alg.kl_coef > 0:
        if any(mb.old_log_probs is None or mb.ref_log_probs is None for mb in flat):
            raise ValueError("algorithm.kl_coef needs the recomputed old and the reference log-probs")
        per_mb = [algorithms.approx_kl(mb.old_log_probs, mb.ref_log_probs, alg.kl_loss_type) * mb.mask
                  for mb in flat]
        kl = gather_per_sample(flat, per_mb, n, group, dp_size)
    if values is None:
        _write_advantages(flat, algorithms.compute_advantages(
            alg.advantage_estimator, rewards, list(masks), cfg.rollout.n_samples_per_prompt, kl=kl, cfg=alg,
            kl_coef=alg.kl_coef))
        return {}, None
    mask = _padded(masks)
    values_t = _padded(values)
    # a sample without loss-mask token (an empty response) trains nothing: it has no token for its reward
    live = mask.sum(-1) > 0
    per_token = torch.zeros_like(mask)
    kl_t = _padded(kl)[live] if kl is not None else None
    if bool(live.any()):
        per_token[live] = gae.token_rewards(rewards[live], mask[live], kl_t, alg.kl_coef)
    adv, returns = gae.gae_advantages_and_returns(per_token, values_t, mask, alg.gamma, alg.lam)
    count = float(mask.sum().clamp_min(1.0))
    metrics = {"critic/explained_variance": gae.explained_variance(values_t, returns, mask),
               "critic/values_mean": float((values_t * mask).sum()) / count,
               "critic/returns_mean": float((returns * mask).sum()) / count}
    if alg.normalize_advantages is not False and bool(mask.sum() > 0):  # (all responses empty: none trains)
        adv = algorithms.masked_whiten(adv, mask) * mask
    _write_advantages(flat, [adv[i, : len(m)] for i, m in enumerate(masks)])
    return metrics, [returns[i, : len(m)].clone() for i, m in enumerate(masks)]
