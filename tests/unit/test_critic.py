"""hpcrl.train.critic at world size 1 (gloo), on the real tiny Qwen2 in megatron-core: the value head reads
the value of response token j where the actor reads its log-prob (checked against an HF forward of the same
weights), a sample's values do not depend on its micro-batch or on the packed layout, a reward model's
``score`` head is loaded, and the PPO path of :class:`~hpcrl.train.actor.Actor` (GAE) trains."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from hpcrl.train import actor as actor_mod  # noqa: E402
from hpcrl.train.actor import Actor  # noqa: E402
from hpcrl.train.critic import Critic  # noqa: E402
from tests.unit.test_actor import make_config, make_samples, tp1  # noqa: E402,F401 (fixture)


@pytest.fixture(scope="module")
def samples(tiny_model_dir):
    return make_samples(tiny_model_dir, num_groups=2, seed=3, correct_first=True)


def gae_config(**changes):
    return make_config(**{"algorithm.advantage_estimator": "gae", **changes})


def hf_values(model_dir, samples, head: torch.Tensor) -> list[torch.Tensor]:
    """Per sample ``[response_length]``: the HF decoder's last hidden state (after the final norm) at the
    position before each response token, times ``head`` ``[1, hidden]``."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            h = hf(torch.tensor([s.tokens])).last_hidden_state[0]  # [T, hidden]
            t = len(s.tokens)
            out.append((h[t - s.response_length - 1: t - 1] @ head.float().T)[:, 0])
    return out


def micro_batch(samples, positions, packed=False):
    zeros = [torch.zeros(s.response_length) for s in samples]
    return actor_mod.build_micro_batch(samples, positions, zeros, packed=packed)


