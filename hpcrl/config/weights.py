"""The ``weights`` section (weight sync from the trainer to the engines) and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional

from hpcrl.config.checks import non_negative, positive, require
from hpcrl.config.errors import MIB
from hpcrl.config.rollout import sglang_engines_by_config


@dataclass
class WeightsSection:
    """Weight sync from trainer to engines."""

    method: Literal["auto", "tensor", "distributed", "disk"] = "auto"
    """``auto``: ``tensor`` when colocated, ``distributed`` when disaggregated (resolved by :func:`resolve`).
    ``tensor`` needs colocation (CUDA IPC shares device memory)."""
    bucket_bytes: int = 512 * 1024 * 1024
    """Bytes per ``/update_weights_from_tensor`` bucket (slime ``--update-weight-buffer-size``); >= 1 MiB.
    With CPU trainers the tensor path stages each bucket once in shared memory it keeps for the run
    (:class:`hpcrl.engine.serialize.StagingArena`): that much host memory on the trainer's rank 0."""
    timeout_s: float = 300.0
    pause_mode: Optional[Literal["abort", "retract", "in_place"]] = None
    """How the engines pause for a weight update (SGLang's ``/pause_generation`` modes): ``abort`` running
    requests (they return what they have; the rollout continues them), ``retract`` them (kept, re-prefilled
    under the new weights) or keep them ``in_place`` (their KV cache stays; no cache flush). null:
    ``in_place`` in ``run.mode: fully_async`` (miles' in-flight updates), ``abort`` otherwise (the engines are
    idle at a sync there)."""
    delta: bool = False
    """Send only the words of each tensor that changed since the last sync (:mod:`hpcrl.weights.delta`):
    bitwise the same engine weights, fewer bytes when the engines' dtype absorbs small updates (bf16, fp8).
    Costs one host copy of the model on the trainer's rank 0. hpcrl's CPU engine applies deltas on every
    method; SGLang on ``tensor`` only (hpcrl starts it with ``--custom-weight-loader``)."""
    full_every: int = 20
    """With ``delta``: every this many syncs one is full (besides the first, the first after a failed sync and
    the first after an engine was replaced or restarted); 0: only those."""
    rollout_dtype: Optional[Literal["fp8"]] = None
    """``fp8``: the engines serve block-fp8 weights (128 x 128 blocks with float32 scales, DeepSeek-V3's
    format; :mod:`hpcrl.weights.fp8`): they start from a block-fp8 copy of the model
    (``RUN/rollout-model-fp8``) and every sync quantises the trainer's weights the same way. The trainer keeps
    its precision; the wider rollout/train log-prob gap is what ``algorithm.use_tis`` / ``mis_level``
    correct. null: the engines hold ``model.dtype``."""


def check_weights(cfg) -> None:
    """The ``weights`` section's own checks and its combinations with the engine (one-line ConfigError)."""
    w = cfg.weights
    require(not (w.method == "tensor" and cfg.run.placement == "disaggregate"), "weights.method", w.method,
            "tensor (CUDA IPC) needs trainer and engines on the same devices, but run.placement is "
            "disaggregate",
            "use weights.method=distributed (or disk, or auto)")
    require(w.bucket_bytes >= MIB, "weights.bucket_bytes", w.bucket_bytes,
            "must be at least 1 MiB (1048576)",
            f"the default is {512 * MIB} (512 MiB)")
    positive(cfg, "weights.timeout_s")
    non_negative(cfg, "weights.full_every")
    require(w.full_every == WeightsSection.full_every or w.delta, "weights.full_every", w.full_every,
            "has no effect without weights.delta (every sync is full)", "set weights.delta=true, or remove it")
    sglang = sglang_engines_by_config(cfg)
    method = w.method if w.method != "auto" else ("tensor" if cfg.run.placement == "colocate" else "distributed")
    quant = str((cfg.sglang or {}).get("quantization") or "")
    require(w.rollout_dtype is None or quant in ("", "fp8"), "sglang.quantization", quant,
            "weights.rollout_dtype=fp8 starts the engines from a block-fp8 checkpoint, which SGLang reads as "
            "fp8 (another quantization would not take its block scales)",
            "remove sglang.quantization (or set it to fp8), or weights.rollout_dtype=null")
    require(not (w.delta and sglang and method != "tensor"), "weights.delta", w.delta,
            f"SGLang 0.5.23 takes a delta (a custom weight loader) only on /update_weights_from_tensor; its "
            f"{method} path loads full tensors",
            "use weights.method=tensor (colocated), or weights.delta=false")


