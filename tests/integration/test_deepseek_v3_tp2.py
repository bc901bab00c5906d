"""DeepSeek-V3-family multi-latent attention across 2 real processes (torchrun, gloo on loopback): TP=2 and
EP=2.

One torchrun job (this file run as a script, see ``worker``) builds the tiny MLA models of
tests/unit/test_deepseek_v3_bridge.py and saves per rank what it computed; the tests compare it with HF
transformers in this process:

- TP=2 (MLA's q/kv down projections split and all-gathered, up projections split by heads, o_proj by rows),
  dense DeepSeek-V3 with YaRN, dense GLM-lite, and DeepSeek-V3 with a MoE layer under both token dispatchers:
  HF -> megatron -> HF export bitwise on both ranks; gathered logits equal HF's (1e-5).
- EP=2 (experts 0-1 on rank 0, 2-3 on rank 1) of the MoE DeepSeek-V3, both dispatchers: the same.
- The TP=2 runs also with sequence parallelism (the latents of each rank's half of the tokens, the rope key
  gathered over the sequence).
- One optimizer step at TP=2 (dense, YaRN; with and without sequence parallelism), at TP=2 + SP for the MoE
  DeepSeek-V3 and GLM-lite, and at EP=2 (MoE, all-to-all): loss, grad norm and the weights after the step
  equal HF AdamW's (at TP=2 this needs the shared rope key's gradient summed over the ranks once:
  hpcrl.train.mla_layers.LatentAttention).
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

DISPATCHERS = ("allgather", "alltoall")
RUNS = (  # name, kind, TP, EP, dispatcher; sequence-parallel where the name starts with "tp2sp"
    ("tp2-deepseek_v3", "deepseek_v3", 2, 1, None),
    ("tp2sp-deepseek_v3", "deepseek_v3", 2, 1, None),
    ("tp2-glm4_moe_lite", "glm4_moe_lite", 2, 1, None),
    ("tp2sp-glm4_moe_lite", "glm4_moe_lite", 2, 1, None),
    *((f"tp2-deepseek_v3_moe-{d}", "deepseek_v3_moe", 2, 1, d) for d in DISPATCHERS),
    ("tp2sp-deepseek_v3_moe-alltoall", "deepseek_v3_moe", 2, 1, "alltoall"),
    *((f"ep2-deepseek_v3_moe-{d}", "deepseek_v3_moe", 1, 2, d) for d in DISPATCHERS),
)
STEPS = (("tp2-step", "deepseek_v3", 2, 1, None), ("tp2sp-step", "deepseek_v3", 2, 1, None),
         ("tp2sp-moe-step", "deepseek_v3_moe", 2, 1, "alltoall"), ("tp2sp-lite-step", "glm4_moe_lite", 2, 1, None),
         ("ep2-step", "deepseek_v3_moe", 1, 2, "alltoall"))


# --- the distributed side: `torchrun --nproc_per_node=2 test_deepseek_v3_tp2.py --dirs JSON --out DIR` ---


def worker(dirs: dict[str, str], out: Path) -> None:
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
    for name, kind, tp, ep, dispatcher in RUNS:
        parallel.initialize_model_parallel(tp=tp, ep=ep)
        parallel.model_parallel_cuda_manual_seed(1234)
        hf_config = AutoConfig.from_pretrained(dirs[kind])
        overrides = {"moe_token_dispatcher_type": dispatcher} if dispatcher else {}
        model = bridge.build_gpt_model(hf_config, sequence_parallel=name.startswith("tp2sp"), **overrides)
        bridge.load_hf_weights(model, dirs[kind])
        model.eval()
        tokens = torch.cat([h.sample_batch(hf_config.vocab_size)[0]] * 2, dim=1)  # past YaRN's 16
        with torch.no_grad():
            logits = model(input_ids=tokens, position_ids=torch.arange(2 * h.SEQ).expand(3, -1),
                           attention_mask=None)
        attention = model.decoder.layers[0].self_attention
        res[name] = dict(tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                         ep_rank=parallel_state.get_expert_model_parallel_rank(),
                         q_up_rows=int(attention.linear_q_up_proj.weight.shape[0]),
                         export=dict(bridge.export_hf_weights(model)),
                         logits=gather_from_tensor_model_parallel_region(logits)[..., :hf_config.vocab_size])
        parallel_state.destroy_model_parallel()
    for name, kind, tp, ep, dispatcher in STEPS:
        parallel.initialize_model_parallel(tp=tp, ep=ep)
        parallel.model_parallel_cuda_manual_seed(1234)
        megatron = {**h.MEGATRON, "moe_token_dispatcher_type": dispatcher} if dispatcher else h.MEGATRON
        train = dataclasses.replace(h.TRAIN, tensor_parallel_size=tp, expert_parallel_size=ep,
                                    sequence_parallel=name.startswith("tp2sp"))
        res[name] = one_step(dirs[kind], train, megatron, h.megatron_loss_fn(h.sample_batch(37, seed=5)))
        parallel_state.destroy_model_parallel()
    torch.save(res, out / f"rank{env.rank}.pt")
    parallel.destroy()


# --- the test side ------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration


h = helpers_fixture()


@pytest.fixture(scope="module")
def dirs(h, tmp_path_factory):
    from tests.unit.test_deepseek_v3_bridge import make_tiny_mla

    root = tmp_path_factory.mktemp("mla-tp2")
    kinds = ("deepseek_v3", "glm4_moe_lite", "deepseek_v3_moe")
    return {kind: make_tiny_mla(kind, root / kind) for kind in kinds}


@pytest.fixture(scope="module")
def ranks(dirs, tmp_path_factory):
    """Run the torchrun job once; the per-rank results, rank 0 first."""
    return run_two_ranks(__file__, dirs_args(dirs),
                         tmp_path_factory.mktemp("mla-tp2-out"))


@pytest.mark.parametrize("name,kind,tp,ep,dispatcher", RUNS, ids=[r[0] for r in RUNS])
def test_export_is_bitwise_and_logits_match_hf(h, dirs, ranks, name, kind, tp, ep, dispatcher):
    from hpcrl.train import bridge

    hf = bridge.read_hf_state_dict(dirs[kind])
    hf_model = h.load_hf(dirs[kind])
    tokens = torch.cat([h.sample_batch(hf_model.config.vocab_size)[0]] * 2, dim=1)
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    results = [r[name] for r in ranks]
    if tp == 2:  # q_b_proj split by heads: half the rows on each rank
        assert [r["tp_rank"] for r in results] == [0, 1]
        assert {r["q_up_rows"] for r in results} == {hf_model.config.num_attention_heads * 24 // 2}
    else:
        assert [r["ep_rank"] for r in results] == [0, 1]
    for res in results:
        assert_export_bitwise(res["export"], hf)
        assert (res["logits"] - hf_logits).abs().max() < 1e-5


@pytest.mark.parametrize("name,kind", [(s[0], s[1]) for s in STEPS])
def test_train_step_matches_hf(h, dirs, ranks, name, kind):
    from hpcrl.models.moe import unfuse_experts

    batch = h.sample_batch(37, seed=5)
    ref_loss, ref_norm, ref_state = h.hf_train_step(h.load_hf(dirs[kind]).train(), *batch)
    ref_state = unfuse_experts(ref_state)
    for res in ranks:
        assert res[name]["sp"] == name.startswith("tp2sp")
        assert_step_matches(res[name], ref_loss, ref_norm, ref_state)


if __name__ == "__main__":
    worker_main(worker, "--dirs", "JSON {kind: HF folder} of the tiny MLA models")
