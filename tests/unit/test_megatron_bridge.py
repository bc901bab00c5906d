"""The Megatron model layer at tensor-parallel size 1, in this process (gloo, world size 1).

Real HF models (tiny random Qwen2 / Qwen3 / Llama) against real megatron-core GPTModels built and loaded by
hpcrl.train.bridge: bitwise weight round trip, logits, log-probs and entropy against HF, and one optimizer step
with megatron-core DDP + optimizer against the same step done with HF + torch AdamW.
The tensor-parallel (2 process) versions are in tests/integration/test_megatron_tp2.py, which reuses the
helpers at the top of this file.

Device-aware: on a machine with CUDA the trainer's process group is NCCL and the megatron models live on
the current GPU, so inputs go to the model's device (:func:`device_of`) and results come back with ``.cpu()``
to be compared against the HF references, which stay on the CPU. On the CPU every ``.to(device)`` and
``.cpu()`` is a no-op and the tests are the CPU tests they were.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from hpcrl.config import TrainSection  # noqa: E402
from hpcrl.models import moe  # noqa: E402
from hpcrl.train import bridge, cpu_compat, logprobs, parallel, model as tmodel  # noqa: E402

# --- helpers shared with the TP=2 integration test ------------------------------------------------------

FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe")
SEQ = 12


def make_tiny_hf(kind: str, path: Path) -> Path:
    """Save a random tiny Qwen3 (explicit head_dim, q/k norm, untied), Llama (tied, llama3 RoPE scaling) or
    Qwen3-MoE (4 experts, top-2, untied; ``qwen3_moe_pre_softmax``: without ``norm_topk_prob``)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    common = dict(vocab_size=37, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if kind == "qwen3":
        config, cls = Qwen3Config(head_dim=24, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common), \
            Qwen3ForCausalLM
    elif kind == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        config, cls = LlamaConfig(tie_word_embeddings=True, rope_parameters=rope, **common), LlamaForCausalLM
    elif kind in ("qwen3_moe", "qwen3_moe_pre_softmax"):
        config, cls = Qwen3MoeConfig(head_dim=24, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=48, norm_topk_prob=kind == "qwen3_moe",
                                     decoder_sparse_step=1, mlp_only_layers=[], **common), Qwen3MoeForCausalLM
    else:
        raise ValueError(kind)
    return save_random(cls, config, path, seed=1)


def save_random(build, config, path: Path, seed: int, tokenizer=None, bias_std: float | None = None,
                router_std: float | None = None, expert_bias: float | None = None) -> Path:
    """Save ``build(config)`` (a model class or ``AutoModelForCausalLM.from_config``), initialised from
    ``seed`` without touching the global RNG, to ``path`` (safetensors; with ``tokenizer`` if given). HF
    inits norms to 1, biases and the expert bias to 0: norm weights become U(0.5, 1.5) so that a mix-up would
    show; with ``bias_std`` every bias parameter N(0, bias_std^2); with ``router_std`` the router weights
    (``mlp.gate.weight``) N(0, router_std^2), wider than HF's init so that routing has no near-ties; with
    ``expert_bias`` every ``e_score_correction_bias`` U(-expert_bias, expert_bias). Returns ``path``."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif bias_std is not None and name.endswith("bias"):
                    p.normal_(0.0, bias_std)
                elif router_std is not None and name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, router_std)
            for name, b in model.named_buffers():
                if expert_bias is not None and name.endswith("e_score_correction_bias"):
                    b.uniform_(-expert_bias, expert_bias)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def sample_batch(vocab_size: int, seed: int = 0):
    """tokens [3, SEQ] (right-padded with 0), total and response lengths, advantages [3]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (3, SEQ), generator=g)
    total = torch.tensor([SEQ, 9, 7])
    resp = torch.tensor([5, 4, 1])
    for i, n in enumerate(total.tolist()):
        tokens[i, n:] = 0
    return tokens, total, resp, torch.tensor([1.0, -0.5, 2.0])