def test_values_aligned_with_response_tokens_padded_and_packed(tp1, tiny_model_dir, samples):
    critic = Critic(gae_config(), tiny_model_dir)
    head = critic.model.output_layer.weight
    assert tuple(head.shape) == (1, 128) and not head.any()  # a causal LM's folder: the head starts at 0
    assert critic.values([micro_batch(samples, [0, 1])])[0].eq(0).all()
    torch.manual_seed(0)
    with torch.no_grad():
        head.normal_(0, 0.1)
    ref = hf_values(tiny_model_dir, samples, head.detach())
    rows = list(range(len(samples)))
    batched, packed = critic.values([micro_batch(samples, rows), micro_batch(samples, rows, packed=True)])
    assert batched.shape == (len(samples), max(s.response_length for s in samples))
    for i, s in enumerate(samples):
        alone = critic.values([micro_batch(samples, [i])])[0]
        n = s.response_length
        assert alone.shape == (1, n)
        torch.testing.assert_close(alone[0], ref[i], rtol=0, atol=1e-5)  # megatron vs HF, fp32
        torch.testing.assert_close(batched[i, :n], alone[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(packed[i, :n], alone[0], rtol=0, atol=1e-5)
        assert batched[i, n:].eq(0).all() and packed[i, n:].eq(0).all()


def test_score_head_of_a_reward_model_is_loaded_lm_head_is_not(tp1, tiny_model_dir, tmp_path, samples):
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1,
                                                            dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        rm.score.weight.normal_(0, 0.1)
    rm.save_pretrained(tmp_path / "rm")
    critic = Critic(gae_config(**{"critic.path": str(tmp_path / "rm")}), tiny_model_dir)
    assert critic.path == str(tmp_path / "rm")
    assert torch.equal(critic.model.output_layer.weight.detach(), rm.score.weight.detach())
    values = critic.values([micro_batch(samples, [2])])[0][0]
    torch.testing.assert_close(values, hf_values(tmp_path / "rm", samples[2:3], rm.score.weight.detach())[0],
                               rtol=0, atol=1e-5)
    from hpcrl.models.tiny import create_tiny_qwen2

    untied = create_tiny_qwen2(tmp_path / "untied", seed=2, tie_word_embeddings=False)  # lm_head unused
    head = Critic(gae_config(**{"critic.path": str(untied)}), tiny_model_dir).model.output_layer.weight
    assert not head.any()
    rm3 = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=3)
    rm3.save_pretrained(tmp_path / "rm3")
    with pytest.raises(ValueError, match=r"score.weight has shape \(3, 128\)"):
        Critic(gae_config(**{"critic.path": str(tmp_path / "rm3")}), tiny_model_dir)


# --- the PPO (GAE) path of Actor.train ------------------------------------------------------------------


def test_critic_only_warmup_then_ppo_step(tp1, tiny_model_dir, samples):
    """Two critic-only rollouts leave the actor bitwise as it was and lower the value loss on the same
    samples; the third trains the actor with the CI gates (first-step ppo_kl exactly 0), its learning-rate
    warm-up starting at that first actor step (not used up by the critic-only rollouts)."""
    from tests.unit.test_actor import weights_of

    cfg = gae_config(**{"critic.warmup_steps": 2, "critic.lr": 3e-4, "run.num_rollout": 4,
                        "train.num_steps_per_rollout": 2, "train.micro_batch_size": 3,
                        "train.lr_warmup_steps": 2})
    actor = Actor(cfg, tiny_model_dir, ci_checks=True)
    assert actor.critic is not None and actor.weights.tags == ()
    initial = weights_of(actor)
    metrics = [actor.train(r, samples) for r in range(3)]
    for m in metrics[:2]:
        assert m["train/num_steps"] == 0.0 and "train/loss" not in m and "train/first_step_ppo_kl" not in m
    assert metrics[0]["critic/values_mean"] == 0.0  # the zero head
    assert metrics[0]["critic/explained_variance"] == pytest.approx(0.0, abs=1e-12)  # V = 0
    assert metrics[1]["critic/value_loss"] < metrics[0]["critic/value_loss"]
    assert metrics[2]["critic/value_loss"] < metrics[1]["critic/value_loss"]
    assert metrics[2]["critic/explained_variance"] > metrics[0]["critic/explained_variance"]
    for key in ("value_clipfrac", "grad_norm", "lr", "seconds"):
        assert all(math.isfinite(m[f"critic/{key}"]) for m in metrics), key
    assert metrics[2]["critic/lr"] == 3e-4 and metrics[2]["critic/grad_norm"] > 0
    third = metrics[2]
    assert third["train/num_steps"] == 2.0 and third["train/first_step_ppo_kl"] == 0.0
    assert [m["lr"] for m in actor.step_metrics] == pytest.approx([0.0, cfg.train.lr / 2])  # warm-up steps 0, 1
    assert third["train/grad_norm"] > 0
    trained = weights_of(actor)
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-5


def test_an_empty_response_trains_nothing(tp1, tiny_model_dir, samples):
    import dataclasses

    s = samples[1]
    empty = dataclasses.replace(s, tokens=s.tokens[: s.prompt_length], response_length=0, loss_mask=[],
                                rollout_log_probs=[])
    actor = Actor(gae_config(), tiny_model_dir, ci_checks=True)
    m = actor.train(0, [samples[0], empty, *samples[2:]])
    assert m["train/grad_norm"] > 0 and m["critic/grad_norm"] > 0


def test_packed_critic_step_equals_the_padded_one(tp1, tiny_model_dir, samples):
    runs = []
    for extra in ({}, {"train.max_tokens_per_microbatch": 64}):
        cfg = gae_config(**{"critic.warmup_steps": 2, "critic.lr": 3e-4, "run.num_rollout": 3}, **extra)
        actor = Actor(cfg, tiny_model_dir)
        runs.append([actor.train(r, samples) for r in range(2)])
    padded, packed = runs
    assert packed[0]["train/forward_tokens"] < padded[0]["train/forward_tokens"]
    for a, b in zip(padded, packed):
        for key in ("value_loss", "grad_norm", "values_mean", "explained_variance"):
            assert b[f"critic/{key}"] == pytest.approx(a[f"critic/{key}"], rel=1e-5, abs=1e-7), key


def test_kl_in_reward_keeps_the_reference_and_is_zero_at_rollout_0(tp1, tiny_model_dir, samples):
    """algorithm.kl_coef with REINFORCE++: the reference weights are kept and the old log-probs recomputed; at
    rollout 0 the policy is the reference (KL exactly 0), so the step is bitwise the one without the penalty;
    after it the penalty changes the advantages."""
    base = {"algorithm.advantage_estimator": "reinforce_plus_plus"}
    plain = Actor(make_config(**base), tiny_model_dir, recompute_log_probs=True)
    shaped = Actor(make_config(**base, **{"algorithm.kl_coef": 0.5}), tiny_model_dir, ci_checks=True)
    assert shaped.weights.tags == ("ref",) and shaped.recompute and plain.weights.tags == ()
    a, b = plain.train(0, samples), shaped.train(0, samples)
    assert b["train/ref_logprob_diff"] == 0.0 and "train/kl_loss" not in b
    assert a["train/loss"] == b["train/loss"] and a["train/grad_norm"] == b["train/grad_norm"]
    a, b = plain.train(1, samples), shaped.train(1, samples)
    assert a["train/loss"] != b["train/loss"]
