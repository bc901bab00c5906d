"""Where checkpoints live and what makes one complete: paths, the ``COMPLETE`` marker, validation, finding the newest,
pruning (the layout is in :mod:`hpcrl.checkpoint`). Reads only; no torch.distributed needed."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import zlib
from pathlib import Path
from typing import Any, Optional, Union

from hpcrl.fsutil import fsync_path

logger = logging.getLogger("hpcrl.checkpoint")


CHECKPOINTS_DIR = "checkpoints"


DIST_DIR = "dist"
"""The main (actor) model's megatron-core distributed checkpoint folder; another named model ``name`` (e.g. the
critic) has its own, :func:`model_dist_dir` (``dist_<name>``)."""

_MODEL_NAME_RE = re.compile(r"^[a-z][a-z0-9]*$")


def model_dist_dir(name: str) -> str:
    """The distributed checkpoint folder of the extra model ``name`` (``"critic"`` -> ``dist_critic``).
    Raises ValueError for a name that is not lower-case letters and digits starting with a letter."""
    if not _MODEL_NAME_RE.match(name):
        raise ValueError(f"a checkpoint's model name is lower-case letters and digits, got {name!r}")
    return f"{DIST_DIR}_{name}"


RNG_DIR = "rng"


STATE_FILE = "state.json"


MARKER_FILE = "COMPLETE"


FORMAT = "hpcrl-checkpoint"


FORMAT_VERSION = 1


_ITER_RE = re.compile(r"^iter_(\d{7})$")


_GARBAGE_RE = re.compile(r"^iter_\d{7}\.(tmp|del)-[0-9a-f]+$")


_CHUNK = 1 << 22  # 4 MiB read size for checksums


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete, truncated or not an hpcrl checkpoint (the message says why)."""


def checkpoint_root(run_dir: Union[str, os.PathLike]) -> Path:
    """``run_dir/checkpoints``: the folder holding every checkpoint of a run."""
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoint_path(run_dir: Union[str, os.PathLike], rollout_id: int) -> Path:
    """``run_dir/checkpoints/iter_{rollout_id:07d}``: where the checkpoint of ``rollout_id`` lives."""
    if not 0 <= int(rollout_id) < 10**7:
        raise ValueError(f"rollout_id must be in [0, 9999999], got {rollout_id}")
    return checkpoint_root(run_dir) / f"iter_{int(rollout_id):07d}"


def rollout_id_of(path: Union[str, os.PathLike]) -> int:
    """The rollout id in a checkpoint folder's name (``iter_0000012`` -> 12); ValueError for other names."""
    m = _ITER_RE.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not named iter_XXXXXXX")
    return int(m.group(1))


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def size_and_crc(path: Path, fsync: bool = False, crc: bool = True) -> tuple[int, Optional[str]]:
    """Size in bytes and CRC-32 (8 hex digits; None without ``crc``) of a file; ``fsync`` flushes it too.

    With ``crc`` the size is what reading returns (on NFS, open-to-close consistent, unlike a cached stat).
    """
    with open(path, "rb") as f:
        if crc:
            value, size = 0, 0
            while chunk := f.read(_CHUNK):
                value = zlib.crc32(chunk, value)
                size += len(chunk)
        else:
            size = os.fstat(f.fileno()).st_size
        if fsync:
            os.fsync(f.fileno())
    return size, f"{value:08x}" if crc else None


_DISTCP_RE = re.compile(rf"^{DIST_DIR}(?:_[a-z0-9]+)?/__(\d+)_\d+\.distcp$")


_RNG_RE = re.compile(rf"^{RNG_DIR}/rank_(\d+)\.pt$")


def file_owner(name: str, world: int) -> int:
    """The rank that wrote a checkpoint file (its data is in that node's page cache), else 0."""
    m = _DISTCP_RE.match(name) or _RNG_RE.match(name)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def files_of(folder: Path) -> list[str]:
    """Every regular file under ``folder`` as sorted POSIX paths relative to it, ``COMPLETE`` excluded."""
    out = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return sorted(f for f in out if f != MARKER_FILE)


def subdirs(folder: Path) -> list[Path]:
    return [folder, *sorted(p for p in folder.rglob("*") if p.is_dir())]


