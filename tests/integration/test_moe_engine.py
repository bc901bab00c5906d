"""The CPU engine serving a mixture-of-experts model (issue #15 point 2), against real processes.

A tiny random Qwen3-MoE (4 experts, top-2, 2 layers) served by ``python -m hpcrl.engine.server``:

- ``return_routed_experts`` (SGLang's request field and response shape: ``meta_info["routed_experts"]``, base64
  int32 ``[len(prompt) + len(output) - 1, layers, top_k]``) equals the experts HF transformers' own routers
  choose for the same tokens in one forward pass, for a group of samples (one shared prefill, then batched
  decode steps) and for a prefill-only request.
- Weight sync of expert weights from a megatron-core trainer (per-expert HF names into the engine's fused
  ``gate_up_proj`` / ``down_proj``): at EP=1 in this process and at EP=2 (two torchrun processes, the experts
  gathered across the expert-parallel group, rank 0 sends), the engine's log-probs then equal the trainer's
  to 1e-5 in fp32 and its routing equals the trainer's model's.
This file is the EP=2 torchrun worker when run as a script.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch

try:
    from tests.integration.engine_utils import (http_json, key_file, keyed_engine, local_trainer, max_diff,
                                                perturb, run_two_rank_sync, sync_trainer, sync_worker_main,
                                                trainer_model)
except ImportError:  # tests/integration is not a package (also when run by torchrun)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_utils import (http_json, key_file, keyed_engine, local_trainer, max_diff, perturb,
                              run_two_rank_sync, sync_trainer, sync_worker_main, trainer_model)

KEY = "moe-engine-test-key"
TOL = 1e-5
SEQS = [[1, 5, 9, 12, 3, 7, 18, 4, 11, 6], [1, 14, 8, 20, 10, 2, 17]]
"""Token ids (tiny vocab of 21) of sequences whose log-probs and routing are compared."""
LAYERS, EXPERTS, TOP_K = 2, 4, 2


def make_moe(path: Path) -> Path:
    from hpcrl.models.tiny import create_tiny_qwen3_moe

    return create_tiny_qwen3_moe(path, hidden_size=64, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
                                 head_dim=16, num_experts=EXPERTS, top_k=TOP_K, moe_intermediate_size=32, seed=5)


def hf_routing(model, tokens: list[int]) -> torch.Tensor:
    """int32 ``[len(tokens), layers, top_k]``: HF's routers' choices in one forward pass over ``tokens``."""
    from hpcrl.engine.routing import RoutedExperts

    recorder = getattr(model, "_recorder", None) or RoutedExperts(model)
    model._recorder = recorder
    with torch.no_grad(), recorder.recording():
        model(torch.tensor([tokens]))
    return recorder.take(1, len(tokens))[0]


def engine_view(url: str, key: str = KEY) -> tuple[list[list[float]], list, str]:
    """Per sequence of SEQS: the engine's input log-probs (tokens 1..n-1), its routed experts
    ``[n - 1, layers, top_k]`` (prefill only), and its weight_version."""
    from hpcrl.engine.routing import decode

    lps, routes, version = [], [], None
    for seq in SEQS:
        status, body = http_json("POST", url + "/generate", {
            "input_ids": seq, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0, "return_routed_experts": True},
            headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert status == 200, body
        lps.append([t[0] for t in body["meta_info"]["input_token_logprobs"][1:]])
        routes.append(decode(body["meta_info"]["routed_experts"], len(seq), LAYERS, TOP_K).tolist())
        version = body["meta_info"]["weight_version"]
    return lps, routes, version


def trainer_view(model) -> tuple[list[list[float]], list]:
    """The trainer's log-probs of tokens 1..n-1 of each sequence, and the routing of its weights (exported to
    an HF model) for tokens 0..n-2 (a collective on every rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.models.moe import fuse_experts
    from hpcrl.train.bridge import export_hf_weights, unwrap_model
    from hpcrl.train.logprobs import response_log_probs

    out = []
    with torch.no_grad():
        for seq in SEQS:
            res = response_log_probs(model, torch.tensor([seq]), [len(seq)], [len(seq) - 1])
            out.append(res.log_probs[0].tolist())
    state = fuse_experts(dict(export_hf_weights(model)))
    hf_config = unwrap_model(model).hf_config
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config.to_dict())).eval()
    hf.load_state_dict(state, strict=False)  # a tied lm_head is not exported
    return out, [hf_routing(hf, seq[:-1]).tolist() for seq in SEQS]


