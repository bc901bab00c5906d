"""Colocated weight sync: buckets of tensors sent by handle with ``/update_weights_from_tensor``.

slime's ``UpdateWeightFromTensor``: gather the TP shards into full HF tensors, pack them into buckets of at
most ``--update-weight-buffer-size`` bytes, serialize each bucket (``MultiprocessingSerializer``: CUDA-IPC
handles on GPU, shared-memory blocks on CPU; :mod:`hpcrl.engine.serialize`), and post it with
``serialized_named_tensors`` holding one entry per engine TP rank. Only the last bucket carries
``weight_version`` and ``flush_cache``.

Payload formats: ``flattened_bucket`` (slime's choice: one ``uint8`` tensor per bucket plus metadata, so one
handle per bucket) or ``direct`` (a list of ``(name, tensor)``, one handle per tensor).

Handles only work on the sender's machine, so every engine must run on the sender's host (colocated). On GPU
one IPC handle may be opened by every engine rank. On CPU each bucket is copied once into the sender's
:class:`~hpcrl.engine.serialize.StagingArena` (shared memory allocated once per run and reused, so a sync
allocates nothing and takes no page faults on the sender) and sent as views of it; a shared-memory payload is
opened once (its extra reference is dropped by the first receiver), so each engine TP rank gets a pickle of
its own, of the same pages. The copies a CPU sync makes: the export (none for most tensors at TP=1: they are
views of the parameters; :func:`hpcrl.train.bridge.export_hf_weights` with ``copy=False``), the one into the
arena, and the engine's into its parameters.

Lifetime: the bucket's tensors stay referenced until the HTTP call has returned (CUDA IPC needs it; slime
also warns not to reuse the producer buffer), then ``torch.cuda.ipc_collect()`` runs on GPU (slime's step 5).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Optional

from hpcrl.weights.buckets import iter_buckets
from hpcrl.weights.common import EngineCalls

if TYPE_CHECKING:
    from hpcrl.engine.serialize import StagingArena

ENDPOINT = "/update_weights_from_tensor"
FORMATS = ("flattened_bucket", "direct")


def _serialize(tensors: list, fmt: str) -> str:
    from hpcrl.engine.serialize import serialize_flattened_bucket, serialize_named_tensors

    if fmt == "flattened_bucket":
        return serialize_flattened_bucket(tensors)
    return serialize_named_tensors(tensors)


def _staged_payloads(arena: "StagingArena", tensors: list, fmt: str, ranks: int) -> list[str]:
    """``ranks`` payloads of one bucket staged in ``arena`` (one copy in, one pickle of handles per rank)."""
    from hpcrl.engine.serialize import serialize_views

    views, flat, metadata = arena.pack(tensors)
    obj = {"flattened_tensor": flat, "metadata": metadata} if fmt == "flattened_bucket" else views
    return [serialize_views(obj) for _ in range(ranks)]


async def send_tensor_buckets(calls: EngineCalls, named_tensors: Iterable, weight_version: str, *,
                              bucket_bytes: int, engine_tp_sizes: Sequence[int],
                              fmt: str = "flattened_bucket", flush: bool = True,
                              arena: Optional["StagingArena"] = None, load_format: Optional[str] = None) -> dict:
    """Send every tensor of ``named_tensors`` to every engine with ``/update_weights_from_tensor``.

    ``bucket_bytes``: the bucket size in bytes (a larger tensor goes alone). ``engine_tp_sizes``: TP size of
    each engine, in ``calls.urls`` order. ``fmt``: ``flattened_bucket`` or ``direct``. ``flush``: whether the
    last bucket asks the engine to flush its cache (``flush_cache``; every other bucket does not). ``arena``:
    the sender's :class:`~hpcrl.engine.serialize.StagingArena`, which CPU buckets are staged in (None: each
    bucket is copied into fresh shared memory per receiving rank, the path before the arena). ``load_format``:
    sent instead of the format's own (``direct`` only: a custom loader the engines were started with, e.g.
    :data:`hpcrl.weights.delta.DELTA_LOADER`). The calls
    must run inside a weight-update session (SGLang refuses them otherwise). Each call is bounded by
    ``calls.timeout_s`` seconds. Returns ``{"bytes", "buckets", "tensors", "serialize_seconds",
    "post_seconds"}``. Raises WeightSyncError if an engine refuses a bucket (e.g. an unknown name: the engine
    names it) or does not answer in time (earlier buckets stay applied, as in slime), ValueError for an
    empty stream or an unknown ``fmt``.
    """
    import torch

    if fmt not in FORMATS:
        raise ValueError(f"unknown tensor payload format {fmt!r}; use one of {FORMATS}")
    if load_format is not None and fmt != "direct":
        raise ValueError(f"a custom load_format ({load_format}) takes the direct format, not {fmt}")
    if len(engine_tp_sizes) != len(calls.urls):
        raise ValueError(f"{len(engine_tp_sizes)} TP sizes for {len(calls.urls)} engines")
    stats = {"bytes": 0, "buckets": 0, "tensors": 0, "serialize_seconds": 0.0, "post_seconds": 0.0}
    for bucket in iter_buckets(named_tensors, bucket_bytes):
        t0 = time.perf_counter()
        on_cpu = all(t.device.type == "cpu" for _, t in bucket.tensors)
        if on_cpu and arena is not None:  # one copy into the arena, one pickle of handles per receiving rank
            payloads = _staged_payloads(arena, bucket.tensors, fmt, sum(engine_tp_sizes))
            entries, i = [], 0
            for tp in engine_tp_sizes:
                entries.append(payloads[i: i + tp])
                i += tp
        elif on_cpu:  # one shared-memory payload per receiving rank (see the module docstring)
            entries = [[_serialize(bucket.tensors, fmt) for _ in range(tp)] for tp in engine_tp_sizes]
        else:  # one IPC handle set, opened by every rank
            payload = _serialize(bucket.tensors, fmt)
            entries = [[payload] * tp for tp in engine_tp_sizes]
        t1 = time.perf_counter()
        bodies = []
        for per_rank in entries:
            body = {"serialized_named_tensors": per_rank,
                    "load_format": load_format or (fmt if fmt != "direct" else None),
                    "flush_cache": bucket.is_last and flush}
            if bucket.is_last:
                body["weight_version"] = str(weight_version)
            bodies.append(body)
        del entries
        await calls.each(ENDPOINT, bodies, per_engine=True)
        del bodies
        stats["serialize_seconds"] += t1 - t0
        stats["post_seconds"] += time.perf_counter() - t1
        stats["bytes"] += bucket.nbytes
        stats["buckets"] += 1
        stats["tensors"] += len(bucket)
        del bucket  # the tensors may be freed only now that the engines have copied them
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
    if stats["buckets"] == 0:
        raise ValueError("no tensors to send")
    return stats
