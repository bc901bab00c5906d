"""PPO with a learned critic: token rewards, GAE advantages and returns, the clipped value loss, explained
variance.

Pure torch, no Megatron, no process groups. Shapes: ``B`` samples (responses), ``T`` the padded response
length; per-token tensors are ``[B, T]`` aligned with the response tokens, and ``mask`` is the loss mask (1.0
on tokens that train, 0.0 on padding and on tokens that do not train, such as tool output in a multi-turn
sample).

Flow of one rollout step with ``algorithm.advantage_estimator: gae`` (the actor's train step does this)::

    values = critic.values(micro_batches)                  # V before each response token
    r = token_rewards(rewards, mask, kl, cfg.kl_coef)      # KL in the reward (slime --kl-coef)
    adv, ret = gae_advantages_and_returns(r, values, mask, cfg.gamma, cfg.lam)
    adv = masked_whiten(adv, mask) * mask                  # normalize_advantages (default on)
    ... actor steps on adv; critic steps on value_loss(new_values, values, ret, mask, reduce, value_clip)

Sources: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation"
(GAE); Schulman et al. 2017 (PPO, the clipped objective the value clip mirrors); slime
``slime/utils/ppo_utils.py`` (``get_advantages_and_returns``, ``compute_value_loss``, ``--value-clip``,
``--lambd``, ``--gamma``, ``--kl-coef``); veRL ``verl/trainer/ppo/core_algos.py``
(``compute_gae_advantage_return``, ``compute_value_loss`` with ``cliprange_value``) and
``verl/utils/torch_functional.py`` (``masked_var`` in the critic's ``vf_explained_var`` metric).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

Tensor = torch.Tensor
Reducer = Callable[[Tensor], Tensor]
"""``[B, T] -> scalar``, as :func:`hpcrl.train.algorithms.make_reducer` returns (typed here, not imported, so
that :mod:`hpcrl.train.algorithms` may import this module)."""


def token_rewards(rewards: Tensor, mask: Tensor, kl: Optional[Tensor] = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards of PPO: ``-kl_coef * kl_t * mask_t``, plus the scalar reward on each row's last mask
    token.

    The KL-in-reward shaping of InstructGPT-style PPO (Ouyang et al. 2022; Ziegler et al. 2019). slime: the
    token rewards of ``get_advantages_and_returns``'s callers (``--kl-coef``; ``kl`` is ``compute_approx_kl``
    of the old policy against the reference, ``--kl-loss-type``); veRL ``apply_kl_penalty``
    (``token_level_rewards = token_level_scores - beta * kld``).

    rewards: ``[B]`` scalar rewards (raw, no group baseline); mask: ``[B, T]``; kl: ``[B, T]`` or None (no
    penalty). Returns ``[B, T]`` in the dtype of ``kl`` (or of ``mask`` as float), detached, 0 where
    ``mask`` is 0. Raises ValueError when a row has no mask token (there is nowhere to put its reward) or the
    shapes disagree.
    """
    if kl is not None:
        dtype = kl.dtype
    else:
        dtype = mask.dtype if mask.is_floating_point() else torch.get_default_dtype()
    mask = mask.detach().to(dtype)
    rewards = torch.as_tensor(rewards).detach().to(dtype=dtype, device=mask.device)
    if mask.ndim != 2 or rewards.shape != (mask.shape[0],):
        raise ValueError(f"token_rewards: rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} "
                         "disagree")
    if bool((mask.sum(-1) <= 0).any()):
        raise ValueError("token_rewards: a sample has no loss-mask token to put the reward on")
    out = -kl_coef * kl.detach() * mask if kl is not None else torch.zeros_like(mask)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).amax(dim=-1)
    out = out.clone()
    out[torch.arange(mask.shape[0], device=mask.device), last] += rewards
    return out


