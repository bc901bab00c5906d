"""Advantages, KL estimators, policy loss, TIS and loss reduction: slime's definitions in pure torch.

Every formula follows slime (``slime/utils/ppo_utils.py``, ``slime/backends/megatron_utils/loss.py``,
``RolloutManager._post_process_rewards``, ``slime/utils/distributed_utils.py``); each function names its slime
counterpart and the paper it comes from. Nothing here knows about Megatron, SGLang or process groups (except
the optional ``process_group`` of :func:`masked_whiten`).

Shapes. ``B`` is the number of samples (responses) in a batch, ``T`` the padded response length. Per-token
tensors are ``[B, T]`` and aligned with the response tokens; ``mask`` is slime's ``loss_mask`` (1.0 for tokens
that train, 0.0 for padding and for tokens that do not train, such as tool output). Where a function also
takes a list of ``[len_i]`` tensors it says so.

Flow of one training step::

    adv = compute_advantages(cfg.advantage_estimator, rewards, masks, n, kl=None, cfg=cfg)  # once per step
    sums = compute_rollout_mask_sums(masks, rollout_ids)                                      # once per step
    for mb in micro_batches:
        reduce, report = step_reducers(config, mb.mask, mb.rollout_ids, sums)  # algorithm.loss_reduction
        out = compute_loss(mb.logp, mb.old_logp, mb.adv, mb.mask, reduce, cfg, entropy=..., ref_logp=...,
                           metric_reduce=report)
        out.loss.backward()  # no division by the number of micro-batches: see rollout_token_mean

The reductions are in :mod:`hpcrl.train.reduction` (re-exported here); GAE and the value loss of PPO with a
critic in :mod:`hpcrl.train.gae`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from hpcrl.names import (ESTIMATORS, KL_KINDS, MIS_LEVELS, POLICY_LOSSES, Estimator, KLKind, MISLevel,
                         PolicyLoss)
# The loss reductions live in hpcrl.train.reduction; re-exported here, where the flow below uses them.
from hpcrl.train.reduction import (Reducer, ReductionKind, compute_rollout_mask_sums,  # noqa: F401
                                   make_reducer, rollout_token_mean, seq_mean_token_sum, sequence_mean,
                                   step_reducers, token_mean)

if TYPE_CHECKING:
    from hpcrl.config import AlgorithmSection

Tensor = torch.Tensor
# The names this module dispatches on (compute_advantages, approx_kl, compute_loss) are the config's: one
# list in the leaf module hpcrl.names, re-exported here (ESTIMATORS, KL_KINDS, POLICY_LOSSES, MIS_LEVELS,
# their Literals).


# ------------------------------------------------------------------------------------------------------------
# Reward post-processing and advantages
# ------------------------------------------------------------------------------------------------------------


def _as_float(t: Tensor) -> Tensor:
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def group_centered_rewards(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """Subtract each prompt group's mean reward: ``r <- r - mean_group(r)``.

    slime: ``RolloutManager._post_process_rewards`` (rewards normalisation, on by default) for grpo, gspo and
    reinforce_plus_plus_baseline. The baseline is the group mean of GRPO, DeepSeekMath (Shao et al. 2024).

    rewards: ``[num_groups * n]``, the ``n`` samples of one prompt adjacent. Returns ``[num_groups * n]``.
    With ``n == 1`` every result is 0 (the sample is its own baseline), as in slime.
    """
    rewards = _as_float(rewards)
    if rewards.ndim != 1 or n_samples_per_prompt < 1 or rewards.numel() % n_samples_per_prompt != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"n_samples_per_prompt={n_samples_per_prompt}")
    groups = rewards.view(-1, n_samples_per_prompt)
    return (groups - groups.mean(dim=-1, keepdim=True)).reshape(-1)


def grpo_advantages(rewards: Tensor, n_samples_per_prompt: int, std_normalization: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO's scalar advantage per sample: ``(r - mean_group) / (std_group + eps)``.

    GRPO: DeepSeekMath (Shao et al. 2024), outcome supervision. GSPO (Zheng et al. 2025) uses the same scalar
    advantages. slime: ``_post_process_rewards``; ``std_normalization`` is ``--grpo-std-normalization``
    (turned off by ``--disable-grpo-std-normalization``, i.e. Dr.GRPO, Liu et al. 2025, which drops the std
    divide). ``std`` is torch's default, Bessel-corrected (``/(n-1)``) standard deviation of the group, as in
    slime. Std normalisation is off automatically when ``n_samples_per_prompt == 1`` (slime does the same: the
    std of one sample is undefined).

    rewards: ``[num_groups * n]`` raw rewards, a prompt's ``n`` samples adjacent. Returns
    ``[num_groups * n]``. A group whose rewards are all equal gets zeros.
    """
    centered = group_centered_rewards(rewards, n_samples_per_prompt)
    if not std_normalization or n_samples_per_prompt == 1:
        return centered
    groups = centered.view(-1, n_samples_per_prompt)
    return (groups / (groups.std(dim=-1, keepdim=True) + eps)).reshape(-1)


