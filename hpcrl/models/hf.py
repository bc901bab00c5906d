"""Load HF causal-LM folders and create the configured model folder when it is missing.

hpcrl's trainer, engines and weight sync know the decoder families below (their HF parameter names map to
Megatron and SGLang); :func:`load_hf_model` refuses anything else up front with a message that names the
architecture. :func:`ensure_model` turns a ``model:`` config section into an existing folder: it creates
``model.path`` when it is missing and ``model.create`` says how (``tiny-qwen2`` or ``gguf``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
}
"""HF ``model_type`` -> causal-LM class of every supported family (Qwen2, Qwen3 dense and MoE, Llama,
GLM-4.5 / 4.6 / 4.7 MoE, Mistral, Mixtral, DeepSeek-V3 / R1 / Moonlight, GLM-4.7-Flash-style MLA)."""

_DTYPES = ("float32", "bfloat16", "float16")


class UnsupportedModelError(ValueError):
    """The folder holds a model family hpcrl does not support."""


class ModelFolderError(FileNotFoundError):
    """The model folder is missing, or is not an HF model folder (no ``config.json``)."""


def context_length(config: Any) -> int:
    """A model's context in tokens from its HF ``config``: ``max_position_embeddings``, or 2**20 when it has
    none."""
    return int(getattr(config, "max_position_embeddings", 0) or 1 << 20)


def check_supported(config: Any) -> str:
    """Return ``config.model_type`` if it is a supported family, else raise :class:`UnsupportedModelError`.

    ``config`` is a ``transformers.PretrainedConfig`` (or anything with ``model_type`` and
    ``architectures``). The message names the architecture found and the supported list.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = getattr(config, "architectures", None) or [f"model_type={model_type!r}"]
        supported = ", ".join(SUPPORTED_MODEL_TYPES.values())
        raise UnsupportedModelError(
            f"unsupported model architecture {'/'.join(archs)} (model_type {model_type!r}); "
            f"hpcrl supports: {supported}")
    return model_type


