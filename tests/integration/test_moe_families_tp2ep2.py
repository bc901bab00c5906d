"""GLM-4.5, DeepSeek-V3 and Mixtral at slime's MoE layout in small: TP=2 x EP=2 with sequence parallelism and
expert-tensor parallelism 1, on 4 real processes (torchrun, gloo on loopback; issue #54 point 3).

One 4-rank torchrun job (this file run as a script, see ``worker``) builds each family's tiny MoE model of the
unit tests (tests/unit/test_glm4_moe_bridge.py, test_deepseek_v3_bridge.py, test_mistral_bridge.py): the
attention split over the two TP ranks and sequence-parallel, every expert whole on one rank (ETP 1: experts
0..E/2-1 on EP rank 0, the rest on EP rank 1, each pair of expert-data-parallel ranks holding the same ones),
tokens dispatched all-to-all. It saves per rank what it computed; the tests compare it with HF transformers in
this process: the HF -> megatron -> HF export bitwise, the logits to 1e-5, and one optimizer step (the same batch
on every rank) to HF + AdamW's loss, grad norm and weights to 1e-6. Qwen3-MoE at this layout (and at ETP 2) is
tests/integration/test_megatron_moe.py's 4-rank job; the 2-rank layouts of these families are in
test_glm4_moe_parallel.py, test_deepseek_v3_tp2.py and test_megatron_mistral.py.
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

FAMILIES = ("glm4_moe", "deepseek_v3_moe", "mixtral")
TP, EP, ETP = 2, 2, 1


def tokens_of(h, vocab_size: int) -> torch.Tensor:
    """The logits batch: twice the unit tests' sequence (past DeepSeek-V3's YaRN original length of 16)."""
    return torch.cat([h.sample_batch(vocab_size)[0]] * 2, dim=1)


# --- the distributed side: `torchrun --nproc_per_node=4 test_moe_families_tp2ep2.py --dirs JSON --out DIR` --


def worker(dirs: dict[str, str], out: Path) -> None:
    """Run on each of 4 ranks; writes ``out/rank{r}.pt``."""
    torch.set_num_threads(1)
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoConfig

    from hpcrl.train import bridge, parallel

    h = unit_helpers()
    env = parallel.init_distributed()
    res: dict = {}
    parallel.initialize_model_parallel(tp=TP, ep=EP, etp=ETP)
    megatron = {**h.MEGATRON, "moe_token_dispatcher_type": "alltoall"}
    for kind in FAMILIES:
        parallel.model_parallel_cuda_manual_seed(1234)
        hf_config = AutoConfig.from_pretrained(dirs[kind])
        model = h.build_loaded(dirs[kind], sequence_parallel=True, moe_token_dispatcher_type="alltoall")
        tokens = tokens_of(h, hf_config.vocab_size)
        with torch.no_grad():
            logits = model(input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).expand(3, -1),
                           attention_mask=None)
        train = dataclasses.replace(h.TRAIN, tensor_parallel_size=TP, expert_parallel_size=EP,
                                    expert_tensor_parallel_size=ETP)
        res[kind] = one_step(dirs[kind], train, megatron,
                             h.megatron_loss_fn(h.sample_batch(hf_config.vocab_size, seed=5)))
        res[kind].update(
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            ep_rank=parallel_state.get_expert_model_parallel_rank(),
            local_experts=len({n.split(".")[-3] for n, _ in model.named_parameters() if "local_experts" in n}),
            num_experts=model.config.num_moe_experts,
            export=dict(bridge.export_hf_weights(model)),
            logits=gather_from_tensor_model_parallel_region(logits)[..., :hf_config.vocab_size].clone())
    parallel_state.destroy_model_parallel()
    torch.save(res, out / f"rank{env.rank}.pt")
    parallel.destroy()


# --- the test side ------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration


h = helpers_fixture()


@pytest.fixture(scope="module")
def dirs(h, tmp_path_factory):
    from tests.unit.test_deepseek_v3_bridge import make_tiny_mla
    from tests.unit.test_glm4_moe_bridge import make_tiny_glm
    from tests.unit.test_mistral_bridge import make_tiny

    root = tmp_path_factory.mktemp("moe-tp2ep2")
    return {"glm4_moe": make_tiny_glm(root / "glm4_moe"),
            "deepseek_v3_moe": make_tiny_mla("deepseek_v3_moe", root / "deepseek_v3_moe"),
            "mixtral": make_tiny("mixtral", root / "mixtral")}


@pytest.fixture(scope="module")
def ranks(dirs, tmp_path_factory):
    """Run the 4-rank torchrun job once; the per-rank results, rank 0 first."""
    return run_two_ranks(__file__, dirs_args(dirs), tmp_path_factory.mktemp("moe-tp2ep2-out"), nprocs=4)


@pytest.mark.parametrize("kind", FAMILIES)
def test_tp2_ep2_sp_etp1_matches_hf(h, dirs, ranks, kind):
    from hpcrl.models import moe
    from hpcrl.train import bridge

    hf = bridge.read_hf_state_dict(dirs[kind])
    hf_model = h.load_hf(dirs[kind])
    with torch.no_grad():
        hf_logits = hf_model(tokens_of(h, hf_model.config.vocab_size)).logits
    results = [r[kind] for r in ranks]
    # megatron's rank order: TP innermost for the dense part; at ETP 1 the expert-parallel ranks alternate
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    assert [r["ep_rank"] for r in results] == [0, 1, 0, 1]
    assert all(EP * r["local_experts"] == r["num_experts"] for r in results)  # whole experts, half on each
    for res in results:
        assert_export_bitwise(res["export"], hf)
        assert (res["logits"] - hf_logits).abs().max() < 1e-5
    batch = h.sample_batch(hf_model.config.vocab_size, seed=5)
    ref_loss, ref_norm, ref_state = h.hf_train_step(h.load_hf(dirs[kind]).train(), *batch)
    ref_state = moe.unfuse_experts(ref_state)
    if kind == "mixtral":  # its checkpoint's (and the export's) names; the tied head is not in it
        ref_state = dict(moe.RenamedWeights(ref_state, moe.to_mixtral_name))
        ref_state.pop("lm_head.weight")
    for res in results:
        assert res["sp"]
        assert_step_matches(res, ref_loss, ref_norm, ref_state)


if __name__ == "__main__":
    worker_main(worker, "--dirs", "JSON {kind: HF folder} of the tiny MoE models")
