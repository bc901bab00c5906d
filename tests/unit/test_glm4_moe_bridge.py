"""GLM-4.5 (``glm4_moe``) in the Megatron trainer at TP=1, against HF transformers' ``Glm4MoeForCausalLM``
(issue #35 points 1 and 2).

The tiny model has every GLM-4.5 feature at once: partial RoPE 0.5 (in ``rope_parameters``, as transformers
5 keeps it), q/k/v bias, QK norm (in one of the two variants), one shared expert, sigmoid routing over 8
experts in 4 groups (top-4 over 2 groups: megatron's group score equals HF's top-2 sum),
``routed_scaling_factor`` 2.5, a random non-zero ``e_score_correction_bias`` (a dropped bias would change the
routing, which :func:`test_the_expert_bias_and_groups_decide_the_routing` shows), and a first dense layer.
Checked: the login-node refusals, the config mapping, export bitwise, logits / log-probs / entropy to 1e-5,
one AdamW step to 1e-6, the packed micro-batch path equal to the padded one, MTP tensors in a checkpoint
(dropped), and the expert bias in RL: frozen by default (bitwise), moved by megatron's rule when
``moe_router_bias_update_rate`` > 0, and saved / resumed by the checkpoint bitwise. TP=2 and EP=2 are in
tests/integration/test_glm4_moe_parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from hpcrl.models.support import unsupported_feature  # noqa: E402
from hpcrl.train import bridge, deepseek_moe, logprobs, model as tmodel  # noqa: E402
from tests.unit.test_megatron_bridge import (  # noqa: E402,F401
    MEGATRON, SEQ, TRAIN, assert_exports_checkpoint, build_loaded, device_of, hf_reference, hf_train_step,
    load_hf, megatron_loss_fn, sample_batch, save_random, tp1)

GLM = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=24, moe_intermediate_size=32, n_routed_experts=8,
           num_experts_per_tok=4, n_group=4, topk_group=2,
           first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True,
           norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
           rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})


def make_tiny_glm(path: Path, use_qk_norm: bool = True, seed: int = 1, **changes) -> Path:
    """Save a random tiny GLM-4.5 (:data:`GLM` + ``changes``) with hpcrl's character tokenizer: norms, biases
    and ``e_score_correction_bias`` random (HF inits them to 1 / 0), router weights wider than HF's init so
    that routing decisions are not near ties."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from hpcrl.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Glm4MoeConfig(vocab_size=len(tokenizer), use_qk_norm=use_qk_norm, **{**GLM, **changes})
    return save_random(Glm4MoeForCausalLM, config, path, seed, tokenizer, bias_std=0.1, router_std=0.2,
                       expert_bias=0.1)


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    return {"qk_norm": make_tiny_glm(root / "qk_norm"),
            "plain": make_tiny_glm(root / "plain", use_qk_norm=False)}


def megatron_logits(model, tokens):
    dev = device_of(model)
    with torch.no_grad():
        return model(input_ids=tokens.to(dev), position_ids=torch.arange(tokens.shape[1], device=dev).expand(
            tokens.shape[0], -1), attention_mask=None)


# --- login node and config ---------------------------------------------------------------------------------


def test_routers_megatron_cannot_express_are_refused_in_one_line():
    from transformers import AutoConfig

    fields = {k: v for k, v in GLM.items() if k != "rope_parameters"}
    ok = AutoConfig.for_model("glm4_moe", **fields).to_dict()
    assert unsupported_feature(ok) is None
    assert unsupported_feature({**ok, "n_group": 1, "topk_group": 1}) is None  # GLM-4.5's published router
    assert unsupported_feature({**ok, "partial_rotary_factor": 0.5, "rope_parameters": None}) is None  # hub
    for change, field in [({"topk_group": 1}, "n_group"),  # top 4 // 1 group: megatron sums 4, HF 2
                          ({"n_group": 3}, "n_group"),  # 8 experts do not split into 3 groups
                          ({"norm_topk_prob": False}, "norm_topk_prob"),
                          ({"scoring_func": "softmax"}, "scoring_func"),
                          ({"n_shared_experts": 0}, "n_shared_experts"),
                          ({"hidden_act": "gelu"}, "hidden_act")]:
        bad = unsupported_feature({**ok, **change})
        assert bad is not None and bad[0] == field, (change, bad)
        cfg = AutoConfig.for_model("glm4_moe", **{**fields, **change})
        with pytest.raises(NotImplementedError, match=field):
            bridge.mcore_config_from_hf(cfg)


