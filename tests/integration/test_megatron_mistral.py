"""Mistral and Mixtral across 2 real processes (torchrun, gloo on loopback): TP=2, and for Mixtral EP=2.

One torchrun job (this file run as a script, see ``worker``) builds the tiny models of
tests/unit/test_mistral_bridge.py (sliding windows of 5 and 6 tokens, shorter than the 12-token batch) in each
layout, Mixtral with each of megatron-core's two CPU-capable token dispatchers (``allgather``, ``alltoall``),
and saves per rank what it computed; the tests compare it with HF transformers in this process:

- Mistral TP=2; Mixtral TP=2 x EP=1 (every expert split over the ranks) and EP=2 (experts 0-1 on rank 0, 2-3
  on rank 1); at TP=2 also with sequence parallelism: HF -> megatron -> HF export bitwise on both ranks
  (Mixtral in its ``block_sparse_moe`` naming); logits, log-probs and entropy (vocab-parallel at TP=2) equal
  HF's to 1e-5.
- One optimizer step, Mistral at TP=2 (with and without sequence parallelism), Mixtral at TP=2 + SP and at
  EP=2 (alltoall), the same batch on both ranks: loss, grad norm and the weights after the step equal HF +
  torch AdamW's to 1e-6.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/integration is not a package
from megatron_utils import (  # noqa: E402
    assert_export_bitwise, assert_step_matches, one_step, dirs_args, helpers_fixture, run_two_ranks, unit_helpers,
    worker_main)

LAYOUTS = (("mistral", "tp2", 2, 1, (None,)), ("mistral", "tp2sp", 2, 1, (None,)),
           ("mixtral", "tp2", 2, 1, ("allgather", "alltoall")), ("mixtral", "tp2sp", 2, 1, ("alltoall",)),
           ("mixtral", "ep2", 1, 2, ("allgather", "alltoall")))  # family, name, TP, EP, dispatchers
STEPS = (("mistral", "tp2", 2, 1), ("mistral", "tp2sp", 2, 1), ("mixtral", "tp2sp", 2, 1),
         ("mixtral", "ep2", 1, 2))
"""Sequence-parallel where the name ends in ``sp`` (megatron-core trains MoE at TP > 1 only so)."""


# --- the distributed side: `torchrun --nproc_per_node=2 test_megatron_mistral.py --dirs JSON --out DIR` -----


def worker(dirs: dict[str, str], out: Path) -> None:
    """Run on each of 2 ranks; writes ``out/rank{r}.pt``."""
    torch.set_num_threads(1)
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hpcrl.train import bridge, logprobs, parallel

    h = unit_helpers("test_mistral_bridge")
    env = parallel.init_distributed()
    res: dict = {}
    for kind, name, tp, ep, dispatchers in LAYOUTS:
        parallel.initialize_model_parallel(tp=tp, ep=ep)
        parallel.model_parallel_cuda_manual_seed(1234)
        for dispatcher in dispatchers:
            extra = {"moe_token_dispatcher_type": dispatcher} if dispatcher else {}
            model = h.build_loaded(dirs[kind], sequence_parallel=name.endswith("sp"), **extra)
            vocab = model.hf_config.vocab_size
            tokens = h.sample_batch(vocab)[0]
            with torch.no_grad():
                logits = model(input_ids=tokens, position_ids=torch.arange(h.SEQ).expand(3, -1),
                               attention_mask=None)
                lp = logprobs.compute_log_probs(logits[:, :-1], tokens[:, 1:], vocab_size=vocab)
                ent = logprobs.compute_entropy(logits[:, :-1], vocab_size=vocab)
            res[f"{kind}-{name}-{dispatcher}"] = dict(
                ep_rank=parallel_state.get_expert_model_parallel_rank(),
                local_experts=sorted({n.split(".")[6] for n, _ in model.named_parameters()
                                      if "local_experts" in n}),
                export=dict(bridge.export_hf_weights(model)),
                logits=gather_from_tensor_model_parallel_region(logits)[..., :vocab].clone(), log_probs=lp,
                entropy=ent)
        for step_kind, step_name, _, _ in STEPS:
            if (step_kind, step_name) != (kind, name):
                continue
            batch = h.sample_batch(21, seed=5)
            megatron = {**h.MEGATRON, "moe_token_dispatcher_type": "alltoall"} if ep > 1 else h.MEGATRON
            train = dataclasses.replace(h.TRAIN, tensor_parallel_size=tp, expert_parallel_size=ep,
                                        sequence_parallel=name.endswith("sp"))
            res[f"{kind}-{name}-step"] = one_step(dirs[kind], train, megatron, h.megatron_loss_fn(batch))
        parallel_state.destroy_model_parallel()
    torch.save(res, out / f"rank{env.rank}.pt")
    parallel.destroy()


# --- the test side ------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration


h = helpers_fixture("test_mistral_bridge")


@pytest.fixture(scope="module")
def dirs(h, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-mistral")
    return {kind: h.make_tiny(kind, root / kind) for kind in h.FAMILIES}


@pytest.fixture(scope="module")
def ranks(dirs, tmp_path_factory):
    """Run the torchrun job once; the per-rank results, rank 0 first."""
    return run_two_ranks(__file__, dirs_args(dirs),
                         tmp_path_factory.mktemp("mistral-out"))


CASES = [(kind, name, d) for kind, name, _, _, ds in LAYOUTS for d in ds]


@pytest.mark.parametrize("kind,layout,dispatcher", CASES)
def test_export_is_bitwise_and_logits_log_probs_entropy_match_hf(h, dirs, ranks, kind, layout, dispatcher):
    from hpcrl.train import bridge

    hf = bridge.read_hf_state_dict(dirs[kind])
    hf_model = h.load_hf(dirs[kind])
    tokens = h.sample_batch(hf_model.config.vocab_size)[0]
    hf_logits, ref_lp, ref_ent = h.hf_reference(hf_model, tokens)
    results = [r[f"{kind}-{layout}-{dispatcher}"] for r in ranks]
    if layout == "ep2":  # each rank holds two whole experts
        assert [r["ep_rank"] for r in results] == [0, 1]
        assert [r["local_experts"] for r in results] == [["0", "1"], ["0", "1"]]
    elif kind == "mixtral":
        assert results[0]["local_experts"] == ["0", "1", "2", "3"]
    for res in results:
        assert_export_bitwise(res["export"], hf)
        assert (res["logits"][:, :-1] - hf_logits).abs().max() < 1e-5
        assert (res["log_probs"] - ref_lp).abs().max() < 1e-5
        assert (res["entropy"] - ref_ent).abs().max() < 1e-5


@pytest.mark.parametrize("kind,layout", [(k, n) for k, n, _, _ in STEPS])
def test_train_step_matches_hf(h, dirs, ranks, kind, layout):
    from hpcrl.models import moe

    batch = h.sample_batch(21, seed=5)
    ref_loss, ref_norm, ref_state = h.hf_train_step(h.load_hf(dirs[kind]).train(), *batch)
    if kind == "mixtral":
        ref_state = dict(moe.RenamedWeights(moe.unfuse_experts(ref_state), moe.to_mixtral_name))
        ref_state.pop("lm_head.weight")  # tied: HF's checkpoint (and the export) has none
    for res in ranks:
        assert res[f"{kind}-{layout}-step"]["sp"] == layout.endswith("sp")
        assert_step_matches(res[f"{kind}-{layout}-step"], ref_loss, ref_norm, ref_state)


if __name__ == "__main__":
    worker_main(worker, "--dirs", "JSON {family: HF folder}")
