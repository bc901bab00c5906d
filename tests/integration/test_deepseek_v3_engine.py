"""The CPU engine serving a DeepSeek-V3-style model and a GLM-4.7-Flash-style one (multi-latent attention,
YaRN, a dense first layer, a MoE layer with the sigmoid grouped router, expert bias and a shared expert),
against a real engine process.

A tiny random ``DeepseekV3ForCausalLM`` of tests/unit/test_deepseek_v3_bridge.py with hpcrl's character
tokenizer, served by ``python -m hpcrl.engine.server``:

- it generates (a sampled group of 3 from one prompt, text and token ids);
- weight sync (tensor, distributed, disk) from a megatron-core trainer (TP=1, this process) carries every
  name the bridge exports (MLA's q_a/q_b/kv_a/kv_b projections and latent norms, the router's
  ``e_score_correction_bias`` buffer, the shared and routed experts) into the engine's model, after seeded
  noise on every trainer tensor, the bias included; the engine's log-probs then equal the trainer's to 1e-5
  in fp32 (before the sync they do not).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

try:
    from tests.integration.engine_utils import (http_json, key_file, keyed_engine, local_trainer, max_diff,
                                                prefill_logprobs, sync_weights)
except ImportError:  # tests/integration is not a package
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_utils import (http_json, key_file, keyed_engine, local_trainer, max_diff, prefill_logprobs,
                              sync_weights)

KEY = "deepseek-engine-test-key"
SEQS = [[1, 5, 9, 12, 3, 7, 18, 4, 11, 6, 13, 8, 19, 2, 10, 16, 5, 3, 12, 7], [1, 14, 8, 20, 10, 2, 17]]
"""Token ids (character vocab of 21); the first is longer than the model's YaRN original context (16)."""

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["deepseek_v3_moe", "glm4_moe_lite_moe"])
def model_dir(request, tiny_model_dir, tmp_path_factory):
    """A tiny DeepSeek-V3 or GLM-4.7-Flash-style (``glm4_moe_lite``) MLA model with a MoE second layer."""
    from tests.unit.test_deepseek_v3_bridge import make_tiny_mla

    return make_tiny_mla(request.param, tmp_path_factory.mktemp("ds") / f"tiny-{request.param}",
                         tokenizer_dir=tiny_model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ds-engine")
    with keyed_engine(model_dir, key_file(root, KEY), root / "engine.log") as eng:
        yield eng


@pytest.fixture(scope="module")
def trainer(model_dir):
    pytest.importorskip("megatron.core")
    yield from local_trainer(model_dir)


def engine_log_probs(url: str) -> list[list[float]]:
    return prefill_logprobs(url, SEQS, KEY)[0]


def trainer_log_probs(model) -> list[list[float]]:
    from hpcrl.train.logprobs import response_log_probs

    with torch.no_grad():
        return [response_log_probs(model, torch.tensor([seq]), [len(seq)], [len(seq) - 1]).log_probs[0]
                .tolist() for seq in SEQS]


def test_engine_generates_a_group(engine):
    status, body = http_json("POST", engine.url + "/generate", {
        "text": "12+34=", "sampling_params": {"n": 3, "max_new_tokens": 5, "temperature": 1.0,
                                              "ignore_eos": True, "sampling_seed": 3}},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert status == 200, body
    assert len(body) == 3 and all(len(out["output_ids"]) == 5 for out in body), body
    assert all(isinstance(out["text"], str) for out in body)


def perturb_trainer(trainer, seed: int) -> list[list[float]]:
    """Seeded noise on every tensor the bridge maps (the expert bias buffer included); returns the trainer's
    new log-probs of :data:`SEQS`."""
    from hpcrl.train import bridge

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in bridge.named_tensors(bridge.unwrap_model(trainer)):
            scale = 0.02 if "expert_bias" in name else 0.05
            t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * scale)
    return trainer_log_probs(trainer)


@pytest.mark.parametrize("method", ["tensor", "distributed", "disk"])
def test_sync_carries_every_name_and_log_probs_match(engine, trainer, model_dir, method, tmp_path):
    from hpcrl.train import bridge
    from hpcrl.weights import iterate_for_sync

    mine = perturb_trainer(trainer, seed={"tensor": 7, "distributed": 9, "disk": 11}[method])
    assert max_diff(engine_log_probs(engine.url), mine) > 1e-3  # not synced yet

    kwargs = dict(disk_dir=str(tmp_path), hf_checkpoint=str(model_dir)) if method == "disk" else {}
    metrics = asyncio.run(sync_weights(engine.url, KEY, iterate_for_sync(trainer), f"ds-{method}", method,
                                       bucket_bytes=16 * 1024, **kwargs))
    names = {n for n, _ in bridge.export_hf_weights(trainer)}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    assert metrics["tensors"] == len(names), metrics
    assert method != "tensor" or metrics["buckets"] > 1, metrics
    assert max_diff(engine_log_probs(engine.url), mine) < 1e-5