def test_glm_config_fields(glm_dirs):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(glm_dirs["qk_norm"]))
    c = bridge.mcore_config_from_hf(hf)
    assert (c.add_qkv_bias, c.add_bias_linear, c.qk_layernorm, c.kv_channels, c.ffn_hidden_size) == \
        (True, False, True, 24, 96)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size,
            c.moe_shared_expert_intermediate_size,
            c.moe_shared_expert_gate, c.moe_layer_freq) == (8, 4, 32, 32, False, [0, 1])
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias, c.moe_router_bias_update_rate,
            c.moe_router_topk_scaling_factor, c.moe_router_num_groups, c.moe_router_group_topk,
            c.moe_router_load_balancing_type) == ("sigmoid", True, 0.0, 2.5, 4, 2, "none")
    assert bridge.rotary_percent(hf) == 0.5
    plain = AutoConfig.from_pretrained(str(glm_dirs["plain"]))
    assert bridge.mcore_config_from_hf(plain).qk_layernorm is False
    with pytest.raises(ValueError, match="moe_router_bias_update_rate"):
        bridge.mcore_config_from_hf(hf, moe_router_bias_update_rate=-1e-3)


def test_bias_update_rate_is_validated_on_the_login_node(glm_dirs):
    from hpcrl.config import ConfigError
    from hpcrl.validate import load_and_check

    path = glm_dirs["qk_norm"]
    cfg = load_and_check(None, [f"model.path={path}", "train.nprocs=2", "train.expert_parallel_size=2",
                                "megatron.moe_router_bias_update_rate=0.001"])
    assert cfg.megatron["moe_router_bias_update_rate"] == 0.001
    with pytest.raises(ConfigError, match="moe_router_bias_update_rate"):
        load_and_check(None, [f"model.path={path}", "megatron.moe_router_bias_update_rate=-1"])


