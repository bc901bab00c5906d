"""hpcrl.train.algorithms against hand computations on small explicit numbers (float64 for exactness)."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.config import AlgorithmSection
from hpcrl.train import algorithms as alg

F64 = torch.float64


def t(*rows, dtype=F64):
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=dtype)


def close(a, b, tol=1e-12):
    a = torch.as_tensor(a, dtype=F64)
    b = torch.as_tensor(b, dtype=F64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=tol, rtol=0), (a, b)


# --- GRPO ---------------------------------------------------------------------------------------------------


def test_grpo_without_std_is_group_mean_centering():
    adv = alg.grpo_advantages(t([1.0, 0, 0, 1, 1, 1, 1, 1]), 4, std_normalization=False)
    close(adv, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_grpo_with_std_divides_by_bessel_std_plus_eps():
    adv = alg.grpo_advantages(t([1.0, 0, 0, 1, 1, 1, 1, 1]), 4)
    # group 1: centred (.5, -.5, -.5, .5); std = sqrt(4 * .25 / 3) = sqrt(1/3).
    # group 2: all equal -> 0 / 1e-6 = 0.
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    close(adv, [a, -a, -a, a, 0, 0, 0, 0])


def test_grpo_single_sample_groups_turn_std_off():
    adv = alg.grpo_advantages(t([3.0, 5.0]), 1)
    assert not torch.isnan(adv).any()
    close(adv, [0.0, 0.0])


def test_compute_advantages_grpo_broadcasts_over_tokens_list_and_padded():
    rewards = t([1.0, 0.0])
    cfg = AlgorithmSection(grpo_std_normalization=False)
    out = alg.compute_advantages("grpo", rewards, [torch.ones(3), torch.tensor([1.0, 0.0])], 2, cfg=cfg)
    close(out[0], [0.5, 0.5, 0.5])
    close(out[1], [-0.5, 0.0])  # zero where the mask is 0
    padded = alg.compute_advantages("gspo", rewards, t([1.0, 1, 1], [1.0, 0, 0]), 2, cfg=cfg)
    close(padded, [[0.5, 0.5, 0.5], [-0.5, 0, 0]])


# --- RLOO and advantage whitening --------------------------------------------------------------------------


def test_rloo_is_reward_minus_the_mean_of_the_others_by_hand():
    adv = alg.rloo_advantages(t([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4)
    # group 1: 1 - (0+0+1)/3 = 2/3; 0 - (1+0+1)/3 = -2/3. group 2: all equal -> 0.
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    close(alg.rloo_advantages(t([3.0, 1.0]), 2), [2.0, -2.0])  # n = 2: the other sample is the baseline
    # n/(n-1) times GRPO's centred reward (veRL's form)
    r = t([0.3, 1.7, -0.4, 2.2, 0.0, 5.0])
    close(alg.rloo_advantages(r, 3), alg.group_centered_rewards(r, 3) * 1.5)
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        alg.rloo_advantages(t([1.0, 0.0]), 1)


def test_compute_advantages_rloo_broadcasts_and_is_not_whitened_by_default():
    masks = [torch.ones(3), torch.tensor([1.0, 0.0])]
    out = alg.compute_advantages("rloo", t([1.0, 0.0]), masks, 2, cfg=AlgorithmSection())
    close(out[0], [1.0, 1.0, 1.0])
    close(out[1], [-1.0, 0.0])
    with pytest.raises(ValueError, match="critic"):
        alg.compute_advantages("gae", t([1.0, 0.0]), masks, 2, cfg=AlgorithmSection())


def test_normalize_advantages_from_the_config_overrides_the_estimators_choice():
    masks = t([1.0, 1, 1], [1.0, 0, 0])
    rewards = t([1.0, 0.0])
    plain = alg.compute_advantages("rloo", rewards, masks, 2, cfg=AlgorithmSection())
    on = alg.compute_advantages("rloo", rewards, masks, 2, cfg=AlgorithmSection(normalize_advantages=True))
    close(on, alg.masked_whiten(plain, masks) * masks)
    # REINFORCE++ whitens by default; normalize_advantages: false turns it off
    rpp_off = alg.compute_advantages("reinforce_plus_plus", rewards, masks, 2,
                                     cfg=AlgorithmSection(normalize_advantages=False))
    close(rpp_off, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    # the keyword wins over the config
    close(alg.compute_advantages("rloo", rewards, masks, 2, cfg=AlgorithmSection(normalize_advantages=True),
                                 normalize_advantages=False), plain)
    assert [alg.whitens_advantages(e) for e in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                                 "grpo", "gspo", "rloo")] == [True] * 3 + [False] * 3
    assert alg.whitens_advantages("gae", False) is False


# --- KL estimators ------------------------------------------------------------------------------------------


def test_kl_estimators_on_explicit_deltas():
    logp, ref = t([0.5, -0.2, 0.0, 3.0]), t([0.0, 0.0, 0.0, 0.0])
    close(alg.approx_kl(logp, ref, "k1"), [0.5, -0.2, 0.0, 3.0])
    close(alg.approx_kl(logp, ref, "k2"), [0.125, 0.02, 0.0, 4.5])
    k3 = [math.exp(-0.5) - 0.5, math.exp(0.2) - 1.2, 0.0, math.exp(-3) + 2]
    close(alg.approx_kl(logp, ref, "k3"), k3)
    close(alg.approx_kl(logp, ref, "low_var_kl"), k3)
    # d = -20: k3 = exp(20) - 21, clamped to 10 by low_var_kl only.
    close(alg.approx_kl(t([-20.0]), t([0.0]), "low_var_kl"), [10.0])
    close(alg.approx_kl(t([-20.0]), t([0.0]), "k3"), [math.exp(20) - 21], tol=1e-3)
    with pytest.raises(ValueError):
        alg.approx_kl(logp, ref, "k4")


# --- PPO clip, dual clip, GSPO ------------------------------------------------------------------------------


def _ratio_case(ratios, adv, **kw):
    old = torch.zeros(1, len(ratios), dtype=F64)
    logp = torch.log(t([ratios]))
    return alg.policy_loss(logp, old, t([adv]), torch.ones_like(old), **kw)


def test_ppo_clip_positive_advantage():
    # A = 1, eps 0.2 / eps_high 0.28. r=1.5: L1=-1.5, L2=-1.28 -> -1.28 clipped. r=1.1: -1.1 not clipped.
    # r=0.5: L1=-0.5, L2=-0.8 -> max is -0.5, not clipped (the lower clip only binds for A < 0).
    loss, clipfrac, ppo_kl = _ratio_case([1.5, 1.1, 0.5], [1.0, 1.0, 1.0], eps_clip=0.2, eps_clip_high=0.28)
    close(loss, [[-1.28, -1.1, -0.5]])
    close(clipfrac, [[1.0, 0.0, 0.0]])
    close(ppo_kl, [[-math.log(1.5), -math.log(1.1), -math.log(0.5)]])


def test_ppo_clip_negative_advantage_and_dual_clip():
    # A = -1. r=0.5: L1=0.5, L2=0.8 -> 0.8 clipped. r=5: L1=5, L2=1.28 -> 5; dual clip c=3 -> min(3, 5)=3.
    # r=2: L=2 < 3, dual clip inactive.
    loss, clipfrac, _ = _ratio_case([0.5, 5.0, 2.0], [-1.0, -1.0, -1.0], eps_clip=0.2, eps_clip_high=0.28)
    close(loss, [[0.8, 5.0, 2.0]])
    close(clipfrac, [[1.0, 0.0, 0.0]])
    loss_dc, _, _ = _ratio_case([0.5, 5.0, 2.0], [-1.0, -1.0, -1.0], eps_clip=0.2, eps_clip_high=0.28,
                                eps_clip_c=3.0)
    close(loss_dc, [[0.8, 3.0, 2.0]])
    # Dual clip leaves positive advantages alone: r=5, A=+1 -> -1.28.
    loss_pos, _, _ = _ratio_case([5.0], [1.0], eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    close(loss_pos, [[-1.28]])
    with pytest.raises(ValueError):
        _ratio_case([1.0], [-1.0], eps_clip_c=0.5)


def test_eps_clip_high_defaults_to_eps_clip():
    loss, clipfrac, _ = _ratio_case([1.5], [1.0], eps_clip=0.2)
    close(loss, [[-1.2]])
    close(clipfrac, [[1.0]])


def test_gspo_ratio_is_sequence_masked_mean():
    logp = t([-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0])
    old = t([-1.5, -2.5, -9.0], [-1.2, -0.8, -1.3])
    mask = t([1.0, 1.0, 0.0], [1.0, 1.0, 1.0])
    adv = torch.ones_like(logp)
    # seq 1: ((-0.5) + (-0.5)) / 2 = -0.5 (third token masked); seq 2: (-0.2 + 0.2 - 0.3) / 3 = -0.1.
    loss, _, ppo_kl = alg.policy_loss(logp, old, adv, mask, eps_clip=10.0, gspo=True)
    close(ppo_kl, [[-0.5] * 3, [-0.1] * 3])
    close(loss, [[-math.exp(0.5)] * 3, [-math.exp(0.1)] * 3])


def test_ppo_kl_is_exactly_zero_on_the_first_step():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    loss, clipfrac, ppo_kl = alg.policy_loss(logp, logp.clone(), adv, torch.ones(3, 5))
    assert torch.equal(ppo_kl, torch.zeros(3, 5))
    assert torch.equal(clipfrac, torch.zeros(3, 5))
    assert torch.equal(loss, -adv)


def test_cispo_by_hand_keeps_every_tokens_gradient():
    # r = (1.5, 1.1, 0.5, 0.5); A = (1, 1, 1, -1); eps_low 0.2, eps_high 0.28 -> w = (1.28, 1.1, 0.8, 0.8).
    # Loss per token -w * A * logp; its gradient -w * A: the clipped tokens (1 and 3, 4) still get one, where
    # PPO's clip zeroes it (r=1.5, A>0 and r=0.5, A<0).
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    logp = (old + torch.log(t([[1.5, 1.1, 0.5, 0.5]])))
    logp_grad = logp.clone().requires_grad_()
    adv = t([[1.0, 1.0, 1.0, -1.0]])
    loss, clipfrac, ppo_kl = alg.cispo_loss(logp_grad, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    w = t([[1.28, 1.1, 0.8, 0.8]])
    close(loss, -w * adv * logp)
    close(clipfrac, [[1.0, 0.0, 1.0, 1.0]])
    close(ppo_kl, old - logp)
    loss.sum().backward()
    close(logp_grad.grad, -w * adv)
    ppo_grad = logp.clone().requires_grad_()
    alg.policy_loss(ppo_grad, old, adv, torch.ones(1, 4), eps_clip=0.2, eps_clip_high=0.28)[0].sum().backward()
    close(ppo_grad.grad, [[0.0, -1.1, -0.5, 0.0]])  # PPO: clipped tokens drop out; r * -A elsewhere


def test_cispo_equals_ppo_gradient_on_policy_and_eps_low_one_has_no_lower_bound():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(2, 3, generator=g, dtype=F64)
    adv = torch.randn(2, 3, generator=g, dtype=F64)
    grads = []
    for kind in ("ppo_clip", "cispo"):
        x = logp.clone().requires_grad_()
        cfg = AlgorithmSection(policy_loss=kind)
        alg.compute_loss(x, logp, adv, torch.ones(2, 3), alg.make_reducer("token_mean", torch.ones(2, 3)),
                         cfg).loss.backward()
        grads.append(x.grad)
    close(grads[0], grads[1])  # r == 1: the same gradient -A / n
    loss, clipfrac, _ = alg.cispo_loss(t([[math.log(0.01)]]), t([[0.0]]), t([[-1.0]]), eps_clip=1.0,
                                       eps_clip_high=4.0)
    close(clipfrac, [[0.0]])  # weight 0.01 kept: eps_low 1.0 is no lower bound
    close(loss, [[0.01 * math.log(0.01)]])


# --- TIS ----------------------------------------------------------------------------------------------------


def test_tis_clamps_at_both_ends():
    old_train = torch.log(t([3.0, 0.5, 0.01, 1.0]))
    w, m = alg.tis_weights(old_train, torch.zeros(4, dtype=F64), tis_clip=2.0, tis_clip_low=0.1)
    close(w, [2.0, 0.5, 0.1, 1.0])
    close(m["tis"], [3.0, 0.5, 0.01, 1.0])
    close(m["tis_clipfrac"], [1.0, 0.0, 1.0, 0.0])
    close(m["tis_abs"], [2.0, 0.5, 0.99, 0.0])
    assert not w.requires_grad


# --- Reductions ---------------------------------------------------------------------------------------------

# Samples A, B share rollout 0 (mask tokens 3 + 1 = 4); C is rollout 1 (2 tokens). Masked-out values are junk.
VALUES = [[1.0, 2.0, 3.0, 100.0], [4.0, 50.0, 50.0, 50.0], [5.0, 7.0, 60.0, 60.0]]
MASK = [[1.0, 1, 1, 0], [1.0, 0, 0, 0], [1.0, 1, 0, 0]]
IDS = [0, 0, 1]


def test_rollout_token_mean_by_hand_and_micro_batch_additivity():
    values, mask = t(*VALUES), t(*MASK)
    sums = alg.compute_rollout_mask_sums(mask, IDS)
    assert sums == {0: 4.0, 1: 2.0}
    # rollout 0: (1+2+3+4)/4 = 2.5; rollout 1: (5+7)/2 = 6; mean over 2 rollouts = 4.25.
    close(alg.rollout_token_mean(values, mask, IDS, sums), 4.25)
    # micro-batches {A, C} and {B}, which splits rollout 0: (6/4 + 12/2)/2 = 3.75 and (4/4)/2 = 0.5.
    mb1 = alg.rollout_token_mean(values[[0, 2]], mask[[0, 2]], [0, 1], sums)
    mb2 = alg.rollout_token_mean(values[[1]], mask[[1]], [0], sums)
    close(mb1, 3.75)
    close(mb2, 0.5)


def test_micro_batch_gradients_add_up_to_the_full_batch():
    values, mask = t(*VALUES), t(*MASK)
    sums = alg.compute_rollout_mask_sums(mask, IDS)
    full = values.clone().requires_grad_()
    alg.rollout_token_mean(full, mask, IDS, sums).backward()
    acc = values.clone().requires_grad_()
    for rows in ([0, 2], [1]):
        red = alg.make_reducer("rollout_token_mean", mask[rows], rollout_ids=[IDS[r] for r in rows],
                               rollout_mask_sums=sums)
        red(acc[rows]).backward()
    close(acc.grad, full.grad)
    # d/dv = mask / rollout_tokens / num_rollouts
    close(full.grad, [[1 / 8, 1 / 8, 1 / 8, 0], [1 / 8, 0, 0, 0], [1 / 4, 1 / 4, 0, 0]])


def test_sequence_and_token_mean():
    values, mask = t(*VALUES), t(*MASK)
    close(alg.sequence_mean(values, mask), (2.0 + 4.0 + 6.0) / 3)
    close(alg.token_mean(values, mask), 22.0 / 6)
    # with step-wide denominators the micro-batches add up
    s = alg.sequence_mean(values[:2], mask[:2], num_samples=3) + alg.sequence_mean(values[2:], mask[2:], 3)
    close(s, 4.0)
    tok = alg.token_mean(values[:1], mask[:1], num_tokens=6) + alg.token_mean(values[1:], mask[1:], 6)
    close(tok, 22.0 / 6)


def test_seq_mean_token_sum_and_its_constant_normaliser_by_hand():
    values, mask = t(*VALUES), t(*MASK)
    # token sums per sample: 6, 4, 12
    close(alg.seq_mean_token_sum(values, mask), 22.0 / 3)
    close(alg.seq_mean_token_sum(values, mask, loss_scale_factor=4), 22.0 / 3 / 4)
    s = alg.seq_mean_token_sum(values[:1], mask[:1], 3, 4)
    s = s + alg.seq_mean_token_sum(values[1:], mask[1:], 3, 4)
    close(s, 22.0 / 12)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        alg.make_reducer("seq_mean_token_sum_norm", mask, num_samples=3)
    with pytest.raises(ValueError, match="seq_mean_token_sum_norm"):
        alg.make_reducer("token_sum", mask)


# each sample its own rollout, as in the actor; full-step value of each reduction by hand
STEP_REDUCTIONS = {"rollout_token_mean": (2.0 + 4.0 + 6.0) / 3, "sequence_mean": (2.0 + 4.0 + 6.0) / 3,
                   "token_mean": 22.0 / 6, "seq_mean_token_sum": 22.0 / 3,
                   "seq_mean_token_sum_norm": 22.0 / 3 / 5}


@pytest.mark.parametrize("kind", list(STEP_REDUCTIONS))
def test_step_reducers_add_up_over_micro_batches_and_report_token_means(kind):
    from hpcrl.config import Config

    cfg = Config()
    cfg.algorithm.loss_reduction = kind
    cfg.rollout.max_new_tokens = 5  # seq_mean_token_sum_norm's default constant
    values, mask = t(*VALUES), t(*MASK)
    ids = [0, 1, 2]
    sums = alg.compute_rollout_mask_sums(mask, ids)
    loss, metric = alg.step_reducers(cfg, mask, ids, sums)
    close(loss(values), STEP_REDUCTIONS[kind])
    close(metric(values), (2.0 + 4.0 + 6.0) / 3)
    full = values.clone().requires_grad_()
    loss(full).backward()
    acc = values.clone().requires_grad_()
    total = 0.0
    for rows in ([0, 2], [1]):
        red, _ = alg.step_reducers(cfg, mask[rows], [ids[r] for r in rows], sums)
        part = red(acc[rows])
        part.backward()
        total = total + part.detach()
    close(total, STEP_REDUCTIONS[kind])
    close(acc.grad, full.grad)
    if kind == "seq_mean_token_sum_norm":
        cfg.algorithm.loss_scale_factor = 2
        close(alg.step_reducers(cfg, mask, ids, sums)[0](values), 22.0 / 3 / 2)


# --- REINFORCE++ --------------------------------------------------------------------------------------------


def test_discounted_returns_gamma_one_and_below():
    close(alg.discounted_returns(t([[1.0, 2.0, 3.0]]), 1.0), [[6.0, 5.0, 3.0]])
    close(alg.discounted_returns(t([[1.0, 2.0, 4.0]]), 0.5), [[1 + 0.5 * (2 + 0.5 * 4), 2 + 0.5 * 4, 4.0]])


def test_reinforce_plus_plus_returns_by_hand():
    kl = t([[0.2, 0.4, 0.6, 9.0], [0.2, 0.4, 0.6, 9.0]])
    mask = t([1.0, 1, 1, 0], [1.0, 0, 1, 0])
    out = alg.reinforce_plus_plus_returns(t([1.0, 1.0]), kl, mask, kl_coef=0.1, gamma=0.5)
    # row 1: token rewards (-.02, -.04, -.06 + 1, 0) -> G2 = .94, G1 = -.04 + .5*.94 = .43, G0 = -.02 + .5*.43
    # row 2: the hole at t=1 earns no KL penalty: G2 = .94, G1 = .47 (masked to 0), G0 = -.02 + .5*.47
    close(out, [[0.195, 0.43, 0.94, 0.0], [0.215, 0.0, 0.94, 0.0]])


def test_an_empty_response_gets_zero_returns_and_a_rollout_of_them_trains_nothing():
    """REINFORCE++ with an empty response (no loss-mask token, which the actor allows): that row's returns
    are 0 and the others' are unchanged (it used to raise); a rollout of only empty responses gives zero
    advantages instead of failing in the whitening (the same for GAE: tests/unit/test_critic.py)."""
    kl = t([[0.2, 0.4], [0.0, 0.0]])
    out = alg.reinforce_plus_plus_returns(t([1.0, 5.0]), kl, t([1.0, 1], [0.0, 0]), kl_coef=0.1, gamma=0.5)
    close(out, [[-0.02 + 0.5 * 0.96, 0.96], [0.0, 0.0]])
    for estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo", "rloo"):
        adv = alg.compute_advantages(estimator, t([1.0, 0.0]), [torch.ones(0), torch.ones(0)], 2)
        assert [a.numel() for a in adv] == [0, 0], estimator
        adv = alg.compute_advantages(estimator, t([1.0, 0.0]), [torch.ones(2), torch.ones(0)], 2)
        assert adv[1].numel() == 0 and torch.isfinite(adv[0]).all(), estimator


def test_reinforce_plus_plus_baseline_by_hand():
    centred = alg.group_centered_rewards(t([1.0, 0.0, 1.0, 1.0]), 2)
    close(centred, [0.5, -0.5, 0.0, 0.0])
    kl = t([0.1, 0.2], [0.3, 0.0], [0.0, 0.0], [1.0, 1.0])
    mask = t([1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0])
    adv = alg.reinforce_plus_plus_baseline_advantages(centred, kl, mask, kl_coef=0.5)
    close(adv, [[0.45, 0.4], [-0.65, 0.0], [0.0, 0.0], [-0.5, -0.5]])


def test_masked_whiten_by_hand():
    out = alg.masked_whiten(t([1.0, 2.0, 3.0, 100.0]), t([1.0, 1.0, 1.0, 0.0]))
    # masked mean 2, Bessel variance ((1 + 0 + 1) / 2) = 1
    s = 1 / math.sqrt(1 + 1e-8)
    close(out, [-s, 0.0, s, 98 * s])


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_advantages_are_whitened(estimator):
    rewards = t([1.0, 0.0, 0.0, 1.0])
    masks = [torch.tensor(m) for m in ([1.0, 1, 1], [1.0, 0], [1.0, 1, 1, 1], [1.0])]
    kl = [torch.tensor(k) for k in ([0.1, 0.2, 0.3], [0.5, 0.5], [0.0, 0.1, 0.2, 0.3], [0.4])]
    cfg = AlgorithmSection(advantage_estimator=estimator, gamma=0.9)
    adv = alg.compute_advantages(estimator, rewards, masks, 2, kl=kl, cfg=cfg, kl_coef=0.1)
    a = torch.cat(adv)
    m = torch.cat(masks).to(F64)
    n = m.sum()
    mean = (a * m).sum() / n
    var = ((a - mean) ** 2 * m).sum() / (n - 1)
    close(mean, 0.0, tol=1e-9)
    close(var, 1.0, tol=1e-6)
    assert adv[1][1] == 0.0  # masked-out token
    assert [x.shape[0] for x in adv] == [3, 2, 4, 1]


# --- Total loss ---------------------------------------------------------------------------------------------


def test_compute_loss_total_and_gradient_by_hand():
    cfg = AlgorithmSection(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1)
    old = t([[-1.0, -2.0]])
    logp = old.clone().requires_grad_()
    mask, adv = t([[1.0, 1.0]]), t([[1.0, 1.0]])
    reduce = alg.make_reducer("token_mean", mask)
    entropy, ref = t([[2.0, 4.0]]), t([[-1.2, -2.4]])
    out = alg.compute_loss(logp, old, adv, mask, reduce, cfg, entropy=entropy, ref_logp=ref)
    # pg: ratio 1 -> -A, mean -1; entropy mean 3; k1 = (0.2, 0.4) mean 0.3.
    # loss = -1 - 0.1 * 3 + 0.5 * 0.3 = -1.15
    close(out.loss, -1.15)
    close(out.pg_loss, -1.0)
    close(out.entropy, 3.0)
    close(out.kl_loss, 0.3)
    close(out.pg_clipfrac, 0.0)
    close(out.ppo_kl, 0.0)
    assert out.tis is None
    out.loss.backward()
    # d/dlogp: pg -A*r/2 = -0.5, kl 0.5 * 1/2 = 0.25 -> -0.25 per token
    close(logp.grad, [[-0.25, -0.25]])
    assert set(out.metrics()) == {"loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss"}


def test_compute_loss_with_tis_scales_pg_loss():
    cfg = AlgorithmSection(use_tis=True, tis_clip=2.0)
    old = t([[0.0, 0.0]])
    mask, adv = t([[1.0, 1.0]]), t([[1.0, 1.0]])
    reduce = alg.make_reducer("sequence_mean", mask)
    rollout = torch.log(t([[0.25, 2.0]]))  # w = clamp((4, 0.5), 0, 2) = (2, 0.5)
    out = alg.compute_loss(old.clone(), old, adv, mask, reduce, cfg, rollout_logp=rollout)
    close(out.pg_loss, (-2.0 - 0.5) / 2)
    close(out.tis, (4.0 + 0.5) / 2)
    close(out.tis_clipfrac, 0.5)
    close(out.tis_abs, (3.0 + 0.5) / 2)


# --- MIS (masked importance sampling) -----------------------------------------------------------------------

# Log-ratios log(pi_old / pi_rollout) per token (rollout log-probs 0, so old_logp IS the log-ratio) of four
# samples, and their loss masks: C's second token does not train (tool output, an extreme ratio that must not
# count); C's third and D's third are padding.
MIS_LOG_RATIO = [[0.3, 0.3, 0.3], [1.0, -1.0, 0.1], [0.1, 5.0, 0.0], [0.8, 0.8, 0.0]]
MIS_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


@pytest.mark.parametrize("level,keep", [
    # token: exp(0.3) = 1.35 kept; B: e = 2.72 and 1/e = 0.37 out, 1.105 kept; D: exp(0.8) = 2.23 out.
    ("token", [[1, 1, 1], [0, 0, 1], [1, 1, 1], [0, 0, 1]]),
    # sequence: A exp(0.9) = 2.46 out; B exp(0.1) kept; C exp(0.1) kept (the 5.0 is not a loss token);
    # D exp(1.6) = 4.95 out.
    ("sequence", [[0, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 1]]),
    # geometric: A exp(0.3), B exp(0.1 / 3), C exp(0.1) kept; D exp(1.6 / 2) = 2.23 out.
    ("geometric", [[1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 1]]),
])
def test_mis_mask_levels_mask_exactly_the_tokens_by_hand(level, keep):
    old, mask = t(*MIS_LOG_RATIO), t(*MIS_MASK)
    k, m = alg.mis_mask(old, torch.zeros_like(old), mask, level, low=0.5, high=2.0)
    close(k, keep)
    close(m["mis_masked_frac"], (1.0 - t(*keep)) * mask)
    seq = [float(any(kk == 0 for kk in row)) for row in keep]
    close(m["mis_masked_seq_frac"], t(*[[s] * 3 for s in seq]))
    # Reduced like the loss: token_mean gives the share of loss tokens masked, sequence_mean the share of
    # samples with a masked token (9 loss tokens, 4 samples).
    masked_tokens = sum(1 - kk for row, mrow in zip(keep, MIS_MASK) for kk, mm in zip(row, mrow) if mm)
    close(alg.token_mean(m["mis_masked_frac"], mask), masked_tokens / 9)
    close(alg.sequence_mean(m["mis_masked_seq_frac"], mask), sum(seq) / 4)


def test_mis_mask_bounds_inclusive_log_space_and_no_lower_bound():
    old = t([[math.log(2.0), math.log(0.5), 30.0, -30.0]])  # exp(+-30): far outside, no overflow in log space
    mask = t([[1.0, 1.0, 1.0, 1.0]])
    k, _ = alg.mis_mask(old, torch.zeros_like(old), mask, "token", low=0.5, high=2.0)
    close(k, [[1.0, 1.0, 0.0, 0.0]])  # slime's mask mode: low <= r <= high is kept
    k, _ = alg.mis_mask(old, torch.zeros_like(old), mask, "token", low=0.0, high=2.0)
    close(k, [[1.0, 1.0, 0.0, 1.0]])  # low 0: no lower bound
    empty = torch.zeros(1, 3, dtype=F64)  # a sample without loss tokens: ratio 1 at any level, none masked
    for level in ("sequence", "geometric"):
        k, m = alg.mis_mask(t([[9.0, 9.0, 9.0]]), empty.clone(), empty, level)
        close(k, [[1.0, 1.0, 1.0]])
        close(m["mis_masked_seq_frac"], [[0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="unknown MIS level 'batch'"):
        alg.mis_mask(old, old, mask, "batch")
    with pytest.raises(ValueError, match="0 <= low < high"):
        alg.mis_mask(old, old, mask, "token", low=2.0, high=2.0)


def test_compute_loss_with_mis_gives_masked_tokens_no_gradient_by_hand():
    cfg = AlgorithmSection(mis_level="token", use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1")
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logp = old.clone().requires_grad_()
    mask, adv = t([[1.0, 1.0, 1.0, 1.0]]), t([[1.0, 1.0, 1.0, 1.0]])
    rollout = t([[0.0, -1.0, 0.0, 1.0]])  # ratios 1, e (out), 1, 1/e (out)
    ref = t([[-0.2, -0.4, -0.6, -0.8]])  # k1 = logp - ref = 0.2, 0.4, 0.6, 0.8
    reduce = alg.make_reducer("token_mean", mask)  # denominator 4: the batch's loss tokens, MIS or not
    out = alg.compute_loss(logp, old, adv, mask, reduce, cfg, ref_logp=ref, rollout_logp=rollout)
    close(out.pg_loss, (-1.0 - 1.0) / 4)
    close(out.kl_loss, (0.2 + 0.6) / 4)
    close(out.loss, -0.5 + 0.5 * 0.2)
    close(out.mis_masked_frac, 0.5)
    close(out.mis_masked_seq_frac, 1.0)
    assert out.tis is None and out.tis_clipfrac is None
    out.loss.backward()
    # kept tokens: pg -A/4 = -0.25, kl 0.5/4 = 0.125; masked tokens: nothing from any term.
    close(logp.grad, [[-0.125, 0.0, -0.125, 0.0]])
    with pytest.raises(ValueError, match="mis_level needs the rollout engine's log-probs"):
        alg.compute_loss(logp, old, adv, mask, reduce, cfg, ref_logp=ref)


def test_compute_loss_tis_then_geometric_mis_by_hand():
    cfg = AlgorithmSection(use_tis=True, tis_clip=2.0, mis_level="geometric", mis_low=0.5, mis_high=2.0)
    old = t([[0.0, 0.0], [0.0, 0.0]])
    mask, adv = t([[1.0, 1.0], [1.0, 1.0]]), t([[1.0, 1.0], [1.0, 1.0]])
    # sample 0: log-ratios 2, 2 (geometric e^2: masked); sample 1: log 4, log 1/4 (geometric 1: kept), TIS
    # weights clamp(4, 0, 2) = 2 and 0.25.
    rollout = t([[-2.0, -2.0], [-math.log(4.0), math.log(4.0)]])
    logp = old.clone().requires_grad_()
    reduce = alg.make_reducer("sequence_mean", mask)
    out = alg.compute_loss(logp, old, adv, mask, reduce, cfg, rollout_logp=rollout)
    close(out.pg_loss, (0.0 + (-2.0 - 0.25) / 2) / 2)
    close(out.tis, (math.exp(2.0) + (4.0 + 0.25) / 2) / 2, tol=1e-9)  # TIS metrics: over all loss tokens
    close(out.tis_clipfrac, (1.0 + 0.5) / 2)
    close(out.mis_masked_frac, 0.5)
    close(out.mis_masked_seq_frac, 0.5)
    out.loss.backward()
    close(logp.grad, [[0.0, 0.0], [-2.0 / 4, -0.25 / 4]])


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_compute_loss_with_mis_masking_nothing_equals_the_loss_without(level):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=F64)
    rollout = old + 0.05 * (torch.rand(3, 5, generator=g, dtype=F64) - 0.5)  # ratios within exp(+-0.025)
    logp0 = old + 0.1 * torch.randn(3, 5, generator=g, dtype=F64)
    mask = t([[1.0] * 5, [1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    adv, ent, ref = (torch.randn(3, 5, generator=g, dtype=F64) for _ in range(3))
    outs, grads = [], []
    for mis in (None, level):
        cfg = AlgorithmSection(use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01,
                               mis_level=mis)
        logp = logp0.clone().requires_grad_()
        reduce = alg.make_reducer("rollout_token_mean", mask, rollout_ids=[0, 1, 2],
                                  rollout_mask_sums={0: 5.0, 1: 3.0, 2: 3.0})
        out = alg.compute_loss(logp, old, adv, mask, reduce, cfg, entropy=ent, ref_logp=ref,
                               rollout_logp=rollout)
        out.loss.backward()
        outs.append(out.metrics())
        grads.append(logp.grad)
    assert outs[1].pop("mis_masked_frac") == 0.0 and outs[1].pop("mis_masked_seq_frac") == 0.0
    assert outs[0] == outs[1]
    assert torch.equal(grads[0], grads[1])
