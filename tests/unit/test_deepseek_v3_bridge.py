"""DeepSeek-V3-family multi-latent attention (MLA) in the Megatron bridge at TP=1, in this process (gloo).

Real tiny random HF models (``DeepseekV3ForCausalLM``, ``Glm4MoeLiteForCausalLM``, fp32) against megatron-core
GPTModels built by hpcrl.train.bridge with hpcrl.train.mla's spec: HF -> megatron -> HF export bitwise (every
MLA tensor: q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj), logits / log-probs / entropy within 1e-5 of HF (YaRN with mscale / mscale_all_dim, plain RoPE, no q
LoRA, GLM-lite's rms_norm_eps beside HF's fixed latent-norm eps), one optimizer step within 1e-6 of HF + torch
AdamW, the packed and shared-prompt forwards equal to the padded one, and the config fields read from where
transformers 5 and hub checkpoints put them, with what megatron cannot express refused in one line.
TP=2 is in tests/integration/test_deepseek_v3_tp2.py, which reuses :func:`make_tiny_mla`.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from hpcrl.models import moe  # noqa: E402
from hpcrl.models.support import unsupported_feature  # noqa: E402
from hpcrl.train import bridge, mla, model as tmodel  # noqa: E402
from tests.unit.test_megatron_bridge import (  # noqa: E402
    MEGATRON, SEQ, TRAIN, assert_exports_checkpoint, build_loaded, device_of, hf_reference, hf_train_step,
    load_hf, megatron_loss_fn, sample_batch, save_random, tp1)  # noqa: F401 (fixture)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.9}
"""YaRN as DeepSeek-V3 publishes it (both mscales set; here unequal, so neither scale is 1) on a 16-token
original context: the test sequences reach past it."""

KINDS = ("deepseek_v3", "deepseek_v3_no_q_lora", "glm4_moe_lite", "deepseek_v3_moe", "glm4_moe_lite_moe")


def make_tiny_mla(kind: str, path: Path, tokenizer_dir: Path | None = None, seed: int = 1) -> Path:
    """Save a random tiny MLA model: ``deepseek_v3`` (q LoRA 24, kv LoRA 32, nope 16 / rope 8 / v 12 head
    dims, YaRN :data:`YARN`, every layer dense), ``deepseek_v3_no_q_lora`` (``q_proj``, plain RoPE, tied
    embeddings) or ``glm4_moe_lite`` (``rms_norm_eps`` 1e-5, v 20 wider than q/k 16 + 8, YaRN with
    ``mscale_all_dim`` only); ``deepseek_v3_moe`` / ``glm4_moe_lite_moe``: the same with a dense first layer
    and a MoE second one (4 experts in 2 groups, top-2 of 1 group, a shared expert, routed_scaling_factor
    2.5). Norm weights and ``e_score_correction_bias`` are random (HF inits them to 1 / 0), router weights
    wider than HF's init (no near-ties in the routing). With ``tokenizer_dir`` its tokenizer files are copied
    and the vocab is its size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = 37
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=64,
                  rms_norm_eps=1e-6, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    moe = kind.endswith("_moe")
    if moe:
        common.update(n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5)
        kind = kind.removesuffix("_moe")
    if kind == "deepseek_v3":
        config = AutoConfig.for_model("deepseek_v3", q_lora_rank=24, first_k_dense_replace=1 if moe else 2,
                                      rope_parameters=YARN, tie_word_embeddings=False, **common)
    elif kind == "deepseek_v3_no_q_lora":
        config = AutoConfig.for_model("deepseek_v3", q_lora_rank=None, first_k_dense_replace=2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                                      tie_word_embeddings=True, **common)
    elif kind == "glm4_moe_lite":
        rope = {**YARN, "mscale": None, "mscale_all_dim": 0.0, "factor": 2.0}
        config = AutoConfig.for_model("glm4_moe_lite", q_lora_rank=24,
                                      mlp_layer_types=["dense", "sparse" if moe else "dense"],
                                      rope_parameters=rope, tie_word_embeddings=False,
                                      **{**common, "v_head_dim": 20, "rms_norm_eps": 1e-5})
    else:
        raise ValueError(kind)
    save_random(AutoModelForCausalLM.from_config, config, path, seed, router_std=0.2, expert_bias=0.1)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).glob("*token*"):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def mla_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    return {kind: make_tiny_mla(kind, root / kind) for kind in KINDS}