# --- weights and forward -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qk_norm", "plain"])
def test_export_is_bitwise_and_logits_log_probs_entropy_match_hf(tp1, glm_dirs, kind):
    model, hf_model = build_loaded(glm_dirs[kind]), load_hf(glm_dirs[kind])
    hf = bridge.read_hf_state_dict(glm_dirs[kind])
    assert any(n.endswith("e_score_correction_bias") and t.abs().min() > 0 for n, t in hf.items())
    assert_exports_checkpoint(dict(bridge.export_hf_weights(model)), hf)
    names = bridge.mcore_to_hf_names(model)
    assert names["decoder.layers.1.mlp.router.expert_bias"] == (
        "model.layers.1.mlp.gate.e_score_correction_bias",)
    assert names["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == (
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight")
    assert names["decoder.layers.0.mlp.linear_fc1.weight"] == ("model.layers.0.mlp.gate_proj.weight",
                                                              "model.layers.0.mlp.up_proj.weight")
    vocab = hf_model.config.vocab_size
    tokens = sample_batch(vocab)[0]
    logits = megatron_logits(model, tokens)
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    assert (logits[..., :vocab].cpu() - hf_logits).abs().max() < 1e-5
    for temperature in (1.0, 0.7):
        _, ref_lp, ref_ent = hf_reference(hf_model, tokens, temperature)
        dev = device_of(model)
        lp = logprobs.compute_log_probs(logits[:, :-1], tokens[:, 1:].to(dev), temperature, vocab_size=vocab)
        ent = logprobs.compute_entropy(logits[:, :-1], temperature, vocab_size=vocab)
        assert (lp.cpu() - ref_lp).abs().max() < 1e-5
        assert (ent.cpu() - ref_ent).abs().max() < 1e-5


def test_the_expert_bias_and_groups_decide_the_routing(tp1, glm_dirs):
    """The tiny config is one where a bias the bridge dropped, or group-limited routing it ignored, would fail
    the exactness tests: each changes the logits by far more than 1e-5."""
    path = glm_dirs["qk_norm"]
    tokens = sample_batch(load_hf(path).config.vocab_size)[0]
    model = build_loaded(path)
    ref = megatron_logits(model, tokens)
    with torch.no_grad():
        model.decoder.layers[1].mlp.router.expert_bias.zero_()
    assert (megatron_logits(model, tokens) - ref).abs().max() > 1e-3
    ungrouped = build_loaded(path, moe_router_num_groups=None, moe_router_group_topk=None)
    assert (megatron_logits(ungrouped, tokens) - ref).abs().max() > 1e-3


def test_a_checkpoint_with_mtp_layers_loads_and_drops_them(tp1, glm_dirs, tmp_path):
    """GLM-4.5's published checkpoints hold ``num_nextn_predict_layers`` MTP layers after the decoder
    (``model.layers.{num_hidden_layers}.*``: embedding / hidden norms, ``eh_proj``, a decoder layer, a shared
    head). HF transformers ignores them; the bridge drops them too: the model loads, and exports without
    them."""
    import shutil

    from safetensors.torch import save_file

    src = glm_dirs["qk_norm"]
    dst = tmp_path / "with-mtp"
    shutil.copytree(src, dst)
    state = bridge.read_hf_state_dict(src)
    mtp = {n.replace("model.layers.1.", "model.layers.2."): t.clone() for n, t in state.items()
           if n.startswith("model.layers.1.")}
    mtp.update({"model.layers.2.eh_proj.weight": torch.randn(64, 128),
                "model.layers.2.enorm.weight": torch.ones(64), "model.layers.2.hnorm.weight": torch.ones(64),
                "model.layers.2.shared_head.norm.weight": torch.ones(64)})
    save_file({**state, **mtp}, str(dst / "model.safetensors"))
    model = build_loaded(dst)
    exported = dict(bridge.export_hf_weights(model))
    assert sorted(exported) == sorted(state)
    assert all(torch.equal(exported[n].cpu(), t) for n, t in state.items())
    # an unknown name inside the decoder's layers, or a layer beyond the MTP ones, is still an error
    for extra in ("model.layers.1.eh_proj.weight", "model.layers.3.eh_proj.weight"):
        with pytest.raises(KeyError, match="no megatron-core counterpart"):
            bridge.load_hf_weights(model, {**state, **mtp, extra: torch.zeros(64, 128)})
    model.hf_config.num_nextn_predict_layers = 0  # a config without MTP layers: layer 2 is an error too
    with pytest.raises(KeyError, match="no megatron-core counterpart"):
        bridge.load_hf_weights(model, {**state, **mtp})


# --- training ----------------------------------------------------------------------------------------------


def test_one_optimizer_step_matches_hf_adamw_and_the_bias_stays_frozen(tp1, glm_dirs):
    path = glm_dirs["qk_norm"]
    batch = sample_batch(load_hf(path).config.vocab_size, seed=5)
    ref_loss, ref_norm, ref_state = hf_train_step(load_hf(path).train(), *batch)
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, TRAIN, MEGATRON)
    step = tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])
    from hpcrl.models.moe import unfuse_experts

    ref_state = unfuse_experts(ref_state)
    after = {n: t.cpu() for n, t in bridge.export_hf_weights(ddp_model)}
    assert step["update_successful"] and sorted(after) == sorted(ref_state)
    assert step["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert step["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    diffs = {k: (after[k] - ref_state[k]).abs().max().item() for k in ref_state}
    assert max(diffs.values()) < 1e-6, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"  # default rate 0: frozen, bitwise (as slime)
    assert torch.equal(after[bias], bridge.read_hf_state_dict(path)[bias])


def hf_tokens_per_expert(path, tokens, total) -> torch.Tensor:
    """How many of the real tokens of ``tokens`` [batch, seq] (the first ``total`` [batch] of each row; the
    trainer leaves padding out of the counts) HF's router of layer 1 sends to each expert: [experts]."""
    hf_model = load_hf(path)
    picked = []
    gate = hf_model.model.layers[1].mlp.gate
    hook = gate.register_forward_hook(lambda mod, inp, out: picked.append(out[2]))
    with torch.no_grad():
        hf_model(tokens)
    hook.remove()
    valid = (torch.arange(tokens.shape[1]).unsqueeze(0) < total.unsqueeze(1)).flatten()
    return torch.bincount(picked[0][valid].flatten(), minlength=hf_model.config.n_routed_experts).float()


def test_expert_bias_moves_by_megatrons_rule_when_enabled(tp1, glm_dirs):
    path = glm_dirs["qk_norm"]
    batch = sample_batch(load_hf(path).config.vocab_size, seed=5)
    rate = 1e-2
    megatron = {**MEGATRON, "moe_router_bias_update_rate": rate}
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, TRAIN, megatron)
    router = bridge.unwrap_model(ddp_model).decoder.layers[1].mlp.router
    before = router.expert_bias.detach().clone()
    tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])
    counts = hf_tokens_per_expert(path, batch[0], batch[1])
    assert counts.sum() == batch[1].sum() * 4 < 3 * SEQ * 4  # each real token's top 4, no padding
    assert len(set(counts.tolist())) > 1  # unbalanced
    expected = before.cpu() + torch.sign(counts.mean() - counts) * rate  # arXiv 2408.15664, megatron's update
    assert torch.equal(router.expert_bias.cpu(), expected)
    assert router.local_tokens_per_expert.abs().sum() == 0  # reset for the next step
    exported = dict(bridge.export_hf_weights(ddp_model))["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(exported.cpu(), expected)


def test_expert_bias_is_checkpointed_and_resumed_bitwise(tp1, glm_dirs, tmp_path):
    """Saved, loaded and the next step equal to an uninterrupted one's, bitwise. With deterministic algorithms
    (``run.deterministic``), as the bitwise resume of a run needs on CUDA: an H200 without them gave the two
    steps ~1 ulp apart in every weight (nondeterministic CUDA kernels)."""
    from hpcrl import checkpoint
    from hpcrl.train.parallel import deterministic_mode

    was = torch.are_deterministic_algorithms_enabled()
    deterministic_mode(True)
    try:
        expert_bias_resumes_bitwise(glm_dirs, tmp_path, checkpoint)
    finally:
        torch.use_deterministic_algorithms(was)


def expert_bias_resumes_bitwise(glm_dirs, tmp_path, checkpoint) -> None:
    path = glm_dirs["qk_norm"]
    batch = sample_batch(load_hf(path).config.vocab_size, seed=5)
    megatron = {**MEGATRON, "moe_router_bias_update_rate": 1e-2}
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, TRAIN, megatron)
    tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])
    saved = bridge.unwrap_model(ddp_model).decoder.layers[1].mlp.router.expert_bias.detach().clone()
    folder = checkpoint.save_checkpoint(tmp_path, 1, ddp_model, optimizer, {"id": 1})
    fresh, fresh_opt = tmodel.setup_model_and_optimizer(path, TRAIN, megatron)
    router = bridge.unwrap_model(fresh).decoder.layers[1].mlp.router
    assert not torch.equal(router.expert_bias, saved)  # the HF bias, before the step
    checkpoint.load_checkpoint(folder, fresh, fresh_opt)
    assert torch.equal(router.expert_bias, saved)
    for model, opt in ((ddp_model, optimizer), (fresh, fresh_opt)):  # the resumed run's next step is the
        tmodel.train_step(model, opt, megatron_loss_fn(batch), [None])  # uninterrupted one's
    a, b = dict(bridge.export_hf_weights(ddp_model)), dict(bridge.export_hf_weights(fresh))
    differ = {n: (a[n].double() - b[n].double()).abs().max().item() for n in a if not torch.equal(a[n], b[n])}
    assert not differ, differ  # names and largest differences


