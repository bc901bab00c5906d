"""Shared fixtures: a tiny real model created once per test session, and an offline HF environment."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An HF folder with a random tiny Qwen2 (~1M params) and the character tokenizer (seed 0)."""
    from hpcrl.models.tiny import create_tiny_qwen2

    return create_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)
