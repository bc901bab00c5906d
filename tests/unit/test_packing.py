"""Packed micro-batches (issue #13): the THD layout, the token-budget plan, and the exactness gates at TP=1.

Layout and plan are checked on hand-made samples. The gates run the real tiny Qwen2 in megatron-core: per-token
log-probs and entropy of the packed forward and of the shared-prompt forward equal the padded forward's to
1e-5 (fp32), and so does the gradient of one backward (relative norm); an Actor with packing and sharing on
passes slime's CI gates, trains the same first step as the padded Actor and is bitwise repeatable. TP=2 and
DP=2 are in tests/integration/test_actor_tp2.py.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("megatron.core")

from hpcrl.config import ConfigError  # noqa: E402
from hpcrl.data.sample import Sample  # noqa: E402
from hpcrl.train import bridge  # noqa: E402
from hpcrl.train.actor import Actor, build_micro_batch, sequence_multiple  # noqa: E402
from hpcrl.train.model import sum_replicated_grads_over_tp  # noqa: E402
from hpcrl.train.packing import build_pack, plan_micro_batches, unit_tokens  # noqa: E402
from tests.unit.test_actor import finished, make_config, make_samples, tp1  # noqa: E402,F401

PACKED = {"train.max_tokens_per_microbatch": 64}


def sample(prompt: list[int], response: list[int], index: int = 0) -> Sample:
    return Sample(index=index, tokens=prompt + response, response_length=len(response),
                  loss_mask=[1] * len(response), reward=0.0)


# --- layout -----------------------------------------------------------------------------------------------


def test_pack_layout_separate_samples():
    rows = [sample([1, 2, 3], [4, 5]), sample([6, 7], [8])]
    p = build_pack(rows, share_prompt=True)  # different prompts: nothing shared
    assert p.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert p.cu_seqlens.tolist() == [0, 5, 8] and p.prefix_of == (-1, -1)
    assert p.logit_rows.tolist() == [2, 3, 6] and p.labels.tolist() == [4, 5, 8]
    assert (p.num_tokens, p.padded_tokens) == (8, 10)


def test_pack_layout_shared_prompt():
    rows = [sample([1, 2, 3], [4, 5]), sample([9], [8]), sample([1, 2, 3], [6]), sample([1, 2, 3], [])]
    p = build_pack(rows, share_prompt=True, pad_to_multiple=3)
    # the group's prompt once (where its first sample is), then its non-empty responses; the other sample; pad
    assert p.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 9, 8, 0]]
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 0]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 9] and p.prefix_of == (-1, 0, 0, -1, -1)
    # a response's first token is predicted by the prompt's last row (2), shared by the group
    assert p.logit_rows.tolist() == [2, 3, 6, 2] and p.labels.tolist() == [4, 5, 8, 6]
    assert p.num_tokens == 8 and unit_tokens(rows[:1] + rows[2:], True) == 3 + 2 + 1 + 0
    unshared = build_pack(rows, share_prompt=False)
    assert unshared.num_tokens == sum(len(r.tokens) for r in rows) and set(unshared.prefix_of) == {-1}


def episode(first: Sample, *later: Sample) -> Sample:
    """One sample of several sequences (an agent episode split into chains, ``Sample.segments``): ``first``'s
    prompt is its prompt; every later sample's prompt is masked, its response kept."""
    s = Sample(index=first.index, tokens=list(first.tokens), response_length=first.response_length,
               loss_mask=list(first.loss_mask), rollout_log_probs=list(first.rollout_log_probs),
               reward=first.reward, segments=[len(first.tokens)])
    for x in later:
        s.tokens += x.tokens
        s.response_length += len(x.tokens)
        s.loss_mask += [0] * x.prompt_length + list(x.loss_mask)
        s.rollout_log_probs += [0.0] * x.prompt_length + list(x.rollout_log_probs or [0.0] * x.response_length)
        s.segments.append(len(x.tokens))
    return s


def test_pack_layout_of_a_sample_of_several_segments():
    rows = [episode(sample([1, 2], [3, 4, 5]), sample([6], [7, 8])), sample([1, 2], [9])]
    p = build_pack(rows, share_prompt=True)  # the episode never shares its prompt [1, 2]
    assert p.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 9]]
    assert p.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2]  # restart in each sequence
    assert p.cu_seqlens.tolist() == [0, 5, 8, 11] and p.prefix_of == (-1, -1, -1)
    assert p.logit_rows.tolist() == [1, 2, 3, 4, 5, 6, 9] and p.labels.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert unit_tokens(rows, True) == 11
    with pytest.raises(ValueError, match="segments"):
        build_pack([Sample(index=3, tokens=[1, 2, 3], response_length=1, loss_mask=[1], segments=[2, 2])])
    with pytest.raises(ValueError, match="first segment"):
        build_pack([Sample(index=3, tokens=[1, 2, 3], response_length=1, loss_mask=[1], segments=[2, 1])])


