"""A tiny random Qwen2 with a character tokenizer: the CI model (about 1M parameters, 3.9 MB).

Built from a config with transformers and ``tokenizers``; nothing is downloaded. The tokenizer maps each
character of :data:`CHARS` to one token, so arithmetic prompts tokenize one digit per token.
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
CHARS = "0123456789+-*=() \n"
"""Characters the tiny tokenizer knows; anything else is dropped when encoding."""


def _byte_level_char(c: str) -> str:
    """The GPT-2 byte-level alphabet symbol of a one-byte character (`` `` -> ``Ġ``, ``\\n`` -> ``Ċ``)."""
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    b = c.encode("utf-8")
    assert len(b) == 1, c
    if b[0] in visible:
        return chr(b[0])
    return chr(256 + [x for x in range(256) if x not in visible].index(b[0]))


def build_char_tokenizer():
    """Return a ``transformers.PreTrainedTokenizerFast`` with one token per character of :data:`CHARS`.

    Ids: ``<pad>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos), then the characters in order (21 tokens in all); no bos
    is added when encoding; characters outside :data:`CHARS` are dropped. Internally a byte-level BPE without
    merges (space and newline are stored as ``Ġ`` and ``Ċ``): that is the pipeline transformers 5 forces on
    every ``model_type: qwen2`` folder (``AutoTokenizer`` loads it as ``Qwen2Tokenizer``, rebuilding the
    normalizer and pre-tokenizer), so the tokenizer encodes the same after a save and reload.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [_byte_level_char(c) for c in CHARS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>")


def create_tiny_qwen2(path: str | os.PathLike, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int = 512, seed: int = 0,
                      max_position_embeddings: int = 256, tie_word_embeddings: bool = True) -> Path:
    """Create a random-init ``Qwen2ForCausalLM`` with the character tokenizer and save it as an HF folder.

    Tied input/output embeddings by default (as in the reference measurements: SFT on 3-digit addition at
    lr 3e-3, batch 256, seed 1234 reaches 39% greedy after 600 steps tied, 1% untied), qkv bias (as Qwen2
    has), RMSNorm, SwiGLU, RoPE, GQA. With the defaults: 987,904 parameters (990,592 untied). The write is
    atomic (temp folder + rename). Returns ``path``; raises FileExistsError if it already exists.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists")
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    return _save_random(path, Qwen2ForCausalLM, config, tokenizer, seed)


def create_tiny_qwen3_moe(path: str | os.PathLike, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                          num_kv_heads: int = 2, head_dim: int = 32, num_experts: int = 8, top_k: int = 2,
                          moe_intermediate_size: int = 256, seed: int = 0, max_position_embeddings: int = 256,
                          tie_word_embeddings: bool = True) -> Path:
    """Create a random-init ``Qwen3MoeForCausalLM`` with the character tokenizer and save it as an HF folder.

    Every layer is a mixture of experts: ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, a
    top-``top_k`` softmax router renormalised over the k (``norm_topk_prob``), no shared expert; q/k RMSNorm,
    GQA, RoPE, tied embeddings by default. With the defaults: 3,350,528 parameters (991,232 active per token).
    The checkpoint stores experts by HF's per-expert names (``mlp.experts.{e}.{gate,up,down}_proj.weight``), as
    released Qwen3-MoE checkpoints and SGLang do. The write is atomic. Returns ``path``; raises FileExistsError
    if it already exists.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists")
    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=moe_intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_experts=num_experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    return _save_random(path, Qwen3MoeForCausalLM, config, tokenizer, seed)


def glm_expert_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """``(n_group, topk_group)`` of a tiny GLM-4.5-style router: ``(2, 1)`` (two groups of experts, both of
    a token's experts chosen within the better group) when ``top_k`` is 2 and ``num_experts`` is even and at
    least 4; else ``(1, 1)`` (no groups).

    HF's ``Glm4MoeTopkRouter`` scores a group by the sum of its top 2 experts, megatron-core's
    ``group_limited_topk`` by the sum of its top ``top_k // topk_group``: with ``top_k // topk_group == 2``
    both score groups alike, so trainer and engine route alike (issue #35 point 1)."""
    if top_k == 2 and num_experts % 2 == 0 and num_experts >= 4:
        return 2, 1
    return 1, 1


def create_tiny_glm4_moe(path: str | os.PathLike, hidden_size: int = 128, num_layers: int = 4,
                         num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32, num_experts: int = 8,
                         top_k: int = 2, moe_intermediate_size: int = 256, intermediate_size: int = 512,
                         routed_scaling_factor: float = 2.5, use_qk_norm: bool = True,
                         expert_bias_std: float = 0.05, seed: int = 0, max_position_embeddings: int = 256,
                         tie_word_embeddings: bool = True) -> Path:
    """Create a random-init GLM-4.5-style ``Glm4MoeForCausalLM`` with the character tokenizer, saved as an HF
    folder.

    The GLM-4.5 features at CI size: the first layer dense (``first_k_dense_replace=1``, SwiGLU of width
    ``intermediate_size``), the others a mixture of ``num_experts`` routed SwiGLU experts of width
    ``moe_intermediate_size`` plus one shared expert (``n_shared_experts=1``); the sigmoid router with
    ``e_score_correction_bias`` (aux-loss-free balancing; drawn from N(0, ``expert_bias_std``) here, not
    zero, so that a bias that is dropped or not synced changes the routing), group-limited top-``top_k``
    (:func:`glm_expert_groups`), weights renormalised over the k and scaled by ``routed_scaling_factor``;
    partial RoPE (``partial_rotary_factor=0.5``: half of each head's dimensions rotate), q/k/v bias
    (``attention_bias``), per-head q/k RMSNorm (``use_qk_norm``, as GLM-4.5; GLM-4.5-Air has none), GQA,
    tied embeddings by default, no MTP layers (``num_nextn_predict_layers=0``). With the defaults: 3,055,616
    parameters. The checkpoint stores experts by per-expert names (``mlp.experts.{e}.{gate,up,down}_proj
    .weight``) and the bias as ``mlp.gate.e_score_correction_bias``, as released GLM-4.5 checkpoints do. The
    write is atomic. Returns ``path``; raises FileExistsError if it already exists.
    """
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists")
    tokenizer = build_char_tokenizer()
    n_group, topk_group = glm_expert_groups(num_experts, top_k)
    config = Glm4MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, n_routed_experts=num_experts, num_experts_per_tok=top_k,
        n_shared_experts=1, first_k_dense_replace=1, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor, norm_topk_prob=True, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        attention_bias=True, use_qk_norm=use_qk_norm, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    return _save_random(path, Glm4MoeForCausalLM, config, tokenizer, seed,
                        after_init=_expert_bias_init(seed, expert_bias_std))


def create_tiny_deepseek_v3(path: str | os.PathLike, hidden_size: int = 128, num_layers: int = 4,
                            num_heads: int = 4, head_dim: int = 32, num_experts: int = 8, top_k: int = 2,
                            moe_intermediate_size: int = 256, intermediate_size: int = 512,
                            routed_scaling_factor: float = 2.5, expert_bias_std: float = 0.05, seed: int = 0,
                            max_position_embeddings: int = 256, tie_word_embeddings: bool = True) -> Path:
    """Create a random-init DeepSeek-V3-style ``DeepseekV3ForCausalLM`` with the character tokenizer, saved as
    an HF folder.

    The DeepSeek-V3 features at CI size: multi-latent attention with a q LoRA of rank ``hidden_size // 2``, a
    kv LoRA of rank ``hidden_size // 2``, per head ``head_dim`` no-RoPE and ``head_dim // 2`` RoPE query/key
    dimensions and ``head_dim`` value dimensions (v narrower than q/k); YaRN RoPE scaling as DeepSeek-V3
    publishes it (factor 4 over an original context of ``max_position_embeddings // 4``, beta 32 / 1,
    ``mscale = mscale_all_dim = 1``: the attention scores scaled by ``(0.1 ln 4 + 1)^2``), interleaved rope
    pairs (``rope_interleave``); the MoE block of :func:`create_tiny_glm4_moe` (first layer dense, shared
    expert, sigmoid grouped router with a non-zero ``e_score_correction_bias``, :func:`glm_expert_groups`),
    no MTP layers. With the defaults: about 3.2M parameters. The write is atomic. Returns ``path``; raises
    FileExistsError if it already exists.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists")
    tokenizer = build_char_tokenizer()
    n_group, topk_group = glm_expert_groups(num_experts, top_k)
    original = max(max_position_embeddings // 4, 1)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, n_routed_experts=num_experts, num_experts_per_tok=top_k,
        n_shared_experts=1, first_k_dense_replace=1, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor, norm_topk_prob=True, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, q_lora_rank=hidden_size // 2,
        kv_lora_rank=hidden_size // 2, qk_nope_head_dim=head_dim, qk_rope_head_dim=max(head_dim // 2, 2),
        v_head_dim=head_dim, num_mtp_layers=0, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": original, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    return _save_random(path, DeepseekV3ForCausalLM, config, tokenizer, seed,
                        after_init=_expert_bias_init(seed, expert_bias_std))


def _expert_bias_init(seed: int, expert_bias_std: float):
    """An ``after_init`` for :func:`_save_random`: fill every ``mlp.gate.e_score_correction_bias`` buffer (the
    sigmoid router's expert bias, [num_experts]) with N(0, ``expert_bias_std``^2) draws from a generator seeded
    ``seed + 1``, so the bias takes part in routing (HF initialises it to zeros)."""
    import torch

    def init(model) -> None:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("mlp.gate.e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape, generator=g) * expert_bias_std)

    return init


def _save_random(path: Path, model_cls, config, tokenizer, seed: int, after_init=None) -> Path:
    """Initialise ``model_cls(config)`` from ``seed`` (without touching the global RNG), apply
    ``after_init(model)`` if given, and save it with ``tokenizer`` to ``path`` atomically (a temp folder, then
    a rename). Returns ``path``."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    if after_init is not None:
        after_init(model)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path