def read_marker(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """The parsed ``COMPLETE`` marker of a checkpoint folder (no file checks: :func:`validate_checkpoint`).

    Raises CheckpointError if it is missing, unreadable or not an hpcrl marker.
    """
    marker_file = Path(path) / MARKER_FILE
    try:
        marker = json.loads(marker_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MARKER_FILE} marker (incomplete save)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable {MARKER_FILE} marker ({e})") from None
    if not (isinstance(marker, dict) and marker.get("format") == FORMAT
            and isinstance(marker.get("files"), dict)):
        raise CheckpointError(f"{path}: {MARKER_FILE} is not an {FORMAT} marker")
    return marker


def validate_checkpoint(path: Union[str, os.PathLike], verify_checksums: bool = False) -> dict[str, Any]:
    """Check a checkpoint folder against its ``COMPLETE`` marker and return the marker.

    Every listed file must exist with the listed size in bytes (with ``verify_checksums`` also the listed
    CRC-32, if the save computed one; this reads the whole checkpoint). The torch DCP index
    ``dist/.metadata``, ``dist/metadata.json`` (and the same of every extra model's ``dist_<name>/``, the
    marker's ``models``), ``state.json`` and one RNG file per rank of the saved world must be among them. Files on disk that are not listed are ignored. Raises CheckpointError naming the
    first problem.
    """
    path = Path(path)
    marker = read_marker(path)
    files: dict[str, Any] = marker["files"]
    dists = [DIST_DIR] + [model_dist_dir(name) for name in marker.get("models") or {}]
    required = [f"{d}/{f}" for d in dists for f in (".metadata", "metadata.json")] + [STATE_FILE]
    required += [f"{RNG_DIR}/rank_{r:05d}.pt" for r in range(int(marker.get("world_size", 1)))]
    missing = [f for f in required if f not in files]
    if missing:
        raise CheckpointError(f"{path}: {MARKER_FILE} does not list {missing}")
    for name, info in files.items():
        f = path / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: {name} is missing") from None
        if size != info["size"]:
            raise CheckpointError(f"{path}: {name} has {size} bytes, {info['size']} expected (truncated?)")
        if verify_checksums and info.get("crc32") and size_and_crc(f)[1] != info["crc32"]:
            raise CheckpointError(f"{path}: {name} fails its CRC-32 check (corrupted)")
    return marker


def list_checkpoints(run_dir: Union[str, os.PathLike]) -> list[Path]:
    """Every ``iter_XXXXXXX`` folder in ``run_dir/checkpoints``, oldest rollout id first (complete or not)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _ITER_RE.match(p.name)), key=rollout_id_of)


def find_latest_checkpoint(run_dir: Union[str, os.PathLike],
                           verify_checksums: bool = False) -> Optional[Path]:
    """The newest valid checkpoint of a run (:func:`validate_checkpoint`), or None if there is none.

    Folders that fail validation (no marker, missing or short file) are skipped with a logged warning and
    the next older one is tried; ``.tmp-*`` / ``.del-*`` folders are never considered. Reads only the file
    system, so every rank gets the same answer as long as no save runs at the same time.
    """
    for path in reversed(list_checkpoints(run_dir)):
        try:
            validate_checkpoint(path, verify_checksums)
        except CheckpointError as e:
            logger.warning("skipping checkpoint: %s", e)
            continue
        return path
    return None


def prune_checkpoints(run_dir: Union[str, os.PathLike], keep_last: int,
                      keep: Optional[Union[str, os.PathLike]] = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` valid checkpoints and the leftovers of crashed saves.

    Call on one rank only (:func:`save_checkpoint` does, on rank 0). ``keep_last`` <= 0 keeps every
    checkpoint. ``keep`` (a checkpoint folder) is never deleted. Removed: ``.tmp-*`` and ``.del-*`` folders,
    valid checkpoints beyond the newest ``keep_last``, and invalid ``iter_*`` folders older than the oldest
    kept checkpoint (invalid ones newer than that are left alone, with a warning from
    :func:`find_latest_checkpoint`). A checkpoint is first renamed to ``.del-<nonce>`` and then deleted, so a
    kill during deletion never leaves a half-deleted ``iter_*`` folder. Returns the removed paths.
    """
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    keep_path = Path(keep).resolve() if keep is not None else None
    removed: list[Path] = []
    for p in root.iterdir():
        if p.is_dir() and _GARBAGE_RE.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if keep_last <= 0:
        return removed
    valid, invalid = [], []
    for p in list_checkpoints(run_dir):
        try:
            validate_checkpoint(p)
            valid.append(p)
        except CheckpointError:
            invalid.append(p)
    kept = set(valid[-keep_last:]) | ({keep_path} if keep_path else set())
    oldest_kept = min((rollout_id_of(p) for p in kept if _ITER_RE.match(p.name)), default=None)
    doomed = [p for p in valid if p not in kept and p.resolve() != keep_path]
    doomed += [p for p in invalid if oldest_kept is not None and rollout_id_of(p) < oldest_kept]
    for p in sorted(doomed, key=rollout_id_of):
        trash = root / f"{p.name}.del-{secrets.token_hex(4)}"
        os.rename(p, trash)
        fsync_path(root)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(p)
        logger.info("pruned checkpoint %s", p)
    return removed