# --- plan -------------------------------------------------------------------------------------------------


def _groups(num_groups: int, n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(3, 20))]
        for _ in range(n):
            out.append(sample(prompt, [7] * rng.randrange(0, 12), index=len(out)))
    return out


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_plan_fits_budget_covers_each_sample_once_and_balances_ranks(share, dp):
    samples = _groups(8, 4, seed=dp)
    positions = list(range(len(samples)))
    budget = 48
    plans = [plan_micro_batches(samples, positions, r, dp, budget, share) for r in range(dp)]
    assert plans == [plan_micro_batches(samples, positions, r, dp, budget, share) for r in range(dp)]
    flat = sorted(p for plan in plans for mb in plan for p in mb)
    assert flat == positions
    loads = []
    for plan in plans:
        assert plan, "every rank gets a micro-batch"
        assert len(plan) == len(plans[0]), "every rank runs the same number of micro-batches"
        for mb in plan:
            assert build_pack([samples[p] for p in mb], share).num_tokens <= budget
        loads.append(sum(build_pack([samples[p] for p in mb], share).num_tokens for mb in plan))
    assert max(loads) - min(loads) <= budget  # within one micro-batch
    if share:  # fewer tokens than one sample per segment
        assert sum(loads) < sum(len(s.tokens) for s in samples)


def test_plan_gives_every_rank_the_same_number_of_micro_batches():
    """Issue #54's case: four single-sample groups of 60, 50, 50 and 45 tokens, 100 a micro-batch, 2 ranks. Planned
    rank by rank they went [[0], [3]] and [[1, 2]]: rank 1 then waited forever in rank 0's second forward."""
    samples = [sample([i + 1] * 10, [7] * (n - 10), index=i) for i, n in enumerate([60, 50, 50, 45])]
    plans = [plan_micro_batches(samples, [0, 1, 2, 3], r, 2, 100) for r in range(2)]
    assert [len(p) for p in plans] == [2, 2]
    assert sorted(q for p in plans for mb in p for q in mb) == [0, 1, 2, 3]
    assert all(sum(len(samples[q].tokens) for q in mb) <= 100 for p in plans for mb in p)


@pytest.mark.parametrize("share", [True, False])
def test_plan_counts_are_equal_for_any_lengths(share):
    """Random steps (groups of 1-8 samples, 2-60 tokens, budgets from the longest sample up), 1-4 ranks: equal
    counts, each sample once, every micro-batch within the budget. A step's sample count is a multiple of the
    ranks (hpcrl.train.actor.split_steps), which is what makes equal counts always possible."""
    rng = random.Random(54)
    for _ in range(300):
        dp = rng.randint(1, 4)
        out: list[Sample] = []
        while len(out) < dp or len(out) % dp:
            prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
            for _ in range(rng.randint(1, 8)):
                out.append(sample(prompt, [7] * rng.randrange(1, 40), index=len(out)))
        positions = list(range(len(out)))
        budget = max(len(out[p].tokens) for p in positions) + rng.randrange(0, 80)
        plans = [plan_micro_batches(out, positions, r, dp, budget, share) for r in range(dp)]
        assert plans == [plan_micro_batches(out, positions, r, dp, budget, share) for r in range(dp)]
        assert len({len(p) for p in plans}) == 1, (dp, budget, [len(p) for p in plans])
        assert sorted(q for p in plans for mb in p for q in mb) == positions
        assert all(mb and build_pack([out[q] for q in mb], share).num_tokens <= budget for p in plans for mb in p)


def test_plan_that_cannot_be_shared_equally_names_the_fix():
    """Three samples that each fill a micro-batch cannot give 2 ranks the same count: one line, not a hang (a
    step's count is a multiple of the ranks in a run: hpcrl validate refuses other batches)."""
    samples = [sample([i + 1] * 10, [7] * 40, index=i) for i in range(3)]
    with pytest.raises(ValueError, match=r"3 samples in 3 micro-batches of at most 60 tokens .* multiple of 2"):
        plan_micro_batches(samples, [0, 1, 2], 0, 2, 60)


def test_plan_rejects_a_sample_longer_than_the_budget():
    samples = [sample([1] * 10, [2] * 5, index=3)]
    with pytest.raises(ValueError, match=r"sample 3 has 15 tokens .*max_tokens_per_microbatch=12"):
        plan_micro_batches(samples, [0], 0, 1, 12)


# --- exactness gates (TP=1) ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def samples(tiny_model_dir):
    return make_samples(tiny_model_dir, num_groups=4, seed=0, correct_first=True)


