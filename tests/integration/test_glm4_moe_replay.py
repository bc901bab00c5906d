"""Rollout routing replay with GLM-4.5's sigmoid grouped router (issue #35 point 3, ``glm4_moe``), on real
processes: a bf16 CPU engine samples from the tiny GLM (first layer dense, shared expert, non-zero expert bias,
2 groups of 4 experts, top-2), the fp32 megatron-core trainer scores the samples
(``benchmarks/routing_replay.py``'s ``measure``).

Without replay some tokens' choice differs between the two precisions (measured from the experts the trainer's
routers used, their ``routing_map``); replaying the engine's ``return_routed_experts`` (which HF's
``Glm4MoeTopkRouter`` chose with the bias and the group limit) makes that 0 and the train/rollout log-prob
difference smaller. The gate can fail: a trainer that ignored the replayed routing, or replayed it into the
wrong layers (the dense first layer has no router), would keep the difference above 0.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.integration


def _bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("hpcrl_bench_routing_replay", BENCH / "routing_replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replay_of_the_sigmoid_grouped_router_makes_routing_equal(tmp_path):
    pytest.importorskip("megatron.core")
    from hpcrl.models.tiny import build_char_tokenizer, create_tiny_glm4_moe
    from hpcrl.train import parallel

    bench = _bench()
    model_dir = create_tiny_glm4_moe(tmp_path / "glm", **bench.GLM_MODEL)
    tok = build_char_tokenizer()
    prompts = [tok(f"{100 + 37 * i}+{250 + 13 * i}=")["input_ids"] for i in range(8)]
    torch.set_num_threads(1)
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(0)
    proc, url = bench.start_engine(str(model_dir), 1, tmp_path / "engine.log", ("--dtype", "bfloat16"))
    try:
        free, replay = bench.measure(model_dir, url, prompts, samples=3, max_new_tokens=20)
    finally:
        bench.stop_engine(proc)
        parallel.destroy()
    print(free, replay)
    assert free["tokens"] == replay["tokens"] > 0
    assert free["routing_differs"] > 0, "bf16 and fp32 routed every token alike: the gate cannot show anything"
    assert replay["routing_differs"] == 0
    assert replay["logprob_mean"] < free["logprob_mean"]
