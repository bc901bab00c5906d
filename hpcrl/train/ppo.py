"""The parts of a rollout's training that need forward passes before the advantages: the KL penalty in the
reward (``algorithm.kl_coef``, for ``gae`` and the REINFORCE++ estimators) and PPO's critic (``gae``:
values -> GAE advantages and returns -> the critic's optimizer steps).

:meth:`hpcrl.train.actor.Actor.train` builds its micro-batches with zero advantages, recomputes the old and
the reference log-probs, then calls :func:`shaped_advantages`, which fills every micro-batch's ``advantages``
``[b, R]``; after the actor's optimizer steps it calls :func:`critic_steps`. The advantages are computed over
the whole rollout on every rank as for the other estimators (whitening uses every sample), so the per-sample
inputs (KL, values) of this rank's micro-batches are gathered over the data-parallel ranks first
(:func:`gather_per_sample`).

Sources: slime ``compute_advantages_and_returns`` (``--kl-coef`` with ``compute_approx_kl(log_probs,
ref_log_probs, --kl-loss-type)``, ``--advantage-estimator ppo``), veRL ``apply_kl_penalty`` and
``compute_gae_advantage_return``; the maths are in :mod:`hpcrl.train.gae` and
:mod:`hpcrl.train.algorithms`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from hpcrl.train import algorithms, gae
from hpcrl.train.critic import ValueTargets

if TYPE_CHECKING:
    from hpcrl.config import Config
    from hpcrl.train.critic import Critic

Tensor = torch.Tensor


def gather_per_sample(flat: Sequence[Any], per_mb: Sequence[Tensor], num_samples: int, group: Any,
                      dp_size: int) -> list[Tensor]:
    """Every sample's row of per-micro-batch tensors, on every data-parallel rank.

    ``flat``: this rank's micro-batches (their ``positions`` and ``response_lengths``); ``per_mb``: one
    ``[b, R]`` tensor per micro-batch. Returns ``[response_length]`` float32 CPU tensors for positions ``0 ..
    num_samples-1`` (``all_gather_object`` over ``group`` when ``dp_size > 1``; the data-parallel ranks'
    micro-batches together hold every sample once). Raises RuntimeError when a position is missing.
    """
    local: dict[int, Tensor] = {}
    for mb, t in zip(flat, per_mb, strict=True):
        for i, (p, n) in enumerate(zip(mb.positions, mb.response_lengths.tolist(), strict=True)):
            local[p] = t[i, :n].detach().float().cpu()
    if dp_size > 1:
        parts: list[Optional[dict[int, Tensor]]] = [None] * dp_size
        torch.distributed.all_gather_object(parts, local, group=group)
        for part in parts:
            local.update(part or {})
    missing = [p for p in range(num_samples) if p not in local]
    if missing:
        raise RuntimeError(f"samples {missing[:8]} are in no data-parallel rank's micro-batches")
    return [local[p] for p in range(num_samples)]


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
                      critic: Optional["Critic"], group: Any, dp_size: int
                      ) -> tuple[dict[str, float], Optional[list[ValueTargets]]]:
    """Fill each micro-batch's ``advantages`` ``[b, R]`` from rewards, the KL penalty and the critic.

    ``flat``: this rank's micro-batches, with ``old_log_probs`` and ``ref_log_probs`` when
    ``algorithm.kl_coef > 0``; ``rewards``: ``[N]`` of all samples; ``masks``: their ``[len_i]`` loss masks.
    KL: ``approx_kl(old, ref, algorithm.kl_loss_type)`` per token. Without a critic:
    :func:`~hpcrl.train.algorithms.compute_advantages` with that KL and ``kl_coef`` (REINFORCE++). With one:
    its values -> :func:`~hpcrl.train.gae.token_rewards` ->
    :func:`~hpcrl.train.gae.gae_advantages_and_returns` (``gamma``, ``lam``) ->
    :func:`~hpcrl.train.algorithms.masked_whiten` over all samples' mask tokens unless
    ``algorithm.normalize_advantages`` is false. Collective over ``group``.

    Returns ``(metrics, targets)``: with a critic ``critic/explained_variance`` (of the values before this
    rollout's critic steps, over all samples), ``critic/values_mean`` and ``critic/returns_mean`` (mask-token
    means), ``critic/seconds`` (this call's wall time), and one :class:`~hpcrl.train.critic.ValueTargets` per
    micro-batch of ``flat``; without, ``({}, None)``. A sample without loss-mask token (an empty response)
    gets advantage and return 0 (it trains nothing). Raises ValueError when the KL penalty lacks log-probs.
    """
    t0 = time.perf_counter()
    alg = cfg.algorithm
    n = len(masks)
    kl = None
    if alg.kl_coef > 0:
        if any(mb.old_log_probs is None or mb.ref_log_probs is None for mb in flat):
            raise ValueError("algorithm.kl_coef needs the recomputed old and the reference log-probs")
        per_mb = [algorithms.approx_kl(mb.old_log_probs, mb.ref_log_probs, alg.kl_loss_type) * mb.mask
                  for mb in flat]
        kl = gather_per_sample(flat, per_mb, n, group, dp_size)
    if critic is None:
        _write_advantages(flat, algorithms.compute_advantages(
            alg.advantage_estimator, rewards, list(masks), cfg.rollout.n_samples_per_prompt, kl=kl, cfg=alg,
            kl_coef=alg.kl_coef))
        return {}, None
    local_values = critic.values(flat)
    mask = _padded(masks)
    values = _padded(gather_per_sample(flat, local_values, n, group, dp_size))
    # a sample without loss-mask token (an empty response) trains nothing: it has no token for its reward
    live = mask.sum(-1) > 0
    per_token = torch.zeros_like(mask)
    kl_t = _padded(kl)[live] if kl is not None else None
    if bool(live.any()):
        per_token[live] = gae.token_rewards(rewards[live], mask[live], kl_t, alg.kl_coef)
    adv, returns = gae.gae_advantages_and_returns(per_token, values, mask, alg.gamma, alg.lam)
    count = float(mask.sum().clamp_min(1.0))
    metrics = {"critic/explained_variance": gae.explained_variance(values, returns, mask),
               "critic/values_mean": float((values * mask).sum()) / count,
               "critic/returns_mean": float((returns * mask).sum()) / count}
    if alg.normalize_advantages is not False and bool(mask.sum() > 0):  # (all responses empty: none trains)
        adv = algorithms.masked_whiten(adv, mask) * mask
    _write_advantages(flat, [adv[i, : len(m)] for i, m in enumerate(masks)])
    targets = []
    for mb, v in zip(flat, local_values, strict=True):
        rows = torch.zeros_like(v)
        for i, (p, k) in enumerate(zip(mb.positions, mb.response_lengths.tolist(), strict=True)):
            rows[i, :k] = returns[p, :k].to(rows)
        targets.append(ValueTargets(old_values=v, returns=rows))
    metrics["critic/seconds"] = time.perf_counter() - t0
    return metrics, targets


def critic_steps(critic: "Critic", steps: Sequence[Sequence[Any]], targets: Sequence[ValueTargets],
                 reducers: Sequence[Callable[[Any], Any]], first_step: int, seconds: float = 0.0
                 ) -> dict[str, float]:
    """The critic's optimizer steps over the actor's step split: step ``k`` trains on ``steps[k]`` (this
    rank's micro-batches) with ``reducers[k]`` (the actor's ``(loss, metrics)`` reducers of a micro-batch of
    that step, :meth:`~hpcrl.train.critic.Critic.train_step`) at global
    optimizer step ``first_step + k``. ``targets``: one per micro-batch, in the order of ``steps`` flattened.

    Returns ``critic/{value_loss, value_clipfrac, grad_norm}`` (means over the steps, each the step's global
    value), ``critic/lr`` (of the last step) and ``critic/seconds`` (wall time plus ``seconds``, the time
    already spent on the critic in this rollout: its values forward). Collective over the
    data-parallel group; raises what :meth:`~hpcrl.train.critic.Critic.train_step` raises.
    """
    t0 = time.perf_counter()
    per_step, i = [], 0
    for k, (step, reducer) in enumerate(zip(steps, reducers, strict=True)):
        per_step.append(critic.train_step(step, targets[i: i + len(step)], reducer, first_step + k))
        i += len(step)
    if i != len(targets):
        raise ValueError(f"{len(targets)} value targets for {i} micro-batches")
    out: dict[str, float] = {}
    for key in ("value_loss", "value_clipfrac", "grad_norm"):
        vals = [m[key] for m in per_step if m.get(key) is not None]
        if vals:
            out[f"critic/{key}"] = sum(vals) / len(vals)
    out["critic/lr"] = float(per_step[-1]["lr"])
    out["critic/seconds"] = seconds + time.perf_counter() - t0
    return out