async def sync(url: str, model, version: str, sender: bool = True) -> dict:
    """One ``tensor`` sync of the trainer's export (every rank iterates it; ``sender`` posts it)."""
    return await sync_trainer(url, KEY, model, version, sender=sender)


# --- the EP=2 worker: `torchrun --nproc_per_node=2 test_moe_engine.py --model DIR --url URL --out DIR` ------

def worker(model_dir: str, url: str, out: Path) -> None:
    """Each of 2 ranks (EP=2: experts 0-1 on rank 0, 2-3 on rank 1) exports; rank 0 syncs."""
    with trainer_model(model_dir, ep=2) as (model, rank):
        perturb(model, seed=200)  # the same noise on both ranks: the replicated weights stay replicas
        metrics = asyncio.run(sync(url, model, "ep2", sender=rank == 0))
        mine, routes = trainer_view(model)
        (out / f"rank{rank}.json").write_text(json.dumps(dict(metrics=metrics, trainer=mine, routes=routes)))


# --- fixtures -----------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_moe(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe")


@pytest.fixture(scope="module")
def engine(moe_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-engine")
    with keyed_engine(moe_dir, key_file(root, KEY), root / "engine.log") as eng:
        yield eng


@pytest.fixture(scope="module")
def trainer(moe_dir):
    pytest.importorskip("megatron.core")
    yield from local_trainer(moe_dir)


# --- tests --------------------------------------------------------------------------------------------------

def test_routed_experts_of_a_sampled_group_equal_hf_routing(engine, moe_dir):
    from transformers import AutoModelForCausalLM

    from hpcrl.engine.routing import decode

    hf = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    prompt = [1, 5, 9, 12, 3]
    status, body = http_json("POST", engine.url + "/generate", {
        "input_ids": prompt, "return_routed_experts": True,
        "sampling_params": {"n": 3, "max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True,
                            "sampling_seed": 11}}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert status == 200, body
    assert len(body) == 3
    for out in body:
        tokens = prompt + out["output_ids"]
        assert len(out["output_ids"]) == 6
        routed = decode(out["meta_info"]["routed_experts"], len(tokens), LAYERS, TOP_K)  # the shape SGLang gives
        assert ((0 <= routed) & (routed < EXPERTS)).all()
        ref = hf_routing(hf, tokens[:-1]).numpy()
        # same expert set per token and layer (the order within top-k is by weight in both)
        assert (routed == ref).all(), (routed.tolist(), ref.tolist())
    status, body = http_json("POST", engine.url + "/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 2}},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert status == 200 and "routed_experts" not in body["meta_info"]  # only when asked


def test_weight_sync_of_experts_gives_the_trainers_log_probs_and_routing(engine, trainer):
    perturb(trainer, seed=1)
    before, _, _ = engine_view(engine.url)
    mine, routes = trainer_view(trainer)
    assert max_diff(before, mine) > 1e-3  # the engine serves other weights
    metrics = asyncio.run(sync(engine.url, trainer, "ep1"))
    assert metrics["tensors"] > 0
    theirs, engine_routes, version = engine_view(engine.url)
    assert version == "ep1"
    assert max_diff(theirs, mine) < TOL
    assert engine_routes == routes


def test_ep2_trainer_syncs_every_expert(engine, moe_dir, tmp_path):
    ranks = run_two_rank_sync(__file__, ["--model", str(moe_dir), "--url", engine.url], tmp_path / "out")
    assert max_diff(ranks[0]["trainer"], ranks[1]["trainer"]) < 1e-6  # one model across the ranks
    theirs, engine_routes, version = engine_view(engine.url)
    assert version == "ep2"
    assert max_diff(theirs, ranks[0]["trainer"]) < TOL
    assert engine_routes == ranks[0]["routes"]


if __name__ == "__main__":
    sync_worker_main(worker)
