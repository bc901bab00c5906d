"""``python -m hpcrl ...`` as the integration tests start it: forked from a fork server of this test process
(:class:`hpcrl.fork_server.ForkServer`, started on first use as a new interpreter that imported hpcrl's CLI,
trainer and engine modules once) instead of a new interpreter per command.

Why (issue #52): each ``hpcrl run`` of the suite paid ~5 CPU-seconds of imports (torch, megatron-core,
transformers, hpcrl) before its first step, a few hundred times per CI run on a 2-core machine. A forked command
runs the same ``hpcrl.cli.main`` with the arguments, environment, working directory and log file a new
interpreter would have had (``PYTHONPATH`` put on ``sys.path`` as the interpreter puts it; an environment that
differs in what libraries read at import starts a new interpreter instead: :meth:`ForkServer.can_run`), and
exits as the interpreter does (threads joined, ``atexit`` functions run). The user's path, a new interpreter,
stays tested: the e2e tier (the README's quickstart and the family quickstarts) and the Slurm tests start
``hpcrl`` as users do. ``HPCRL_TEST_FORK=0`` starts every command as a new interpreter.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Mapping, Optional, Sequence, Union

PRELOAD = ("hpcrl.train.preload", "hpcrl.cli", "hpcrl.launch_local", "hpcrl.validate", "hpcrl.convert")
"""What the tests' fork server imports (``hpcrl.train.preload``: torch, megatron-core prepared for the CPU,
transformers, the trainer and the engine)."""

_servers: list = []  # this test process's fork server, started on first use (None: not available here)


def fork_server():
    """This test process's fork server (started on first use, closed at exit), or None where commands are
    started as new interpreters (``HPCRL_TEST_FORK=0``, a GPU present)."""
    if not _servers:
        server = None
        if os.environ.get("HPCRL_TEST_FORK", "1") != "0":
            from hpcrl.fork_server import ForkServer

            server = ForkServer.start_fresh(PRELOAD)
            if server is not None:
                atexit.register(server.close)
        _servers.append(server)
    return _servers[0]


def forked_cpu_seconds() -> float:
    """CPU seconds of the commands this test process forked that have ended (:attr:`ForkServer.reaped_cpu_s`;
    0 before the first): ``tests/timing.py`` adds them to the test's process tree, which they are not part of."""
    server = _servers[0] if _servers else None
    return server.reaped_cpu_s if server is not None else 0.0


def popen_hpcrl(args: Sequence[str], *, cwd: Union[str, Path], env: Mapping[str, str],
                log: Union[str, Path, IO[bytes]], fork: bool = True) -> Any:
    """Start ``python -m hpcrl ARGS`` in ``cwd`` with environment ``env``, stdout and stderr appended to
    ``log`` (a path, or a file opened for appending, as the tests keep their runs' output: torch's shared-memory
    manager keeps pipes open). Returns the process: a :class:`subprocess.Popen` or a
    :class:`hpcrl.fork_server.ForkedProcess` (``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``,
    ``kill``, ``returncode``). ``fork`` False: a new interpreter (a test that needs what only an interpreter's
    start does, such as a ``sitecustomize`` module)."""
    path = Path(log if isinstance(log, (str, os.PathLike)) else log.name).absolute()
    server = fork_server() if fork else None
    if server is not None and server.can_run(env):
        return server.spawn("hpcrl.cli", list(args), env, path, cwd=cwd,
                            title=[sys.executable, "-m", "hpcrl", *args])
    with open(path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "hpcrl", *args], cwd=cwd, env=dict(env), stdout=out,
                                stderr=subprocess.STDOUT)


def run_hpcrl(args: Sequence[str], *, cwd: Union[str, Path], env: Mapping[str, str],
              log: Union[str, Path, IO[bytes]], timeout: Optional[float] = None) -> int:
    """:func:`popen_hpcrl` and wait (``timeout`` seconds: then the command is killed and
    :class:`subprocess.TimeoutExpired` raised, as ``subprocess.run`` does); its exit status."""
    proc = popen_hpcrl(args, cwd=cwd, env=env, log=log)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def check_hpcrl(args: Sequence[str], *, cwd: Union[str, Path], log: Union[str, Path],
                timeout: float = 300) -> str:
    """``python -m hpcrl ARGS`` (:func:`run_hpcrl`, forked where it can be) in ``cwd`` with this process's
    environment, e.g. an ``hpcrl convert`` of a finished run (a new interpreter per export paid ~4 CPU-seconds
    of imports); asserts exit status 0 (the log's tail in the message) and returns the log's text."""
    rc = run_hpcrl(args, cwd=cwd, env=os.environ, log=log, timeout=timeout)
    text = Path(log).read_text(errors="replace")
    assert rc == 0, f"hpcrl {' '.join(map(str, args))} exited {rc}\n{text[-3000:]}"
    return text
