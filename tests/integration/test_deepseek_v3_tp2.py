"""DeepSeek-V3-family multi-latent attention across 2 real processes (torchrun, gloo on loopback): TP=2 and
EP=2.

One torchrun job (this file run as a script, see ``worker``) builds the tiny MLA models of
tests/unit/test_deepseek_v3_bridge.py and saves per rank what it computed; the tests compare it with HF
transformers in this process:

- TP=2 (MLA's q/kv down projections split and all-gathered, up projections split by heads, o_proj by rows),
  dense DeepSeek-V3 with YaRN, dense GLM-lite, and DeepSeek-V3 with a MoE layer under both token dispatchers:
  HF -> megatron -> HF export bitwise on both ranks; gathered logits equal HF's (1e-5).
- EP=2 (experts 0-1 on rank 0, 2-3 on rank 1) of the MoE DeepSeek-V3, both dispatchers: the same.
- One optimizer step at TP=2 (dense, YaRN) and at EP=2 (MoE, all-to-all): loss, grad norm and the weights
  after the step equal HF AdamW's (at TP=2 this needs the shared rope key's gradient summed over the ranks:
  hpcrl.train.mla_layers.LatentAttention).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_UNIT = Path(__file__).resolve().parents[1] / "unit" / "test_megatron_bridge.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/integration is not a package
from engine_utils import free_port  # noqa: E402

DISPATCHERS = ("allgather", "alltoall")
RUNS = (  # name, kind, TP, EP, dispatcher
    ("tp2-deepseek_v3", "deepseek_v3", 2, 1, None),
    ("tp2-glm4_moe_lite", "glm4_moe_lite", 2, 1, None),
    *((f"tp2-deepseek_v3_moe-{d}", "deepseek_v3_moe", 2, 1, d) for d in DISPATCHERS),
    *((f"ep2-deepseek_v3_moe-{d}", "deepseek_v3_moe", 1, 2, d) for d in DISPATCHERS),
)
STEPS = (("tp2-step", "deepseek_v3", 2, 1, None), ("ep2-step", "deepseek_v3_moe", 1, 2, "alltoall"))


def _unit_helpers():
    spec = importlib.util.spec_from_file_location("hpcrl_tests_megatron_bridge_helpers", _UNIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the distributed side: `torchrun --nproc_per_node=2 test_deepseek_v3_tp2.py --dirs JSON --out DIR` ---


def worker(dirs: dict[str, str], out: Path) -> None:
    """Run on each of 2 ranks; writes ``out/rank{r}.pt``."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoConfig

    from hpcrl.train import bridge, parallel, model as tmodel

    h = _unit_helpers()
    env = parallel.init_distributed()
    res: dict = {}
    for name, kind, tp, ep, dispatcher in RUNS:
        parallel.initialize_model_parallel(tp=tp, ep=ep)
        parallel.model_parallel_cuda_manual_seed(1234)
        hf_config = AutoConfig.from_pretrained(dirs[kind])
        overrides = {"moe_token_dispatcher_type": dispatcher} if dispatcher else {}
        model = bridge.build_gpt_model(hf_config, **overrides)
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
        ddp_model, optimizer = tmodel.setup_model_and_optimizer(dirs[kind], h.TRAIN, megatron)
        step = tmodel.train_step(ddp_model, optimizer, h.megatron_loss_fn(h.sample_batch(37, seed=5)), [None])
        res[name] = dict(step=step, after=dict(bridge.export_hf_weights(ddp_model)))
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
def dirs(h, tmp_path_factory):
    from tests.unit.test_deepseek_v3_bridge import make_tiny_mla

    root = tmp_path_factory.mktemp("mla-tp2")
    kinds = ("deepseek_v3", "glm4_moe_lite", "deepseek_v3_moe")
    return {kind: make_tiny_mla(kind, root / kind) for kind in kinds}


@pytest.fixture(scope="module")
def ranks(dirs, tmp_path_factory):
    """Run the torchrun job once; the per-rank results, rank 0 first."""
    out = tmp_path_factory.mktemp("mla-tp2-out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__,
           "--dirs", json.dumps({k: str(v) for k, v in dirs.items()}), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-6000:]}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


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
        assert sorted(res["export"]) == sorted(hf)
        for hf_name, tensor in hf.items():
            assert torch.equal(res["export"][hf_name], tensor), hf_name
        assert (res["logits"] - hf_logits).abs().max() < 1e-5


@pytest.mark.parametrize("name,kind", [(s[0], s[1]) for s in STEPS])
def test_train_step_matches_hf(h, dirs, ranks, name, kind):
    from hpcrl.models.moe import unfuse_experts

    batch = h.sample_batch(37, seed=5)
    ref_loss, ref_norm, ref_state = h.hf_train_step(h.load_hf(dirs[kind]).train(), *batch)
    ref_state = unfuse_experts(ref_state)
    for res in ranks:
        run = res[name]
        assert run["step"]["update_successful"]
        assert sorted(run["after"]) == sorted(ref_state)
        diffs = {k: (run["after"][k] - ref_state[k]).abs().max().item() for k in ref_state}
        worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
        assert run["step"]["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert run["step"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5), (run["step"], worst)
        assert max(diffs.values()) < 1e-6, worst


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=worker.__doc__)
    parser.add_argument("--dirs", required=True, help="JSON {kind: HF folder} of the tiny MLA models")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    worker(json.loads(args.dirs), args.out)
