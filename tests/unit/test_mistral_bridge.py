"""Mistral (sliding-window attention) and Mixtral (softmax top-2 router, ``block_sparse_moe`` checkpoint
names) in the Megatron model layer at tensor-parallel size 1, in this process (gloo, world size 1).

Real tiny random HF models (transformers 5's ``MistralForCausalLM`` / ``MixtralForCausalLM``, hidden 64,
2 layers, a sliding window shorter than the test sequences) against megatron-core GPTModels built by
hpcrl.train.bridge: bitwise HF -> Megatron -> HF export in the released naming, loading from transformers
5's in-memory naming, logits / log-probs / entropy against HF, one optimizer step against HF + torch AdamW
(Mixtral with both token dispatchers), and the packed and shared-prompt micro-batches against the padded
forward with sequences longer than the window. TP=2 and EP=2 are in
tests/integration/test_megatron_mistral.py; the CPU engine, weight sync and routing replay in
tests/integration/test_mistral_engine.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from hpcrl.models import moe, support  # noqa: E402
from hpcrl.train import bridge, logprobs, model as tmodel  # noqa: E402
from tests.unit.test_megatron_bridge import (  # noqa: E402,F401
    MEGATRON, SEQ, TRAIN, assert_exports_checkpoint, build_loaded, device_of, hf_reference, hf_train_step,
    load_hf, megatron_loss_fn, sample_batch, save_random, tp1)

FAMILIES = ("mistral", "mixtral")
WINDOWS = {"mistral": 5, "mixtral": 6}
"""Sliding windows shorter than :data:`SEQ` (12) and than the packing test's samples (up to 13 tokens)."""

assert tp1  # the fixture, imported for the tests below


def make_tiny(kind: str, path: Path, window: int | None = -1, seed: int = 1) -> Path:
    """Save a random tiny Mistral (GQA, untied, window 5) or Mixtral (4 experts of width 48, top-2, tied,
    window 6) with hpcrl's character tokenizer (21 tokens); ``window=None``: no sliding window. Norm weights
    are random so that a mix-up shows. Returns ``path``."""
    from transformers import MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

    from hpcrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  sliding_window=WINDOWS[kind] if window == -1 else window, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if kind == "mistral":
        config, cls = MistralConfig(head_dim=16, tie_word_embeddings=False, **common), MistralForCausalLM
    elif kind == "mixtral":
        common["intermediate_size"] = 48
        config, cls = MixtralConfig(tie_word_embeddings=True, num_local_experts=4, num_experts_per_tok=2,
                                    **common), MixtralForCausalLM
    else:
        raise ValueError(kind)
    return save_random(cls, config, path, seed, tok)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-mistral")
    return {kind: make_tiny(kind, root / kind) for kind in FAMILIES}


# --- names and config ---------------------------------------------------------------------------------------


def test_mixtral_names_round_trip():
    pairs = {"mlp.gate.weight": "block_sparse_moe.gate.weight",
             "mlp.experts.11.gate_proj.weight": "block_sparse_moe.experts.11.w1.weight",
             "mlp.experts.2.up_proj.weight": "block_sparse_moe.experts.2.w3.weight",
             "mlp.experts.0.down_proj.weight": "block_sparse_moe.experts.0.w2.weight",
             "self_attn.q_proj.weight": "self_attn.q_proj.weight"}
    for canonical, released in pairs.items():
        canonical, released = f"model.layers.3.{canonical}", f"model.layers.3.{released}"
        assert moe.to_mixtral_name(canonical) == released and moe.from_mixtral_name(released) == canonical
    with pytest.raises(ValueError, match="both"):
        moe.RenamedWeights({"model.layers.0.mlp.gate.weight": torch.zeros(1),
                            "model.layers.0.block_sparse_moe.gate.weight": torch.zeros(1)},
                           moe.from_mixtral_name)


def test_config_window_router_and_refusals(dirs):
    import json

    from transformers import AutoConfig

    m = bridge.mcore_config_from_hf(AutoConfig.from_pretrained(str(dirs["mistral"])))
    assert (m.window_size, m.masked_softmax_fusion, m.num_moe_experts, m.kv_channels) == \
        ((4, 0), False, None, 16)
    x = bridge.mcore_config_from_hf(AutoConfig.from_pretrained(str(dirs["mixtral"])))
    assert (x.window_size, x.num_moe_experts, x.moe_router_topk, x.moe_ffn_hidden_size,
            x.moe_router_pre_softmax, x.moe_router_score_function, x.moe_router_load_balancing_type,
            x.qk_layernorm, x.add_qkv_bias) == ((5, 0), 4, 2, 48, False, "softmax", "none", False, False)
    for kind in FAMILIES:  # the login node's check passes them
        assert support.check_model_folder(dirs[kind]) is None
    hf = json.loads((dirs["mixtral"] / "config.json").read_text())
    assert support.routed_experts(hf) == 4
    bad = support.unsupported_feature({**hf, "router_jitter_noise": 0.01})
    assert bad is not None and bad[:2] == ("router_jitter_noise", 0.01)
    assert "set router_jitter_noise: 0" in bad[2]
    config = AutoConfig.from_pretrained(str(dirs["mixtral"]))
    config.router_jitter_noise = 0.1
    with pytest.raises(NotImplementedError, match="router_jitter_noise=0.1"):
        bridge.mcore_config_from_hf(config)
    no_window = AutoConfig.from_pretrained(str(dirs["mistral"]))
    no_window.sliding_window = None
    assert bridge.mcore_config_from_hf(no_window).window_size is None