def response_mask(total, resp, seq=SEQ):
    """[batch, seq - 1] bool: prediction positions t whose label tokens[t + 1] is a response token."""
    t = torch.arange(seq - 1).unsqueeze(0) + 1
    return (t >= (total - resp).unsqueeze(1)) & (t < total.unsqueeze(1))


def pg_loss(log_probs, mask, adv):
    """A policy-gradient-style loss: -mean over response tokens of advantage * log-prob."""
    return -(log_probs * mask * adv.unsqueeze(1)).sum() / mask.sum()


def hf_reference(hf_model, tokens, temperature=1.0):
    """Full-vocab log-probs of the next token [batch, seq-1] and entropy [batch, seq-1] from HF logits."""
    with torch.no_grad():
        logits = hf_model(tokens).logits[:, :-1] / temperature
    logp = torch.log_softmax(logits, -1)
    return logits, logp.gather(-1, tokens[:, 1:, None])[..., 0], -(logp.exp() * logp).sum(-1)


def hf_train_step(hf_model, tokens, total, resp, adv, lr=1.0, eps=1.0, clip=1.0):
    """The step megatron should take: loss, backward, grad norm, clip, AdamW (no weight decay).

    With the default ``eps=1`` Adam's first step is about ``lr * g`` rather than ``lr * sign(g)``, so float
    rounding in tiny gradients does not decide the update's sign and the weights after the step compare
    tightly."""
    opt = torch.optim.AdamW(hf_model.parameters(), lr=lr, betas=(0.9, 0.98), eps=eps, weight_decay=0.0)
    logp = torch.log_softmax(hf_model(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    loss = pg_loss(logp, response_mask(total, resp), adv)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(hf_model.parameters(), clip)
    opt.step()
    return float(loss.detach()), float(grad_norm), {k: v.detach().clone() for k, v in hf_model.state_dict().items()}


def megatron_loss_fn(micro_batch):
    """A ``train_step`` loss: :func:`pg_loss` on the response log-probs, the loss of :func:`hf_train_step`."""

    def loss_fn(model, _):
        tokens, total, resp, adv = (t.to(device_of(model)) for t in micro_batch)
        out = logprobs.response_log_probs(model, tokens, total, resp)
        return pg_loss(out.log_probs, out.mask, adv), {"tokens": float(out.mask.sum())}

    return loss_fn


def device_of(model=None) -> torch.device:
    """Where a test's inputs go: the parameters' device of ``model`` (megatron-core, possibly wrapped);
    without a model, the device :func:`hpcrl.train.parallel.init_distributed` uses, whose collectives (NCCL
    on CUDA, gloo on the CPU) need tensors there."""
    if model is not None:
        return next(bridge.unwrap_model(model).parameters()).device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


TRAIN = TrainSection(lr=1.0, adam_beta1=0.9, adam_beta2=0.98, clip_grad=1.0, weight_decay=0.0)
MEGATRON = {"adam_eps": 1.0}  # the run config's free ``megatron:`` dict; see hf_train_step

# --- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp1():
    """gloo world of 1 with megatron-core model parallelism (TP=1), torn down after the module."""
    torch.set_num_threads(1)
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(1234)
    yield
    parallel.destroy()


@pytest.fixture(scope="module")
def hf_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"qwen2": tiny_model_dir, **{kind: make_tiny_hf(kind, root / kind) for kind in FAMILIES[1:]},
            "qwen3_moe_pre_softmax": make_tiny_hf("qwen3_moe_pre_softmax", root / "qwen3_moe_pre_softmax")}


def build_loaded(path, **overrides):
    """The megatron-core GPTModel of the HF folder ``path`` (``overrides``: TransformerConfig fields) with
    its weights loaded, in eval mode."""
    from transformers import AutoConfig

    model = bridge.build_gpt_model(AutoConfig.from_pretrained(str(path)), **overrides)
    bridge.load_hf_weights(model, path)
    return model.eval()


def assert_exports_checkpoint(exported: dict, hf: dict) -> None:
    """``exported`` (an ``export_hf_weights`` dict, any device) has exactly the checkpoint ``hf``'s names,
    each tensor of its dtype and bitwise equal."""
    out = {name: t.cpu() for name, t in exported.items()}
    assert sorted(out) == sorted(hf)
    for name, tensor in hf.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


# --- bridge ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FAMILIES)
def test_load_then_export_is_bitwise_identical(tp1, hf_dirs, kind):
    model = build_loaded(hf_dirs[kind])
    hf = bridge.read_hf_state_dict(hf_dirs[kind])
    exported = dict(bridge.export_hf_weights(model))
    assert {t.device for t in exported.values()} == {device_of(model)}  # on the parameters' device
    assert_exports_checkpoint(exported, hf)
    # the weight sync's export (copy=False): the same tensors, most of them views of the parameters
    views = dict(bridge.export_hf_weights(model, copy=False))
    assert_exports_checkpoint(views, hf)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    aliased = [n for n, t in views.items() if t.untyped_storage().data_ptr() in params]
    assert len(aliased) >= len(views) // 2, aliased
    assert all(t.untyped_storage().data_ptr() not in params for t in exported.values())  # copies
    names = bridge.mcore_to_hf_names(model)
    if kind == "qwen3_moe":
        assert names["decoder.layers.1.mlp.router.weight"] == ("model.layers.1.mlp.gate.weight",)
        assert names["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] == (
            "model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight")
    else:
        assert names["decoder.layers.1.mlp.linear_fc1.weight"] == ("model.layers.1.mlp.gate_proj.weight",
                                                                  "model.layers.1.mlp.up_proj.weight")
    from transformers import AutoConfig

    tied = AutoConfig.from_pretrained(str(hf_dirs[kind])).tie_word_embeddings
    assert ("output_layer.weight" in names) == (not tied)  # a tied model shares the embedding


def test_load_from_state_dict_and_errors(tp1, hf_dirs):
    from transformers import AutoConfig

    hf_model = load_hf(hf_dirs["llama"])  # tied: its state dict has lm_head.weight, which is skipped
    model = bridge.build_gpt_model(AutoConfig.from_pretrained(str(hf_dirs["llama"])))
    bridge.load_hf_weights(model, hf_model.state_dict())
    assert all(torch.equal(t.cpu(), hf_model.state_dict()[n]) for n, t in bridge.export_hf_weights(model))
    state = bridge.read_hf_state_dict(hf_dirs["llama"])
    with pytest.raises(KeyError, match="no megatron-core counterpart"):
        bridge.load_hf_weights(model, {**state, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)})
    del state["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        bridge.load_hf_weights(model, state)


@pytest.mark.parametrize("kind", (*FAMILIES, "qwen3_moe_pre_softmax"))
def test_logits_log_probs_entropy_match_hf(tp1, hf_dirs, kind):
    model, hf_model = build_loaded(hf_dirs[kind]), load_hf(hf_dirs[kind])
    vocab = hf_model.config.vocab_size
    tokens = sample_batch(vocab)[0]  # the CPU copy feeds the HF reference
    dev = device_of(model)
    with torch.no_grad():
        logits = model(input_ids=tokens.to(dev), position_ids=torch.arange(SEQ, device=dev).expand(3, -1),
                       attention_mask=None)
        hf_logits = hf_model(tokens).logits
    assert logits.shape == (3, SEQ, bridge.padded_vocab_size(vocab))
    assert (logits[..., :vocab].cpu() - hf_logits).abs().max() < 1e-5
    for temperature in (1.0, 0.7):
        _, ref_lp, ref_ent = hf_reference(hf_model, tokens, temperature)
        lp = logprobs.compute_log_probs(logits[:, :-1], tokens[:, 1:].to(dev), temperature, vocab_size=vocab)
        ent = logprobs.compute_entropy(logits[:, :-1], temperature, vocab_size=vocab)
        assert lp.device == ent.device == dev
        assert (lp.cpu() - ref_lp).abs().max() < 1e-5
        assert (ent.cpu() - ref_ent).abs().max() < 1e-5


def test_padded_vocab_is_excluded_only_when_vocab_size_given(tp1):
    logits = torch.randn(2, 3, 8)
    labels = torch.randint(0, 5, (2, 3))
    ref = torch.log_softmax(logits[..., :5], -1).gather(-1, labels[..., None])[..., 0]
    dev = device_of()  # vocab_parallel_cross_entropy all-reduces over the TP group even at TP=1
    on_dev = logits.to(dev), labels.to(dev)
    assert torch.allclose(logprobs.compute_log_probs(*on_dev, vocab_size=5).cpu(), ref, atol=1e-6)
    full = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    assert torch.allclose(logprobs.compute_log_probs(*on_dev).cpu(), full, atol=1e-6)


def test_entropy_gradient_matches_autograd_reference(tp1):
    dev = device_of()
    logits = torch.randn(2, 4, 8, dtype=torch.float32).to(dev).requires_grad_(True)
    weights = torch.randn(2, 4).to(dev)
    (logprobs.compute_entropy(logits, 0.9, vocab_size=6) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    logp = torch.log_softmax(logits[..., :6] / 0.9, -1)
    (-(logp.exp() * logp).sum(-1) * weights).sum().backward()
    assert torch.allclose(ours, logits.grad, atol=1e-6)
    assert ours[..., 6:].abs().max() == 0


def test_response_log_probs_reads_response_positions(tp1, hf_dirs):
    model, hf_model = build_loaded(hf_dirs["qwen2"]), load_hf(hf_dirs["qwen2"])
    tokens, total, resp, _ = sample_batch(hf_model.config.vocab_size, seed=3)  # on the CPU for HF
    dev = device_of(model)
    with torch.no_grad():
        out = logprobs.response_log_probs(model, tokens.to(dev), total, resp, temperature=0.8,
                                          with_entropy=True)
    assert out.log_probs.shape == out.entropy.shape == out.mask.shape == (3, int(resp.max()))
    assert out.log_probs.device == out.entropy.device == out.mask.device == dev
    for i in range(3):
        n, r = int(total[i]), int(resp[i])
        # HF on the unpadded row: the response tokens are tokens[n - r:n], predicted from positions n-r-1..n-2
        _, lp, ent = hf_reference(hf_model, tokens[i:i + 1, :n], 0.8)
        assert (out.log_probs[i, :r].cpu() - lp[0, n - r - 1:]).abs().max() < 1e-5
        assert (out.entropy[i, :r].cpu() - ent[0, n - r - 1:]).abs().max() < 1e-5
        assert out.mask[i].tolist() == [True] * r + [False] * (int(resp.max()) - r)
        assert (out.log_probs[i, r:] == 0).all()
    with pytest.raises(ValueError, match="prompt"):
        logprobs.response_log_probs(model, tokens.to(dev), total, total)


# --- config ---------------------------------------------------------------------------------------------


def test_mcore_config_from_hf_fields(hf_dirs):
    from transformers import AutoConfig

    q2 = bridge.mcore_config_from_hf(AutoConfig.from_pretrained(str(hf_dirs["qwen2"])))
    assert (q2.normalization, q2.gated_linear_unit, q2.add_qkv_bias, q2.add_bias_linear, q2.qk_layernorm) == \
        ("RMSNorm", True, True, False, False)
    cpu_init = not torch.cuda.is_available()  # CPU initialisation only without CUDA (megatron-core's default)
    assert (q2.num_query_groups, q2.kv_channels, q2.use_cpu_initialization, q2.params_dtype) == \
        (2, 32, cpu_init, torch.float32)
    q3 = bridge.mcore_config_from_hf(AutoConfig.from_pretrained(str(hf_dirs["qwen3"])), dtype=torch.bfloat16)
    assert (q3.qk_layernorm, q3.add_qkv_bias, q3.kv_channels, q3.bf16, q3.params_dtype) == \
        (True, False, 24, True, torch.bfloat16)
    assert bridge.rope_theta(AutoConfig.from_pretrained(str(hf_dirs["qwen3"]))) == 1e6
    legacy = types.SimpleNamespace(rope_theta=12345.0)  # transformers 4.x keeps it as an attribute
    assert bridge.rope_theta(legacy) == 12345.0
    assert bridge.padded_vocab_size(21, 1) == 128 and bridge.padded_vocab_size(21, 2, 8) == 32
    moe = AutoConfig.from_pretrained(str(hf_dirs["qwen3_moe"]))
    m = bridge.mcore_config_from_hf(moe)
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_router_pre_softmax,
            m.moe_router_load_balancing_type, m.qk_layernorm, m.moe_grouped_gemm) == (4, 2, 48, False, "none", True,
                                                                                     False)
    moe.output_router_logits = True  # HF trains with its load-balancing loss only then
    m = bridge.mcore_config_from_hf(moe, moe_token_dispatcher_type="alltoall")
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_token_dispatcher_type) == \
        ("aux_loss", moe.router_aux_loss_coef, "alltoall")
    assert bridge.mcore_config_from_hf(AutoConfig.from_pretrained(str(hf_dirs["qwen3_moe_pre_softmax"]))
                                       ).moe_router_pre_softmax


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(NotImplementedError, match="model_type"):
        bridge.mcore_config_from_hf(GPT2Config())
    with pytest.raises(NotImplementedError, match="attention_bias"):
        bridge.mcore_config_from_hf(LlamaConfig(attention_bias=True))
    from transformers import Qwen3MoeConfig

    with pytest.raises(NotImplementedError, match="mlp_only_layers"):
        bridge.mcore_config_from_hf(Qwen3MoeConfig(num_hidden_layers=2, mlp_only_layers=[1]))
    with pytest.raises(NotImplementedError, match="decoder_sparse_step"):
        bridge.mcore_config_from_hf(Qwen3MoeConfig(num_hidden_layers=2, decoder_sparse_step=2))


