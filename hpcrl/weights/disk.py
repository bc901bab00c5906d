"""Weight sync through a shared folder: an HF safetensors checkpoint per sync, loaded by
``/update_weights_from_disk``.

slime's ``--update-weight-transport disk`` with ``--update-weight-disk-dir``: each sync writes a full HF
checkpoint ``weight_v{N:06d}/`` (N: the weight version when it is an integer, else a counter) and every engine
loads it. The folder is written under a hidden temporary name, each file fsynced, and renamed into place, so
an engine never sees a partial checkpoint. Shards are the sync buckets (at most ``bucket_bytes`` each, a
larger tensor alone), named like HF's (``model-00001-of-00003.safetensors`` with
``model.safetensors.index.json``); the non-weight files of ``hf_checkpoint`` (config, tokenizer, generation
config) are copied next to them so the folder is a loadable HF model. Only the newest folder is kept (slime's
default without ``--update-weight-disk-keep-files``): older ``weight_v*`` folders are removed after the
engines have loaded the new one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from hpcrl.fsutil import atomic_folder, fsync_path
from hpcrl.weights.buckets import iter_buckets
from hpcrl.weights.common import EngineCalls

ENDPOINT = "/update_weights_from_disk"
FOLDER_RE = re.compile(r"^weight_v\d{6,}$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SKIP_FILES = {"model.safetensors.index.json", "pytorch_model.bin.index.json"}


def folder_name(index: int) -> str:
    """``weight_v{index:06d}``."""
    return f"weight_v{index:06d}"



def write_hf_folder(named_tensors: Iterable, dest: str | os.PathLike, *, bucket_bytes: int,
                    hf_checkpoint: str | os.PathLike | None = None) -> dict:
    """Write ``named_tensors`` as an HF safetensors folder at ``dest``, atomically (temp folder + rename).

    ``bucket_bytes``: the most bytes per shard file. ``hf_checkpoint``: an HF folder whose non-weight files
    (``config.json``, tokenizer files...) are copied. An existing ``dest`` is replaced. Returns ``{"bytes",
    "buckets", "tensors", "write_seconds"}``. Raises ValueError for an empty stream, OSError on write errors
    (the temporary folder is removed).
    """
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    stats = {"bytes": 0, "buckets": 0, "tensors": 0}
    with atomic_folder(dest) as tmp:
        weight_map: dict[str, int] = {}
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            shard = {name: t.detach().to("cpu").contiguous() for name, t in bucket.tensors}
            path = tmp / f"shard-{bucket.index:05d}.safetensors"
            save_file(shard, str(path), metadata={"format": "pt"})
            fsync_path(path)
            weight_map.update(dict.fromkeys(shard, bucket.index))
            stats["bytes"] += bucket.nbytes
            stats["buckets"] += 1
            stats["tensors"] += len(bucket)
            del shard, bucket
        if stats["buckets"] == 0:
            raise ValueError("no tensors to write")
        n = stats["buckets"]
        names = {i: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)}
        if n == 1:
            names = {0: "model.safetensors"}
        for i, name in names.items():
            os.replace(tmp / f"shard-{i:05d}.safetensors", tmp / name)
        if n > 1:
            index = {"metadata": {"total_size": stats["bytes"]},
                     "weight_map": {k: names[i] for k, i in weight_map.items()}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if hf_checkpoint is not None:
            for f in Path(hf_checkpoint).iterdir():
                if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _SKIP_FILES:
                    shutil.copy2(f, tmp / f.name)
    stats["write_seconds"] = time.perf_counter() - t0
    return stats


def remove_old_folders(disk_dir: str | os.PathLike, keep: str) -> list[str]:
    """Remove every ``weight_v*`` folder (and their temporary folders) in ``disk_dir`` except ``keep``.

    Returns the removed names. Only names matching ``weight_v<digits>`` are touched.
    """
    removed = []
    for f in Path(disk_dir).iterdir():
        base = f.name
        if base.startswith(".") and ".tmp-" in base:
            base = base[1:].split(".tmp-")[0]
            if base == keep or not FOLDER_RE.match(base):
                continue
        elif not FOLDER_RE.match(base) or base == keep:
            continue
        if f.is_dir():
            shutil.rmtree(f, ignore_errors=True)
            removed.append(f.name)
    return removed


async def send_disk(calls: EngineCalls, named_tensors: Iterable, weight_version: str, *,
                    disk_dir: str | os.PathLike,
                    index: int, bucket_bytes: int, hf_checkpoint: str | os.PathLike | None = None,
                    flush: bool = True, load_format: str | None = None) -> dict:
    """Write ``disk_dir/weight_v{index:06d}/`` and POST ``/update_weights_from_disk`` (``model_path``,
    ``weight_version``, ``flush_cache``: ``flush``, and ``load_format`` when given: hpcrl's CPU engine takes
    :data:`hpcrl.weights.delta.DELTA_LOADER`, a folder of a delta's pieces) to every engine; then remove older
    folders. SGLang runs this update outside a weight-update session too.

    ``disk_dir`` must be readable by every engine at the same path (a shared file system). Each call is
    bounded by ``calls.timeout_s`` seconds. Returns ``{"bytes", "buckets", "tensors", "write_seconds",
    "post_seconds", "path"}``. Raises WeightSyncError if an engine refuses (unknown name, shape, architecture)
    or does not answer in time (the new folder is kept for inspection), ValueError for an empty stream.
    """
    import asyncio

    dest = Path(disk_dir) / folder_name(index)
    stats: dict = await asyncio.to_thread(write_hf_folder, named_tensors, dest, bucket_bytes=bucket_bytes,
                                          hf_checkpoint=hf_checkpoint)
    t0 = time.perf_counter()
    body = {"model_path": str(dest.resolve()), "weight_version": str(weight_version), "flush_cache": bool(flush)}
    if load_format is not None:
        body["load_format"] = load_format
    await calls.each(ENDPOINT, body)
    stats["post_seconds"] = time.perf_counter() - t0
    stats["path"] = str(dest)
    remove_old_folders(disk_dir, dest.name)
    return stats
