"""The MoE model layer across 2 real processes (torchrun, gloo on loopback): expert parallel and tensor parallel.

One torchrun job (this file run as a script, see ``worker``) builds the tiny Qwen3-MoE of
tests/unit/test_megatron_bridge.py (4 experts, top-2) in each layout below, with each of megatron-core's two
CPU-capable token dispatchers (``allgather``, ``alltoall``; ``flex`` needs DeepEP/GPUs), and saves per rank
what it computed; the tests compare it with HF transformers in this process:

- EP=2 (experts 0-1 on rank 0, 2-3 on rank 1; attention data-parallel) and TP=2 x EP=1 (every expert split
  over the two ranks), without and with sequence parallelism: HF -> megatron -> HF export bitwise equal on
  both ranks; logits equal HF's (1e-5).
- One optimizer step at EP=2, and at TP=2 with sequence parallelism (megatron-core trains MoE layers at
  TP > 1 only so; expert-tensor parallelism 2 and 1), on the same batch on both ranks: loss, grad norm and the
  weights after the step equal HF AdamW's step (the experts' gradients come from both ranks' tokens, and
  megatron-core scales them as the dense ones).
- A random routing replayed at TP=2 + SP gives the logits of the same replay at TP=1 (each rank replays its
  half of the tokens).
- A second torchrun job on 4 ranks: TP=2 x EP=2 with sequence parallelism at ETP 2 and 1 (slime's layouts in
  small): export, logits (both dispatchers; the all-to-all one's uneven expert-TP gathers over gloo:
  hpcrl.train.cpu_compat point 7) and one optimizer step as above.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/integration is not a package
from megatron_utils import (  # noqa: E402
    assert_export_bitwise, assert_step_matches, one_step, helpers_fixture, run_two_ranks, unit_helpers, worker_main)

LAYOUTS = (("ep2", 1, 2, False, None), ("tp2", 2, 1, False, None), ("tp2sp", 2, 1, True, 2),
           ("tp2sp-etp1", 2, 1, True, 1))
"""name, TP, EP, sequence parallel, expert-tensor-parallel size (None: megatron's default, TP)."""
LAYOUTS4 = (("tp2ep2-etp2", 2, 2, True, 2), ("tp2ep2-etp1", 2, 2, True, 1))
"""The same on 4 ranks (a second torchrun job): slime's layouts in small, TP=2 x EP=2 with sequence parallelism,
each expert split over the two TP ranks (ETP 2, no expert data parallelism) or whole (ETP 1, two expert-data-
parallel ranks)."""
DISPATCHERS = ("allgather", "alltoall")


# --- the distributed side: `torchrun --nproc_per_node=2 test_megatron_moe.py --path DIR --out DIR` ----------


def worker(path: str, out: Path) -> None:
    """Run on each of 2 ranks; writes ``out/rank{r}.pt``."""
    torch.set_num_threads(1)
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoConfig

    from hpcrl.train import bridge, parallel

    h = unit_helpers()
    env = parallel.init_distributed()
    res: dict = {}
    hf_config = AutoConfig.from_pretrained(path)
    tokens = h.sample_batch(hf_config.vocab_size)[0]
    for name, tp, ep, sp, etp in (LAYOUTS if env.world_size == 2 else LAYOUTS4):
        parallel.initialize_model_parallel(tp=tp, ep=ep, etp=etp)
        parallel.model_parallel_cuda_manual_seed(1234)
        for dispatcher in DISPATCHERS:
            model = bridge.build_gpt_model(hf_config, moe_token_dispatcher_type=dispatcher, sequence_parallel=sp)
            bridge.load_hf_weights(model, path)
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=tokens, position_ids=torch.arange(h.SEQ).expand(3, -1),
                               attention_mask=None)
            res[f"{name}-{dispatcher}"] = dict(
                ep_rank=parallel_state.get_expert_model_parallel_rank(),
                expert_rows=int(model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc2.weight.shape[1]),
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                local_experts=sorted({n.split(".")[6] for n, _ in model.named_parameters() if "local_experts" in n}),
                export=dict(bridge.export_hf_weights(model)),
                logits=gather_from_tensor_model_parallel_region(logits)[..., :hf_config.vocab_size].clone())
        if name in ("ep2", "tp2sp", "tp2ep2-etp1"):  # a routing replayed (random experts), split over TP ranks under SP
            from hpcrl.train import routing_replay

            model = bridge.build_gpt_model(hf_config, moe_token_dispatcher_type="alltoall", sequence_parallel=sp,
                                           moe_enable_routing_replay=True)
            bridge.load_hf_weights(model, path)
            model.eval()
            g = torch.Generator().manual_seed(11)
            k, experts = hf_config.num_experts_per_tok, hf_config.num_experts
            replay = torch.stack([torch.randperm(experts, generator=g)[:k]
                                  for _ in range(tokens.numel() * hf_config.num_hidden_layers)])
            replay = replay.view(tokens.numel(), hf_config.num_hidden_layers, k)
            with torch.no_grad(), routing_replay.replaying(replay, model.config):
                logits = model(input_ids=tokens, position_ids=torch.arange(h.SEQ).expand(3, -1),
                               attention_mask=None)
            res[f"{name}-replayed"] = gather_from_tensor_model_parallel_region(logits)[..., :hf_config.vocab_size]
        if name != "tp2":  # megatron-core trains MoE layers at TP > 1 only sequence-parallel
            batch = h.sample_batch(hf_config.vocab_size, seed=5)
            train = dataclasses.replace(h.TRAIN, tensor_parallel_size=tp, expert_parallel_size=ep,
                                        expert_tensor_parallel_size=etp or tp)
            res[f"{name}-step"] = one_step(path, train, {**h.MEGATRON, "moe_token_dispatcher_type": "alltoall"},
                                           h.megatron_loss_fn(batch))
        parallel_state.destroy_model_parallel()
    torch.save(res, out / f"rank{env.rank}.pt")
    parallel.destroy()