def test_split_megatron_kwargs_by_dataclass():
    out = tmodel.split_megatron_kwargs({"recompute_granularity": "full", "adam_eps": 1e-6, "bucket_size": 10,
                                          "params_dtype": "bfloat16", "make_vocab_size_divisible_by": 64})
    assert out["transformer"] == {"recompute_granularity": "full", "params_dtype": torch.bfloat16}
    assert out["optimizer"] == {"adam_eps": 1e-6, "params_dtype": torch.bfloat16}
    assert out["ddp"] == {"bucket_size": 10}
    assert out["model"] == {"make_vocab_size_divisible_by": 64}
    with pytest.raises(ValueError, match="megatron.adam_beta: .*adam_beta1"):
        tmodel.split_megatron_kwargs({"adam_beta": 0.9})


# --- optimizer step -------------------------------------------------------------------------------------


def test_train_step_matches_hf_adamw_step(tp1, hf_dirs):
    path = hf_dirs["qwen2"]
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, TRAIN, MEGATRON)
    batch = sample_batch(21, seed=5)
    result = tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])
    ref_loss, ref_norm, ref_state = hf_train_step(load_hf(path).train(), *batch)
    assert result["update_successful"] and result["num_micro_batches"] == 1 and result["tokens"] == 10
    assert result["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert ref_norm > TRAIN.clip_grad  # so clipping was exercised
    after = {k: v.cpu() for k, v in bridge.export_hf_weights(ddp_model)}  # the HF step ran on the CPU
    before = bridge.read_hf_state_dict(path)
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-2
    assert max((after[k] - ref_state[k]).abs().max().item() for k in after) < 1e-6


@pytest.mark.parametrize("dispatcher", ("allgather", "alltoall"))
def test_moe_train_step_matches_hf_adamw_step(tp1, hf_dirs, dispatcher):
    """One optimizer step of the MoE model (router and experts get gradients through the routing weights)
    equals HF's step, with either token dispatcher."""
    path = hf_dirs["qwen3_moe"]
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(
        path, TRAIN, {**MEGATRON, "moe_token_dispatcher_type": dispatcher})
    assert bridge.unwrap_model(ddp_model).config.moe_token_dispatcher_type == dispatcher
    batch = sample_batch(37, seed=5)
    result = tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(batch), [None])
    ref_loss, ref_norm, ref_state = hf_train_step(load_hf(path).train(), *batch)
    ref_state = moe.unfuse_experts(ref_state)  # transformers 5 fuses the experts in memory
    assert result["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert result["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    after = {k: v.cpu() for k, v in bridge.export_hf_weights(ddp_model)}
    before = bridge.read_hf_state_dict(path)
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.0.up_proj.weight"):
        assert not torch.equal(after[name], before[name]), f"{name} got no update"
    assert max((after[k] - ref_state[k]).abs().max().item() for k in after) < 1e-6


def test_fused_experts_round_trip_and_load_from_a_module_state_dict(tp1, hf_dirs):
    """transformers 5's in-memory fused experts <-> the checkpoint's per-expert names, and a megatron model
    loaded from ``HFModel.state_dict()`` (fused) equals one loaded from the folder (per expert)."""
    from transformers import AutoConfig

    path = hf_dirs["qwen3_moe"]
    fused = load_hf(path).state_dict()
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 96, 64)
    per_expert = bridge.read_hf_state_dict(path)
    unfused = moe.unfuse_experts(fused)
    assert sorted(unfused) == sorted(k for k in per_expert)
    assert all(torch.equal(unfused[k], per_expert[k]) for k in per_expert)
    refused = moe.fuse_experts(per_expert)
    assert sorted(refused) == sorted(fused) and all(torch.equal(refused[k], fused[k]) for k in fused)
    model = bridge.build_gpt_model(AutoConfig.from_pretrained(str(path)))
    bridge.load_hf_weights(model, fused)
    assert all(torch.equal(t.cpu(), per_expert[n]) for n, t in bridge.export_hf_weights(model))
    del per_expert["model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(KeyError, match="experts"):
        moe.fuse_experts(per_expert)


def test_bf16_train_step_runs(tp1, hf_dirs):
    train = dataclasses.replace(TRAIN, bf16=True)
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(hf_dirs["llama"], train)
    assert bridge.unwrap_model(ddp_model).embedding.word_embeddings.weight.dtype == torch.bfloat16
    result = tmodel.train_step(ddp_model, optimizer, megatron_loss_fn(sample_batch(37, seed=6)), [None, None])
    assert result["update_successful"] and result["grad_norm"] > 0 and result["num_micro_batches"] == 2


# --- cpu_compat -----------------------------------------------------------------------------------------


def test_cpu_compat_apply_is_idempotent_and_leaves_torch_alone(tp1):
    import megatron.core.utils as mcore_utils
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if torch.cuda.is_available():
        assert cpu_compat.apply() is False and not cpu_compat.is_applied()
        return
    alias, init = mcore_utils.torch, Float16OptimizerWithFloat16Params.__init__
    assert cpu_compat.apply() is True and cpu_compat.apply() is True
    assert mcore_utils.torch is alias and alias is not torch
    assert Float16OptimizerWithFloat16Params.__init__ is init
    assert alias.zeros(1, device="cuda").device.type == "cpu"
    assert torch.zeros(1).type() == "torch.FloatTensor"  # the real torch is untouched
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


PROBE_JIT_FUSER = """
import sys, torch
compile_before = torch.compile
from hpcrl.train import cpu_compat
assert cpu_compat.apply() is True
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu
print(jit.jit_fuser is jit.noop_decorator, torch.compile is compile_before,
      fused_bias_swiglu.swiglu.__code__.co_filename.endswith("fused_bias_swiglu.py"))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on GPUs megatron-core keeps its torch.compile fusions")
def test_cpu_compat_imports_megatron_with_its_jit_fuser_off():
    """Point 6 of cpu_compat: a fresh process's first megatron-core import decorates the fusions (all off on
    the CPU) with megatron's no-op instead of torch.compile, and torch.compile is torch's own afterwards."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PROBE_JIT_FUSER], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"], out.stdout