def gae_advantages_and_returns(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                               lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimates and the critic's regression targets (Schulman et al. 2016).

    Backwards over the response tokens: ``delta_t = r_t + gamma * V_next - V_t`` and
    ``A_t = delta_t + gamma * lam * A_next``; returns ``R_t = A_t + V_t`` (the lambda-return).
    ``values[:, t]`` is the critic's value of the state before response token ``t`` (the prefix up to it);
    the value after a row's last token is 0 (the episode ends there).

    Masked-out tokens (``mask == 0``: padding, and tool output inside a multi-turn response) are skipped, not
    treated as steps: ``V_next`` and ``A_next`` are those of the next *mask-in* token, so a turn's last
    trained token bootstraps from the first trained token of the next turn, with no discount for the tokens in
    between, and rewards on masked-out tokens are ignored. This is veRL's ``compute_gae_advantage_return``
    (which carries ``nextvalues`` / ``lastgaelam`` through ``response_mask == 0`` positions for multi-turn);
    slime's ``get_advantages_and_returns`` runs over all response tokens, which is the same when the loss mask
    has no gap. ``lam == 1`` gives the discounted return-to-go minus ``V_t``; ``lam == 0`` the one-step TD
    error. No whitening here (``algorithm.normalize_advantages`` is applied by the caller).

    token_rewards, values, mask: ``[B, T]`` (:func:`token_rewards`; ``values`` from the critic). Returns
    ``(advantages, returns)``, both ``[B, T]`` in the promoted float dtype, detached, 0 where ``mask`` is 0.
    Raises ValueError for shapes that differ, or ``gamma`` / ``lam`` outside ``[0, 1]``.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or mask.ndim != 2:
        raise ValueError(f"gae: token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and "
                         f"mask {tuple(mask.shape)} must be equal [B, T] shapes")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma={gamma} and lam={lam} must be in [0, 1]")
    dtype = torch.promote_types(torch.promote_types(token_rewards.dtype, values.dtype), torch.float32)
    r = token_rewards.detach().to(dtype)
    v = values.detach().to(dtype)
    m = mask.detach().to(dtype)
    advantages = torch.zeros_like(r)
    if r.shape[-1] == 0:  # every response empty: nothing to estimate
        return advantages, advantages.clone()
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        keep = m[:, t]
        next_value = keep * v[:, t] + (1.0 - keep) * next_value
        next_adv = keep * adv_t + (1.0 - keep) * next_adv
        advantages[:, t] = adv_t * keep
    returns = (advantages + v) * m
    return advantages, returns


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, reduce: Reducer,
               value_clip: Optional[float] = 0.2) -> tuple[Tensor, Tensor]:
    """The critic's clipped regression loss, reduced like the policy loss.

    Per token ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` with ``c = value_clip``
    (PPO's value clipping, Schulman et al. 2017 / OpenAI baselines ``cliprange_value``); with
    ``value_clip=None`` simply ``0.5 * (V - R)^2``. ``clipfrac`` is 1 on the tokens where the clipped term is
    the larger. slime: ``compute_value_loss`` (``--value-clip``), the loss scaled by 0.5 in the critic's loss
    function; veRL: ``compute_value_loss`` (``cliprange_value``, ``vf_clipfrac``).

    values (with grad, the critic's current prediction), old_values (the prediction the returns were computed
    with), returns, mask: ``[B, T]``. reduce: a reducer of this micro-batch
    (:func:`hpcrl.train.algorithms.make_reducer`, ``algorithm.loss_reduction``), so the micro-batch losses of
    a step add up to the step's. Returns ``(loss, clipfrac)``: scalars; ``clipfrac`` is detached. Raises
    ValueError for ``value_clip <= 0``.
    """
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"value_clip must be > 0 or None, got {value_clip}")
    m = mask.detach().to(values.dtype)
    returns = returns.detach().to(values.dtype)
    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token = unclipped
        clipfrac = torch.zeros_like(unclipped)
    else:
        old = old_values.detach().to(values.dtype)
        clipped = (torch.clamp(values, old - value_clip, old + value_clip) - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipfrac = (clipped > unclipped).to(values.dtype)
    return 0.5 * reduce(per_token * m), reduce(clipfrac * m).detach()


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the tokens where ``mask`` is 1 (1: perfect values; 0: no better than
    a constant; negative: worse).

    The critic's ``vf_explained_var`` of veRL (``masked_var``) and OpenAI baselines' ``explained_variance``.
    Both variances are population variances over the same tokens (the Bessel factor cancels).

    values, returns, mask: ``[B, T]`` (or any equal shapes). Returns a Python float; NaN when ``Var(R)`` is 0
    or no token is in the mask.
    """
    m = mask.detach().to(torch.float64)
    count = m.sum()
    if count.item() == 0:
        return math.nan
    v = values.detach().to(torch.float64)
    r = returns.detach().to(torch.float64)

    def var(x: Tensor) -> Tensor:
        mean = (x * m).sum() / count
        return (((x - mean) ** 2) * m).sum() / count

    var_r = var(r)
    if var_r.item() == 0:
        return math.nan
    return float(1.0 - var(r - v) / var_r)