def rloo_advantages(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """RLOO's scalar advantage per sample: its reward minus the mean reward of the *other* samples of its
    group, ``A_i = R_i - 1/(n-1) * sum_{j != i} R_j`` (equal to ``n/(n-1) * (R_i - mean_group)``).

    REINFORCE Leave-One-Out: Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free"), for LLMs
    Ahmadian et al. 2024 ("Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs"). veRL: ``compute_rloo_outcome_advantage`` (``algorithm.adv_estimator: rloo``), outcome
    reward only, broadcast over the response tokens by :func:`compute_advantages`; no std division and no
    whitening by default (``algorithm.normalize_advantages``).

    rewards: ``[num_groups * n]`` raw rewards, a prompt's ``n`` samples adjacent. Returns
    ``[num_groups * n]``. Raises ValueError for ``n_samples_per_prompt < 2`` (a sample needs another to be
    its baseline) or rewards that do not split into groups.
    """
    rewards = _as_float(rewards)
    n = n_samples_per_prompt
    if n < 2:
        raise ValueError(f"rloo needs n_samples_per_prompt >= 2 (leave-one-out baseline), got {n}")
    if rewards.ndim != 1 or rewards.numel() % n != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of "
                         f"n_samples_per_prompt={n}")
    groups = rewards.view(-1, n)
    others = (groups.sum(dim=-1, keepdim=True) - groups) / (n - 1)
    return (groups - others).reshape(-1)


def whitens_advantages(estimator: Estimator, normalize_advantages: Optional[bool] = None) -> bool:
    """Whether the advantages of ``estimator`` are whitened (:func:`masked_whiten`, slime
    ``--normalize-advantages``): ``normalize_advantages`` (``algorithm.normalize_advantages``) when set, else
    on for ``gae`` and the REINFORCE++ estimators (slime requires it for them) and off for the group
    estimators ``grpo``, ``gspo``, ``rloo`` (their advantages are already group-relative)."""
    if normalize_advantages is not None:
        return bool(normalize_advantages)
    return estimator in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def reinforce_plus_plus_baseline_advantages(centered_rewards: Tensor, kl: Tensor, mask: Tensor,
                                            kl_coef: float = 0.0) -> Tensor:
    """REINFORCE++-baseline advantages before whitening: ``A_t = R - kl_coef * kl_t``.

    REINFORCE++ (Hu 2025, arXiv:2501.03262), baseline variant. slime:
    ``get_reinforce_plus_plus_baseline_advantages``. ``R`` is already group-mean-centred, without std division
    (:func:`group_centered_rewards`). slime then whitens with ``--normalize-advantages`` (required);
    :func:`compute_advantages` does that.

    centered_rewards: ``[B]``; kl, mask: ``[B, T]``. Returns ``[B, T]``, zero where ``mask`` is 0.
    """
    return (centered_rewards.to(kl.dtype)[:, None] - kl_coef * kl) * mask