def test_routing_replay_indices_follow_megatrons_token_order():
    """Padded ``[b, s]`` input reaches the routers sequence-first (row ``s * b + i``); a pack in its own order;
    the last token of a sample (never fed to the engine), padding and unrouted samples get experts 0..k-1."""
    from hpcrl.train import routing_replay as rr

    a = torch.tensor([[[5, 6]], [[7, 1]]])  # sample 0: 3 tokens -> routing of tokens 0, 1 (1 layer, top-2)
    b = torch.tensor([[[2, 3]]])  # sample 1: 2 tokens -> token 0
    out = rr.padded_indices([a, b], [3, 2], width=3, layers=1, top_k=2)
    assert out.shape == (6, 1, 2)
    assert out[:, 0].tolist() == [[5, 6], [2, 3],  # position 0 of samples 0 and 1
                                  [7, 1], [0, 1],  # position 1: sample 1's last token
                                  [0, 1], [0, 1]]  # position 2: sample 0's last token, sample 1's padding
    sources = torch.tensor([[0, 0], [0, 1], [0, 2], [1, 1], [-1, -1]])
    packed = rr.packed_indices([a, b], sources, layers=1, top_k=2)
    assert packed[:, 0].tolist() == [[5, 6], [7, 1], [0, 1], [0, 1], [0, 1]]
    with pytest.raises(ValueError, match="routed experts of shape"):
        rr.padded_indices([a], [4], width=4, layers=1, top_k=2)
    # sequence parallelism: TP rank r routes the r-th block of positions (positions 0-1 of 4 on rank 0)
    four = rr.padded_indices([a, b], [3, 2], width=4, layers=1, top_k=2)
    assert rr.sequence_shard(four, 0, 2)[:, 0].tolist() == [[5, 6], [2, 3], [7, 1], [0, 1]]
    assert torch.equal(rr.sequence_shard(four, 1, 2), four[4:])
    with pytest.raises(ValueError, match="6 tokens cannot be split over 4"):
        rr.sequence_shard(out, 0, 4)