# --- bridge ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_load_then_export_is_bitwise_identical(tp1, mla_dirs, kind):
    model = build_loaded(mla_dirs[kind])
    hf = bridge.read_hf_state_dict(mla_dirs[kind])
    assert_exports_checkpoint(dict(bridge.export_hf_weights(model)), hf)
    names = bridge.mcore_to_hf_names(model)
    prefix = "decoder.layers.1.self_attention."
    kv_a = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert names[prefix + "linear_kv_down_proj.weight"] == (kv_a,)
    assert names[prefix + "kv_layernorm.weight"] == ("model.layers.1.self_attn.kv_a_layernorm.weight",)
    assert names[prefix + "linear_kv_up_proj.weight"] == ("model.layers.1.self_attn.kv_b_proj.weight",)
    assert names[prefix + "linear_proj.weight"] == ("model.layers.1.self_attn.o_proj.weight",)
    if kind.endswith("_moe"):
        assert names["decoder.layers.1.mlp.router.expert_bias"] == (
            "model.layers.1.mlp.gate.e_score_correction_bias",)
        assert names["decoder.layers.0.mlp.linear_fc1.weight"] == (
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in hf  # the export has exactly these names
    if kind == "deepseek_v3_no_q_lora":
        assert names[prefix + "linear_q_proj.weight"] == ("model.layers.1.self_attn.q_proj.weight",)
    else:
        assert names[prefix + "linear_q_down_proj.weight"] == ("model.layers.1.self_attn.q_a_proj.weight",)
        assert names[prefix + "q_layernorm.weight"] == ("model.layers.1.self_attn.q_a_layernorm.weight",)
        assert names[prefix + "linear_q_up_proj.weight"] == ("model.layers.1.self_attn.q_b_proj.weight",)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_log_probs_entropy_match_hf(tp1, mla_dirs, kind):
    model, hf_model = build_loaded(mla_dirs[kind]), load_hf(mla_dirs[kind])
    vocab = hf_model.config.vocab_size
    tokens = torch.cat([sample_batch(vocab)[0]] * 2, dim=1)  # 24 positions: past YaRN's original 16
    dev = device_of(model)
    with torch.no_grad():
        logits = model(input_ids=tokens.to(dev), position_ids=torch.arange(2 * SEQ, device=dev).expand(3, -1),
                       attention_mask=None)
    _, ref_lp, ref_ent = hf_reference(hf_model, tokens)
    with torch.no_grad():
        assert (logits[..., :vocab].cpu() - hf_model(tokens).logits).abs().max() < 1e-5
    from hpcrl.train import logprobs

    lp = logprobs.compute_log_probs(logits[:, :-1], tokens[:, 1:].to(dev), 1.0, vocab_size=vocab)
    ent = logprobs.compute_entropy(logits[:, :-1], 1.0, vocab_size=vocab)
    assert (lp.cpu() - ref_lp).abs().max() < 1e-5
    assert (ent.cpu() - ref_ent).abs().max() < 1e-5


def test_latent_norms_use_hfs_fixed_eps_and_yarn_scales_match_hf(tp1, mla_dirs):
    """GLM-lite: decoder norms with rms_norm_eps 1e-5, latent norms with 1e-6 as HF builds them; the softmax
    scale and cos/sin scale are HF's (DeepSeek-V3: both mscales; GLM-lite: mscale_all_dim 0)."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    glm = build_loaded(mla_dirs["glm4_moe_lite"])
    attention = glm.decoder.layers[0].self_attention
    assert attention.kv_layernorm.eps == attention.q_layernorm.eps == mla.LATENT_NORM_EPS
    assert glm.decoder.layers[0].input_layernorm.eps == 1e-5
    ds = build_loaded(mla_dirs["deepseek_v3"])
    cfg = AutoConfig.from_pretrained(str(mla_dirs["deepseek_v3"]))
    attention = ds.decoder.layers[0].self_attention
    # HF's own numbers, read from the modules it builds (its helper functions move between releases)
    hf_scale = DeepseekV3Attention(cfg, layer_idx=0).scaling
    assert hf_scale != pytest.approx((16 + 8) ** -0.5)  # YaRN's mscale_all_dim is in it
    assert attention.core_attention.softmax_scale == pytest.approx(hf_scale, rel=1e-12)
    assert attention.rotary_pos_emb(8)[1] == pytest.approx(
        DeepseekV3RotaryEmbedding(cfg).attention_scaling, rel=1e-12)
    original = cfg.rope_parameters["original_max_position_embeddings"]
    assert ds.config.original_max_position_embeddings == original == 16


# --- optimizer step and packing -------------------------------------------------------------------------


@pytest.mark.parametrize("kind,dispatcher", [("deepseek_v3", None), ("deepseek_v3_moe", "allgather"),
                                             ("deepseek_v3_moe", "alltoall"), ("glm4_moe_lite", None),
                                             ("glm4_moe_lite_moe", "alltoall")])
def test_train_step_matches_hf_adamw_step(tp1, mla_dirs, kind, dispatcher):
    path = mla_dirs[kind]
    megatron = {**MEGATRON, "moe_token_dispatcher_type": dispatcher} if dispatcher else MEGATRON
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, TRAIN, megatron)
    batch = sample_batch(37, seed=5)
    result = tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])
    ref_loss, ref_norm, ref_state = hf_train_step(load_hf(path).train(), *batch)
    ref_state = moe.unfuse_experts(ref_state)  # transformers 5 fuses the experts in memory
    assert result["update_successful"]
    assert result["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    after = {k: v.cpu() for k, v in bridge.export_hf_weights(ddp_model)}
    before = bridge.read_hf_state_dict(path)
    changed = ["model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.1.self_attn.kv_b_proj.weight"]
    if dispatcher:
        changed += ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"]
    for name in changed:
        assert not torch.equal(after[name], before[name]), f"{name} got no update"
    assert max((after[k] - ref_state[k]).abs().max().item() for k in after) < 1e-6


def test_bf16_train_step_runs(tp1, mla_dirs):
    """bf16 MLA (YaRN, MoE layer): the step runs, the latent norms and projections train in bf16, and the
    expert bias stays fp32 (as HF's e_score_correction_bias)."""
    import dataclasses

    ddp_model, optimizer = tmodel.setup_model_and_optimizer(mla_dirs["deepseek_v3_moe"],
                                                            dataclasses.replace(TRAIN, bf16=True))
    bare = bridge.unwrap_model(ddp_model)
    attention = bare.decoder.layers[0].self_attention
    assert attention.linear_kv_down_proj.weight.dtype == attention.kv_layernorm.weight.dtype == torch.bfloat16
    assert bare.decoder.layers[1].mlp.router.expert_bias.dtype == torch.float32
    result = tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(sample_batch(37, seed=6)), [None, None])
    assert result["update_successful"] and result["grad_norm"] > 0 and result["num_micro_batches"] == 2


def test_checkpoint_save_and_resume_is_bitwise(tp1, mla_dirs, tmp_path):
    """megatron's distributed checkpoint of an MLA model (the duplicated kv_a_proj_with_mqa, latent norms,
    expert bias): a fresh model + optimizer resumed from it takes the uninterrupted run's next step
    bitwise."""
    from hpcrl import checkpoint

    path = mla_dirs["deepseek_v3_moe"]
    batch = sample_batch(37, seed=5)
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, TRAIN, MEGATRON)
    tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])
    folder = checkpoint.save_checkpoint(tmp_path, 1, ddp_model, optimizer, {"id": 1})
    fresh, fresh_opt = tmodel.setup_model_and_optimizer(path, TRAIN, MEGATRON)
    checkpoint.load_checkpoint(folder, fresh, fresh_opt)
    a, b = dict(bridge.export_hf_weights(ddp_model)), dict(bridge.export_hf_weights(fresh))
    assert all(torch.equal(a[n], b[n]) for n in a)
    for model, opt in ((ddp_model, optimizer), (fresh, fresh_opt)):
        tmodel.train_step(model, opt, megatron_loss_fn(batch), [None])
    a, b = dict(bridge.export_hf_weights(ddp_model)), dict(bridge.export_hf_weights(fresh))
    assert all(torch.equal(a[n], b[n]) for n in a)
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert not torch.equal(a[kv_a].cpu(), bridge.read_hf_state_dict(path)[kv_a])  # it trained