def _flat_grad(ddp) -> torch.Tensor:
    return torch.cat([p.main_grad.flatten().clone() for p in ddp.parameters()])


def forward_gates(actor: Actor, samples: list[Sample]) -> dict[str, float]:
    """Max |packed - padded| of per-token log-probs and entropy, and the relative norm of the gradient
    difference after one backward of ``sum(log-probs) + sum(entropy)``, for the packed and the shared-prompt
    layouts of ``samples`` (one micro-batch)."""
    adv = [torch.zeros(s.response_length) for s in samples]
    positions = list(range(len(samples)))
    out = {}
    grads = {}
    for name, packed, share in (("padded", False, False), ("packed", True, False), ("shared", True, True)):
        mb = build_micro_batch(samples, positions, adv, actor.device, packed=packed, share_prompt=share,
                               pad_to_multiple=sequence_multiple(actor.model.config))
        actor.ddp_model.zero_grad_buffer()
        res = finished(actor._forward(mb, with_entropy=True))
        (res.log_probs.sum() + res.entropy.sum()).backward()
        actor.ddp_model.finish_grad_sync()
        sum_replicated_grads_over_tp(actor.ddp_model)  # as train_step: under SP the norms' are per-rank parts
        grads[name] = (res.log_probs.detach(), res.entropy.detach(), _flat_grad(actor.ddp_model))
        if packed:
            out[f"{name}_tokens"] = mb.pack.num_tokens
    lp, ent, g = grads["padded"]
    for name in ("packed", "shared"):
        out[f"{name}_logprob"] = (grads[name][0] - lp).abs().max().item()
        out[f"{name}_entropy"] = (grads[name][1] - ent).abs().max().item()
        out[f"{name}_grad"] = ((grads[name][2] - g).norm() / g.norm()).item()
    out["padded_tokens"] = mb.padded_tokens
    actor.ddp_model.zero_grad_buffer()
    return out


def test_packed_and_shared_forwards_equal_the_padded_one(tp1, tiny_model_dir, samples):
    gates = forward_gates(Actor(make_config(), tiny_model_dir), samples)
    for name in ("packed", "shared"):
        assert gates[f"{name}_logprob"] < 1e-5 and gates[f"{name}_entropy"] < 1e-5, gates
        assert gates[f"{name}_grad"] < 1e-5, gates
    assert gates["shared_tokens"] < gates["packed_tokens"] < gates["padded_tokens"], gates


def test_packed_actor_passes_ci_gates_and_trains_the_padded_step(tp1, tiny_model_dir, samples):
    changes = {"algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.5, "algorithm.kl_loss_type": "k3",
               "algorithm.use_tis": True, "algorithm.entropy_coef": 0.01, "train.num_steps_per_rollout": 2}
    padded = Actor(make_config(**changes), tiny_model_dir, ci_checks=True)
    m_pad = padded.train(0, samples)
    steps_pad = padded.step_metrics
    packed = Actor(make_config(**changes, **PACKED), tiny_model_dir, ci_checks=True)  # gates raise on failure
    m_pack = packed.train(0, samples)
    assert m_pack["train/first_step_ppo_kl"] == 0.0 and m_pack["train/ref_logprob_diff"] == 0.0
    for key in ("grad_norm", "loss", "pg_loss", "kl_loss", "entropy", "tis"):
        assert packed.step_metrics[0][key] == pytest.approx(steps_pad[0][key], rel=1e-5, abs=1e-7), key
    assert m_pad["train/forward_tokens"] == m_pad["train/padded_tokens"]
    assert m_pack["train/forward_tokens"] < min(m_pack["train/padded_tokens"], m_pad["train/forward_tokens"])
    # Adam magnifies rounding of near-zero gradients: as at TP=2
    packed_weights = dict(bridge.export_hf_weights(packed.ddp_model))
    for name, w in bridge.export_hf_weights(padded.ddp_model):
        assert (packed_weights[name] - w).abs().max().item() < 1e-3, name