def _torch_dtype(dtype: str | Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    return getattr(torch, dtype)


def load_hf_model(path: str | os.PathLike, dtype: str = "float32"):
    """Load the HF causal-LM folder ``path`` (config.json + safetensors + tokenizer) on CPU.

    ``dtype`` is ``float32``, ``bfloat16`` or ``float16`` (or a ``torch.dtype``): the parameter dtype.
    Returns ``(model, tokenizer)``; the model is in eval mode. A tokenizer without a pad token gets its eos
    token as pad token (batched generation needs one); nothing else about it is changed.

    Raises :class:`ModelFolderError` (a FileNotFoundError) when ``path`` has no ``config.json``,
    :class:`UnsupportedModelError` (a ValueError) when the family is not in :data:`SUPPORTED_MODEL_TYPES`,
    ValueError for an unknown dtype.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelFolderError(f"{path} is not an HF model folder (no config.json)")
    torch_dtype = _torch_dtype(dtype)
    config = AutoConfig.from_pretrained(path)
    check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def same_tokenizer(a: str | os.PathLike, b: str | os.PathLike) -> "str | None":
    """None when the HF folders ``a`` and ``b`` have the same tokenizer (vocabulary: token -> id, and the
    eos/bos/pad ids), else a short reason (``"vocabulary 49152 vs 49153 tokens"``). Loads both with
    transformers' AutoTokenizer (raises what it raises for a folder without one)."""
    from transformers import AutoTokenizer

    ta, tb = (AutoTokenizer.from_pretrained(str(p)) for p in (a, b))
    va, vb = ta.get_vocab(), tb.get_vocab()
    if len(va) != len(vb):
        return f"vocabulary {len(va)} vs {len(vb)} tokens"
    if va != vb:
        token = next(t for t in sorted(va) if vb.get(t) != va[t])
        return f"token {token!r} is id {va[token]} vs {vb.get(token)}"
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(ta, attr) != getattr(tb, attr):
            return f"{attr} {getattr(ta, attr)} vs {getattr(tb, attr)}"
    return None


def ensure_model(model_cfg: Any, seed: int = 0) -> Path:
    """Return ``model_cfg.path`` as an existing HF folder, creating it first when missing.

    ``model_cfg`` is the config's ``model`` section (:class:`hpcrl.config.ModelSection`). When ``path``
    exists it is returned as is (no check that it matches ``create``). When it is missing:
    ``create: tiny-qwen2`` builds a random tiny Qwen2 with the section's ``tiny_*`` sizes, initialised from
    ``seed`` (pass ``cfg.run.seed``), ``create: tiny-qwen3-moe`` a tiny Qwen3-MoE likewise (head size
    ``tiny_hidden_size / tiny_num_heads``), ``create: tiny-glm4-moe`` a tiny GLM-4.5-style model likewise (the
    first layer dense of width ``tiny_intermediate_size``, a shared expert, the sigmoid grouped router with a
    non-zero expert bias: :func:`hpcrl.models.tiny.create_tiny_glm4_moe`), ``create: tiny-deepseek-v3`` a tiny
    DeepSeek-V3-style model likewise (multi-latent attention with YaRN, the same MoE block:
    :func:`hpcrl.models.tiny.create_tiny_deepseek_v3`; ``tiny_num_kv_heads`` unused); ``create: gguf``
    converts ``gguf_file`` (a path or ``smollm2``).

    Creation is atomic and safe enough for concurrent callers (e.g. array jobs sharing a model folder): each
    creator builds in its own staging folder next to ``path`` and renames it into place; a loser of the race
    discards its copy and returns the winner's folder.

    Raises ValueError when ``path`` is empty, or ``create: gguf`` without ``gguf_file``;
    :class:`ModelFolderError` (a FileNotFoundError) when ``path`` is missing and ``create`` is not set.
    """
    from hpcrl.models.gguf import convert_gguf_to_hf
    from hpcrl.models.tiny import create_tiny_glm4_moe, create_tiny_qwen2, create_tiny_qwen3_moe
    from hpcrl.models.tiny import create_tiny_deepseek_v3

    if not model_cfg.path:
        raise ValueError("model.path is empty; set it to an HF folder (created first when model.create is set)")
    path = Path(model_cfg.path)
    if path.exists():
        return path
    create = model_cfg.create
    if create is None:
        raise ModelFolderError(f"model.path {str(path)!r} does not exist and model.create is not set "
                                "(set model.create: tiny-qwen2, tiny-qwen3-moe, tiny-glm4-moe, "
                                "tiny-deepseek-v3 or gguf to create it)")
    if create == "gguf" and not model_cfg.gguf_file:
        raise ValueError("model.create is 'gguf' but model.gguf_file is not set (a .gguf path or 'smollm2')")
    if create not in ("tiny-qwen2", "tiny-qwen3-moe", "tiny-glm4-moe", "tiny-deepseek-v3", "gguf"):
        raise ValueError(f"model.create {create!r} is not one of: tiny-qwen2, tiny-qwen3-moe, tiny-glm4-moe, "
                         "tiny-deepseek-v3, gguf")

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        built = staging / "model"
        if create == "tiny-qwen2":
            create_tiny_qwen2(built, hidden_size=model_cfg.tiny_hidden_size, num_layers=model_cfg.tiny_num_layers,
                              num_heads=model_cfg.tiny_num_heads, num_kv_heads=model_cfg.tiny_num_kv_heads,
                              intermediate_size=model_cfg.tiny_intermediate_size, seed=seed)
        elif create == "tiny-qwen3-moe":
            create_tiny_qwen3_moe(built, hidden_size=model_cfg.tiny_hidden_size, num_layers=model_cfg.tiny_num_layers,
                                  num_heads=model_cfg.tiny_num_heads, num_kv_heads=model_cfg.tiny_num_kv_heads,
                                  head_dim=model_cfg.tiny_hidden_size // model_cfg.tiny_num_heads,
                                  num_experts=model_cfg.tiny_num_experts, top_k=model_cfg.tiny_moe_top_k,
                                  moe_intermediate_size=model_cfg.tiny_moe_intermediate_size, seed=seed)
        elif create == "tiny-glm4-moe":
            create_tiny_glm4_moe(built, hidden_size=model_cfg.tiny_hidden_size,
                                 num_layers=model_cfg.tiny_num_layers, num_heads=model_cfg.tiny_num_heads,
                                 num_kv_heads=model_cfg.tiny_num_kv_heads,
                                 head_dim=model_cfg.tiny_hidden_size // model_cfg.tiny_num_heads,
                                 num_experts=model_cfg.tiny_num_experts, top_k=model_cfg.tiny_moe_top_k,
                                 moe_intermediate_size=model_cfg.tiny_moe_intermediate_size,
                                 intermediate_size=model_cfg.tiny_intermediate_size, seed=seed)
        elif create == "tiny-deepseek-v3":
            create_tiny_deepseek_v3(built, hidden_size=model_cfg.tiny_hidden_size,
                                    num_layers=model_cfg.tiny_num_layers, num_heads=model_cfg.tiny_num_heads,
                                    head_dim=model_cfg.tiny_hidden_size // model_cfg.tiny_num_heads,
                                    num_experts=model_cfg.tiny_num_experts, top_k=model_cfg.tiny_moe_top_k,
                                    moe_intermediate_size=model_cfg.tiny_moe_intermediate_size,
                                    intermediate_size=model_cfg.tiny_intermediate_size, seed=seed)
        else:
            convert_gguf_to_hf(model_cfg.gguf_file, built)
        try:
            os.replace(built, path)
        except OSError:
            if not path.exists():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
