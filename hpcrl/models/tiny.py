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


def _save_random(path: Path, model_cls, config, tokenizer, seed: int) -> Path:
    """Initialise ``model_cls(config)`` from ``seed`` (without touching the global RNG) and save it with
    ``tokenizer`` to ``path`` atomically (a temp folder, then a rename). Returns ``path``."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)
    return path
