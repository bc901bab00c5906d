"""Durable-write helpers shared by checkpoints, HF exports, disk weight sync and the run-folder files."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder by path (a folder's fsync makes renames and new entries in it durable).

    Raises OSError if the path cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = False) -> Path:
    """Write ``text`` to ``path`` atomically: a temp file in the same folder, then ``os.replace``, so a reader
    sees the old file or the new one, never a part. ``fsync``: also flush the data to disk before the rename.

    Returns the path. Raises OSError when the folder is not writable (the temp file is removed).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def atomic_folder(dest: str | os.PathLike) -> Iterator[Path]:
    """Write a folder atomically: the block fills the temporary folder it is given (beside ``dest``, created
    empty); when the block ends without error an existing ``dest`` is removed and the temporary folder renamed
    to it, so a reader sees a whole folder or none (or the previous one until the swap). On an error the
    temporary folder is removed and the error raised. Raises OSError when the parent is not writable."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
