"""Models the trainer cannot build, and model folders that cannot load, are refused on the login node in one
line (issue #35 point 4), by the check the bridge uses too (:mod:`hpcrl.models.support`). The folders are
real: HF configs written by transformers' own classes, safetensors written by the safetensors package, then
damaged.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import ConfigError
from hpcrl.models.support import check_model_folder, routed_experts, unsupported_feature
from hpcrl.validate import load_and_check

HPCRL = [sys.executable, "-m", "hpcrl"]


def hf_folder(path: Path, model_type: str, **fields) -> Path:
    """A tiny random-config folder of ``model_type`` saved by transformers, with one small safetensors
    file."""
    import numpy as np
    from safetensors.numpy import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=32, **fields)
    cfg.save_pretrained(path)
    save_file({"model.embed_tokens.weight": np.zeros((32, 64), dtype=np.float32)},
              str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("model_type,why", [("gpt_oss", "is not a family hpcrl trains"),
                                            ("qwen3_next", "gated delta-net"), ("glm_moe_dsa", "sparse attention")])
def test_unsupported_families_are_refused_by_validate_and_run_in_one_line(tmp_path, model_type, why):
    folder = hf_folder(tmp_path / model_type, model_type)
    with pytest.raises(ConfigError) as e:
        load_and_check(None, [f"model.path={folder}"])
    assert e.value.field == "model.path"
    assert f"config.json model_type={model_type!r} " in str(e.value) and why in str(e.value)
    config = write_config(tmp_path, folder)
    for cmd in ("validate", "run"):
        out = subprocess.run([*HPCRL, cmd, str(config)], capture_output=True, text=True, timeout=120,
                             check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        [line] = out.stderr.strip().splitlines()
        assert line.startswith(f"config error: model.path={str(folder)!r}: config.json model_type=")


def write_config(tmp_path: Path, folder: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: {folder}}}\nsft: {{enabled: false}}\n")
    return path


def test_supported_folder_passes_and_the_bridge_agrees(tmp_path, tiny_model_dir):
    assert check_model_folder(tiny_model_dir) is None
    from transformers import AutoConfig

    from hpcrl.train import bridge

    for model_type, fields in [("qwen2", {"use_sliding_window": True}), ("llama", {"mlp_bias": True}),
                               ("llama", {"hidden_act": "gelu"}),
                               ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                              "rope_theta": 10000.0}})]:
        cfg = AutoConfig.for_model(model_type, **fields)
        bad = unsupported_feature(cfg.to_dict())
        assert bad is not None, (model_type, fields)
        with pytest.raises(NotImplementedError, match=bad[0]):
            bridge.mcore_config_from_hf(cfg)


def test_partial_rope_where_transformers_5_and_the_hub_put_it():
    base = {"model_type": "llama", "hidden_act": "silu"}
    assert unsupported_feature(base) is None
    assert unsupported_feature({**base, "partial_rotary_factor": 0.5})[0] == "partial_rotary_factor"  # GLM
    nested = {**base, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}  # tf 5
    assert unsupported_feature(nested)[0] == "partial_rotary_factor"
    assert unsupported_feature({**base, "partial_rotary_factor": 1.0}) is None
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert unsupported_feature({**base, "rope_scaling": llama3}) is None
    odd = {**base, "rope_scaling": {**llama3, "high_freq_factor": 2.0}}
    assert unsupported_feature(odd)[0] == "rope_parameters"


def test_expert_counts_of_every_family():
    assert routed_experts({"num_experts": 8}) == 8  # Qwen3-MoE
    assert routed_experts({"num_local_experts": 8}) == 8  # Mixtral
    assert routed_experts({"n_routed_experts": 64}) == 64  # GLM-4.5, DeepSeek-V3
    assert routed_experts({"hidden_size": 64}) == 0


@pytest.mark.parametrize("damage,words", [
    ("truncate", "model.safetensors is truncated: its tensors need"),
    ("no_weights", "no weights (no *.safetensors file)"),
    ("bad_config", "config.json is not valid JSON"),
    ("bad_header", "model.safetensors: its header"),
    ("missing_shard", "model.safetensors.index.json names 1 missing shard(s), e.g. model-00002-of-00002"),
])
def test_damaged_folders_are_refused_without_reading_tensors(tmp_path, tiny_model_dir, damage, words):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "no_weights":
        weights.unlink()
    elif damage == "bad_config":
        (folder / "config.json").write_text((folder / "config.json").read_text()[:-20])
    elif damage == "bad_header":
        weights.write_bytes(weights.read_bytes()[:8] + b"{not json" + weights.read_bytes()[17:])
    else:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    problem, fix = check_model_folder(folder)
    assert words in problem, problem
    with pytest.raises(ConfigError) as e:
        load_and_check(None, [f"model.path={folder}"])
    assert e.value.field == "model.path" and words in str(e.value) and "\n" not in str(e.value)
