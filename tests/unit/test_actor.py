"""hpcrl.train.actor at world size 1, in this process (gloo): the real tiny Qwen2 in megatron-core.

Samples are built by hand from the tiny character tokenizer: arithmetic prompts, random responses, and rollout
log-probs from an HF transformers forward of the same weights (fp32, at the rollout temperature), as an engine
would report them. The tests check that one ``train()`` call learns, that slime's CI gates hold (first-step
``ppo_kl`` and the rollout-0 reference diff are exactly 0), that the on-policy shortcut, the micro-batch size
and the reference-weight swap do not change the step, that two actors with the same seed stay bitwise equal,
and that a GRPO step raises the log-prob of the rewarded answers. The 2-process (TP=2, DP=2) version is
tests/integration/test_actor_tp2.py, which reuses :func:`make_samples` and :func:`make_config`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest
import torch

pytest.importorskip("megatron.core")

from hpcrl.config import Config  # noqa: E402
from hpcrl.data.sample import Sample  # noqa: E402
from hpcrl.names import LOSS_REDUCTIONS  # noqa: E402
from hpcrl.train import actor as actor_mod  # noqa: E402
from hpcrl.train import bridge, parallel, model as tmodel  # noqa: E402
from hpcrl.train.actor import Actor, WeightBackup, split_steps  # noqa: E402

TEMPERATURE = 0.7
N = 4  # samples per prompt

# --- helpers shared with the TP=2 integration test ------------------------------------------------------


def make_config(**changes) -> Config:
    """A small run config: 4 samples per prompt, micro-batches of 4, Adam lr 1e-3; ``changes`` are dotted
    ``section.field`` keys (``"train.micro_batch_size": 16``)."""
    cfg = Config()
    cfg.rollout.n_samples_per_prompt = N
    cfg.rollout.temperature = TEMPERATURE
    cfg.train.micro_batch_size = 4
    cfg.train.lr = 1e-3
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def hf_response_log_probs(hf_model, samples, temperature=TEMPERATURE) -> list[torch.Tensor]:
    """Per sample, the response tokens' log-probs ``[response_length]`` from an HF forward (fp32)."""
    out = []
    with torch.no_grad():
        for s in samples:
            tokens = torch.tensor([s.tokens])
            logp = torch.log_softmax(hf_model(tokens).logits[0, :-1].float() / temperature, -1)
            lp = logp.gather(-1, tokens[0, 1:, None])[:, 0]
            out.append(lp[-s.response_length:])
    return out