# --- the test side ------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration


h = helpers_fixture()


@pytest.fixture(scope="module")
def moe_dir(h, tmp_path_factory):
    return h.make_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("hf-moe") / "qwen3_moe")


@pytest.fixture(scope="module")
def ranks(moe_dir, tmp_path_factory):
    """Run the torchrun job once; the per-rank results, rank 0 first."""
    return run_two_ranks(__file__, ["--path", str(moe_dir)], tmp_path_factory.mktemp("moe-out"))


@pytest.fixture(scope="module")
def ranks4(moe_dir, tmp_path_factory):
    """The 4-rank torchrun job (:data:`LAYOUTS4`); the per-rank results, rank 0 first."""
    return run_two_ranks(__file__, ["--path", str(moe_dir)], tmp_path_factory.mktemp("moe-out4"), nprocs=4)


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS4])
def test_tp2_ep2_on_four_ranks_matches_hf(h, moe_dir, ranks4, layout):
    """TP=2 x EP=2 with sequence parallelism on 4 ranks, ETP 2 and 1: each rank holds two of the four experts
    (half of each, or whole), the export is bitwise, the logits (both dispatchers) and one optimizer step
    equal HF's; the replayed routing at ETP 1 equals the 2-rank one."""
    from hpcrl.models.moe import unfuse_experts
    from hpcrl.train import bridge

    hf = bridge.read_hf_state_dict(moe_dir)
    hf_model = h.load_hf(moe_dir)
    with torch.no_grad():
        hf_logits = hf_model(h.sample_batch(hf_model.config.vocab_size)[0]).logits
    whole = int(hf_model.config.moe_intermediate_size)
    for dispatcher in DISPATCHERS:
        results = [r[f"{layout}-{dispatcher}"] for r in ranks4]
        # megatron's order: expert-TP innermost, then EP (ranks 0,1 | 2,3 at ETP 2; 0,2 | 1,3 at ETP 1)
        assert [r["ep_rank"] for r in results] == ([0, 0, 1, 1] if layout.endswith("etp2") else [0, 1, 0, 1])
        assert all(r["local_experts"] == ["0", "1"] for r in results)
        assert {r["expert_rows"] for r in results} == {whole if layout.endswith("etp1") else whole // 2}
        for res in results:
            assert_export_bitwise(res["export"], hf)
            assert (res["logits"] - hf_logits).abs().max() < 1e-5
    batch = h.sample_batch(37, seed=5)
    ref_loss, ref_norm, ref_state = h.hf_train_step(h.load_hf(moe_dir).train(), *batch)
    ref_state = unfuse_experts(ref_state)
    for res in ranks4:
        assert res[f"{layout}-step"]["sp"]
        assert_step_matches(res[f"{layout}-step"], ref_loss, ref_norm, ref_state)


def test_replay_on_four_ranks_equals_two(ranks, ranks4):
    for res in ranks4:
        assert (res["tp2ep2-etp1-replayed"] - ranks[0]["ep2-replayed"]).abs().max() < 1e-5


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_moe_export_is_bitwise_and_logits_match_hf(h, moe_dir, ranks, layout, dispatcher):
    from hpcrl.train import bridge

    hf = bridge.read_hf_state_dict(moe_dir)
    hf_model = h.load_hf(moe_dir)
    with torch.no_grad():
        hf_logits = hf_model(h.sample_batch(hf_model.config.vocab_size)[0]).logits
    results = [r[f"{layout}-{dispatcher}"] for r in ranks]
    if layout == "ep2":  # each rank holds two whole experts
        assert [r["ep_rank"] for r in results] == [0, 1]
        assert [r["local_experts"] for r in results] == [["0", "1"], ["0", "1"]]
    else:  # each rank holds every expert: half of each (ETP 2), or whole ones (ETP 1)
        assert [r["tp_rank"] for r in results] == [0, 1]
        assert results[0]["local_experts"] == ["0", "1", "2", "3"]
        whole = int(hf_model.config.moe_intermediate_size)
        assert {r["expert_rows"] for r in results} == {whole if layout.endswith("etp1") else whole // 2}
    for res in results:
        assert_export_bitwise(res["export"], hf)
        assert (res["logits"] - hf_logits).abs().max() < 1e-5


def test_replayed_routing_is_split_over_the_sequence_parallel_ranks(h, moe_dir, ranks):
    """Routing replay at TP=2 + SP: each rank's routers replay the rows of its own half of the tokens
    (:func:`hpcrl.train.routing_replay.sequence_shard`), so the logits under a random replayed routing equal
    those of the same replay at TP=1 (EP=2), and differ from the model's own routing."""
    hf_model = h.load_hf(moe_dir)
    with torch.no_grad():
        hf_logits = hf_model(h.sample_batch(hf_model.config.vocab_size)[0]).logits
    for res in ranks:
        assert (res["tp2sp-replayed"] - ranks[0]["ep2-replayed"]).abs().max() < 1e-5
        assert (res["tp2sp-replayed"] - hf_logits).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["ep2", "tp2sp", "tp2sp-etp1"])
def test_moe_train_step_matches_hf(h, moe_dir, ranks, layout):
    """One optimizer step at EP=2, and at TP=2 with sequence parallelism (each rank routes its half of the
    tokens through half of every expert, or with expert-tensor parallelism 1 through whole experts, whose
    gradients are then averaged over the two expert-data-parallel ranks; the router's and the norms'
    gradients are summed over TP)."""
    from hpcrl.models.moe import unfuse_experts

    batch = h.sample_batch(37, seed=5)
    ref_loss, ref_norm, ref_state = h.hf_train_step(h.load_hf(moe_dir).train(), *batch)
    ref_state = unfuse_experts(ref_state)
    for res in ranks:
        assert res[f"{layout}-step"]["sp"] == layout.startswith("tp2sp")
        assert_step_matches(res[f"{layout}-step"], ref_loss, ref_norm, ref_state)


if __name__ == "__main__":
    worker_main(worker, "--path", "the tiny Qwen3-MoE HF folder")