SGLANG_FP8_BLOCK = 128
"""Edge of the fp8 weight blocks SGLang 0.5.23 serves (``weight_block_size`` [128, 128])."""


def sglang_fp8_shape_problem(hf: Mapping[str, Any], tp: int, experts: int = 0) -> Optional[str]:
    """Why SGLang would refuse the block-fp8 copy of the model of ``config.json`` ``hf`` at engine tensor
    parallelism ``tp``, or None. Mirrors SGLang 0.5.23's ``validate_fp8_block_shape``: a fused projection's
    parts but the last (q and k of q/k/v, gate of gate/up) and, at ``tp > 1``, every column shard and every
    row shard's input must be whole 128-wide blocks (seen: the tiny Qwen2's 64-wide k/v projection, "Weight
    output_partition_size = 64 is not divisible by weight quantization block_n = 128"). Checks the attention
    of non-MLA models and the MLP of dense ones (``experts``: routed experts per layer, 0 for dense)."""
    block, tp = SGLANG_FP8_BLOCK, max(1, int(tp))
    widths: list[tuple[str, int]] = []
    heads = int(hf.get("num_attention_heads") or 0)
    hidden = int(hf.get("hidden_size") or 0)
    if heads and hidden and "kv_lora_rank" not in hf:
        head_dim = int(hf.get("head_dim") or hidden // heads)
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        q, kv = heads // tp * head_dim, max(1, kv_heads // tp) * head_dim
        widths += [("q projection", q), ("k/v projection", kv)] + ([("o projection input", q)] if tp > 1 else [])
    inter = int(hf.get("intermediate_size") or 0)
    if inter and not experts:
        widths += [("MLP gate/up projection", inter // tp)] + ([("MLP down projection input", inter // tp)]
                                                              if tp > 1 else [])
    for what, width in widths:
        if width % block:
            return (f"the fp8 copy's {what} is {width} wide per engine shard (sglang tp_size={tp}), not a "
                    f"multiple of SGLang's {block}-wide fp8 blocks")
    return None


def check_sglang_fp8(cfg, read_hf: Callable[[], Optional[Mapping[str, Any]]], env=None) -> None:
    """``weights.rollout_dtype: fp8`` on SGLang engines: what SGLang 0.5.23 refuses at start, before anything
    is queued (one-line ConfigError): ``sglang.dtype: float32`` (its fp8 method takes bf16/fp16 only; a
    local run on a CPU, where float32 is hpcrl's default, is checked by
    :func:`hpcrl.launch_local.check_local_engine`) and a model whose projections are not whole 128-wide
    blocks per shard (:func:`sglang_fp8_shape_problem`): ``read_hf()`` gives the model's ``config.json`` (None
    to skip), called only for such a run; ``env`` counts its routed experts."""
    if cfg.weights.rollout_dtype != "fp8" or not sglang_engines_by_config(cfg):
        return
    sglang = cfg.sglang or {}
    require(str(sglang.get("dtype")) != "float32", "sglang.dtype", sglang.get("dtype"),
            "SGLang serves fp8 weights with bfloat16 or float16 activations only ('torch.float32 is not supported "
            "for quantization method fp8')", "set sglang.dtype=bfloat16, or weights.rollout_dtype=null")
    hf = read_hf()
    if hf is not None:
        problem = sglang_fp8_shape_problem(hf, int(sglang.get("tp_size") or 1), env.routed_experts(hf))
        require(problem is None, "weights.rollout_dtype", "fp8", f"{problem}: SGLang would refuse it at start",
                "set weights.rollout_dtype=null for this model (SGLang's fp8 needs every projection's width per "
                "shard a multiple of 128)")
