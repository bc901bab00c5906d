"""hpcrl.train.actor across 2 real processes (forked ranks with torchrun's variables, gloo on loopback): TP=2 x DP=1, then TP=1 x DP=2.

One torchrun job (this file run as a script, see ``worker``) trains an :class:`~hpcrl.train.actor.Actor` on
the same 16 samples at both layouts, with a KL loss (so old log-probs are recomputed and the reference weights
are swapped in), TIS, an entropy bonus and 2 optimizer steps per rollout, all with slime's CI gates on. This
process does the same at world size 1. Every layout must give the same per-step grad norms and losses (rel
1e-5 for the first step): that checks the tensor-parallel log-probs/entropy and, at DP=2, the global
reduction (step-wide ``rollout_mask_sums`` and ``loss *= dp_size``). Samples and configs come from
tests/unit/test_actor.py.

Issue #38: every other ``algorithm.loss_reduction`` (:data:`REDUCTIONS`) trains one rollout at DP=2 only and
matches world size 1 (the reductions' step-wide denominators are additive over DP ranks).

Issue #13: the same two layouts with packed micro-batches and shared group prompts
(``train.max_tokens_per_microbatch``, token-budget micro-batches balanced over the DP ranks) pass the CI gates
and match world size 1 padded; at TP=2 the packed and shared forwards' per-token log-probs equal the padded
forward's to 1e-5 and so does one backward's gradient (relative norm; tests/unit/test_packing.py at TP=1).

Issue #54: the TP=2 and the packed DP=2 runs again through the plain loop hpcrl ran before megatron-core's
schedule (tests/unit/test_actor.py ``plain_loop``) give the very same weights and metrics.

Issue #38: one PPO rollout (``gae`` with the KL penalty in the reward, 2 steps) at TP=2 and at DP=2, the
critic started from a reward model's random ``score`` head so that its values are not 0: the critic's values
of all samples equal world size 1's to 1e-5, and so do the first actor step and the GAE metrics.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.engine_utils import run_ranks

_UNIT = Path(__file__).resolve().parents[1] / "unit" / "test_actor.py"
CHANGES = {"algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.5, "algorithm.kl_loss_type": "k3",
           "algorithm.use_tis": True, "algorithm.entropy_coef": 0.01, "train.num_steps_per_rollout": 2,
           "train.micro_batch_size": 3}
ROLLOUTS = 2
PACKED = {"train.max_tokens_per_microbatch": 64, "train.share_group_prompt": True}
PLAIN_LOOP = ("tp2", "dp2-packed")
"""Layouts also trained through the plain loop (issue #54 point 2: megatron's schedule must equal it)."""
REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
"""The ``algorithm.loss_reduction`` values besides the default, each run for one rollout at DP=2 only."""
GAE = {"algorithm.advantage_estimator": "gae", "algorithm.kl_coef": 0.05, "algorithm.kl_loss_type": "k3",
       "train.num_steps_per_rollout": 2, "train.micro_batch_size": 3, "critic.lr": 3e-4}


def _unit_helpers(path: Path = _UNIT):
    spec = importlib.util.spec_from_file_location(f"hpcrl_tests_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_actor(model_dir, samples, rollouts: int = ROLLOUTS, **extra) -> dict:
    """Train ``rollouts`` rollouts on ``samples`` with CI gates (config :data:`CHANGES` and ``extra``);
    per-rollout metrics and step metrics."""
    from megatron.core import parallel_state

    from hpcrl.train import bridge
    from hpcrl.train.actor import Actor

    h = _unit_helpers()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    actor = Actor(h.make_config(**CHANGES, **extra, **{"train.tensor_parallel_size": tp}), model_dir, ci_checks=True)
    out: dict = {"tp": tp, "dp": actor.dp_size,
                 "metrics": [], "steps": []}
    for rollout_id in range(rollouts):
        m = actor.train(rollout_id, samples)
        timing = ("train/seconds", "train/tokens_per_s")
        out["metrics"].append({k: v for k, v in m.items() if k not in timing})
        out["steps"].append([dict(s) for s in actor.step_metrics])
    out["weights"] = {k: v.clone() for k, v in bridge.export_hf_weights(actor.ddp_model)}
    return out


def run_gae(model_dir, samples, critic_path) -> dict:
    """One PPO rollout (:data:`GAE`, critic from ``critic_path``): the critic's values of all samples (one
    padded micro-batch) before it, the rollout's metrics and its first actor step."""
    from megatron.core import parallel_state

    from hpcrl.train.actor import Actor, build_micro_batch, sequence_multiple

    tp = parallel_state.get_tensor_model_parallel_world_size()
    cfg = _unit_helpers().make_config(**GAE, **{"train.tensor_parallel_size": tp,
                                                "critic.path": str(critic_path)})
    actor = Actor(cfg, model_dir, ci_checks=True)
    mb = build_micro_batch(samples, range(len(samples)), [torch.zeros(s.response_length) for s in samples],
                           pad_to_multiple=sequence_multiple(actor.model.config))
    values = actor.critic.values([mb])[0]
    m = actor.train(0, samples)
    timing = ("seconds", "tokens_per_s")
    return {"values": values, "metrics": {k: v for k, v in m.items() if not k.endswith(timing)},
            "first_step": dict(actor.step_metrics[0])}


def make_reward_model(model_dir, path: Path) -> Path:
    """A one-output ``score`` head (random, std 0.1) on the tiny model's decoder, saved to ``path``."""
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        rm.score.weight.normal_(0, 0.1)
    rm.save_pretrained(path)
    return path


# --- the distributed side: `torchrun --nproc_per_node=2 test_actor_tp2.py --model M --samples F --out D` ---


def worker(model_dir: str, samples_file: Path, out: Path) -> None:
    """Run on each of 2 ranks; writes ``out/rank{r}.pt`` with the TP=2 and the DP=2 results."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from hpcrl.data.sample import Sample
    from hpcrl.train import parallel

    samples = [Sample.from_dict(d) for d in torch.load(samples_file, weights_only=False)]
    env = parallel.init_distributed()
    res = {}
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: tests/unit/test_packing imports
    packing = _unit_helpers(_UNIT.with_name("test_packing.py"))
    for name, tp, extra in (("tp2", 2, {}), ("dp2", 1, {}), ("tp2-packed", 2, PACKED), ("dp2-packed", 1, PACKED)):
        parallel.initialize_model_parallel(tp=tp)
        parallel.model_parallel_cuda_manual_seed(1234)
        res[name] = run_actor(model_dir, samples, **extra)
        if name in PLAIN_LOOP:  # the same run through hpcrl's plain loop, without megatron's schedule
            parallel.model_parallel_cuda_manual_seed(1234)
            with _unit_helpers().plain_loop():
                res[f"{name}-plain"] = run_actor(model_dir, samples, **extra)
        if extra is not PACKED:
            res[f"{name}-gae"] = run_gae(model_dir, samples, out / "rm")
        if name == "tp2":
            from hpcrl.train.actor import Actor

            res["tp2-gates"] = packing.forward_gates(Actor(_unit_helpers().make_config(
                **{"train.tensor_parallel_size": 2}), model_dir), samples)
        if name == "dp2":
            for reduction in REDUCTIONS:
                parallel.model_parallel_cuda_manual_seed(1234)
                res[f"dp2-{reduction}"] = run_actor(model_dir, samples, 1,
                                                    **{"algorithm.loss_reduction": reduction})
        parallel_state.destroy_model_parallel()
    torch.save(res, out / f"rank{env.rank}.pt")
    parallel.destroy()


# --- the test side ------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def h():
    pytest.importorskip("megatron.core")
    return _unit_helpers()


@pytest.fixture(scope="module")
def samples(h, tiny_model_dir):
    return h.make_samples(tiny_model_dir, num_groups=4, seed=0, correct_first=True)


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, samples, tmp_path_factory):
    """Run the 2-rank job once (engine_utils.run_ranks); the per-rank results, rank 0 first."""
    out = tmp_path_factory.mktemp("actor-tp2-out")
    torch.save([s.to_dict() for s in samples], out / "samples.pt")
    make_reward_model(tiny_model_dir, out / "rm")
    run_ranks(__file__, ["--model", str(tiny_model_dir), "--samples", str(out / "samples.pt")], out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def single(tiny_model_dir, samples, tmp_path_factory):
    """The same training at world size 1, in this process."""
    from hpcrl.train import parallel

    def run(*args, **extra):
        parallel.model_parallel_cuda_manual_seed(1234)
        return run_actor(tiny_model_dir, samples, *args, **extra)

    torch.set_num_threads(1)
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    try:
        res = {**run(), "reductions": {reduction: run(1, **{"algorithm.loss_reduction": reduction})
                                       for reduction in REDUCTIONS}}
        rm = make_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm") / "rm")
        res["gae"] = run_gae(tiny_model_dir, samples, rm)
        yield res
    finally:
        parallel.destroy()


LAYOUTS = (("tp2", 2, 1), ("dp2", 1, 2), ("tp2-packed", 2, 1), ("dp2-packed", 1, 2))


def test_layouts_and_ranks_agree(ranks):
    for name, tp, dp in LAYOUTS:
        r0, r1 = ranks[0][name], ranks[1][name]
        assert (r0["tp"], r0["dp"]) == (tp, dp)
        assert r0["metrics"] == r1["metrics"]  # all-reduced: the same floats on every rank
        assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])


def test_ci_gates_hold_at_tp2_and_dp2(ranks, single):
    for run in [ranks[0][name] for name, _, _ in LAYOUTS] + [single]:
        first = run["metrics"][0]
        assert first["train/ref_logprob_diff"] == 0.0 and first["train/first_step_ppo_kl"] == 0.0
        assert run["metrics"][1]["train/first_step_ppo_kl"] == 0.0
        assert first["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert [len(steps) for steps in run["steps"]] == [2] * ROLLOUTS


def test_packed_and_shared_forwards_equal_the_padded_one_at_tp2(ranks):
    for gates in (ranks[0]["tp2-gates"], ranks[1]["tp2-gates"]):
        for name in ("packed", "shared"):
            assert gates[f"{name}_logprob"] < 1e-5 and gates[f"{name}_entropy"] < 1e-5, gates
            assert gates[f"{name}_grad"] < 1e-5, gates
        assert gates["shared_tokens"] < gates["packed_tokens"] < gates["padded_tokens"], gates


@pytest.mark.parametrize("name", [name for name, _, _ in LAYOUTS])
def test_grad_norm_and_loss_match_world_size_1(ranks, single, name):
    run = ranks[0][name]
    first, ref = run["steps"][0][0], single["steps"][0][0]
    for key in ("grad_norm", "entropy", "kl_loss", "tis"):
        assert first[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), key
    diff = "train_rollout_logprob_abs_diff"  # ~1e-7: rounding only
    assert first[diff] == pytest.approx(ref[diff], abs=1e-7)
    assert abs(first["loss"] - ref["loss"]) < 1e-6 and abs(first["pg_loss"] - ref["pg_loss"]) < 1e-6
    # later steps follow the (slightly differently rounded) updates: looser
    for rollout in range(ROLLOUTS):
        for step, ref_step in zip(run["steps"][rollout], single["steps"][rollout]):
            assert step["grad_norm"] == pytest.approx(ref_step["grad_norm"], rel=1e-3)
            assert step["entropy"] == pytest.approx(ref_step["entropy"], rel=1e-3)
    for k, w in single["weights"].items():
        assert (run["weights"][k] - w).abs().max().item() < 1e-3, k


@pytest.mark.parametrize("name", PLAIN_LOOP)
def test_megatron_schedule_equals_the_plain_loop(ranks, name):
    """Issue #54 point 2 at TP=2 (sequence parallel: the norms' gradients summed over TP by megatron's
    ``finalize_model_grads``) and at DP=2 with packed micro-batches: the very weights and metrics."""
    for rank in ranks:
        run, plain = rank[name], rank[f"{name}-plain"]
        assert run["metrics"] == plain["metrics"] and run["steps"] == plain["steps"]
        assert all(torch.equal(run["weights"][k], plain["weights"][k]) for k in plain["weights"])


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_loss_reduction_is_additive_over_data_parallel_ranks(ranks, single, reduction):
    """Issue #38: each ``algorithm.loss_reduction`` gives the same step at DP=2 as at world size 1."""
    run, ref = ranks[0][f"dp2-{reduction}"], single["reductions"][reduction]
    assert run["dp"] == 2 and run["metrics"] == ranks[1][f"dp2-{reduction}"]["metrics"]
    for step, ref_step in zip(run["steps"][0], ref["steps"][0], strict=True):
        for key in ("grad_norm", "loss"):
            assert step[key] == pytest.approx(ref_step[key], rel=1e-5, abs=1e-9), (reduction, key)
    if reduction != "sequence_mean":  # = rollout_token_mean when each sample is its own rollout
        assert run["metrics"][0]["train/loss"] != pytest.approx(single["metrics"][0]["train/loss"], rel=1e-3)


@pytest.mark.parametrize("name", ["tp2", "dp2"])
def test_critic_values_and_ppo_rollout_match_world_size_1(ranks, single, name):
    ref = single["gae"]
    assert ref["values"].abs().max() > 0.1  # the reward model's head, not a zero one
    for rank in ranks:
        run = rank[f"{name}-gae"]
        torch.testing.assert_close(run["values"], ref["values"], rtol=0, atol=1e-5)
        assert run["metrics"]["train/first_step_ppo_kl"] == 0.0 and run["metrics"]["train/num_steps"] == 2
        for key in ("grad_norm", "loss", "entropy"):
            assert run["first_step"][key] == pytest.approx(ref["first_step"][key], rel=1e-5, abs=1e-7), key
        for key in ("critic/values_mean", "critic/explained_variance", "critic/value_loss"):
            assert run["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
    assert ranks[0][f"{name}-gae"]["metrics"] == ranks[1][f"{name}-gae"]["metrics"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=worker.__doc__)
    parser.add_argument("--model", required=True, help="HF folder of the tiny model")
    parser.add_argument("--samples", required=True, type=Path, help="torch.save'd list of Sample.to_dict()")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    worker(args.model, args.samples, args.out)
