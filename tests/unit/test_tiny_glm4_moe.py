"""The tiny GLM-4.5-style model (``model.create: tiny-glm4-moe``, issue #35 point 5): what the folder holds,
that transformers and the character tokenizer load it, that its expert bias decides routing, and that its
grouped sigmoid router chooses the experts megatron-core's router chooses for the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from hpcrl.config import ModelSection
from hpcrl.models.hf import SUPPORTED_MODEL_TYPES, ensure_model
from hpcrl.models.tiny import glm_expert_groups

SECTION = dict(create="tiny-glm4-moe", tiny_hidden_size=64, tiny_num_layers=3, tiny_num_heads=4,
               tiny_num_kv_heads=2, tiny_num_experts=8, tiny_moe_top_k=2, tiny_moe_intermediate_size=32,
               tiny_intermediate_size=96)


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return ensure_model(ModelSection(path=str(tmp_path_factory.mktemp("glm") / "glm"), **SECTION), seed=4)


def routing(model, ids: torch.Tensor) -> torch.Tensor:
    """Sorted expert ids ``[batch, seq, moe layers, top_k]`` that the HF routers choose for ``ids``."""
    from hpcrl.engine.routing import RoutedExperts

    recorder = RoutedExperts(model)
    with torch.no_grad(), recorder.recording():
        model(ids)
    return recorder.take(*ids.shape).sort(dim=-1).values


def test_glm4_moe_is_a_supported_family():
    assert SUPPORTED_MODEL_TYPES["glm4_moe"] == "Glm4MoeForCausalLM"


def test_ensure_model_creates_a_glm45_style_folder(glm_dir):
    config = json.loads((glm_dir / "config.json").read_text())
    assert (config["model_type"], config["n_routed_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["intermediate_size"], config["head_dim"],
            config["num_hidden_layers"]) == ("glm4_moe", 8, 2, 32, 96, 16, 3)
    assert (config["first_k_dense_replace"], config["n_shared_experts"], config["n_group"],
            config["topk_group"], config["norm_topk_prob"], config["attention_bias"],
            config["num_nextn_predict_layers"]) == (1, 1, 2, 1, True, True, 0)
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert config["routed_scaling_factor"] == 2.5
    from safetensors import safe_open

    with safe_open(str(glm_dir / "model.safetensors"), "pt") as f:  # names as released GLM-4.5 checkpoints
        names = set(f.keys())
        bias = f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")
    assert {"model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.experts.0.gate_proj.weight",
            "model.layers.1.mlp.shared_experts.up_proj.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.k_norm.weight"} <= names
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in names)  # the first layer is dense
    assert bias.shape == (8,) and bias.abs().min() > 0


def test_transformers_and_the_tokenizer_load_it(glm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(glm_dir)).eval()
    saved = json.loads((glm_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(glm_dir))
    ids = tok("12+34=")["input_ids"]
    assert tok.decode(ids) == "12+34=" and len(ids) == 6
    assert model(torch.tensor([ids])).logits.shape == (1, 6, saved["vocab_size"])
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0  # loaded, not re-zeroed


def test_the_expert_bias_changes_which_experts_are_chosen(glm_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(glm_dir)).eval()
    ids = torch.randint(3, 21, (2, 24), generator=torch.Generator().manual_seed(0))
    with_bias = routing(model, ids)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    without = routing(model, ids)
    changed = (with_bias != without).any(-1).any(-1).float().mean().item()
    assert changed > 0.2, f"only {changed:.0%} of tokens route elsewhere without the bias"


@pytest.mark.parametrize("experts,top_k", [(8, 2), (4, 2), (16, 2)])
def test_hf_and_megatron_grouped_sigmoid_routers_choose_the_same_experts(experts, top_k):
    """Same logits and bias into HF's Glm4MoeTopkRouter and megatron-core's topk_routing_with_score_function
    (sigmoid, expert bias, num_groups / group_topk from glm_expert_groups): same experts, same weights."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    n_group, topk_group = glm_expert_groups(experts, top_k)
    assert (n_group, top_k // topk_group) == (2, 2)  # grouped, and both score a group by its top 2
    config = Glm4MoeConfig(hidden_size=16, n_routed_experts=experts, num_experts_per_tok=top_k,
                           n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    g = torch.Generator().manual_seed(experts)
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.3)
    hidden = torch.randn(512, 16, generator=g)
    logits, weights, indices = router(hidden)
    probs, routing_map = topk_routing_with_score_function(
        logits, top_k, num_groups=n_group, group_topk=topk_group, scaling_factor=2.5,
        score_function="sigmoid", expert_bias=router.e_score_correction_bias)
    hf_map = torch.zeros_like(routing_map).scatter(1, indices, True)
    assert torch.equal(hf_map, routing_map)
    torch.testing.assert_close(probs.gather(1, indices), weights, rtol=0, atol=1e-6)
    # the bias takes part in both: without it some tokens route elsewhere
    _, unbiased = topk_routing_with_score_function(logits, top_k, num_groups=n_group, group_topk=topk_group,
                                                   score_function="sigmoid")
    assert not torch.equal(unbiased, routing_map)


def test_groups_fall_back_to_one_where_the_scorings_would_differ():
    assert glm_expert_groups(8, 2) == (2, 1)
    assert glm_expert_groups(8, 4) == (1, 1)  # HF: top-2 per group; megatron: top 4 // topk_group
    assert glm_expert_groups(6, 3) == (1, 1)
    assert glm_expert_groups(2, 2) == (1, 1)  # a group of one expert has no top 2


def test_the_glm4_moe_quickstart_config_loads_and_knows_its_experts():
    """configs/glm4-moe-quickstart.yaml: the tiny GLM, GSPO, TP=2 x EP=2 with sequence parallelism and ETP 1 on
    2 ranks; the login node counts its experts from the tiny_* keys before the folder exists (EP=2 divides 8),
    and routing replay validates on it."""
    from pathlib import Path

    from hpcrl.validate import load_and_check
    from hpcrl.config.train import model_experts, sequence_parallel

    path = Path(__file__).resolve().parents[2] / "configs" / "glm4-moe-quickstart.yaml"
    cfg = load_and_check(path)
    assert (cfg.model.create, cfg.model.path, cfg.train.expert_parallel_size, cfg.train.nprocs) == \
        ("tiny-glm4-moe", ".cache/models/tiny-glm4-moe", 2, 2)
    assert (cfg.train.tensor_parallel_size, sequence_parallel(cfg.train), cfg.train.expert_tensor_parallel_size) \
        == (2, True, 1)
    assert (cfg.algorithm.advantage_estimator, cfg.rollout.router, cfg.sft.enabled) == ("gspo", False, True)
    assert model_experts(cfg, check_files=False) == (8, 2)
    assert load_and_check(path, ["algorithm.routing_replay=true"]).algorithm.routing_replay
