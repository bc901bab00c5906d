"""The ``weights`` section (weight sync from the trainer to the engines) and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

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