def test_packed_micro_batches_equal_the_padded_forward(tp1, glm_dirs):
    from hpcrl.train.actor import Actor
    from tests.unit.test_actor import make_config, make_samples
    from tests.unit.test_packing import forward_gates

    path = glm_dirs["qk_norm"]
    samples = make_samples(path, num_groups=3, seed=0, correct_first=True)
    gates = forward_gates(Actor(make_config(**{"train.max_tokens_per_microbatch": 64}), path), samples)
    for name in ("packed", "shared"):
        assert gates[f"{name}_logprob"] < 1e-5 and gates[f"{name}_entropy"] < 1e-5, gates
        assert gates[f"{name}_grad"] < 1e-5, gates
    assert gates["shared_tokens"] < gates["packed_tokens"] < gates["padded_tokens"], gates


def test_bf16_training_keeps_the_expert_bias_in_fp32_bitwise(tp1, glm_dirs):
    """HF keeps ``e_score_correction_bias`` in fp32 in a bf16 model (``_keep_in_fp32_modules_strict``), and so
    must the bf16 trainer: rounding it to bf16 (megatron's ``Float16Module`` casts every buffer) would move
    routing decisions away from the engine's."""
    import dataclasses

    path = glm_dirs["qk_norm"]
    train = dataclasses.replace(TRAIN, bf16=True)
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, train, MEGATRON)
    router = bridge.unwrap_model(ddp_model).decoder.layers[1].mlp.router
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    hf_bias = bridge.read_hf_state_dict(path)[name]
    assert not torch.equal(hf_bias.bfloat16().float(), hf_bias)  # bf16 would round it
    assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias.cpu(), hf_bias)
    batch = sample_batch(load_hf(path).config.vocab_size, seed=5)
    assert tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])["update_successful"]
    exported = dict(bridge.export_hf_weights(ddp_model))[name]
    assert exported.dtype == torch.float32 and torch.equal(exported.cpu(), hf_bias)


