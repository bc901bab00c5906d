"""GLM-4.5 (``glm4_moe``) across 2 real processes (torchrun, gloo on loopback): expert and tensor parallel.

One torchrun job (this file run as a script, see ``worker``) builds the tiny GLM-4.5 of
tests/unit/test_glm4_moe_bridge.py (8 experts in 4 groups, top-4, a shared expert, a first dense layer,
partial RoPE, q/k/v bias, QK norm, a random expert bias) at EP=2 (experts 0-3 on rank 0, 4-7 on rank 1)
and at TP=2 (every expert, the shared expert and attention split over the two ranks), with each of
megatron-core's two CPU-capable token dispatchers (``allgather``, ``alltoall``), and saves per rank what it
computed; the tests compare it with HF transformers' ``Glm4MoeForCausalLM`` in this process:

- HF -> megatron -> HF export bitwise on both ranks (the expert bias included); logits, log-probs and entropy
  equal HF's to 1e-5.
- One optimizer step at EP=2 (the same batch on both ranks) and at TP=2 with sequence parallelism (megatron-core
  trains MoE layers under TP only so; the norms are :mod:`hpcrl.train.norms`'): loss, grad norm and the weights
  after the step equal HF + AdamW's to 1e-6, the expert bias frozen (the default rate 0). The forward is
  checked at TP=2 without sequence parallelism too.
- One step at EP=2 and at TP=2 + SP with ``moe_router_bias_update_rate`` > 0: the bias moves by megatron's rule
  from the token counts summed over the data- and tensor-parallel ranks.
- Three micro-batches at EP=2 and at TP=2 + SP, the bias moving: megatron-core's schedule
  (``get_forward_backward_func`` + ``finalize_model_grads``) equals the plain loop hpcrl ran before, bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/integration is not a package
from megatron_utils import (  # noqa: E402
    assert_export_bitwise, assert_step_matches, one_step, helpers_fixture, run_two_ranks, unit_helpers, worker_main)

LAYOUTS = (("ep2", 1, 2, False), ("tp2", 2, 1, False), ("tp2sp", 2, 1, True))  # name, TP, EP, sequence parallel
DISPATCHERS = ("allgather", "alltoall")
RATE = 1e-2
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


# --- the distributed side: `torchrun --nproc_per_node=2 test_glm4_moe_parallel.py --path DIR --out DIR` ---


def worker(path: str, out: Path) -> None:
    """Run on each of 2 ranks; writes ``out/rank{r}.pt``."""
    torch.set_num_threads(1)
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoConfig

    from hpcrl.train import bridge, parallel, model as tmodel

    h = unit_helpers("test_glm4_moe_bridge")
    env = parallel.init_distributed()
    res: dict = {}
    hf_config = AutoConfig.from_pretrained(path)
    tokens = h.sample_batch(hf_config.vocab_size)[0]
    batch = h.sample_batch(hf_config.vocab_size, seed=5)
    for name, tp, ep, sp in LAYOUTS:
        parallel.initialize_model_parallel(tp=tp, ep=ep)
        parallel.model_parallel_cuda_manual_seed(1234)
        for dispatcher in DISPATCHERS:
            model = h.build_loaded(path, moe_token_dispatcher_type=dispatcher, sequence_parallel=sp)
            logits = h.megatron_logits(model, tokens)
            res[f"{name}-{dispatcher}"] = dict(
                ep_rank=parallel_state.get_expert_model_parallel_rank(),
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                local_experts=sorted({n.split(".")[6] for n, _ in model.named_parameters()
                                      if "local_experts" in n}),
                export=dict(bridge.export_hf_weights(model)),
                logits=gather_from_tensor_model_parallel_region(logits)[..., :hf_config.vocab_size].clone())
        if name == "tp2":  # megatron-core trains MoE at TP > 1 only with sequence parallelism
            parallel_state.destroy_model_parallel()
            continue
        megatron = {**h.MEGATRON, "moe_token_dispatcher_type": "alltoall"}
        train = dataclasses.replace(h.TRAIN, tensor_parallel_size=tp, expert_parallel_size=ep)
        res[f"{name}-step"] = one_step(path, train, megatron, h.megatron_loss_fn(batch))
        ddp_model, optimizer = tmodel.setup_model_and_optimizer(
            path, train, {**megatron, "moe_router_bias_update_rate": RATE})
        tmodel.train_step(ddp_model, optimizer, h.megatron_loss_fn(batch), [None])
        res[f"{name}-bias"] = dict(bridge.export_hf_weights(ddp_model))[BIAS]
        # megatron's schedule against the plain loop: 3 micro-batches, the bias moving (issue #54 point 2)
        micro_batches = [h.sample_batch(hf_config.vocab_size, seed=seed) for seed in (5, 6, 7)]
        for kind, step_fn in (("schedule", tmodel.train_step), ("plain", unit_helpers("test_actor").plain_train_step)):
            ddp_model, optimizer = tmodel.setup_model_and_optimizer(
                path, train, {**megatron, "moe_router_bias_update_rate": RATE})
            step = step_fn(ddp_model, optimizer, lambda model, mb: h.megatron_loss_fn(mb)(model, None), micro_batches)
            res[f"{name}-{kind}"] = dict(grad_norm=step["grad_norm"], loss=step["loss"],
                                         after=dict(bridge.export_hf_weights(ddp_model)))
        parallel_state.destroy_model_parallel()
    torch.save(res, out / f"rank{env.rank}.pt")
    parallel.destroy()


# --- the test side ------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration


h = helpers_fixture("test_glm4_moe_bridge")


@pytest.fixture(scope="module")
def glm_dir(h, tmp_path_factory):
    return h.make_tiny_glm(tmp_path_factory.mktemp("hf-glm") / "glm4_moe")


@pytest.fixture(scope="module")
def ranks(glm_dir, tmp_path_factory):
    """Run the torchrun job once; the per-rank results, rank 0 first."""
    return run_two_ranks(__file__, ["--path", str(glm_dir)], tmp_path_factory.mktemp("glm-out"))


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_export_is_bitwise_and_logits_log_probs_entropy_match_hf(h, glm_dir, ranks, layout, dispatcher):
    from hpcrl.train import bridge

    hf = bridge.read_hf_state_dict(glm_dir)
    hf_model = h.load_hf(glm_dir)
    tokens = h.sample_batch(hf_model.config.vocab_size)[0]
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    results = [r[f"{layout}-{dispatcher}"] for r in ranks]
    if layout == "ep2":  # each rank holds four whole experts
        assert [r["ep_rank"] for r in results] == [0, 1]
        assert [r["local_experts"] for r in results] == [["0", "1", "2", "3"]] * 2
    else:  # each rank holds half of every expert
        assert [r["tp_rank"] for r in results] == [0, 1]
        assert results[0]["local_experts"] == [str(e) for e in range(8)]
    for res in results:
        assert_export_bitwise(res["export"], hf)
        assert (res["logits"] - hf_logits).abs().max() < 1e-5
        for temperature in (1.0, 0.7):
            _, ref_lp, ref_ent = h.hf_reference(hf_model, tokens, temperature)
            logp = torch.log_softmax(res["logits"][:, :-1] / temperature, -1)
            lp = logp.gather(-1, tokens[:, 1:, None])[..., 0]
            assert (lp - ref_lp).abs().max() < 1e-5
            assert (-(logp.exp() * logp).sum(-1) - ref_ent).abs().max() < 1e-5


@pytest.mark.parametrize("layout", ["ep2", "tp2sp"])
def test_train_step_matches_hf_adamw(h, glm_dir, ranks, layout):
    """One step at EP=2 and at TP=2 with sequence parallelism (each rank routes half of the tokens through
    half of every expert and of the shared expert)."""
    from hpcrl.models.moe import unfuse_experts
    from hpcrl.train import bridge

    batch = h.sample_batch(h.load_hf(glm_dir).config.vocab_size, seed=5)
    ref_loss, ref_norm, ref_state = h.hf_train_step(h.load_hf(glm_dir).train(), *batch)
    ref_state = unfuse_experts(ref_state)
    for res in ranks:
        run = res[f"{layout}-step"]
        assert run["sp"] == (layout == "tp2sp")
        assert_step_matches(run, ref_loss, ref_norm, ref_state)
        assert torch.equal(run["after"][BIAS], bridge.read_hf_state_dict(glm_dir)[BIAS])


@pytest.mark.parametrize("layout", ["ep2", "tp2sp"])
def test_expert_bias_update_sums_the_ranks_token_counts(h, glm_dir, ranks, layout):
    """The bias step counts every token once: at EP=2 the same batch on both data-parallel ranks (twice the
    batch's counts), at TP=2 + SP each rank's half of the sequence (the batch's counts, summed over TP)."""
    from hpcrl.train import bridge

    batch = h.sample_batch(h.load_hf(glm_dir).config.vocab_size, seed=5)
    counts = (2 if layout == "ep2" else 1) * h.hf_tokens_per_expert(glm_dir, batch[0], batch[1])
    expected = bridge.read_hf_state_dict(glm_dir)[BIAS] + torch.sign(counts.mean() - counts) * RATE
    for res in ranks:
        assert torch.equal(res[f"{layout}-bias"], expected)


@pytest.mark.parametrize("layout", ["ep2", "tp2sp"])
def test_megatron_schedule_equals_the_plain_loop(glm_dir, ranks, layout):
    """Issue #54 point 2: three micro-batches through megatron-core's schedule (``finalize_model_grads``
    reducing over DP, summing the SP norms over TP and moving the expert bias) give the plain loop's step
    bitwise, at EP=2 and at TP=2 + SP."""
    from hpcrl.train import bridge

    for res in ranks:
        run, plain = res[f"{layout}-schedule"], res[f"{layout}-plain"]
        assert run["grad_norm"] == plain["grad_norm"] and run["loss"] == plain["loss"]
        assert all(torch.equal(run["after"][k], plain["after"][k]) for k in plain["after"])
        assert not torch.equal(run["after"][BIAS], bridge.read_hf_state_dict(glm_dir)[BIAS])


if __name__ == "__main__":
    worker_main(worker, "--path", "the tiny GLM-4.5 HF folder")
