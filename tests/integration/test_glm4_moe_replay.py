"""Rollout routing replay with GLM-4.5's and DeepSeek-V3's sigmoid grouped router (issue #35 point 3,
``glm4_moe`` and ``deepseek_v3`` with multi-latent attention), on real processes: a bf16 CPU engine samples
from the tiny model (first layer dense, shared expert, non-zero expert bias, 2 groups of 4 experts, top-2),
the fp32 megatron-core trainer scores the samples (``benchmarks/routing_replay.py``'s ``measure``). Without
replay some tokens' choice differs between the two precisions (measured from the experts the trainer's
routers used, their ``routing_map``); replaying the engine's ``return_routed_experts`` (which HF's
``Glm4MoeTopkRouter`` chose with the bias and the group limit) makes that 0 and the train/rollout log-prob
difference smaller. The gate can fail: a trainer that ignored the replayed routing, or replayed it into the
wrong layers (the dense first layer has no router), would keep the difference above 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

try:
    from tests.integration.engine_utils import load_benchmark
except ImportError:  # tests/integration is not a package
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_utils import load_benchmark

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_replay_of_the_sigmoid_grouped_router_makes_routing_equal(tmp_path, family):
    pytest.importorskip("megatron.core")
    torch.set_num_threads(1)
    bench = load_benchmark("routing_replay")
    free, replay = bench.measure_family(family, tmp_path, prompts=8, samples=3, max_new_tokens=20)
    print(free, replay)
    assert free["tokens"] == replay["tokens"] > 0
    assert free["routing_differs"] > 0, "bf16 and fp32 routed every token alike: the gate shows nothing"
    assert replay["routing_differs"] == 0
    assert replay["logprob_mean"] < free["logprob_mean"]