def test_padded_and_packed_micro_batches_move_the_bias_alike(tp1, glm_dirs):
    """The bias update counts real tokens only: right-padded micro-batches (padding left out of the counts)
    and packed ones (no padding) of the same samples give the same bias after a step."""
    from hpcrl.train.actor import Actor
    from tests.unit.test_actor import make_config, make_samples

    path = glm_dirs["qk_norm"]
    samples = make_samples(path, num_groups=3, seed=0, correct_first=True)
    biases = []
    for changes in ({}, {"train.max_tokens_per_microbatch": 64, "train.share_group_prompt": False}):
        cfg = make_config(**changes)
        cfg.megatron = {"moe_router_bias_update_rate": 1e-2}
        actor = Actor(cfg, path)
        before = actor.model.decoder.layers[1].mlp.router.expert_bias.detach().clone()
        actor.train(0, samples)
        biases.append(actor.model.decoder.layers[1].mlp.router.expert_bias.detach().clone())
        assert not torch.equal(biases[-1], before)
    assert torch.equal(biases[0], biases[1])


@pytest.mark.parametrize("experts,groups,topk_group,top_k", [(8, 1, 1, 2), (8, 4, 2, 4), (16, 8, 4, 8),
                                                             (16, 4, 1, 4)])
def test_megatrons_group_scoring_equals_hfs_exactly_where_accepted(experts, groups, topk_group, top_k):
    """HF's ``Glm4MoeTopkRouter`` against megatron-core's ``topk_routing_with_score_function`` with the fields
    :func:`hpcrl.train.deepseek_moe.moe_kwargs` sets, on 512 random tokens: the same experts and weights for
    every router :func:`hpcrl.models.support.deepseek_router_problem` accepts (the last, 4 // 1 != 2, is
    refused, and there the two pick different experts)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    fields = dict(n_routed_experts=experts, n_group=groups, topk_group=topk_group, num_experts_per_tok=top_k,
                  routed_scaling_factor=2.5, norm_topk_prob=True, hidden_size=16)
    config = Glm4MoeConfig(**fields)
    accepted = unsupported_feature({"model_type": "glm4_moe", **fields}) is None
    g = torch.Generator().manual_seed(experts + groups + topk_group)
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 16, generator=g))
        router.e_score_correction_bias.copy_(torch.rand(experts, generator=g) * 0.2 - 0.1)
    hidden = torch.randn(512, 16, generator=g)
    with torch.no_grad():
        logits, hf_weights, hf_idx = router(hidden)
    kw = deepseek_moe.moe_kwargs(config)
    probs, routing_map = topk_routing_with_score_function(
        logits, top_k, num_groups=kw["moe_router_num_groups"], group_topk=kw["moe_router_group_topk"],
        scaling_factor=kw["moe_router_topk_scaling_factor"], score_function="sigmoid",
        expert_bias=router.e_score_correction_bias)
    hf_map = torch.zeros_like(routing_map).scatter(1, hf_idx, True)
    if not accepted:
        assert not torch.equal(routing_map, hf_map)
        return
    assert torch.equal(routing_map, hf_map)
    hf_probs = torch.zeros_like(probs).scatter(1, hf_idx, hf_weights)
    assert (probs - hf_probs).abs().max() < 1e-6
