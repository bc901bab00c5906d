"""The tiny DeepSeek-V3-style model (``model.create: tiny-deepseek-v3``, issue #35 point 5): what the folder
holds, that transformers and the character tokenizer load it, that the login node counts its experts and
accepts it, and that the megatron-core trainer built from it gives HF's logits."""

from __future__ import annotations

import json

import pytest
import torch

from hpcrl.config import ModelSection
from hpcrl.models.hf import SUPPORTED_MODEL_TYPES, ensure_model
from hpcrl.models.support import check_model_folder
from hpcrl.validate import ENVIRONMENT, load_and_check

SECTION = dict(create="tiny-deepseek-v3", tiny_hidden_size=64, tiny_num_layers=3, tiny_num_heads=4,
               tiny_num_experts=8, tiny_moe_top_k=2, tiny_moe_intermediate_size=32, tiny_intermediate_size=96,
               tiny_num_kv_heads=2)


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return ensure_model(ModelSection(path=str(tmp_path_factory.mktemp("ds") / "ds"), **SECTION), seed=4)


def test_ensure_model_creates_a_deepseek_v3_style_folder(ds_dir):
    assert SUPPORTED_MODEL_TYPES["deepseek_v3"] == "DeepseekV3ForCausalLM"
    config = json.loads((ds_dir / "config.json").read_text())
    assert (config["model_type"], config["n_routed_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        "deepseek_v3", 8, 2, 32, 96, 3)
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_nope_head_dim"],
            config["qk_rope_head_dim"], config["v_head_dim"], config["num_key_value_heads"]) == (
        32, 32, 16, 8, 16, 4)
    assert (config["first_k_dense_replace"], config["n_shared_experts"], config["n_group"],
            config["topk_group"], config["rope_interleave"]) == (1, 1, 2, 1, True)
    rope = config["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["mscale"], rope["mscale_all_dim"]) == (
        "yarn", 4.0, 1.0, 1.0)
    from safetensors import safe_open

    with safe_open(str(ds_dir / "model.safetensors"), "pt") as f:  # names as released DeepSeek-V3 ones
        names = set(f.keys())
        bias = f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")
    assert {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_a_layernorm.weight",
            "model.layers.0.self_attn.q_b_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.0.self_attn.kv_b_proj.weight",
            "model.layers.1.mlp.experts.7.down_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.0.mlp.gate_proj.weight"} <= names
    assert not any(n.startswith(("model.layers.0.mlp.experts", "model.layers.3.")) for n in names)
    assert bias.shape == (8,) and bias.abs().min() > 0
    assert check_model_folder(ds_dir) is None


def test_transformers_the_tokenizer_and_the_login_node_read_it(ds_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(ds_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(ds_dir))
    ids = tok("12+34=")["input_ids"]
    assert tok.decode(ids) == "12+34=" and len(ids) == 6
    assert model(torch.tensor([ids])).logits.shape == (1, 6, len(tok))
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0  # loaded, not re-zeroed
    from hpcrl.config.train import model_experts

    cfg = load_and_check(None, [f"model.path={ds_dir}", "model.create=tiny-deepseek-v3", "sft.enabled=false"])
    assert model_experts(cfg, check_files=True, env=ENVIRONMENT) == (8, 2)


def test_megatron_logits_equal_hfs(ds_dir):
    """The bridge builds it (MLA with YaRN, dense first layer, grouped sigmoid router) and gives HF's logits
    past YaRN's original context (64 of its 256 positions)."""
    pytest.importorskip("megatron.core")
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.train import bridge, parallel

    torch.set_num_threads(1)
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(1)
    try:
        model = bridge.build_gpt_model(AutoConfig.from_pretrained(str(ds_dir)))
        bridge.load_hf_weights(model, ds_dir)
        hf = AutoModelForCausalLM.from_pretrained(str(ds_dir), dtype=torch.float32).eval()
        ids = torch.randint(3, 21, (2, 80), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            dev = next(model.parameters()).device  # CUDA when there is one (build_gpt_model moves it)
            positions = torch.arange(80, device=dev).expand(2, -1)
            logits = model.eval()(input_ids=ids.to(dev), position_ids=positions, attention_mask=None)
            assert (logits[..., :hf.config.vocab_size].cpu() - hf(ids).logits).abs().max() < 1e-5
    finally:
        parallel.destroy()