def test_packed_and_shared_forwards_equal_the_padded_one(tp1, tiny_model_dir, tmp_path):
    """hpcrl's packed THD attention with MLA's q/k head (24) wider than its v head (12), YaRN positions per
    token: log-probs, entropy and the gradient of the packed and shared-prompt layouts equal the padded
    one."""
    from hpcrl.train.actor import Actor
    from tests.unit.test_actor import make_config, make_samples
    from tests.unit.test_packing import forward_gates

    path = make_tiny_mla("deepseek_v3", tmp_path / "ds", tokenizer_dir=tiny_model_dir)
    samples = make_samples(path, num_groups=3, seed=0, correct_first=True)
    gates = forward_gates(Actor(make_config(), path), samples)
    for name in ("packed", "shared"):
        assert gates[f"{name}_logprob"] < 1e-5 and gates[f"{name}_entropy"] < 1e-5, gates
        assert gates[f"{name}_grad"] < 1e-5, gates
    assert gates["shared_tokens"] < gates["packed_tokens"] < gates["padded_tokens"], gates


# --- config fields and refusals -------------------------------------------------------------------------


def test_hub_style_config_json_is_read_like_transformers_5s(tmp_path, mla_dirs):
    """A published DeepSeek-V3 config.json keeps YaRN in ``rope_scaling`` (``type``) and ``rope_theta`` at
    the top level; the megatron fields equal those of the transformers 5 form (``rope_parameters``)."""
    from transformers import AutoConfig

    tf5 = json.loads((mla_dirs["deepseek_v3"] / "config.json").read_text())
    hub = {k: v for k, v in tf5.items() if k != "rope_parameters"}
    hub["rope_scaling"] = {"type": "yarn",
                           **{k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")}}
    hub["rope_theta"] = YARN["rope_theta"]
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hub))
    assert unsupported_feature(hub) is None and unsupported_feature(tf5) is None
    fields = [mla.config_kwargs(AutoConfig.from_pretrained(str(d)), 1e4)
              for d in (folder, mla_dirs["deepseek_v3"])]
    assert fields[0] == fields[1]
    assert fields[0]["rope_type"] == "yarn" and fields[0]["rotary_scaling_factor"] == 4.0
    assert (fields[0]["mscale"], fields[0]["mscale_all_dim"]) == (0.707, 0.9)


