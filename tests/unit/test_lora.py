"""LoRA adapters on the megatron-core trainer (issue #56 point 1) against HF PEFT's LoRA on the same HF model, in
this process (gloo, world size 1).

The same adapters (hpcrl's, with every ``lora_B`` set to random values so the adapters change the output) are
loaded into ``peft.get_peft_model`` under PEFT's saved names (:func:`hpcrl.train.lora.peft_state_dict`): the
log-probs agree to 1e-5, and one AdamW step of a policy-gradient loss (megatron-core's DDP and optimizer against
torch's AdamW on PEFT's trainable parameters, both clipped at 1.0) leaves the adapters within 1e-6 of each other
and the base weights untouched; the export with the adapters merged equals PEFT's ``merge_and_unload``. Dense
families: Qwen2 (q/k/v bias, tied embedding) and Llama (untied).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
peft = pytest.importorskip("peft")

from hpcrl.train import bridge, logprobs, lora, model as tmodel  # noqa: E402
from tests.unit.test_megatron_bridge import (MEGATRON, TRAIN, device_of, hf_train_step, load_hf,  # noqa: E402
                                             make_tiny_hf, megatron_loss_fn, response_mask, sample_batch,
                                             tp1)  # noqa: F401 - the fixture

SPEC = lora.LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def dense_dirs(tiny_model_dir, tmp_path_factory):
    return {"qwen2": tiny_model_dir, "llama": make_tiny_hf("llama", tmp_path_factory.mktemp("hf") / "llama")}


def adapted(path, spec=SPEC, seed=3):
    """hpcrl's model of ``path`` with ``spec``'s adapters, each ``lora_B`` filled from a seeded normal (std 0.5):
    ``(ddp_model, optimizer)``."""
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, TRAIN, MEGATRON, lora=spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bridge.unwrap_model(ddp_model).named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return ddp_model, optimizer


def peft_model(path, ddp_model, spec=SPEC):
    """HF transformers + PEFT's LoRA (``spec``'s config) with hpcrl's adapters loaded under PEFT's names."""
    model = peft.get_peft_model(load_hf(path), peft.LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=list(spec.target_modules)))
    state = {k: v.detach().cpu().clone() for k, v in lora.peft_state_dict(ddp_model)}
    result = peft.set_peft_model_state_dict(model, state)
    assert not result.unexpected_keys, result.unexpected_keys
    assert sorted(peft.get_peft_model_state_dict(model)) == sorted(state)  # every adapter of PEFT's is ours
    return model


def test_adapters_start_at_the_base_model_and_freeze_it(tp1, tiny_model_dir):
    """Fresh adapters (B = 0) leave the logits as the base model's; only adapters train (the optimizer holds
    them alone); the bridge's export is the base model, bitwise."""
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(tiny_model_dir, TRAIN, MEGATRON, lora=SPEC)
    model = bridge.unwrap_model(ddp_model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(bridge.is_adapter_name(n) for n in trainable)
    # 4 layers x (q, k, v, o, gate, up, down) x (A, B)
    assert len(trainable) == 4 * 7 * 2
    in_optimizer = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    assert in_optimizer == sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    tokens, total, resp, _ = sample_batch(21, seed=1)
    hf = load_hf(tiny_model_dir)
    with torch.no_grad():
        ref = hf(tokens).logits
        ours = model(tokens.to(device_of(model)), position_ids=None, attention_mask=None).cpu()
    assert (ours[..., :21] - ref).abs().max().item() < 1e-5
    exported = dict(bridge.export_hf_weights(ddp_model))
    base = bridge.read_hf_state_dict(tiny_model_dir)
    assert sorted(exported) == sorted(k for k in base if k != "lm_head.weight")
    assert all(torch.equal(exported[k].cpu(), base[k]) for k in exported)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_log_probs_and_one_adamw_step_match_peft(tp1, dense_dirs, family):
    path = dense_dirs[family]
    ddp_model, optimizer = adapted(path)
    reference = peft_model(path, ddp_model).train()
    tokens, total, resp, adv = batch = sample_batch(21, seed=5)

    with torch.no_grad():
        ours = logprobs.response_log_probs(bridge.unwrap_model(ddp_model), tokens.to(device_of(ddp_model)),
                                           total, resp)
        logits = reference(tokens).logits[:, :-1]
    theirs = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    mask = response_mask(total, resp)  # [batch, seq - 1]; ours are the response's positions, left-aligned
    assert ours.mask.sum(1).tolist() == mask.sum(1).tolist() == resp.tolist()
    base = load_hf(path)
    with torch.no_grad():
        plain = torch.log_softmax(base(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert (theirs - plain)[mask].abs().max().item() > 1e-2  # the adapters change the policy
    assert (ours.log_probs.cpu()[ours.mask.cpu()] - theirs[mask]).abs().max().item() < 1e-5

    result = tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])
    ref_loss, ref_norm, _ = hf_train_step(reference, *batch)
    assert result["update_successful"]
    assert result["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    after = {k: v.detach().cpu() for k, v in lora.peft_state_dict(ddp_model)}
    ref_after = peft.get_peft_model_state_dict(reference)
    before = {k: v.detach().cpu() for k, v in lora.peft_state_dict(adapted(path)[0])}
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-2  # the step moved them
    assert max((after[k] - ref_after[k]).abs().max().item() for k in after) < 1e-6
    exported = dict(bridge.export_hf_weights(ddp_model, merge_adapters=False))  # the base: frozen
    hf_base = bridge.read_hf_state_dict(path)
    assert all(torch.equal(exported[k].cpu(), hf_base[k]) for k in exported)
    # merged into the base (for engines that serve no adapters): PEFT's merge_and_unload
    merged = dict(bridge.export_hf_weights(ddp_model))  # (the default)
    ref_merged = reference.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(exported)
    # the adapters agree within 1e-6, their product B @ A within a few 1e-6 (B drawn at std 0.5)
    assert max((merged[k].cpu() - ref_merged[k]).abs().max().item() for k in merged) < 1e-5
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"].cpu(),
                           hf_base["model.layers.0.self_attn.q_proj.weight"])


def test_only_the_targets_get_adapters_and_unknown_targets_are_refused(tp1, tiny_model_dir):
    spec = lora.LoraSpec(rank=2, alpha=2.0, target_modules=("q_proj", "v_proj", "down_proj"))
    ddp_model, _ = tmodel.setup_model_and_optimizer(tiny_model_dir, TRAIN, MEGATRON, lora=spec)
    names = [k for k, _ in lora.peft_state_dict(ddp_model)]
    assert names[:6] == [f"base_model.model.model.layers.0.{m}.lora_{ab}.weight" for m in
                         ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj") for ab in "AB"]
    assert len(names) == 4 * 3 * 2
    with pytest.raises(ValueError, match=r"model.lora.target_modules: \['qkv'\]"):
        tmodel.setup_model_and_optimizer(tiny_model_dir, TRAIN, MEGATRON,
                                         lora=lora.LoraSpec(target_modules=("q_proj", "qkv")))


def test_peft_folder_loads_in_peft_to_the_same_log_probs(tp1, tiny_model_dir, tmp_path):
    """The adapters written as a PEFT folder (issue #56 point 4's export): ``peft.PeftModel.from_pretrained`` on
    the base model loads them and gives the log-probs of hpcrl's model (1e-5); the adapter file is a fraction of
    the model's bytes."""
    ddp_model, _ = adapted(tiny_model_dir)
    stats = lora.write_peft_folder(ddp_model, tmp_path / "adapter", SPEC, str(tiny_model_dir))
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                      "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(load_hf(tiny_model_dir), str(tmp_path / "adapter")).eval()
    tokens, total, resp, _ = sample_batch(21, seed=5)
    with torch.no_grad():
        ours = logprobs.response_log_probs(bridge.unwrap_model(ddp_model), tokens.to(device_of(ddp_model)),
                                           total, resp)
        theirs = torch.log_softmax(loaded(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    mask = response_mask(total, resp)
    assert (ours.log_probs.cpu()[ours.mask.cpu()] - theirs[mask]).abs().max().item() < 1e-5
    model_bytes = sum(t.numel() * t.element_size() for t in bridge.read_hf_state_dict(tiny_model_dir).values())
    assert stats["tensors"] == 4 * 7 * 2 and 0 < stats["bytes"] < model_bytes / 5



def test_with_the_adapters_off_the_model_is_its_base(tp1, tiny_model_dir):
    """The KL reference of a LoRA run (``adapters_disabled``: no copy of the weights) computes the base model's
    logits while trained adapters change them, and the adapters are back on after it."""
    ddp_model, _ = adapted(tiny_model_dir)
    model = bridge.unwrap_model(ddp_model)
    tokens = sample_batch(21, seed=2)[0].to(device_of(model))
    with torch.no_grad():
        base = load_hf(tiny_model_dir)(tokens.cpu()).logits

        def logits():
            return model(tokens, position_ids=None, attention_mask=None).cpu()[..., :base.shape[-1]]

        on = logits()
        with lora.adapters_disabled(ddp_model):
            off = logits()
        again = logits()
    assert (on - base).abs().max().item() > 1e-2  # the adapters matter
    assert (off - base).abs().max().item() < 1e-5
    assert torch.equal(again, on)


def test_the_memory_estimate_counts_the_adapters_and_no_adam_for_the_base(tp1, tiny_model_dir):
    """``hpcrl validate``'s adapter count (from ``config.json``) is the model's, at TP=1 and (split as the
    trainer splits them) TP=2; with LoRA the trainer's estimate has the base's weights but gradients and Adam
    states of the adapters alone."""
    import json
    from pathlib import Path

    from hpcrl.config import Config, LoraSection
    from hpcrl.config.lora import lora_parameters
    from hpcrl.config.memory import trainer_memory
    from hpcrl.models.params import count_parameters

    section = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    ddp_model, _ = tmodel.setup_model_and_optimizer(tiny_model_dir, TRAIN, MEGATRON, lora=lora.LoraSpec.of(section))
    real = sum(p.numel() for p in bridge.unwrap_model(ddp_model).parameters() if p.requires_grad)
    hf = json.loads(Path(tiny_model_dir, "config.json").read_text())
    assert lora_parameters(hf, section) == real
    h, heads, kv, inter, layers = (hf[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                   "intermediate_size", "num_hidden_layers"))
    d = h // heads  # q: A [4, h] whole, B [heads d / 2, 4]; o: A [4, heads d / 2], B [h, 4] whole; ...
    per_layer_tp2 = 4 * (h + heads * d / 2) + 4 * (h + kv * d / 2) + 4 * (heads * d / 2 + h) + 4 * (inter / 2 + h)
    assert lora_parameters(hf, section, tp=2) == per_layer_tp2 * layers
    full, adapted_run = Config(), Config()
    adapted_run.model.lora = section
    p = count_parameters(hf)
    a, b = trainer_memory(full, p, hf=hf), trainer_memory(adapted_run, p, hf=hf)
    assert b.params == a.params + real and b.weights == 4 * b.params  # fp32 weights, the base's and the adapters'
    assert b.grads == 4 * real and b.adam == 8 * real  # fp32 main grads; Adam's two moments
    assert a.grads == 4 * a.params and a.adam == 8 * a.params


def test_a_moe_model_without_adapters_saves_its_whole_state(tp1, tmp_path):
    """A MoE layer has no ``linear_fc1`` (its experts do): asking whether a model has adapters, which every
    checkpoint save does, must not walk LoRA's dense linears (it raised on GLM-4.5 and DeepSeek-V3 runs)."""
    from hpcrl.checkpoint.state import sharded_state_dict
    from tests.unit.test_megatron_bridge import make_tiny_hf

    path = make_tiny_hf("qwen3_moe", tmp_path / "moe")
    ddp_model, _ = tmodel.setup_model_and_optimizer(path, TRAIN, MEGATRON)
    assert not lora.has_adapters(ddp_model) and list(lora.peft_state_dict(ddp_model)) == []
    keys = sharded_state_dict(ddp_model, None, {}, is_loading=False)["model"]
    assert any(".experts." in k for k in keys) and any("embedding" in k for k in keys)