# --- bridge -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FAMILIES)
def test_load_then_export_is_bitwise_identical(tp1, dirs, kind):
    model = build_loaded(dirs[kind])
    hf = bridge.read_hf_state_dict(dirs[kind])
    assert_exports_checkpoint(dict(bridge.export_hf_weights(model)), hf)
    names = bridge.mcore_to_hf_names(model)
    if kind == "mixtral":  # the released naming, which transformers 5 writes and SGLang loads
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in hf
        assert names["decoder.layers.1.mlp.router.weight"] == ("model.layers.1.block_sparse_moe.gate.weight",)
        assert names["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] == (
            "model.layers.1.block_sparse_moe.experts.3.w1.weight",
            "model.layers.1.block_sparse_moe.experts.3.w3.weight")
        assert "output_layer.weight" not in names  # tied
    else:
        assert names["decoder.layers.1.mlp.linear_fc1.weight"] == ("model.layers.1.mlp.gate_proj.weight",
                                                                  "model.layers.1.mlp.up_proj.weight")


def test_mixtral_loads_from_transformers5_in_memory_names(tp1, dirs):
    """``HFModel.state_dict()`` (``mlp.gate``, fused ``mlp.experts.gate_up_proj``) loads like the folder."""
    from transformers import AutoConfig

    path = dirs["mixtral"]
    fused = load_hf(path).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and "model.layers.0.mlp.gate.weight" in fused
    model = bridge.build_gpt_model(AutoConfig.from_pretrained(str(path)))
    bridge.load_hf_weights(model, fused)
    released = bridge.read_hf_state_dict(path)
    exported = dict(bridge.export_hf_weights(model))
    assert sorted(exported) == sorted(released)
    assert all(torch.equal(t.cpu(), released[n]) for n, t in exported.items())
    state = dict(released)
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    with pytest.raises(KeyError, match="experts.2.up_proj"):
        bridge.load_hf_weights(model, state)


@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_log_probs_entropy_match_hf(tp1, dirs, kind, tmp_path):
    model, hf_model = build_loaded(dirs[kind]), load_hf(dirs[kind])
    vocab = hf_model.config.vocab_size
    tokens = sample_batch(vocab)[0]
    dev = device_of(model)
    with torch.no_grad():
        logits = model(input_ids=tokens.to(dev), position_ids=torch.arange(SEQ, device=dev).expand(3, -1),
                       attention_mask=None)[..., :vocab].cpu()
        hf_logits = hf_model(tokens).logits
        full = load_hf(make_tiny(kind, tmp_path / "full", window=None))(tokens).logits  # same seed, no window
    assert (logits - hf_logits).abs().max() < 1e-5
    assert (full - hf_logits)[:, WINDOWS[kind]:].abs().max() > 1e-3  # the window changes what HF computes
    assert (full - hf_logits)[:, :WINDOWS[kind]].abs().max() < 1e-5  # ... only past the window
    for temperature in (1.0, 0.7):
        _, ref_lp, ref_ent = hf_reference(hf_model, tokens, temperature)
        lp = logprobs.compute_log_probs(logits[:, :-1].to(dev), tokens[:, 1:].to(dev), temperature)
        ent = logprobs.compute_entropy(logits[:, :-1].to(dev), temperature)
        assert (lp.cpu() - ref_lp).abs().max() < 1e-5
        assert (ent.cpu() - ref_ent).abs().max() < 1e-5


# --- optimizer step -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,dispatcher",
                         (("mistral", None), ("mixtral", "allgather"), ("mixtral", "alltoall")))
def test_train_step_matches_hf_adamw_step(tp1, dirs, kind, dispatcher):
    path = dirs[kind]
    extra = {"moe_token_dispatcher_type": dispatcher} if dispatcher else {}
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, TRAIN, {**MEGATRON, **extra})
    batch = sample_batch(21, seed=5)
    result = tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])
    ref_loss, ref_norm, ref_state = hf_train_step(load_hf(path).train(), *batch)
    ref_state = moe.RenamedWeights(moe.unfuse_experts(ref_state), moe.to_mixtral_name) \
        if kind == "mixtral" else ref_state
    assert result["update_successful"]
    assert result["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    after = {k: v.cpu() for k, v in bridge.export_hf_weights(ddp_model)}
    before = bridge.read_hf_state_dict(path)
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-2
    if kind == "mixtral":
        for layer in (0, 1):  # the router and the experts the batch reached got gradients
            prefix = f"model.layers.{layer}.block_sparse_moe."
            assert not torch.equal(after[prefix + "gate.weight"], before[prefix + "gate.weight"])
            moved = [e for e in range(4) if not torch.equal(after[f"{prefix}experts.{e}.w3.weight"],
                                                            before[f"{prefix}experts.{e}.w3.weight"])]
            assert len(moved) >= 2, (layer, moved)
    assert max((after[k] - ref_state[k]).abs().max().item() for k in after) < 1e-6


# --- packed micro-batches -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FAMILIES)
def test_packed_and_shared_forwards_equal_the_padded_one(tp1, dirs, kind):
    """Samples of 7-13 tokens, windows of 5 and 6: the packed (THD) and shared-prompt forwards apply the
    window as the padded one (megatron's mask) does, log-probs, entropy and gradient to 1e-5."""
    from hpcrl.train.actor import Actor
    from tests.unit.test_actor import make_config, make_samples
    from tests.unit.test_packing import forward_gates

    samples = make_samples(dirs[kind], num_groups=3, seed=0, correct_first=True)
    assert max(len(s.tokens) for s in samples) > WINDOWS[kind] + 3
    gates = forward_gates(Actor(make_config(), dirs[kind]), samples)
    for name in ("packed", "shared"):
        assert gates[f"{name}_logprob"] < 1e-5 and gates[f"{name}_entropy"] < 1e-5, gates
        assert gates[f"{name}_grad"] < 1e-5, gates
    assert gates["shared_tokens"] < gates["packed_tokens"] < gates["padded_tokens"], gates