@pytest.mark.parametrize("change,field", [
    ({"rope_interleave": False}, "rope_interleave"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.2}}, "rope_parameters.attention_factor"),
    ({"rope_parameters": {**YARN, "truncate": False}}, "rope_parameters.truncate"),
    ({"rope_parameters": {**YARN, "mscale": None}}, "rope_parameters.mscale"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_parameters"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"first_k_dense_replace": 1, "n_group": 2, "topk_group": 2}, "n_group"),  # MoE: group scoring
])
def test_what_megatron_cannot_express_is_refused_in_one_line(mla_dirs, change, field):
    base = json.loads((mla_dirs["deepseek_v3"] / "config.json").read_text())
    fields = {**base, **change}
    if "rope_scaling" in change:
        fields.pop("rope_parameters")
    bad = unsupported_feature(fields)
    assert bad is not None and bad[0] == field, bad
    assert "\n" not in f"{bad[0]}={bad[1]!r} {bad[2]}"


def test_plain_rope_has_megatrons_unscaled_softmax(mla_dirs):
    from transformers import AutoConfig

    fields = mla.config_kwargs(AutoConfig.from_pretrained(str(mla_dirs["deepseek_v3_no_q_lora"])), 5e4)
    assert fields["rope_type"] == "rope" and fields["rotary_base"] == 5e4 and fields["q_lora_rank"] is None
    config = bridge.mcore_config_from_hf(AutoConfig.from_pretrained(str(mla_dirs["deepseek_v3_no_q_lora"])))
    assert config.multi_latent_attention and config.num_moe_experts is None
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (16, 8, 12)
    assert math.isclose(config.rotary_scaling_factor, 1.0)


def test_mtp_layers_of_a_checkpoint_are_dropped(tp1, mla_dirs, tmp_path):
    """A DeepSeek-V3 checkpoint's multi-token-prediction layer (``model.layers.{num_hidden_layers}``:
    ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head`` and a full decoder layer) loads, as HF's own model
    loads it (dropped), and is not exported; every other tensor round-trips bitwise."""
    from safetensors.torch import save_file

    src = mla_dirs["deepseek_v3_moe"]
    folder = tmp_path / "with-mtp"
    shutil.copytree(src, folder)
    state = bridge.read_hf_state_dict(src)
    mtp = {f"model.layers.2.{k[len('model.layers.1.'):]}": v.clone() for k, v in state.items()
           if k.startswith("model.layers.1.")}
    mtp.update({"model.layers.2.eh_proj.weight": torch.zeros(64, 128),
                "model.layers.2.enorm.weight": torch.ones(64), "model.layers.2.hnorm.weight": torch.ones(64),
                "model.layers.2.shared_head.norm.weight": torch.ones(64)})
    save_file({**state, **mtp}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert unsupported_feature({**config, "num_nextn_predict_layers": 1}) is None
    model = build_loaded(folder)
    out = {n: t.cpu() for n, t in bridge.export_hf_weights(model)}
    assert sorted(out) == sorted(state)
    assert all(torch.equal(out[n], state[n]) for n in state)
    hf = load_hf(folder)  # HF drops them too
    assert not any(n.startswith("model.layers.2.") for n in hf.state_dict())


@pytest.mark.parametrize("kind", KINDS)
def test_engine_loader_takes_every_exported_name(tp1, mla_dirs, kind):
    """Weight sync's receiving end (the CPU engine's :class:`hpcrl.engine.weights.WeightLoader` on the HF
    model) accepts every name and shape the trainer exports, and after loading the trainer's perturbed
    weights the HF model's logits equal the trainer's."""
    from hpcrl.engine.weights import WeightLoader

    model = build_loaded(mla_dirs[kind])
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, t in bridge.named_tensors(model):
            t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device) * 0.02)
    exported = [(n, t.cpu()) for n, t in bridge.export_hf_weights(model)]
    hf_model = load_hf(mla_dirs[kind])
    loader = WeightLoader(hf_model)
    assert loader.load(exported) == len(exported)
    tokens = sample_batch(hf_model.config.vocab_size)[0]
    dev = device_of(model)
    with torch.no_grad():
        logits = model(input_ids=tokens.to(dev), position_ids=torch.arange(SEQ, device=dev).expand(3, -1),
                       attention_mask=None)
        assert (logits[..., :hf_model.config.vocab_size].cpu() - hf_model(tokens).logits).abs().max() < 1e-5