def test_packed_actor_same_seed_is_bitwise_repeatable(tp1, tiny_model_dir, samples):
    def run():
        actor = Actor(make_config(**PACKED, **{"run.deterministic": True}), tiny_model_dir, ci_checks=True)
        for rollout_id in range(2):
            actor.train(rollout_id, samples)
        return {k: v.clone() for k, v in bridge.export_hf_weights(actor.ddp_model)}

    a, b = run(), run()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_packed_forward_with_megatron_activation_recompute(tp1, tiny_model_dir, samples):
    """With megatron's full recomputation (the memory setting of docs/performance.md, TRL's default
    gradient checkpointing) the packed and shared forwards still equal the padded one, and the shared layout's
    gradient equals the one without recomputation."""
    cfg = make_config()
    cfg.megatron.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    recompute = Actor(cfg, tiny_model_dir)
    gates = forward_gates(recompute, samples)
    for name in ("packed", "shared"):
        assert gates[f"{name}_logprob"] < 1e-5 and gates[f"{name}_grad"] < 1e-5, gates

    def shared_grad(actor):
        mb = build_micro_batch(samples, list(range(len(samples))), [torch.zeros(s.response_length) for s in samples],
                               actor.device, packed=True, share_prompt=True)
        actor.ddp_model.zero_grad_buffer()
        finished(actor._forward(mb)).log_probs.sum().backward()
        actor.ddp_model.finish_grad_sync()
        return _flat_grad(actor.ddp_model)

    g_plain, g_recompute = shared_grad(Actor(make_config(), tiny_model_dir)), shared_grad(recompute)
    assert ((g_recompute - g_plain).norm() / g_plain.norm()).item() < 1e-6


def test_each_segment_of_a_sample_is_its_own_sequence(tp1, tiny_model_dir, samples):
    """A sample of three sequences (two groups' samples and a third) in a micro-batch beside ordinary samples:
    its log-probs and entropy equal those of the three samples forwarded on their own (padded), and so does the
    gradient of the masked log-probs. It is packed even when packing is off (``packed=False``)."""
    actor = Actor(make_config(), tiny_model_dir)
    parts = [samples[0], samples[5], samples[9]]
    rows = [episode(*parts), samples[1], samples[6]]
    alone = parts + rows[1:]

    def run(batch, packed):
        adv = [torch.zeros(s.response_length) for s in batch]
        mb = build_micro_batch(batch, list(range(len(batch))), adv, actor.device, packed=packed)
        actor.ddp_model.zero_grad_buffer()
        res = finished(actor._forward(mb, with_entropy=True))
        (res.log_probs * mb.mask).sum().backward()
        actor.ddp_model.finish_grad_sync()
        return mb, res.log_probs.detach().cpu(), res.entropy.detach().cpu(), _flat_grad(actor.ddp_model)

    mb, lp, ent, g = run(rows, packed=False)
    assert mb.pack is not None and mb.pack.cu_seqlens.tolist()[:4] == [0] + [sum(len(x.tokens) for x in parts[:k])
                                                                              for k in (1, 2, 3)]
    _, lp_ref, ent_ref, g_ref = run(alone, packed=False)
    # the episode's row, laid out as its parts' responses: the first part's response, then each later part's
    # prompt (masked; no reference) and response
    mask = mb.mask[0].bool().cpu()
    offsets, pieces_lp, pieces_ent = 0, [], []
    for k, x in enumerate(parts):
        if k:
            pieces_lp.append(torch.zeros(x.prompt_length))
            pieces_ent.append(torch.zeros(x.prompt_length))
        pieces_lp.append(lp_ref[k, :x.response_length])
        pieces_ent.append(ent_ref[k, :x.response_length])
    want_lp, want_ent = torch.cat(pieces_lp), torch.cat(pieces_ent)
    assert (lp[0][mask] - want_lp[mask]).abs().max().item() < 1e-5
    assert (ent[0][mask] - want_ent[mask]).abs().max().item() < 1e-5
    w = lp_ref.shape[1]
    assert (lp[1:3, :w] - lp_ref[3:5]).abs().max().item() < 1e-5 and not lp[1:3, w:].any()
    assert ((g - g_ref).norm() / g_ref.norm()).item() < 1e-5
    actor.ddp_model.zero_grad_buffer()


# --- bad input ----------------------------------------------------------------------------------------------


def test_budget_smaller_than_a_sample_is_a_config_error_naming_both_numbers(tmp_path, tiny_model_dir):
    from hpcrl.validate import load_and_check

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{path: {tiny_model_dir}}}\nrollout: {{max_new_tokens: 16}}\n"
                   "train: {max_tokens_per_microbatch: 12}\n")
    with pytest.raises(ConfigError, match=r"train\.max_tokens_per_microbatch.*12.*17 tokens.*max_new_tokens=16"):
        load_and_check(cfg)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n' * 3 + '{"prompt": "' + "9" * 40 + '=", "label": "9"}\n'
                    + '{"prompt": "2+2=", "label": "4"}\n')
    cfg.write_text(f"model: {{path: {tiny_model_dir}}}\nrollout: {{max_new_tokens: 16}}\n"
                   f"data: {{source: {data}, num_eval: 1}}\ntrain: {{max_tokens_per_microbatch: 40}}\n")
    from hpcrl.data.datasets import check_data

    with pytest.raises(ConfigError, match=r"train\.max_tokens_per_microbatch.*40.*longest prompt of (\d+) "
                                          r"tokens \+ rollout\.max_new_tokens=16.*at least"):
        check_data(load_and_check(cfg))
