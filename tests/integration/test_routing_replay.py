"""Rollout routing replay's gate (issue #15 point 3) on real processes: a bf16 CPU engine samples from a tiny
Qwen3-MoE, the fp32 megatron-core trainer scores the samples (``benchmarks/routing_replay.py``'s ``measure``).

Without replay some tokens' top-k choice differs between the two precisions (measured from the experts the
trainer's routers used); replaying the engine's ``return_routed_experts`` makes that 0 and the train/rollout
log-prob difference smaller. The gate can fail: a trainer that ignored the replayed routing would keep the
difference above 0.
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


def test_replay_makes_routing_equal_and_log_probs_closer(tmp_path):
    pytest.importorskip("megatron.core")
    torch.set_num_threads(1)
    bench = load_benchmark("routing_replay")
    free, replay = bench.measure_family("qwen3_moe", tmp_path, prompts=6, samples=3, max_new_tokens=16)
    print(free, replay)
    assert free["tokens"] == replay["tokens"] > 0
    assert free["routing_differs"] > 0, "bf16 and fp32 routed every token alike: the gate cannot show anything"
    assert replay["routing_differs"] == 0
    assert replay["logprob_mean"] < free["logprob_mean"]