def discounted_returns(token_rewards: Tensor, gamma: float) -> Tensor:
    """Discounted returns ``G_t = r_t + gamma * G_{t+1}``, ``G_T = 0``, along the last dimension.

    slime: the loop in ``get_reinforce_plus_plus_returns`` (``chunked_discounted_returns``).
    token_rewards: ``[B, T]``. Returns ``[B, T]``. ``gamma == 1`` is a reversed cumulative sum.
    """
    if gamma == 1.0:
        return token_rewards.flip(-1).cumsum(-1).flip(-1)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[..., 0])
    for t in range(token_rewards.shape[-1] - 1, -1, -1):
        running = token_rewards[..., t] + gamma * running
        returns[..., t] = running
    return returns


def reinforce_plus_plus_returns(rewards: Tensor, kl: Tensor, mask: Tensor, kl_coef: float = 0.0,
                                gamma: float = 1.0) -> Tensor:
    """REINFORCE++ returns before whitening (the advantages are the returns).

    REINFORCE++ (Hu 2025, arXiv:2501.03262). slime: ``get_reinforce_plus_plus_returns``. Token rewards are
    ``-kl_coef * kl_t * mask_t`` with the scalar reward ``R`` added at the last token where ``mask`` is 1;
    then :func:`discounted_returns` with ``gamma`` (``--gamma``). slime requires ``--normalize-advantages``
    for this estimator; :func:`compute_advantages` whitens.

    rewards: ``[B]`` raw scalar rewards (no group baseline); kl, mask: ``[B, T]``. Returns ``[B, T]``, zero
    where ``mask`` is 0; a row without mask token (an empty response) has no token for its reward and is all
    zero (it trains nothing, as under GAE).
    """
    mask = mask.to(kl.dtype)
    live = mask.sum(-1) > 0
    if not bool(live.any()):
        return torch.zeros_like(mask)
    token_rewards = -kl_coef * kl * mask
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).amax(dim=-1)
    token_rewards = token_rewards.clone()
    rows = torch.arange(mask.shape[0], device=mask.device)[live]
    token_rewards[rows, last[live]] += rewards.to(kl.dtype)[live]
    return discounted_returns(token_rewards, gamma) * mask


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  process_group=None) -> Tensor:
    """Whiten ``values`` with the mean and variance of the tokens where ``mask`` is 1.

    slime: ``distributed_masked_whiten`` (``--normalize-advantages``, ``shift_mean=True``). The variance is
    Bessel-corrected (``* N/(N-1)`` when ``N >= 2`` mask tokens): ``(v - mean) / sqrt(var + eps)``; with
    ``shift_mean=False`` the mean is added back. With ``process_group`` (and torch.distributed initialised)
    the three sums are all-reduced over it first, so every rank uses the global statistics (slime whitens over
    DP x CP). Masked-out positions are whitened too (callers mask them).

    values, mask: any equal shapes (``[B, T]`` or flat). Returns the same shape.
    """
    mask = mask.to(values.dtype)
    stats = torch.stack([(values * mask).sum(), (values * values * mask).sum(), mask.sum()])
    if process_group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats, group=process_group)
    total, total_sq, count = stats.unbind()
    if count.item() == 0:
        raise ValueError("masked_whiten: the mask has no token")
    mean = total / count
    var = total_sq / count - mean * mean
    if count.item() >= 2:
        var = var * count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def _pad(seqs: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    width = max((int(s.numel()) for s in seqs), default=0)
    out = torch.zeros(len(seqs), width, dtype=dtype, device=seqs[0].device if seqs else None)
    for i, s in enumerate(seqs):
        out[i, : s.numel()] = s.to(dtype)
    return out


def compute_advantages(estimator: Estimator, rewards: Tensor, response_masks: Union[Sequence[Tensor], Tensor],
                       n_samples_per_prompt: int, kl: Union[Sequence[Tensor], Tensor, None] = None,
                       cfg: Optional["AlgorithmSection"] = None, *, kl_coef: float = 0.0,
                       normalize_advantages: Optional[bool] = None) -> Union[list[Tensor], Tensor]:
    """Per-token advantages for a whole rollout step (slime's reward post-processing plus
    ``compute_advantages_and_returns``).

    - ``grpo`` / ``gspo``: :func:`grpo_advantages` (std normalisation from ``cfg.grpo_std_normalization``),
      broadcast over the response tokens. As in slime, ``kl`` / ``kl_coef`` have no effect here (use the KL
      loss).
    - ``reinforce_plus_plus_baseline``: group-mean-centred R, :func:`reinforce_plus_plus_baseline_advantages`.
    - ``reinforce_plus_plus``: :func:`reinforce_plus_plus_returns` with ``cfg.gamma``.
    - ``rloo``: :func:`rloo_advantages` (leave-one-out baseline), broadcast over the response tokens.
    - ``gae`` needs the critic's values: :mod:`hpcrl.train.gae` (ValueError here).
    - Then, when :func:`whitens_advantages` (``normalize_advantages``, else ``cfg.normalize_advantages``, else
      on for the REINFORCE++ variants, as slime asserts, and off for grpo/gspo/rloo), :func:`masked_whiten`
      over all mask tokens of the batch.

    rewards: ``[B]`` raw scalar rewards, ``B = num_groups * n_samples_per_prompt`` with each prompt's samples
    adjacent. response_masks: a list of ``B`` tensors ``[len_i]`` (returns a list of ``[len_i]``) or a padded
    ``[B, T]`` tensor (returns ``[B, T]``). kl: per-token KL to the reference in the same layout (``None``:
    zeros; slime computes it only when ``kl_coef != 0``). ``kl_coef`` is slime's ``--kl-coef`` (reward
    shaping, exclusive with ``use_kl_loss``). Advantages are 0 where the mask is 0; the result is detached.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ESTIMATORS}")
    if estimator == "gae":
        raise ValueError("gae advantages need the critic's values: "
                         "hpcrl.train.gae.gae_advantages_and_returns")
    std_normalization = cfg.grpo_std_normalization if cfg is not None else True
    gamma = cfg.gamma if cfg is not None else 1.0
    rewards = _as_float(torch.as_tensor(rewards)).detach()
    dtype = rewards.dtype

    as_list = not isinstance(response_masks, Tensor)
    if as_list:
        lengths = [int(m.numel()) for m in response_masks]
        mask = _pad(list(response_masks), dtype)
        kl_t = _pad(list(kl), dtype) if kl is not None else torch.zeros_like(mask)
    else:
        mask = response_masks.to(dtype)
        kl_t = kl.to(dtype) if kl is not None else torch.zeros_like(mask)
    kl_t = kl_t.detach()
    if rewards.shape != (mask.shape[0],):
        raise ValueError(f"rewards {tuple(rewards.shape)} and masks ({mask.shape[0]} samples) disagree")

    if estimator in ("grpo", "gspo"):
        scalar = grpo_advantages(rewards, n_samples_per_prompt, std_normalization)
        adv = scalar[:, None] * mask
    elif estimator == "rloo":
        adv = rloo_advantages(rewards, n_samples_per_prompt)[:, None] * mask
    elif estimator == "reinforce_plus_plus_baseline":
        centered = group_centered_rewards(rewards, n_samples_per_prompt)
        adv = reinforce_plus_plus_baseline_advantages(centered, kl_t, mask, kl_coef)
    else:
        adv = reinforce_plus_plus_returns(rewards, kl_t, mask, kl_coef, gamma)

    if normalize_advantages is None and cfg is not None:
        normalize_advantages = cfg.normalize_advantages
    if whitens_advantages(estimator, normalize_advantages) and bool(mask.sum() > 0):  # (else nothing trains)
        adv = masked_whiten(adv, mask) * mask

    if as_list:
        return [adv[i, :n] for i, n in enumerate(lengths)]
    return adv


# ------------------------------------------------------------------------------------------------------------
# KL estimators
# ------------------------------------------------------------------------------------------------------------


def approx_kl(logp: Tensor, logp_ref: Tensor, kind: KLKind = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.

    Schulman, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html). slime:
    ``compute_approx_kl`` (``--kl-loss-type``, default k1). With ``d = logp - logp_ref``:

    - ``k1``: ``d``
    - ``k2``: ``d**2 / 2``
    - ``k3``: ``exp(-d) - 1 + d`` (non-negative, unbiased, low variance)
    - ``low_var_kl``: k3 clamped to ``[-10, 10]``

    logp, logp_ref: equal shapes (``[B, T]``). Computed in at least float32 (slime upcasts bf16). Returns the
    same shape; gradients flow into both inputs.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_KINDS)}")
    dtype = torch.promote_types(torch.promote_types(logp.dtype, logp_ref.dtype), torch.float32)
    d = logp.to(dtype) - logp_ref.to(dtype)
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2.0
    kl = torch.exp(-d) - 1.0 + d
    return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl


# ------------------------------------------------------------------------------------------------------------
# Policy loss, TIS, entropy
# ------------------------------------------------------------------------------------------------------------


def sequence_ppo_kl(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level log-ratio: per sample ``sum((old - new) * m) / max(sum(m), 1)``, expanded to
    ``[B, T]``.

    GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization". slime: ``compute_gspo_kl``.
    """
    mask = mask.to(logp.dtype)
    seq = ((old_logp - logp) * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    return seq[:, None].expand_as(logp)


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, eps_clip: float = 0.2,
                eps_clip_high: Optional[float] = None, eps_clip_c: Optional[float] = None,
                gspo: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate per token, with optional dual clip and GSPO's sequence-level ratio.

    PPO clip: Schulman et al. 2017. Dual clip: Ye et al. 2020 ("Mastering Complex Control in MOBA Games with
    Deep Reinforcement Learning"). Asymmetric upper clip (``eps_clip_high``, "clip-higher") as in DAPO
    recipes. GSPO: Zheng et al. 2025. slime: ``policy_loss_function`` / ``compute_policy_loss``:

    - ``ppo_kl = old_logp - logp`` per token; for GSPO :func:`sequence_ppo_kl` (masked mean per sequence).
    - ``r = exp(-ppo_kl)``; ``L1 = -r A``; ``L2 = -clip(r, 1 - eps_clip, 1 + eps_clip_high) A``;
      ``L = max(L1, L2)``; ``clipfrac = [L2 > L1]``.
    - Dual clip (``eps_clip_c > 1``): where ``A < 0``, ``L = min(-eps_clip_c * A, L)``.

    ``ppo_kl`` is exactly 0 when ``logp == old_logp`` (slime checks this on the first step of a rollout).
    ``eps_clip_high`` defaults to ``eps_clip``. ``mask`` is only used for GSPO's sequence mean; the outputs
    are not masked (reduce them with a reducer).

    logp (with grad), old_logp, advantages, mask: ``[B, T]``. Returns ``(pg_loss, clipfrac, ppo_kl)``, each
    ``[B, T]``; clipfrac and ppo_kl are detached.
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    old_logp = old_logp.detach()
    advantages = advantages.detach()
    ppo_kl = sequence_ppo_kl(logp, old_logp, mask) if gspo else old_logp - logp
    ratio = torch.exp(-ppo_kl)
    loss1 = -ratio * advantages
    loss2 = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(loss1, loss2)
    clipfrac = (loss2 > loss1).to(loss.dtype)
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c (dual clip) must be > 1, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(-eps_clip_c * advantages, loss), loss)
    return loss, clipfrac.detach(), ppo_kl.detach()


def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_clip: float = 0.2,
               eps_clip_high: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO: the clipped, detached importance weight times the advantage times the token's log-prob.

    MiniMax-M1 (arXiv 2506.13585, eq. 4-5): ``L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp`` with
    ``r = exp(logp - old_logp)``. Unlike PPO's clip (:func:`policy_loss`) no token's gradient is dropped: a
    clipped weight only bounds how much the token counts. slime: the ``cispo`` branch of
    ``policy_loss_function`` (``--eps-clip`` is ``eps_low``, ``--eps-clip-high`` is ``eps_high``; slime warns
    when ``eps_clip < 1`` because the paper's weight has no lower bound - ``eps_clip: 1.0`` is that).

    The gradient per token is ``-w * A * d logp`` with ``w`` the clipped weight, so at ``r == 1`` (the first
    optimizer step on a rollout) it equals PPO's. ``eps_clip_high`` defaults to ``eps_clip``.

    logp (with grad), old_logp, advantages: ``[B, T]``. Returns ``(pg_loss, clipfrac, ppo_kl)``, each
    ``[B, T]``; ``clipfrac`` is 1 where the weight was clipped; clipfrac and ppo_kl are detached.
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    ppo_kl = (old_logp - logp).detach()
    ratio = torch.exp(-ppo_kl)
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    clipfrac = (weight != ratio).to(logp.dtype)
    loss = -weight * advantages.detach() * logp
    return loss, clipfrac, ppo_kl


def opd_advantages(advantages: Tensor, teacher_logp: Tensor, student_logp: Tensor, mask: Tensor,
                   coef: float = 1.0) -> Tensor:
    """On-policy distillation: ``advantages + coef * (teacher_logp - student_logp) * mask``.

    GLM-5 report (on-policy distillation stage): ``A_t = sg[log pi_teacher(y_t | x, y_<t) - log pi_train(y_t |
    x, y_<t)]`` on the student's own samples, i.e. the per-token negative reverse-KL estimate. slime:
    ``--use-opd`` / ``--opd-kl-coef`` (``A_t <- A_t - coef * (logp_student - logp_teacher)``), orthogonal to
    the advantage estimator. All inputs ``[B, T]``; returns ``[B, T]`` (no gradient flows through the
    log-probs: they are detached).
    """
    delta = teacher_logp.detach() - student_logp.detach()
    return advantages + coef * delta * mask


def tis_weights(old_logp_train: Tensor, rollout_logp: Tensor, tis_clip: float = 2.0,
                tis_clip_low: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling weights for the trainer/rollout-engine mismatch.

    Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training". slime:
    ``vanilla_tis_function`` (``--use-tis``, ``--tis-clip``, ``--tis-clip-low``):
    ``w = clamp(exp(old_logp_train - rollout_logp), tis_clip_low, tis_clip)``; the caller does
    ``pg_loss <- pg_loss * w``.

    old_logp_train: the trainer's log-probs of the old policy; rollout_logp: the engine's (SGLang) log-probs;
    both ``[B, T]``. Returns ``(w, metrics)``: ``w`` ``[B, T]`` detached; metrics, each ``[B, T]`` and
    detached, to be reduced like the loss: ``tis`` (the unclamped ratio), ``tis_clipfrac`` (``[w != ratio]``)
    and ``tis_abs`` (``|ratio - 1|``).
    """
    ratio = torch.exp(old_logp_train.detach() - rollout_logp.detach())
    w = ratio.clamp(min=tis_clip_low, max=tis_clip)
    metrics = {"tis": ratio, "tis_clipfrac": (w != ratio).to(ratio.dtype), "tis_abs": (ratio - 1.0).abs()}
    return w, metrics


def mis_mask(old_logp_train: Tensor, rollout_logp: Tensor, mask: Tensor, level: MISLevel, low: float = 0.5,
             high: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked importance sampling (MIS): which loss tokens keep their gradient, by the ratio of the proximal
    policy (the trainer's recomputed ``old_logp_train``) to the behaviour policy (the engine's
    ``rollout_logp``) at one of three levels:

    - ``token``: ``r_t = exp(old_t - rollout_t)``, each token kept iff ``low <= r_t <= high``;
    - ``sequence``: ``r = exp(sum_t m_t (old_t - rollout_t))`` over the sample's loss tokens (the product of
      its token ratios), the whole sample kept or masked;
    - ``geometric``: ``r = exp(sum_t m_t (old_t - rollout_t) / max(sum_t m_t, 1))`` (their geometric mean),
      the whole sample kept or masked.

    slime: ``examples/train_infer_mismatch_helper/mis.py`` with ``mis_mode: mask`` (bounds inclusive, levels
    ``token``/``sequence``/``geometric``); veRL's rollout correction, rejection sampling ``rollout_rs``
    (token / sequence / geometric); the token mask of the "When Speed Kills Stability" study (2025), which
    slime's mask mode cites; AReaL's ``behav_imp_weight_cap`` is ``token`` with ``low = 0``. Compared in
    log space, so no ratio overflows; ``low == 0`` means no lower bound. A row is one whole sample (a
    micro-batch never splits a sample: :func:`hpcrl.train.packing.plan_micro_batches` and
    :func:`hpcrl.train.actor.split_steps` hand out whole samples), so the sequence ratio is the sample's.

    old_logp_train, rollout_logp, mask: ``[B, T]`` (``mask``: the loss mask, 1.0 for tokens that train).
    Returns ``(keep, metrics)``: ``keep`` ``[B, T]``, detached, 0.0 on the loss tokens whose ratio leaves
    ``[low, high]`` and 1.0 everywhere else (padding included); metrics, each ``[B, T]`` and detached, to be
    reduced like the loss: ``mis_masked_frac`` (1 on a masked loss token: its sum is the count of masked
    tokens) and ``mis_masked_seq_frac`` (1 on every token of a sample with at least one masked loss token; at
    the sequence and geometric levels these are the masked samples). Raises ValueError for an unknown level or
    bounds outside ``0 <= low < high``.
    """
    if not 0 <= low < high:
        raise ValueError(f"MIS bounds need 0 <= low < high, got low={low}, high={high}")
    m = mask.detach().to(old_logp_train.dtype)
    log_ratio = (old_logp_train.detach() - rollout_logp.detach()) * m
    if level == "token":
        pass
    elif level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(m)
    elif level == "geometric":
        log_ratio = (log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)).expand_as(m)
    else:
        raise ValueError(f"unknown MIS level {level!r}; expected one of {', '.join(MIS_LEVELS)}")
    log_low = math.log(low) if low > 0 else -math.inf
    inside = (log_ratio >= log_low) & (log_ratio <= math.log(high))
    masked = (~inside).to(m.dtype) * m
    keep = 1.0 - masked
    masked_seq = (masked.sum(-1, keepdim=True) > 0).to(m.dtype).expand_as(m)
    return keep, {"mis_masked_frac": masked, "mis_masked_seq_frac": masked_seq}


# ------------------------------------------------------------------------------------------------------------
# Total loss
# ------------------------------------------------------------------------------------------------------------


def total_loss(pg_loss: Tensor, reduce: Reducer, entropy: Optional[Tensor] = None,
               kl: Optional[Tensor] = None, entropy_coef: float = 0.0, kl_loss_coef: float = 0.0,
               use_kl_loss: bool = False) -> Tensor:
    """``reduce(pg_loss) - entropy_coef * reduce(entropy) + kl_loss_coef * reduce(kl)``.

    slime: the end of ``policy_loss_function`` (``--entropy-coef``, default 0; ``--use-kl-loss`` with
    ``--kl-loss-coef``). The entropy term is added when ``entropy`` is given (it needs a gradient when
    ``entropy_coef != 0``); the KL term only when ``use_kl_loss``. All inputs ``[B, T]``; returns a scalar.
    """
    loss = reduce(pg_loss)
    if entropy is not None and entropy_coef != 0.0:
        loss = loss - entropy_coef * reduce(entropy)
    if use_kl_loss:
        if kl is None:
            raise ValueError("use_kl_loss needs the per-token kl (reference log-probs)")
        loss = loss + kl_loss_coef * reduce(kl)
    return loss


@dataclass
class LossOutput:
    """The loss of one (micro-)batch and its metrics, each reduced with the batch's reducer (the metrics with
    :func:`compute_loss`'s ``metric_reduce`` when given).

    ``loss`` carries the gradient; the rest are detached scalar tensors (``None`` when not computed). Because
    the reducers are additive over micro-batches, summing each field over a step's micro-batches gives the
    step's value. Metric names follow slime's logs.
    """

    loss: Tensor
    pg_loss: Tensor
    pg_clipfrac: Tensor
    ppo_kl: Tensor
    entropy: Optional[Tensor] = None
    kl_loss: Optional[Tensor] = None
    tis: Optional[Tensor] = None
    tis_clipfrac: Optional[Tensor] = None
    tis_abs: Optional[Tensor] = None
    mis_masked_frac: Optional[Tensor] = None
    mis_masked_seq_frac: Optional[Tensor] = None

    def metrics(self) -> dict[str, float]:
        """The non-None fields as Python floats (one device sync; call when logging)."""
        return {f.name: float(v.detach()) for f in fields(self) if (v := getattr(self, f.name)) is not None}


def compute_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, reduce: Reducer,
                 cfg: "AlgorithmSection", *, entropy: Optional[Tensor] = None,
                 ref_logp: Optional[Tensor] = None, rollout_logp: Optional[Tensor] = None,
                 metric_reduce: Optional[Reducer] = None) -> LossOutput:
    """The policy loss of one micro-batch as slime's ``policy_loss_function`` computes it.

    :func:`policy_loss` (GSPO ratio when ``cfg.advantage_estimator == "gspo"``) or, with
    ``cfg.policy_loss == "cispo"``, :func:`cispo_loss`; then TIS weights when
    ``cfg.use_tis`` (:func:`tis_weights` of ``old_logp`` against ``rollout_logp``); then, when
    ``cfg.mis_level`` is set, the MIS keep mask (:func:`mis_mask`, same ratio): a masked token is left out of
    every term of the loss (policy, entropy, KL), as slime rebuilds its reducer with MIS's modified loss mask,
    the denominators staying those of the whole batch; then :func:`total_loss` with ``cfg.entropy_coef`` and,
    when ``cfg.use_kl_loss``, ``approx_kl(logp, ref_logp, cfg.kl_loss_type)``. With MIS, ``pg_loss``,
    ``pg_clipfrac``, ``ppo_kl``, ``entropy`` and ``kl_loss`` are reduced over the kept tokens; the TIS and MIS
    metrics over all loss tokens. Nothing masked: exactly the loss without MIS.

    logp (with grad), old_logp, advantages, mask, entropy, ref_logp, rollout_logp: ``[B, T]``. reduce: from
    :func:`make_reducer`, the loss's. metric_reduce: the reducer of every field but ``loss`` (default
    ``reduce``; :func:`step_reducers` gives both). Raises ValueError when TIS, MIS or the KL loss lacks its
    log-probs.
    """
    if cfg.policy_loss == "cispo":
        pg, clipfrac, ppo_kl = cispo_loss(logp, old_logp, advantages, cfg.eps_clip, cfg.eps_clip_high)
    else:
        pg, clipfrac, ppo_kl = policy_loss(logp, old_logp, advantages, mask, cfg.eps_clip, cfg.eps_clip_high,
                                           cfg.eps_clip_c, gspo=cfg.advantage_estimator == "gspo")
    report = reduce if metric_reduce is None else metric_reduce
    correction: dict[str, Tensor] = {}
    if cfg.use_tis:
        if rollout_logp is None:
            raise ValueError("use_tis needs the rollout engine's log-probs (rollout_logp)")
        w, stats = tis_weights(old_logp, rollout_logp, cfg.tis_clip, cfg.tis_clip_low)
        pg = pg * w
        correction = {k: report(v).detach() for k, v in stats.items()}
    kept, kept_report = reduce, report
    if cfg.mis_level is not None:
        if rollout_logp is None:
            raise ValueError("mis_level needs the rollout engine's log-probs (rollout_logp)")
        keep, stats = mis_mask(old_logp, rollout_logp, mask, cfg.mis_level, cfg.mis_low, cfg.mis_high)
        correction.update({k: report(v).detach() for k, v in stats.items()})
        kept = _masked_reducer(reduce, keep)
        kept_report = kept if report is reduce else _masked_reducer(report, keep)
    kl = None
    if cfg.use_kl_loss:
        if ref_logp is None:
            raise ValueError("use_kl_loss needs the reference model's log-probs (ref_logp)")
        kl = approx_kl(logp, ref_logp.detach(), cfg.kl_loss_type)
    loss = total_loss(pg, kept, entropy, kl, cfg.entropy_coef, cfg.kl_loss_coef, cfg.use_kl_loss)
    return LossOutput(
        loss=loss,
        pg_loss=kept_report(pg).detach(),
        pg_clipfrac=kept_report(clipfrac),
        ppo_kl=kept_report(ppo_kl),
        entropy=kept_report(entropy).detach() if entropy is not None else None,
        kl_loss=kept_report(kl).detach() if kl is not None else None,
        **correction,
    )


def _masked_reducer(reduce: Reducer, keep: Tensor) -> Reducer:
    """``reduce`` over the tokens where ``keep`` ``[B, T]`` is 1 (its denominators unchanged)."""
    return lambda v: reduce(v * keep)
