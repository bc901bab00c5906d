"""fp8 rollout weights (``weights.rollout_dtype: fp8``): the engines serve block-fp8 weights quantised from the
trainer's bf16/fp32 ones, as slime does for GLM-4.5 and GLM-5 serves its rollouts.

**Format** (DeepSeek-V3's, which SGLang's ``Fp8Config`` reads from ``config.json``): every linear weight of
the decoder layers (attention and MLP projections, routed and shared experts) is stored as
``float8_e4m3fn`` in blocks of 128 x 128 (:data:`BLOCK`) with one float32 ``<name>_scale_inv`` per block,
``[ceil(out / 128), ceil(in / 128)]``, such that ``weight ~= fp8 * scale_inv`` per block; the scale is the
block's absolute maximum over 448 (e4m3's largest finite value), so no block saturates. The embedding, the LM
head, every norm and the MoE router gate (``mlp.gate.weight``) stay in the model's dtype.
``quantization_config`` is ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``.

**Where**: the engines start from such a checkpoint (:func:`rollout_model_path`: ``rollout-model-fp8`` in the
run folder, made once and reused; ``hpcrl convert mcore-to-hf --fp8`` writes one from a run's checkpoint) and every weight sync quantises the trainer's weights the same way on the trainer's rank 0
(:func:`quantize_stream`), sending each quantised weight with its scales (SGLang's ``--quantization fp8`` on a
bf16 checkpoint would quantise per tensor at load and cannot take block scales). hpcrl's CPU engine emulates
it: it dequantises at load and on every update (:class:`hpcrl.engine.weights.WeightLoader`), so it samples
from the weights an fp8 engine holds. The trainer keeps its own precision: the gap between the rollout's and
the trainer's log-probs grows (``train/train_rollout_logprob_abs_diff``), which TIS / MIS correct
(``algorithm.use_tis``, ``algorithm.mis_level``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional, Union

import torch

BLOCK = 128
"""Block edge of the quantisation (``weight_block_size`` [128, 128])."""
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
"""448: e4m3's largest finite value."""
SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
"""``config.json``'s ``quantization_config`` of a block-fp8 checkpoint (DeepSeek-V3's)."""
_KEPT = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight", "router.weight")
"""Linear weights that stay in the model's dtype: the MoE routers (their logits pick the experts)."""


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether HF tensor ``name`` of ``shape`` is stored in fp8: a 2-D ``.weight`` inside a decoder layer
    (``.layers.N.``), not a router gate."""
    return len(shape) == 2 and name.endswith(".weight") and ".layers." in name and not name.endswith(_KEPT)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``_scale_inv`` shape of a weight of ``shape`` ``[out, in]``."""
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-fp8 of a 2-D weight: ``(fp8 [out, in], scale_inv float32 [ceil(out/128), ceil(in/128)])`` with
    ``scale_inv`` the block's absolute maximum / 448 (1 for an all-zero block) and ``fp8 = round(weight /
    scale_inv)`` (round to nearest even, as torch casts). Computed in float32 on the weight's device, on one
    padded copy of it."""
    out, inp = weight.shape
    ob, ib = scale_shape((out, inp))
    w = torch.nn.functional.pad(weight.to(torch.float32), (0, ib * BLOCK - inp, 0, ob * BLOCK - out))
    if w.data_ptr() == weight.data_ptr():
        w = w.clone()  # (no padding and already float32: keep the caller's tensor)
    blocks = w.view(ob, BLOCK, ib, BLOCK)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg_())
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    blocks.mul_(scale.reciprocal()[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return w[:out, :inp].to(FP8), scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` per 128 x 128 block, cast to ``dtype``. Raises ValueError when the scales do not fit
    the weight's blocks."""
    out, inp = q.shape
    ob, ib = scale_shape((out, inp))
    if tuple(scale_inv.shape) != (ob, ib):
        raise ValueError(f"scales of shape {list(scale_inv.shape)} for a weight of {[out, inp]} (want "
                         f"{[ob, ib]})")
    w = torch.nn.functional.pad(q.to(torch.float32), (0, ib * BLOCK - inp, 0, ob * BLOCK - out))
    w.view(ob, BLOCK, ib, BLOCK).mul_(scale_inv.float()[:, None, :, None])
    return w[:out, :inp].to(dtype)


def quantize_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: Optional[torch.dtype] = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """A weight sync's stream as an fp8 engine takes it: each :func:`quantized` weight as its fp8 tensor
    followed by ``<name>_scale_inv``, every other tensor as it is (cast to ``dtype``, the engines', when
    given)."""
    for name, t in named_tensors:
        if quantized(name, tuple(t.shape)):
            q, scale = quantize(t.detach())
            yield name, q
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, t if dtype is None else t.to(dtype)


def is_fp8_folder(path: Union[str, os.PathLike]) -> bool:
    """Whether an HF folder's ``config.json`` declares block-fp8 weights (``quant_method: fp8`` with a
    ``weight_block_size``)."""
    try:
        q = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return q.get("quant_method") == "fp8" and bool(q.get("weight_block_size"))


def write_fp8_checkpoint(src: Union[str, os.PathLike], dest: Union[str, os.PathLike],
                         named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         shard_bytes: int = 2 * 1024 ** 3) -> Path:
    """Write ``dest``: the HF folder ``src`` (its config, tokenizer and other files) with block-fp8 weights
    (:func:`quantize_stream` of ``named_tensors``, default ``src``'s own safetensors) in shards of at most
    ``shard_bytes``, and ``quantization_config`` in ``config.json``; atomically (written as a temporary
    folder, then renamed). Returns ``dest``. Raises OSError on a write error, ValueError when ``src`` has no
    ``config.json``."""
    from hpcrl.fsutil import fsync_path
    from hpcrl.weights.disk import write_hf_folder

    src, dest = Path(src), Path(dest)
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} is not an HF model folder (no config.json)")
    if named_tensors is None:
        from hpcrl.train.bridge import read_hf_state_dict

        named_tensors = read_hf_state_dict(src).items()
    tmp = dest.with_name(f".{dest.name}.fp8-{os.getpid()}")
    try:
        write_hf_folder(quantize_stream(named_tensors), tmp, bucket_bytes=shard_bytes, hf_checkpoint=src)
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        fsync_path(tmp / "config.json")
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
        fsync_path(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def rollout_model_path(model_path: Union[str, os.PathLike], run_dir: Union[str, os.PathLike]) -> Path:
    """The block-fp8 copy of ``model_path`` the engines of an fp8-rollout run start from:
    ``run_dir/rollout-model-fp8`` (the run folder is writable and shared with the engines' nodes; a model
    folder may be neither), written once (:func:`write_fp8_checkpoint`) and again when the model's
    ``config.json`` is newer than it (another SFT warm start). Raises what :func:`write_fp8_checkpoint`
    raises."""
    src = Path(model_path)
    dest = Path(run_dir) / "rollout-model-fp8"
    if not (dest / "config.json").is_file() or (dest / "config.json").stat().st_mtime < (
            src / "config.json").stat().st_mtime:
        write_fp8_checkpoint(src, dest)
    return dest
