"""Durable-write helpers shared by checkpoints, HF exports and disk weight sync."""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder by path (a folder's fsync makes renames and new entries in it durable).

    Raises OSError if the path cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
