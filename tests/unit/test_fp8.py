"""Block-fp8 rollout weights (hpcrl.weights.fp8): the 128 x 128 quantisation and its error bound, which
tensors stay in full precision, the sync stream's weight + scale pairs, the checkpoint the engines start
from, and the CPU engine's loader that dequantises them (as sent, pairs split over calls too)."""

from __future__ import annotations

import json

import pytest
import torch

from hpcrl.weights.fp8 import (BLOCK, FP8, FP8_MAX, QUANTIZATION_CONFIG, SCALE_SUFFIX, dequantize, is_fp8_folder,
                               quantize, quantize_stream, quantized, scale_shape, write_fp8_checkpoint)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (64, 5)])
def test_blocks_of_128_with_scales_and_the_error_bound(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])  # columns of other magnitudes
    w[:BLOCK, :BLOCK] = 0.0  # an all-zero block
    q, scale = quantize(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.dtype == torch.float32
    assert tuple(scale.shape) == scale_shape(shape) == (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    assert scale[0, 0] == 1.0 and q[:BLOCK, :BLOCK].float().eq(0).all()
    back = dequantize(q, scale)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            amax = w[block].abs().max()
            if amax == 0:
                continue
            assert q[block].float().abs().max() == FP8_MAX  # the block's largest value maps to 448
            # e4m3 keeps 3 mantissa bits: each value is within half a step (1/16 of its binade) of the original
            assert (back[block] - w[block]).abs().max() <= amax / 16 + 1e-12
    assert dequantize(q, scale, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="scales of shape"):
        dequantize(q, torch.ones(scale.shape[0] + 1, scale.shape[1]))


def test_which_tensors_are_fp8_and_the_stream_pairs():
    names = {"model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.mlp.down_proj.weight": (64, 256),
             "model.layers.3.mlp.experts.7.up_proj.weight": (32, 64),
             "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (96, 64)}
    kept = {"model.layers.0.mlp.gate.weight": (8, 64), "model.layers.0.block_sparse_moe.gate.weight": (8, 64),
            "model.embed_tokens.weight": (21, 64), "lm_head.weight": (21, 64),
            "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.self_attn.q_proj.bias": (64,)}
    assert all(quantized(n, s) for n, s in names.items())
    assert not any(quantized(n, s) for n, s in kept.items())
    stream = [(n, torch.randn(s)) for n, s in {**names, **kept}.items()]
    out = list(quantize_stream(stream, torch.bfloat16))
    got = [n for n, _ in out]
    for n in names:
        i = got.index(n)
        assert got[i + 1] == n + SCALE_SUFFIX and out[i][1].dtype == FP8 and out[i + 1][1].dtype == torch.float32
    assert all(dict(out)[n].dtype == torch.bfloat16 for n in kept)
    assert len(out) == 2 * len(names) + len(kept)


def test_the_checkpoint_and_the_engines_loader(tmp_path, tiny_model_dir):
    """``write_fp8_checkpoint`` of the tiny Qwen2; the CPU engine's loader (``fp8=True``) on a model built
    without the quantisation holds the dequantised weights, and a weight and its scales sent in two calls
    end the same."""
    from transformers import AutoModelForCausalLM

    from hpcrl.engine.server import load_fp8_model
    from hpcrl.engine.weights import WeightLoader
    from hpcrl.train.bridge import read_hf_state_dict

    dest = write_fp8_checkpoint(tiny_model_dir, tmp_path / "fp8")
    assert is_fp8_folder(dest) and not is_fp8_folder(tiny_model_dir)
    config = json.loads((dest / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert (dest / "tokenizer.json").is_file()
    state, original = read_hf_state_dict(dest), read_hf_state_dict(tiny_model_dir)
    w = "model.layers.0.mlp.down_proj.weight"
    assert state[w].dtype == FP8 and w + SCALE_SUFFIX in state
    model = load_fp8_model(str(dest), torch.float32)
    loader = WeightLoader(model, fp8=True)
    loader.load_from_disk(dest)
    params = dict(model.named_parameters())
    assert torch.equal(params[w].detach(), dequantize(state[w], state[w + SCALE_SUFFIX]))
    assert torch.equal(params["model.embed_tokens.weight"].detach(), original["model.embed_tokens.weight"])
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gap = (params[w].detach() - dict(reference.named_parameters())[w].detach()).abs().max()
    assert 0 < gap <= original[w].abs().max() / 16
    q, scale = quantize(original[w] * 2)
    loader.load([(w + SCALE_SUFFIX, scale)])  # the scales first, the weight in the next call
    loader.load([(w, q)])
    assert torch.equal(params[w].detach(), dequantize(q, scale))
    from hpcrl.engine.weights import WeightUpdateError

    with pytest.raises(WeightUpdateError, match="shape mismatch"):
        loader.load([(w + SCALE_SUFFIX, torch.ones(2, 2))])


def test_sglang_fp8_block_shapes():
    """SGLang 0.5.23 refuses a block-fp8 projection that is not whole 128-wide blocks per shard (its
    ``validate_fp8_block_shape``; seen with the tiny Qwen2's 64-wide k/v projection)."""
    from hpcrl.config.weights import sglang_fp8_shape_problem

    tiny = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512}
    assert "k/v projection is 64 wide" in sglang_fp8_shape_problem(tiny, 1)
    wider = dict(tiny, hidden_size=256)  # head_dim 64: k/v 128 wide
    assert sglang_fp8_shape_problem(wider, 1) is None
    assert "(sglang tp_size=2)" in sglang_fp8_shape_problem(wider, 2)  # 64 per shard
    qwen25_7b = {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                 "intermediate_size": 18944}
    assert all(sglang_fp8_shape_problem(qwen25_7b, tp) is None for tp in (1, 2, 4))
    assert sglang_fp8_shape_problem(dict(tiny, intermediate_size=500, num_key_value_heads=4), 1) is not None
    assert sglang_fp8_shape_problem(dict(tiny, intermediate_size=500, num_key_value_heads=4), 1, experts=8) is None


def test_validate_refuses_fp8_sglang_for_the_tiny_model(tiny_model_dir):
    """``hpcrl validate`` reads the model's ``config.json``: fp8 on SGLang engines for a model SGLang cannot
    block-quantise is one line before anything is queued; the CPU engine (which emulates fp8) takes it."""
    from hpcrl.config import ConfigError, load_config
    from hpcrl.validate import ENVIRONMENT

    base = [f"model.path={tiny_model_dir}", "model.create=null", "weights.rollout_dtype=fp8"]
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", base + ["rollout.engine=sglang"], env=ENVIRONMENT)
    assert e.value.field == "weights.rollout_dtype" and "64 wide" in str(e.value) and "\n" not in str(e.value)
    load_config("configs/quickstart.yaml", base + ["rollout.engine=cpu"], env=ENVIRONMENT)