def make_samples(model_dir, num_groups: int = 4, seed: int = 0, correct_first: bool = False) -> list[Sample]:
    """``num_groups`` prompts ``"a+b="`` with :data:`N` responses each, rollout log-probs from HF.

    Responses are random digit strings of 2-6 characters (the last token sometimes masked out, as a tool token
    would be); reward 1 when the response is the right sum, else 0. With ``correct_first`` the first response
    of each group is the right sum followed by ``</s>``, so each group has a positive and negative advantages.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = random.Random(seed)
    samples = []
    for g in range(num_groups):
        a, b = rng.randrange(10, 50), rng.randrange(10, 50)
        prompt = tok.encode(f"{a}+{b}=", add_special_tokens=False)
        for k in range(N):
            if correct_first and k == 0:
                text = str(a + b)
            else:
                text = "".join(rng.choice("0123456789") for _ in range(rng.randrange(2, 7)))
            response = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            mask = [1] * len(response)
            if rng.random() < 0.25:
                mask[-1] = 0
            samples.append(Sample(group_index=g, index=len(samples), prompt=f"{a}+{b}=", label=str(a + b),
                                  tokens=prompt + response, response=text, response_length=len(response),
                                  loss_mask=mask, reward=float(text == str(a + b))))
    for s, lp in zip(samples, hf_response_log_probs(hf, samples)):
        s.rollout_log_probs = [0.0 if m == 0 else float(v) for v, m in zip(lp, s.loss_mask)]
    return samples


def weights_of(actor) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in bridge.export_hf_weights(actor.ddp_model)}


# --- the plain loop hpcrl ran before megatron-core's schedule (issue #54 point 2): the reference ----------


def plain_train_step(ddp_model, optimizer, loss_fn, micro_batches, aux_loss_scale: str = "mean") -> dict:
    """One optimizer step without megatron's schedule, as hpcrl's ``train_step`` was until issue #54: each
    micro-batch's loss (times the loss scale) backward in turn, then the data-parallel reduction, the
    tensor-parallel sum of replicated gradients, megatron's expert-bias step, ``optimizer.step()``. A MoE
    auxiliary loss is scaled by the loss scale over the micro-batch count (``aux_loss_scale="mean"``, the scale
    megatron's schedule documents and sets) or by the loss scale alone (``"sum"``: what hpcrl's loop did, as it
    never set one). Returns what :func:`hpcrl.train.model.train_step` returns, but the metrics."""
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias, reset_model_temporary_tensors)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from hpcrl.train import deepseek_moe

    micro_batches = list(micro_batches)
    device = next(ddp_model.parameters()).device
    scale = optimizer.scale_loss(torch.ones(1, device=device))
    MoEAuxLossAutoScaler.set_loss_scale(scale / len(micro_batches) if aux_loss_scale == "mean" else scale)
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    deepseek_moe.reset_token_counts(ddp_model)
    total, n = 0.0, 0
    for mb in micro_batches:
        out = finished(loss_fn(ddp_model, mb))
        loss = out[0] if isinstance(out, tuple) else out
        optimizer.scale_loss(loss).backward()
        total, n = total + float(loss.detach()), n + 1
    ddp_model.finish_grad_sync()
    tmodel.sum_replicated_grads_over_tp(ddp_model)
    config = bridge.unwrap_model(ddp_model).config
    if config.moe_router_enable_expert_bias:
        _update_router_expert_bias([ddp_model], config)
    reset_model_temporary_tensors(config, [ddp_model])
    update_successful, grad_norm, num_zeros = optimizer.step()
    return dict(loss=total, grad_norm=grad_norm, update_successful=update_successful, num_zeros=num_zeros,
                num_micro_batches=n)


def plain_forward_only(ddp_model, fn, micro_batches) -> list:
    """``fn`` of each micro-batch in a list comprehension: the forward-only reference."""
    return [finished(fn(ddp_model, mb)) for mb in micro_batches]


def finished(out):
    """A loss or forward function's result: a :class:`hpcrl.train.model.StagedLoss` finished on its output
    (no pipeline: this rank is the last stage), anything else as it is."""
    return out.finish(out.output) if isinstance(out, tmodel.StagedLoss) else out


@contextlib.contextmanager
def plain_loop():
    """While inside, the actor, critic and SFT trainer step through :func:`plain_train_step` /
    :func:`plain_forward_only` (they look both up in :mod:`hpcrl.train.model` at every call)."""
    saved = tmodel.train_step, tmodel.forward_only
    tmodel.train_step, tmodel.forward_only = plain_train_step, plain_forward_only
    try:
        yield
    finally:
        tmodel.train_step, tmodel.forward_only = saved


# --- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp1():
    """gloo world of 1 with megatron-core model parallelism (TP=1), torn down after the module."""
    torch.set_num_threads(1)
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel.destroy()


@pytest.fixture(scope="module")
def samples(tiny_model_dir):
    return make_samples(tiny_model_dir, num_groups=4, seed=0, correct_first=True)


# --- batching -------------------------------------------------------------------------------------------


def test_split_steps_contiguous_global_batches_and_rank_slices():
    local, global_ = split_steps(16, dp_rank=1, dp_size=2, num_steps=2, micro_batch_size=3)
    assert global_ == [list(range(8)), list(range(8, 16))]
    assert local == [[[4, 5, 6], [7]], [[12, 13, 14], [15]]]
    assert split_steps(16, 0, 1, 2, 8) == ([[list(range(8))], [list(range(8, 16))]], global_)
    with pytest.raises(ValueError, match="do not split"):
        split_steps(12, 0, 2, 4, 1)


def test_build_micro_batch_pads_right(samples):
    adv = [torch.full((s.response_length,), float(i)) for i, s in enumerate(samples)]
    mb = actor_mod.build_micro_batch(samples, [1, 2], adv)
    s1, s2 = samples[1], samples[2]
    assert mb.tokens.shape == (2, max(len(s1.tokens), len(s2.tokens)))
    assert mb.tokens[0, : len(s1.tokens)].tolist() == s1.tokens and mb.tokens[0, len(s1.tokens):].eq(0).all()
    assert mb.mask.shape == (2, max(s1.response_length, s2.response_length))
    assert mb.mask[1, : s2.response_length].tolist() == s2.loss_mask
    assert mb.advantages[1, : s2.response_length].eq(2.0).all()
    assert mb.advantages[1, s2.response_length:].eq(0).all()
    assert mb.rollout_log_probs[0, : s1.response_length].tolist() == pytest.approx(s1.rollout_log_probs)
    bad = dataclasses.replace(s1, loss_mask=s1.loss_mask[:-1])
    with pytest.raises(ValueError, match="loss_mask"):
        actor_mod.build_micro_batch([bad], [0], adv)


# --- training -------------------------------------------------------------------------------------------


def test_train_learns_and_passes_ci_gates(tp1, tiny_model_dir, samples):
    actor = Actor(make_config(), tiny_model_dir, ci_checks=True, ci_logprob_abs_diff_threshold=1e-3)
    assert actor.on_policy and not actor.recompute and actor.dp_size == 1
    before = weights_of(actor)
    m = actor.train(0, samples)
    for key in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm", "first_step_ppo_kl",
                "train_rollout_logprob_abs_diff", "seconds", "tokens_per_s"):
        assert torch.isfinite(torch.tensor(m[f"train/{key}"])), key
    assert "train/kl_loss" not in m and "train/tis" not in m and "train/ref_logprob_diff" not in m
    assert m["train/first_step_ppo_kl"] == 0.0 and m["train/grad_norm"] > 0
    assert 0.0 < m["train/train_rollout_logprob_abs_diff"] < 1e-3  # HF fp32 vs megatron on the same weights
    assert 1.0 < m["train/entropy"] < 3.1  # nats, under log(21)
    after = weights_of(actor)
    assert sorted(after) == sorted(before)
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-4


def test_kl_loss_recomputes_swaps_reference_and_gates(tp1, tiny_model_dir, samples):
    cfg = make_config(**{"algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.5,
                         "algorithm.kl_loss_type": "low_var_kl", "algorithm.use_tis": True,
                         "algorithm.entropy_coef": 0.01, "train.num_steps_per_rollout": 2})
    actor = Actor(cfg, tiny_model_dir, ci_checks=True, ci_logprob_abs_diff_threshold=1e-3)
    assert actor.recompute and actor.weights.tags == ("ref",)
    initial = weights_of(actor)
    m0 = actor.train(0, samples)
    assert m0["train/ref_logprob_diff"] == 0.0 and m0["train/first_step_ppo_kl"] == 0.0
    assert m0["train/num_steps"] == 2.0
    assert m0["train/ppo_kl"] != 0.0  # the second step sees the first step's update
    for key in ("kl_loss", "tis", "tis_clipfrac", "tis_abs"):
        assert f"train/{key}" in m0
    assert m0["train/tis"] == pytest.approx(1.0, abs=1e-3)  # recomputed vs HF log-probs: same weights
    trained = weights_of(actor)
    actor.ci_logprob_abs_diff_threshold = None  # the rollout log-probs are those of the initial weights
    m1 = actor.train(1, samples)
    assert "train/ref_logprob_diff" not in m1 and m1["train/first_step_ppo_kl"] == 0.0
    assert m1["train/kl_loss"] > 0.0  # low_var_kl to the initial weights, which the model moved away from
    # The swap put the trained weights back (rollout 1 started from them); the ref copy is the initial model.
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-4
    with actor.weights.swapped("ref"):
        assert all(torch.equal(initial[k], v) for k, v in bridge.export_hf_weights(actor.ddp_model))
    assert not all(torch.equal(initial[k], v) for k, v in bridge.export_hf_weights(actor.ddp_model))


def test_ci_gates_raise_with_metric_name(tp1, tiny_model_dir, samples, monkeypatch):
    actor = Actor(make_config(), tiny_model_dir, ci_checks=True, recompute_log_probs=True)
    forward_only = actor._forward_only
    monkeypatch.setattr(actor, "_forward_only", lambda mbs: [lp + 1e-3 for lp in forward_only(mbs)])
    with pytest.raises(AssertionError, match="train/first_step_ppo_kl"):
        actor.train(0, samples)
    strict = Actor(make_config(), tiny_model_dir, ci_checks=True, ci_logprob_abs_diff_threshold=1e-9)
    with pytest.raises(AssertionError, match="train_rollout_logprob_abs_diff"):
        strict.train(0, samples)
    with pytest.raises(ValueError, match="tensor-parallel size"):
        Actor(make_config(**{"train.tensor_parallel_size": 2}), tiny_model_dir)
    with pytest.raises(ValueError, match="on-policy"):
        Actor(make_config(**{"algorithm.use_tis": True}), tiny_model_dir, recompute_log_probs=False)
    with pytest.raises(ValueError, match="do not split"):
        actor.train(0, samples[:6])
    empty = dataclasses.replace(samples[1], tokens=samples[1].tokens[: samples[1].prompt_length],
                                response_length=0, loss_mask=[], rollout_log_probs=[])
    assert actor_mod.build_micro_batch([empty], [0], [torch.zeros(0)]).mask.shape == (1, 0)
    ok = Actor(make_config(), tiny_model_dir, ci_checks=True)
    assert ok.train(0, [samples[0], empty, *samples[2:]])["train/grad_norm"] > 0  # an empty response is fine
    no_reward = [dataclasses.replace(s, reward=None) for s in samples]
    with pytest.raises(ValueError, match="no reward"):
        actor.train(0, no_reward)


def test_on_policy_shortcut_equals_recompute(tp1, tiny_model_dir, samples):
    shortcut = Actor(make_config(), tiny_model_dir)
    recompute = Actor(make_config(), tiny_model_dir, recompute_log_probs=True)
    assert not shortcut.recompute and recompute.recompute
    a, b = shortcut.train(0, samples), recompute.train(0, samples)
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/train_rollout_logprob_abs_diff"):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-12), key
    assert b["train/first_step_ppo_kl"] == 0.0


def test_mis_masks_an_off_sample_and_masking_nothing_changes_nothing(tp1, tiny_model_dir, samples):
    """algorithm.mis_level through the real trainer: with the engine's log-probs of the same weights nothing
    is masked and the step is the plain recomputing one, bitwise; one sample whose rollout log-probs are 1 nat
    per token too low (sequence ratio e^len > 2) is masked whole, also in packed micro-batches."""
    mis_cfg = make_config(**{"algorithm.mis_level": "sequence"})
    mis = Actor(mis_cfg, tiny_model_dir)
    plain = Actor(make_config(), tiny_model_dir, recompute_log_probs=True)
    assert mis.recompute
    m, p = mis.train(0, samples), plain.train(0, samples)
    assert m["train/mis_masked_frac"] == 0.0 and m["train/mis_masked_seq_frac"] == 0.0
    assert m["train/loss"] == p["train/loss"] and m["train/grad_norm"] == p["train/grad_norm"]
    after_mis, after_plain = weights_of(mis), weights_of(plain)
    assert all(torch.equal(after_mis[k], after_plain[k]) for k in after_plain)
    off = [dataclasses.replace(s, rollout_log_probs=[v - 1.0 for v in s.rollout_log_probs]) if i == 3 else s
           for i, s in enumerate(samples)]
    packed = Actor(make_config(**{"algorithm.mis_level": "sequence", "train.max_tokens_per_microbatch": 64}),
                   tiny_model_dir)
    m = packed.train(0, off)
    assert m["train/mis_masked_seq_frac"] == pytest.approx(1 / len(samples))
    assert m["train/mis_masked_frac"] == pytest.approx(1 / len(samples))  # per-sample share, sample mean
    with pytest.raises(ValueError, match="algorithm.mis_level needs the samples' rollout_log_probs"):
        packed.train(1, [dataclasses.replace(s, rollout_log_probs=[]) for s in samples])


def test_micro_batch_size_does_not_change_the_step(tp1, tiny_model_dir, samples):
    results = {}
    for mbs in (4, 16, 3):  # 3: uneven micro-batches that split groups
        actor = Actor(make_config(**{"train.micro_batch_size": mbs}), tiny_model_dir)
        results[mbs] = actor.train(0, samples)
    for mbs in (16, 3):
        for key in ("train/grad_norm", "train/loss", "train/pg_loss", "train/entropy"):
            # pg_loss is ~0 (GRPO advantages sum to 0 per group): compare it to rounding.
            assert results[mbs][key] == pytest.approx(results[4][key], rel=1e-5, abs=1e-7), (mbs, key)


def test_every_loss_reduction_is_additive_over_micro_batches(tp1, tiny_model_dir, samples):
    """One micro-batch of 16 vs uneven ones of 3 (splitting groups): the same loss and gradient norm for each
    ``algorithm.loss_reduction``; the logged token means do not depend on the reduction, the loss does."""
    whole = {}
    for reduction in LOSS_REDUCTIONS:
        results = {}
        for mbs in (16, 3):
            cfg = make_config(**{"train.micro_batch_size": mbs, "algorithm.loss_reduction": reduction,
                                 "algorithm.entropy_coef": 0.01})  # a loss clearly away from 0
            results[mbs] = Actor(cfg, tiny_model_dir).train(0, samples)
        for key in ("train/grad_norm", "train/loss"):
            assert results[3][key] == pytest.approx(results[16][key], rel=1e-6), (reduction, key)
        whole[reduction] = results[16]
    default = whole["rollout_token_mean"]
    for reduction, m in whole.items():
        assert m["train/entropy"] == pytest.approx(default["train/entropy"], rel=1e-6), reduction
    for reduction in ("token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        assert whole[reduction]["train/loss"] != pytest.approx(default["train/loss"], rel=1e-3), reduction


def test_a_short_rollout_trains_like_a_smaller_batch(tp1, tiny_model_dir, samples):
    """A starving filter hands over 3 of ``rollout.batch_size=4`` groups: the actor trains them in the configured
    number of optimizer steps (smaller global batches, uneven micro-batches), bitwise as a run of batch size 3."""
    short = samples[: 3 * N]
    results = []
    for batch_size in (4, 3):
        parallel.model_parallel_cuda_manual_seed(5)
        actor = Actor(make_config(**{"rollout.batch_size": batch_size, "train.num_steps_per_rollout": 2}),
                      tiny_model_dir)
        results.append((actor.train(0, short), weights_of(actor)))
    (m4, w4), (m3, w3) = results
    assert m4["train/num_steps"] == 2 and m4["train/grad_norm"] > 0 and m4["train/entropy"] > 0
    assert m4["train/grad_norm"] == m3["train/grad_norm"]
    assert all(torch.equal(w4[k], w3[k]) for k in w4)


SCHEDULE_CASES = {
    # KL loss (old and reference log-probs recomputed: forward-only passes), TIS, an entropy bonus, 2 steps of
    # 3 micro-batches (3, 3, 2 samples) per rollout
    "kl-tis": {"algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.5, "algorithm.kl_loss_type": "k3",
               "algorithm.use_tis": True, "algorithm.entropy_coef": 0.01, "train.num_steps_per_rollout": 2,
               "train.micro_batch_size": 3},
    # packed micro-batches with shared group prompts, off-policy (recomputed old log-probs)
    "packed": {"train.max_tokens_per_microbatch": 40, "train.share_group_prompt": True,
               "train.num_steps_per_rollout": 2},
    # PPO: the critic's values forward and its own optimizer steps go through the schedule too
    "ppo": {"algorithm.advantage_estimator": "gae", "algorithm.kl_coef": 0.05, "algorithm.kl_loss_type": "k3",
            "train.num_steps_per_rollout": 2, "train.micro_batch_size": 3, "critic.lr": 3e-4},
}


@pytest.mark.parametrize("case", sorted(SCHEDULE_CASES))
def test_megatron_schedule_equals_the_plain_loop_bitwise(tp1, tiny_model_dir, samples, monkeypatch, case):
    """Issue #54 point 2: every forward and backward of the actor (and the critic) through megatron-core's
    ``get_forward_backward_func`` + ``finalize_model_grads`` gives the very weights and metrics of the plain
    loop (two rollouts, several micro-batches a step)."""
    def run():
        parallel.model_parallel_cuda_manual_seed(1234)
        actor = Actor(make_config(**SCHEDULE_CASES[case]), tiny_model_dir, ci_checks=True)
        metrics = [actor.train(r, samples) for r in range(2)]
        timing = ("seconds", "tokens_per_s")
        return weights_of(actor), [{k: v for k, v in m.items() if not k.endswith(timing)} for m in metrics], \
            actor.step_metrics
    calls = []
    schedule = tmodel.train_step
    monkeypatch.setattr(tmodel, "train_step", lambda *a: calls.append(len(a[3])) or schedule(*a))
    weights, metrics, steps = run()
    assert calls and max(calls) > 1  # micro-batches of a step went through the schedule
    with plain_loop():
        ref_weights, ref_metrics, ref_steps = run()
    assert metrics == ref_metrics and steps == ref_steps
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


@pytest.fixture
def deterministic():
    yield
    torch.use_deterministic_algorithms(False)


def test_two_actors_same_seed_are_bitwise_equal(tp1, tiny_model_dir, deterministic):
    batches = [make_samples(tiny_model_dir, num_groups=2, seed=s) for s in (1, 2, 3)]
    finals = []
    for _ in range(2):
        parallel.model_parallel_cuda_manual_seed(77)
        cfg = make_config(**{"run.deterministic": True, "algorithm.entropy_coef": 0.01})
        actor = Actor(cfg, tiny_model_dir)
        assert torch.are_deterministic_algorithms_enabled()
        metrics = [actor.train(i, batch) for i, batch in enumerate(batches)]
        finals.append((weights_of(actor), [m["train/grad_norm"] for m in metrics]))
    (w1, g1), (w2, g2) = finals
    assert g1 == g2
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_grpo_step_raises_log_prob_of_rewarded_answers(tp1, tiny_model_dir, samples):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    before = [float(lp.sum()) for lp in hf_response_log_probs(hf, samples)]
    actor = Actor(make_config(**{"train.lr": 3e-3}), tiny_model_dir, ci_checks=True)
    for rollout_id in range(2):
        actor.train(rollout_id, samples)
    result = hf.load_state_dict(weights_of(actor), strict=False)  # a tied export has no lm_head.weight
    assert not result.unexpected_keys
    assert result.missing_keys == ([] if not hf.config.tie_word_embeddings else ["lm_head.weight"])
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    after = [float(lp.sum()) for lp in hf_response_log_probs(hf, samples)]
    correct = [i for i, s in enumerate(samples) if s.reward == 1.0]
    wrong = [i for i, s in enumerate(samples) if s.reward == 0.0]
    assert len(correct) == 4  # one per group, each with positive advantage
    for i in correct:
        assert after[i] > before[i] + 0.1, (i, before[i], after[i])
    assert sum(after[i] - before[i] for i in wrong) < 0


def test_weight_backup_swap_is_exact(tp1, tiny_model_dir):
    ddp_model, _ = tmodel.setup_model_and_optimizer(tiny_model_dir, make_config().train)
    model = bridge.unwrap_model(ddp_model)
    backup = WeightBackup(model)
    backup.backup("ref")
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    with backup.swapped("ref"):
        assert all(torch.equal(p, original[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p, original[n] + 0.5) for n, p in model.named_parameters())
    with pytest.raises(KeyError, match="teacher"):
        backup.restore("teacher")


@pytest.mark.parametrize("changes", [
    {"algorithm.advantage_estimator": "gspo", "algorithm.eps_clip": 3e-4, "train.num_steps_per_rollout": 2},
    {"algorithm.advantage_estimator": "reinforce_plus_plus", "algorithm.eps_clip_c": 3.0},
    {"algorithm.advantage_estimator": "reinforce_plus_plus_baseline", "train.bf16": True,
     "train.use_distributed_optimizer": True, "algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.1},
    {"algorithm.advantage_estimator": "rloo"},
], ids=["gspo", "reinforce_plus_plus", "rpp_baseline-bf16-distopt-kl", "rloo"])
def test_estimators_and_bf16_pass_ci_gates(tp1, tiny_model_dir, samples, changes):
    actor = Actor(make_config(**changes), tiny_model_dir, ci_checks=True)
    before = weights_of(actor)
    m = actor.train(0, samples)
    assert m["train/first_step_ppo_kl"] == 0.0 and m["train/grad_norm"] > 0
    after = weights_of(actor)
    assert max((after[k].float() - before[k].float()).abs().max().item() for k in after) > 0


def test_lr_schedule_warmup_then_cosine_follows_rollout_id(tp1, tiny_model_dir, samples):
    """slime's --lr-warmup-iters / --lr-decay-style through megatron-core's scheduler: the learning rate of a
    step is a function of its global step number only (what exact resume relies on)."""
    import math

    cfg = make_config(**{"train.lr": 1e-3, "train.min_lr": 1e-4, "train.lr_warmup_steps": 4,
                         "train.lr_decay_style": "cosine", "train.lr_decay_steps": 12, "run.num_rollout": 12})
    actor = Actor(cfg, tiny_model_dir)
    lrs = {r: actor.train(r, samples)["train/lr"] for r in (0, 2, 4, 8, 12, 3)}
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(5e-4) and lrs[4] == pytest.approx(1e-3)
    assert lrs[8] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (math.cos(math.pi * 4 / 8) + 1))
    assert lrs[12] == pytest.approx(1e-4) and lrs[3] == pytest.approx(7.5e-4)  # backwards too (a resume)
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(7.5e-4)
