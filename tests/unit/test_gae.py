"""hpcrl.train.gae (PPO's token rewards, GAE, value loss, explained variance) against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.train import algorithms as alg
from hpcrl.train import gae
from tests.unit.test_algorithms import close

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


def test_token_rewards_kl_penalty_and_reward_on_the_last_mask_token():
    mask = t([[1, 1, 0], [1, 0, 1]])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    out = gae.token_rewards(t([1.0, 2.0]), mask, kl, kl_coef=0.5)
    close(out, [[-0.05, -0.1 + 1.0, 0.0], [-0.2, 0.0, -0.3 + 2.0]])
    close(gae.token_rewards(t([1.0, 2.0]), mask), [[0, 1, 0], [0, 0, 2]])
    with pytest.raises(ValueError, match="no loss-mask token"):
        gae.token_rewards(t([1.0, 2.0]), t([[1, 0, 0], [0, 0, 0]]))


R = [[0.0, 0.0, 1.0]]
V = [[0.5, 0.2, 0.7]]
ONES = [[1.0, 1.0, 1.0]]


def test_lam_one_is_discounted_return_to_go_minus_value():
    adv, ret = gae.gae_advantages_and_returns(t(R), t(V), t(ONES), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.8, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])
    adv, ret = gae.gae_advantages_and_returns(t(R), t(V), t(ONES), gamma=0.9, lam=1.0)
    close(ret, [[0.81, 0.9, 1.0]])
    close(adv, [[0.81 - 0.5, 0.9 - 0.2, 1.0 - 0.7]])


def test_lam_zero_is_one_step_td_error_and_value_after_the_end_is_zero():
    adv, ret = gae.gae_advantages_and_returns(t(R), t(V), t(ONES), gamma=0.9, lam=0.0)
    close(adv, [[0.9 * 0.2 - 0.5, 0.9 * 0.7 - 0.2, 1.0 - 0.7]])
    close(ret, [[0.9 * 0.2, 0.9 * 0.7, 1.0]])


def test_intermediate_gamma_lam_by_hand():
    adv, ret = gae.gae_advantages_and_returns(t(R), t(V), t(ONES), gamma=0.9, lam=0.5)
    a2 = 0.3
    a1 = 0.43 + 0.45 * a2
    a0 = -0.32 + 0.45 * a1
    close(adv, [[a0, a1, a2]])
    close(ret, [[a0 + 0.5, a1 + 0.2, a2 + 0.7]])
    assert not adv.requires_grad and not ret.requires_grad


def test_multi_turn_mask_gaps_are_skipped_and_padding_is_ignored():
    # Mask-in tokens 0, 1, 4 with values .5, .2, .7: the same as the contiguous row above. Values and rewards
    # on the masked-out tokens (a tool's output, trailing padding) must not matter.
    mask = t([[1, 1, 0, 0, 1, 0]])
    values = t([[0.5, 0.2, 9.0, -9.0, 0.7, 5.0]])
    rewards = t([[0.0, 0.0, 3.0, 3.0, 1.0, 7.0]])
    adv, ret = gae.gae_advantages_and_returns(rewards, values, mask, gamma=0.9, lam=0.5)
    ref_adv, ref_ret = gae.gae_advantages_and_returns(t(R), t(V), t(ONES), gamma=0.9, lam=0.5)
    keep = [0, 1, 4]
    close(adv[:, keep], ref_adv)
    close(ret[:, keep], ref_ret)
    close(adv[:, [2, 3, 5]], [[0.0, 0.0, 0.0]])
    close(ret[:, [2, 3, 5]], [[0.0, 0.0, 0.0]])


def test_rows_of_a_batch_are_independent():
    mask = t([[1, 1, 1], [1, 1, 0]])
    rewards = gae.token_rewards(t([1.0, -1.0]), mask)
    values = t([[0.5, 0.2, 0.7], [0.1, 0.3, 4.0]])
    adv, _ = gae.gae_advantages_and_returns(rewards, values, mask, gamma=0.9, lam=0.5)
    close(adv[0], gae.gae_advantages_and_returns(t(R), t(V), t(ONES), 0.9, 0.5)[0][0])
    # row 2, two tokens: d1 = -1 - .3, d0 = .9 * .3 - .1; A0 = d0 + .45 * d1
    close(adv[1], [0.27 - 0.1 + 0.45 * (-1.3), -1.3, 0.0])


def test_no_response_token_at_all_gives_empty_advantages_and_returns():
    adv, ret = gae.gae_advantages_and_returns(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), 1.0, 0.9)
    assert adv.shape == ret.shape == (2, 0)


def test_gae_refuses_bad_shapes_and_coefficients():
    with pytest.raises(ValueError, match="equal"):
        gae.gae_advantages_and_returns(t(R), t([[0.0, 0.0]]), t(ONES))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        gae.gae_advantages_and_returns(t(R), t(V), t(ONES), gamma=1.0, lam=1.5)


def _value_case():
    # token 0: V=1, old=.5 -> clip to [.3, .7] = .7; (1-2)^2 = 1 < (.7-2)^2 = 1.69: clipped term wins.
    # token 1: V=0, old=.1 -> clip to [-.1, .3] = 0; both terms (0-1)^2 = 1: not clipped.
    # token 2: masked out.
    values = t([[1.0, 0.0, 5.0]]).requires_grad_(True)
    old = t([[0.5, 0.1, 0.0]])
    returns = t([[2.0, 1.0, 0.0]])
    mask = t([[1.0, 1.0, 0.0]])
    return values, old, returns, mask


def test_value_loss_clipped_by_hand_with_gradient():
    values, old, returns, mask = _value_case()
    reduce = alg.make_reducer("token_mean", mask)
    loss, clipfrac = gae.value_loss(values, old, returns, mask, reduce, value_clip=0.2)
    close(loss.detach(), 0.5 * (1.69 + 1.0) / 2)
    close(clipfrac, 0.5)
    loss.backward()
    # the clamp saturates on token 0 (no gradient); token 1: d/dV 0.5 * (V - 1)^2 / 2 = (V - 1) / 2
    close(values.grad, [[0.0, -0.5, 0.0]])


def test_value_loss_unclipped_by_hand():
    values, old, returns, mask = _value_case()
    reduce = alg.make_reducer("token_mean", mask)
    loss, clipfrac = gae.value_loss(values, old, returns, mask, reduce, value_clip=None)
    close(loss.detach(), 0.5 * (1.0 + 1.0) / 2)
    close(clipfrac, 0.0)
    loss.backward()
    close(values.grad, [[(1.0 - 2.0) / 2, (0.0 - 1.0) / 2, 0.0]])
    with pytest.raises(ValueError, match="value_clip"):
        gae.value_loss(values, old, returns, mask, reduce, value_clip=0.0)


def test_value_loss_is_additive_over_micro_batches_with_step_wide_denominators():
    values = t([[1.0, 0.0, 5.0], [0.3, -0.2, 0.4]])
    old = t([[0.5, 0.1, 0.0], [0.0, 0.0, 0.0]])
    returns = t([[2.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    def reducer(m):
        return alg.make_reducer("token_mean", m, num_tokens=5)

    whole, _ = gae.value_loss(values, old, returns, mask, reducer(mask), 0.2)
    parts = [gae.value_loss(values[i:i + 1], old[i:i + 1], returns[i:i + 1], mask[i:i + 1],
                            reducer(mask[i:i + 1]), 0.2)[0] for i in (0, 1)]
    close(sum(parts), whole)


def test_explained_variance():
    returns = t([[1.0, 2.0, 3.0, 100.0]])
    mask = t([[1.0, 1.0, 1.0, 0.0]])
    assert gae.explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0, abs=1e-12)
    constant = torch.full_like(returns, 7.0)
    assert gae.explained_variance(constant, returns, mask) == pytest.approx(0.0, abs=1e-12)
    # R - V = (0, 0, 1): variance 2/9; Var(R) = 2/3 -> 1 - 1/3
    values = t([[1.0, 2.0, 2.0, -50.0]])
    assert gae.explained_variance(values, returns, mask) == pytest.approx(2 / 3, abs=1e-12)
    assert math.isnan(gae.explained_variance(values, torch.ones_like(returns), mask))
    assert math.isnan(gae.explained_variance(values, returns, torch.zeros_like(mask)))
