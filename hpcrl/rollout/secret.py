"""The run secret: one random API key per run that every engine and the router require.

``create_run_secret(run_dir)`` writes ``run_dir/secret`` once (43 URL-safe characters, 256 bits from
``secrets.token_urlsafe(32)``), readable by its owner only (mode 0600). It is created under a temporary name
with ``os.open(O_CREAT | O_EXCL, 0o600)``, fsynced, and then moved into place (a hard link, so that two
processes racing to create it agree on one key; a plain rename where the file system has no hard links), so
the key is never visible with wider permissions and a crash never leaves a half-written secret behind.
Processes get the *path* (``--api-key-file``), never the key on their command line, where any user on the node
could read it with ``ps`` (real SGLang is the exception, see :mod:`hpcrl.rollout.engines`).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

SECRET_NAME = "secret"
"""File name of the run secret inside the run folder."""
SECRET_BYTES = 32
"""Random bytes in a run secret (``secrets.token_urlsafe(32)``: 43 characters)."""


class SecretError(ValueError):
    """A secret file is unsafe (readable by group/others), empty, or not a regular file."""


def create_run_secret(run_dir: str | os.PathLike) -> Path:
    """Create ``run_dir/secret`` (mode 0600) with a fresh random key, or return it if it already exists.

    An existing secret is reused (a requeued job keeps its key) after the same permission check as
    :func:`read_secret`. ``run_dir`` is created (mode 0700 for new folders) if missing.
    Returns the path. Raises SecretError if an existing secret is unsafe, OSError if the folder is not
    writable.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = run_dir / SECRET_NAME
    if path.exists():
        read_secret(path)  # validates permissions and content
        return path
    tmp = run_dir / f".{SECRET_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(SECRET_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            # link() fails if another process created the secret meanwhile: keep theirs (one key for all).
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: rename (last writer wins)
            os.rename(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    read_secret(path)
    return path


def read_secret(path: str | os.PathLike) -> str:
    """Return the key stored in ``path`` (whitespace stripped).

    Raises SecretError if the file is accessible by group or others (the message gives the ``chmod 600`` fix),
    is not a regular file, or is empty; FileNotFoundError if it does not exist.
    """
    path = Path(path)
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"secret {path} is not a regular file")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"secret {path} has mode {stat.S_IMODE(st.st_mode):04o}: group/others may read it; "
                          f"fix with: chmod 600 {path}")
    key = path.read_text().strip()
    if not key:
        raise SecretError(f"secret {path} is empty")
    return key