def test_glm_4_7_flash_style_config_json_is_read(tmp_path):
    """GLM-4.7-Flash's published config.json (here at tiny size) has no ``mlp_layer_types`` but
    ``first_k_dense_replace: 1``, ``rope_scaling: null`` with a top-level ``rope_theta``, and one MTP layer:
    accepted on the login node, and the trainer's config has its dense first layer, plain RoPE and router."""
    from transformers import AutoConfig

    hub = {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite",
           "attention_bias": False, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96,
           "moe_intermediate_size": 32, "max_position_embeddings": 64, "topk_method": "noaux_tc",
           "norm_topk_prob": True, "num_attention_heads": 4, "n_group": 1, "topk_group": 1,
           "n_routed_experts": 4, "n_shared_experts": 1, "routed_scaling_factor": 1.8,
           "num_experts_per_tok": 2,
           "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_key_value_heads": 4,
           "num_nextn_predict_layers": 1, "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-05,
           "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "q_lora_rank": 24,
           "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 20,
           "vocab_size": 37}
    assert unsupported_feature(hub) is None
    (tmp_path / "config.json").write_text(json.dumps(hub))
    config = bridge.mcore_config_from_hf(AutoConfig.from_pretrained(str(tmp_path)))
    assert config.multi_latent_attention and config.rope_type == "rope" and config.rotary_base == 1e6
    assert config.moe_layer_freq == [0, 1, 1] and config.num_moe_experts == 4
    assert config.moe_router_topk_scaling_factor == 1.8 and config.moe_router_enable_expert_bias
    assert (config.q_lora_rank, config.kv_lora_rank, config.v_head_dim) == (24, 32, 20)


def test_published_deepseek_v3_config_json_is_accepted_and_mapped(tmp_path):
    """DeepSeek-V3's published config.json fields (YaRN in ``rope_scaling`` with ``type``, factor 40 over
    4096, both mscales 1; 8 expert groups, 4 picked, top 8; 3 dense layers; an MTP layer): accepted on the
    login node, and the megatron config (no model built) has HF's score scale and the router fields."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    yarn = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"}
    hub = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
           "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
           "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
           "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
           "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
           "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
           "rope_scaling": yarn, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
           "topk_group": 4, "topk_method": "noaux_tc", "tie_word_embeddings": False, "v_head_dim": 128,
           "vocab_size": 129280}
    assert unsupported_feature(hub) is None
    (tmp_path / "config.json").write_text(json.dumps(hub))
    hf_config = AutoConfig.from_pretrained(str(tmp_path))
    config = bridge.mcore_config_from_hf(hf_config)
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings) == (
        "yarn", 40.0, 4096)
    assert (config.mscale, config.mscale_all_dim, config.beta_fast, config.beta_slow) == (1.0, 1.0, 32.0, 1.0)
    assert config.moe_layer_freq == [0, 0, 0] + [1] * 58 and config.num_moe_experts == 256
    assert (config.moe_router_num_groups, config.moe_router_group_topk, config.moe_router_topk) == (8, 4, 8)
    from megatron.core.models.common.embeddings import _yarn_get_mscale

    scale = _yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim) ** 2 / math.sqrt(192)
    hf_scale = yarn_apply_mscale(hf_config.rope_parameters, 192 ** -0.5)
    assert scale == pytest.approx(hf_scale, rel=1e-12) and hf_scale > 1.5 * 192 ** -0.5
