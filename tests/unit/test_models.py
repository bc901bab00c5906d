"""HF model loading, the supported-family check, and ensure_model creating the configured model folder."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from hpcrl.config import ModelSection
from hpcrl.models.hf import SUPPORTED_MODEL_TYPES, UnsupportedModelError, ensure_model, load_hf_model
from hpcrl.models.tiny import CHARS, build_char_tokenizer

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _save_random(config, model_cls, path: Path) -> Path:
    torch.manual_seed(0)
    model = model_cls(config)
    model.save_pretrained(path, safe_serialization=True)
    build_char_tokenizer().save_pretrained(path)
    return path


def _ids(tok):
    return dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def _logits(model, text, tokenizer):
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_load_tiny_qwen2(tiny_model_dir):
    model, tok = load_hf_model(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not model.training
    assert 0.9e6 < sum(p.numel() for p in model.parameters()) < 1.1e6  # ~1M parameters
    assert all(p.dtype == torch.float32 for p in model.parameters())
    text = "123+456=579\n(7*8)-9"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no bos added
    assert tok.decode(ids) == text
    assert tok.decode(tok(CHARS)["input_ids"]) == CHARS
    fresh = build_char_tokenizer()  # the saved-and-reloaded tokenizer encodes like the one built in memory
    for s in (text, CHARS, " 1 \n\n2", "x=1"):
        assert tok(s)["input_ids"] == fresh(s)["input_ids"]
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2
    assert _logits(model, "12+34=", tok).shape == (1, 6, len(tok))


def test_load_bfloat16(tiny_model_dir):
    model, _ = load_hf_model(tiny_model_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="int8"):
        load_hf_model(tiny_model_dir, dtype="int8")


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_save_and_load_other_families(tmp_path, family):
    import transformers

    tok = build_char_tokenizer()
    if family == "qwen3":
        config = transformers.Qwen3Config(**TINY, head_dim=8, **_ids(tok))
        cls = transformers.Qwen3ForCausalLM
    elif family == "llama":
        config = transformers.LlamaConfig(**TINY, tie_word_embeddings=True, **_ids(tok))
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**TINY, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=16, **_ids(tok))
        cls = transformers.Qwen3MoeForCausalLM
    path = _save_random(config, cls, tmp_path / family)
    reference = cls.from_pretrained(path)

    model, loaded_tok = load_hf_model(path)
    assert type(model).__name__ == SUPPORTED_MODEL_TYPES[family]
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32
    assert torch.equal(_logits(model, "9+9=18", loaded_tok), _logits(reference, "9+9=18", loaded_tok))
    assert loaded_tok.decode(loaded_tok("42+1=")["input_ids"]) == "42+1="


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path):
    import transformers

    tok = build_char_tokenizer()
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=32, **_ids(tok))
    path = _save_random(config, transformers.GPT2LMHeadModel, tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError) as err:
        load_hf_model(path)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "gpt2" in msg
    for name in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"):
        assert name in msg
    assert isinstance(err.value, ValueError)


def test_load_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_model(tmp_path / "nothing")


def _leftovers(parent: Path, name: str) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name != name]


def test_ensure_model_creates_tiny_qwen2_with_section_sizes(tmp_path):
    section = ModelSection(path=str(tmp_path / "m"), create="tiny-qwen2", tiny_hidden_size=64, tiny_num_layers=2,
                           tiny_num_heads=4, tiny_num_kv_heads=1, tiny_intermediate_size=128)
    path = ensure_model(section, seed=7)
    assert path == tmp_path / "m"
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == \
        ("qwen2", 64, 2, 4, 1, 128)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert _leftovers(tmp_path, "m") == []

    # An existing folder is returned untouched.
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(section, seed=99) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime

    # The run seed decides the init.
    from safetensors.torch import load_file

    same = ensure_model(ModelSection(**{**section.__dict__, "path": str(tmp_path / "same")}), seed=7)
    other = ensure_model(ModelSection(**{**section.__dict__, "path": str(tmp_path / "other")}), seed=8)
    a, b, c = (load_file(p / "model.safetensors") for p in (path, same, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_ensure_model_concurrent_creators_agree(tmp_path):
    section = ModelSection(path=str(tmp_path / "shared"), create="tiny-qwen2", tiny_hidden_size=32,
                           tiny_num_layers=1, tiny_num_heads=2, tiny_num_kv_heads=1, tiny_intermediate_size=64)
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_model(section, seed=0))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [tmp_path / "shared"] * 3
    assert _leftovers(tmp_path, "shared") == []
    model, _ = load_hf_model(tmp_path / "shared")
    assert model.config.hidden_size == 32


def test_ensure_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.create"):
        ensure_model(ModelSection(path=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="gguf_file"):
        ensure_model(ModelSection(path=str(tmp_path / "g"), create="gguf"))
    with pytest.raises(ValueError, match="model.path is empty"):
        ensure_model(ModelSection(path=""))
    with pytest.raises(FileNotFoundError, match="not found"):
        ensure_model(ModelSection(path=str(tmp_path / "g"), create="gguf", gguf_file=str(tmp_path / "no.gguf")))
    assert list(tmp_path.iterdir()) == []


def test_ensure_model_creates_tiny_qwen3_moe_that_transformers_and_the_tokenizer_load(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    section = ModelSection(path=str(tmp_path / "moe"), create="tiny-qwen3-moe", tiny_hidden_size=64,
                           tiny_num_layers=2, tiny_num_heads=4, tiny_num_kv_heads=2, tiny_num_experts=4,
                           tiny_moe_top_k=2, tiny_moe_intermediate_size=32)
    path = ensure_model(section, seed=3)
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"], config["head_dim"], config["norm_topk_prob"]) == \
        ("qwen3_moe", 4, 2, 32, 16, True)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:  # per-expert names, as checkpoints have them
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in set(f.keys())
    model = AutoModelForCausalLM.from_pretrained(str(path))
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok("12+34=")["input_ids"]
    assert tok.decode(ids) == "12+34=" and len(ids) == 6
    assert model(torch.tensor([ids])).logits.shape == (1, 6, config["vocab_size"])