def test_moe_aux_loss_is_scaled_over_micro_batches_as_in_megatron(tp1, tmp_path):
    """Issue #54 point 2: with HF's load-balancing loss on (Qwen3-MoE, ``output_router_logits``), three
    micro-batches through megatron-core's schedule give the step of the plain loop whose aux-loss scale is
    megatron's 1/n, bitwise, and not the one of hpcrl's loop before it (scale 1: the aux loss summed over the
    micro-batches)."""
    import json

    from tests.unit.test_actor import plain_train_step

    path = make_tiny_hf("qwen3_moe", tmp_path / "moe")
    config = json.loads((path / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=0.5)  # large: the difference shows
    (path / "config.json").write_text(json.dumps(config))
    batches = [sample_batch(37, seed=seed) for seed in (5, 6, 7)]

    def step(fn, **kw):
        ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, TRAIN, MEGATRON)
        out = fn(ddp_model, optimizer, lambda model, mb: megatron_loss_fn(mb)(model, None), batches, **kw)
        return out["grad_norm"], dict(bridge.export_hf_weights(ddp_model))

    norm, weights = step(tmodel.train_step)
    ref_norm, ref_weights = step(plain_train_step)
    assert norm == ref_norm and all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    summed_norm, summed = step(plain_train_step, aux_loss_scale="sum")
    assert summed_norm != norm and any(not torch.equal(weights[k], summed[k]) for k in summed)
