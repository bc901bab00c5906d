"""A fork server: a process that has imported what its children import (torch, transformers, megatron-core,
hpcrl) and forks each of them on request, so none imports anything again. Two ways in:

- :meth:`ForkServer.start` forks the server from this process, once this process has imported the modules and
  before it ran a tensor operation or started a thread: a local run's trainer forks its CPU engines from it
  (:func:`hpcrl.launch_local.engine_forks`);
- :meth:`ForkServer.start_fresh` starts it as a new interpreter that imports them (``python -m
  hpcrl.fork_server``), for a process that runs threads: the test suite forks its ``hpcrl`` commands from one
  (``tests/hpcrl_process.py``).

Why (issue #52): a CPU engine started with ``subprocess`` spent ~3.7 CPU-seconds (and as many seconds of wall
time) importing torch and transformers and building its model classes before it loaded ~1 MB of weights; forked
from this server it is ready in ~0.2 s and ~0.15 CPU-seconds (the quickstart's tiny model, AMD EPYC, one
thread: docs/performance.md "CI time"). The test suite starts a few hundred engines and runs.

What a forked process gets, against one started with ``subprocess.Popen``: the environment, working directory,
CPU set, blocked signals and log file it would have had (``stdin`` from ``/dev/null``, ``stdout``/``stderr``
appended to the log, every other inherited descriptor closed, signal handlers at their defaults, logging
unconfigured, ``sys.path`` as ``python -m`` in its folder with its ``PYTHONPATH``), and it exits as the
interpreter does (threads joined, ``atexit``); its command line reads ``python -m MODULE ARGS`` in ``ps``
(``setproctitle``); it dies when the server does, and the server when the process that started it does
(``PR_SET_PDEATHSIG``), as a ``Popen``'d engine dies with its trainer. What it cannot get is an environment that
changes what was decided at import: :meth:`ForkServer.can_run` refuses one that differs from the server's in a
variable read at import or start (:data:`IMPORT_TIME_ENV`, save ``OMP_NUM_THREADS``, applied with
``torch.set_num_threads``, and ``PYTHONPATH``), and the caller starts that process with ``subprocess`` as
before. Not used where a GPU may be present (CUDA must not be
initialised before a fork; engines there are SGLang) or when ``HPCRL_ENGINE_FORK=0``.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["ForkServer", "ForkedProcess", "IMPORT_TIME_ENV", "ENGINE_PRELOAD", "fork_allowed"]

DISABLE_ENV = "HPCRL_ENGINE_FORK"
"""Set to ``0`` to start every engine with ``subprocess`` (for a comparison, or to rule the fork server out)."""

IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "ATEN_", "TORCH", "PYTORCH", "CUDA", "NVIDIA",
                   "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "PYTHON", "LD_", "MALLOC", "GLIBC",
                   "SGLANG", "VIRTUAL_ENV")
"""Prefixes of environment variables that libraries read when they are imported or the process starts (torch's
thread pools and CPU kernels, transformers' and the hub's settings, the interpreter and the loader): an engine
whose environment differs from the fork server's in one of them is started with ``subprocess``, except
``OMP_NUM_THREADS``, which the forked engine applies itself."""

ENGINE_PRELOAD = ("hpcrl.engine.server", "transformers.modeling_utils")
"""What the fork server imports before it forks (the engine's own imports, ~1.8 CPU-seconds, and transformers'
model base, ~1.5): each engine then builds its model from modules already loaded."""

READY_TIMEOUT_S = 600.0
"""Seconds :meth:`ForkServer.spawn` waits for a fresh server (:meth:`ForkServer.start_fresh`) to import its
preload (torch, megatron-core and transformers take ~10 s on a busy 2-core machine)."""

SPAWN_TIMEOUT_S = 60.0
"""Seconds :meth:`ForkServer.spawn` waits for the server to say the engine was forked (it forks at once; a
server that does not answer has died)."""


def fork_allowed() -> bool:
    """Whether engines may be forked here: no GPU device node (:func:`hpcrl.procs.cuda_possible`), a Linux
    kernel with ``pidfd_open``, and not turned off with ``HPCRL_ENGINE_FORK=0``."""
    from hpcrl.procs import cuda_possible

    return (os.environ.get(DISABLE_ENV, "1") != "0" and hasattr(os, "pidfd_open") and hasattr(os, "fork")
            and not cuda_possible())


@dataclass
class ForkedProcess:
    """A process forked by a :class:`ForkServer`, with the part of :class:`subprocess.Popen`'s interface
    hpcrl's process handling uses (``pid``, ``args``, ``returncode``, :meth:`poll`, :meth:`wait`,
    :meth:`send_signal`, :meth:`terminate`, :meth:`kill`). ``returncode`` as ``Popen``'s: the exit status, or
    minus the signal that ended it."""

    server: "ForkServer"
    pid: int
    args: list[str]
    returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        """The exit status once the process ended (reported by the server), else None."""
        if self.returncode is None:
            self.returncode = self.server.exit_status(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait ``timeout`` seconds (None: for ever) for the process to end; its exit status. Raises
        :class:`subprocess.TimeoutExpired` when it is still running then."""
        if self.returncode is None:
            self.returncode = self.server.wait_exit(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process unless it has ended."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


@dataclass
class ForkServer:
    """The fork server's handle in the process that started it (:meth:`start`, :meth:`start_fresh`):
    :meth:`spawn` forks a process that runs a module's ``main(argv)``; a thread here reads the server's answers
    (ready, forked, exited). A context
    manager; :meth:`close` ends the server (processes it forked that still run get SIGTERM)."""

    conn: Connection
    pid: int
    env: dict[str, str]
    """The environment the server was forked with (what the modules it imported saw)."""
    _ids: Any = field(default_factory=itertools.count, repr=False)
    _send: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _forked: dict[int, Any] = field(default_factory=dict, repr=False)
    _exits: dict[int, int] = field(default_factory=dict, repr=False)
    _pidfds: dict[int, int] = field(default_factory=dict, repr=False)
    sock: Any = None
    """The socket under ``conn``: :meth:`close` shuts it down, which ends the server and wakes the reader
    thread (closing ``conn`` alone would do neither while the thread waits in it)."""
    dead: bool = False
    """True once the server has ended (closed, or died)."""
    ready: bool = False
    """True once the server has imported its preload and serves."""
    reaped_cpu_s: float = 0.0
    """CPU seconds (user + system) of the processes forked so far that ended, with the descendants each of them
    reaped (what ``os.times()`` counts for a process's reaped children)."""
    _process: Optional[subprocess.Popen] = field(default=None, repr=False)

    @classmethod
    def start(cls, preload: Sequence[str] = ENGINE_PRELOAD) -> Optional["ForkServer"]:
        """Import ``preload`` here, then fork the server; None (and nothing forked) when forking is not allowed
        (:func:`fork_allowed`) or this process already runs other threads (a fork copies only the calling one,
        and locks the others hold would stay held in the server). Raises ImportError from ``preload``."""
        import importlib
        import socket

        if not fork_allowed():
            return None
        for name in preload:
            importlib.import_module(name)
        if threading.active_count() != 1:
            logger.debug("engines started with subprocess: %d threads run here", threading.active_count())
            return None
        ours, theirs = socket.socketpair()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the server
            code = 1
            try:
                ours.close()
                code = _serve(Connection(theirs.detach()))
            finally:
                os._exit(code)
        theirs.close()
        return cls._attach(ours, pid)

    @classmethod
    def start_fresh(cls, preload: Sequence[str]) -> Optional["ForkServer"]:
        """Start the server as a new interpreter (``python -m hpcrl.fork_server``) that imports ``preload`` and
        then serves: for a process that runs threads (a test runner), which cannot fork one itself. Returns at
        once (:meth:`spawn` waits for the imports); None where forking is not allowed (:func:`fork_allowed`).
        The server dies with this process."""
        import socket

        if not fork_allowed():
            return None
        ours, theirs = socket.socketpair()
        # (no PR_SET_PDEATHSIG here: it fires when the *thread* that started the server ends, and a test runner
        # may start it from a worker thread; the server ends when this process's end of the socket closes)
        process = subprocess.Popen([sys.executable, "-m", "hpcrl.fork_server", str(theirs.fileno()), *preload],
                                   pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        return cls._attach(ours, process.pid, process)

    @classmethod
    def _attach(cls, sock: Any, pid: int, process: Optional[subprocess.Popen] = None) -> "ForkServer":
        """The handle of server ``pid`` behind this process's end ``sock`` of their socket pair (``process``:
        its ``Popen`` when it is a new interpreter), its reader thread started."""
        server = cls(Connection(os.dup(sock.fileno())), pid, dict(os.environ), sock=sock, _process=process)
        threading.Thread(target=server._read, name="hpcrl-fork-server", daemon=True).start()
        return server

    # ------------------------------------------------------------------------------------------ forking
    def can_run(self, env: Mapping[str, str]) -> bool:
        """Whether a process with environment ``env`` may be forked from this server: it differs from the
        server's environment in no variable of :data:`IMPORT_TIME_ENV` but ``OMP_NUM_THREADS`` (applied with
        ``torch.set_num_threads``) and ``PYTHONPATH`` (put on ``sys.path`` as the interpreter would)."""
        keys = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)}
        return not self.dead and not any(k not in ("OMP_NUM_THREADS", "PYTHONPATH") and k.startswith(IMPORT_TIME_ENV)
                                         for k in keys)

    def spawn(self, module: str, argv: Sequence[str], env: Mapping[str, str], log_path: str | os.PathLike,
              cpus: Optional[Sequence[int]] = None, title: Optional[Sequence[str]] = None,
              cwd: Optional[str | os.PathLike] = None) -> ForkedProcess:
        """Fork a process that runs ``python -m module *argv`` as ``module.main(argv)`` does (the exit status it
        returns; ``module`` imported by the server's preload to gain anything) with environment ``env`` and this
        process's blocked signals, pinned to ``cpus`` (default this process's), ``stdout``/``stderr`` appended to
        ``log_path``, in ``cwd`` (default this process's); ``title``: its command line in ``ps`` (default the
        ``python -m`` one). Returns once forked (a fresh server first finishes its imports: up to
        :data:`READY_TIMEOUT_S`). Raises OSError when the server cannot fork (it died, or the kernel refused)."""
        args = [sys.executable, "-m", module, *map(str, argv)]
        request = {"module": module, "argv": [str(a) for a in argv], "env": dict(env),
                   "cwd": str(cwd) if cwd is not None else os.getcwd(),
                   "log": str(log_path),
                   "cpus": sorted(cpus if cpus is not None else os.sched_getaffinity(0)),  # as Popen inherits
                   "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                   "title": " ".join(title if title is not None else args)}
        with self._cond:
            if not self._cond.wait_for(lambda: self.ready or self.dead, READY_TIMEOUT_S):
                raise OSError(f"the fork server (pid {self.pid}) did not finish its imports in {READY_TIMEOUT_S:g} s")
        with self._send:
            rid = next(self._ids)
            try:
                self.conn.send(("spawn", rid, request))
            except (OSError, ValueError) as e:
                raise OSError(f"the fork server (pid {self.pid}) is gone: {e}") from e
        with self._cond:
            if not self._cond.wait_for(lambda: rid in self._forked or self.dead, SPAWN_TIMEOUT_S):
                raise OSError(f"the fork server (pid {self.pid}) did not fork within {SPAWN_TIMEOUT_S:g} s")
            answer = self._forked.pop(rid, None)
        if not isinstance(answer, int):
            raise OSError(answer or f"the fork server (pid {self.pid}) ended before it forked {module}")
        try:
            self._pidfds[answer] = os.pidfd_open(answer)  # its end is seen here too if the server dies first
        except OSError:
            pass
        return ForkedProcess(self, answer, args)

    # ------------------------------------------------------------------------------------------ exits
    def exit_status(self, pid: int) -> Optional[int]:
        """``pid``'s exit status once it ended, else None. If the server died before reporting it, a process
        gone since is taken as ended by the SIGTERM the server's death sent it."""
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            if self.dead and self._ended(pid):
                self._exits[pid] = -signal.SIGTERM
                return self._exits[pid]
        return None

    def wait_exit(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """Wait up to ``timeout`` seconds (None: for ever) for ``pid`` to end; its exit status, or None."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:  # a reentrant lock: exit_status takes it again
            while (status := self.exit_status(pid)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if self.dead:  # no answer comes once the server is gone: look at the process itself every 0.1 s
                    left = 0.1 if left is None else min(0.1, left)
                self._cond.wait(left)
            return status

    def _ended(self, pid: int) -> bool:
        fd = self._pidfds.get(pid)
        if fd is None:
            return not os.path.exists(f"/proc/{pid}")
        return bool(wait([fd], 0))

    def _read(self) -> None:
        """The reader thread: records the server's answers until it closes."""
        while True:
            try:
                kind, key, value = self.conn.recv()
            except (EOFError, OSError):
                with self._cond:
                    self.dead = True
                    self._cond.notify_all()
                return
            with self._cond:
                if kind == "ready":
                    self.ready = True
                elif kind == "exit":
                    self._exits[key], cpu = value
                    self.reaped_cpu_s += cpu
                    fd = self._pidfds.pop(key, None)
                    if fd is not None:
                        os.close(fd)
                else:  # "forked" (a pid) or "error" (why)
                    self._forked[key] = value
                self._cond.notify_all()

    def close(self) -> None:
        """End the server (it exits when this end closes; processes it forked that still run get SIGTERM from
        the kernel) and reap it. Idempotent."""
        import socket

        if self.sock is not None and self.sock.fileno() != -1:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
        with self._cond:
            self._cond.wait_for(lambda: self.dead, 5.0)  # the reader thread saw the end: conn is its own now
        if not self.conn.closed:
            self.conn.close()
        if self._process is not None:
            self._process.wait()
            return
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- the server


def _serve(conn: Connection, with_parent: bool = True) -> int:
    """The server's loop: fork a process per request, report each one's pid and, when it ends, its exit status
    (each watched through a pidfd); return 0 when the parent's end closes. ``with_parent``: also die the moment
    the parent (its forking thread) does (``PR_SET_PDEATHSIG``)."""
    from hpcrl.procs import die_with_parent

    if with_parent:
        die_with_parent()  # the trainer killed outright takes the server with it, and the server its engines
    _set_title(f"hpcrl engine fork server (of pid {os.getppid()})")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    blocked = set(signal.valid_signals()) - {signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)  # a signal to the whole group is for the others
    children: dict[int, int] = {}  # pidfd -> pid
    conn.send(("ready", None, None))
    while True:
        for ready in wait([conn, *children]):
            if ready is conn:
                try:
                    kind, rid, request = conn.recv()
                except (EOFError, OSError):
                    return 0
                try:
                    pid = _fork_child(conn, children, request)
                    children[os.pidfd_open(pid)] = pid
                    conn.send(("forked", rid, pid))
                except OSError as e:
                    conn.send(("error", rid, f"the fork server could not fork {request['module']}: {e}"))
            else:
                pid = children.pop(ready)
                os.close(ready)
                _, status, usage = os.wait4(pid, 0)  # (its CPU includes the descendants it reaped)
                conn.send(("exit", pid, (os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime)))


def _fork_child(conn: Connection, children: Mapping[int, int], request: Mapping[str, Any]) -> int:
    """Fork one process for ``request`` (:meth:`ForkServer.spawn`'s); its pid here. Never returns in the
    child."""
    pid = os.fork()
    if pid != 0:
        return pid
    code = 1
    try:
        conn.close()
        for fd in children:
            os.close(fd)
        code = _run_child(request)
    except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    raise AssertionError("unreachable")


def _run_child(request: Mapping[str, Any]) -> int:
    """In the forked process: take on the state a fresh ``python -m`` would have had, run the module's
    ``main(argv)`` and exit as the interpreter does; its exit status."""
    import importlib
    import random

    from hpcrl.procs import die_with_parent

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    die_with_parent()
    os.sched_setaffinity(0, request["cpus"])
    if sys.path and sys.path[0] == os.getcwd():  # ``python -m``: the working directory first on the path
        sys.path[0] = request["cwd"]
    os.chdir(request["cwd"])
    known = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    added = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in known]
    sys.path[1:1] = [os.path.abspath(p) for p in added]  # where the interpreter puts PYTHONPATH's entries
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024)
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    if "torch" in sys.modules:  # OpenMP read OMP_NUM_THREADS when the server imported torch: this one's
        threads = os.environ.get("OMP_NUM_THREADS")  # (unset: OpenMP's default, one thread per allowed CPU)
        sys.modules["torch"].set_num_threads(max(1, int(threads)) if threads else len(request["cpus"]))
    root = logging.getLogger()
    for handler in list(root.handlers):  # the module's own logging.basicConfig must take effect
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    for other in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(other, logging.Logger) and other.name.startswith("hpcrl"):
            other.setLevel(logging.NOTSET)
    _set_title(request["title"])
    sys.argv = [request["module"], *request["argv"]]
    main = importlib.import_module(request["module"]).main
    signal.pthread_sigmask(signal.SIG_SETMASK, request["mask"])
    try:
        code = int(main(list(request["argv"])) or 0)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed, status 1
            print(e.code, file=sys.stderr)
            code = 1
    # the interpreter's exit: wait for the threads that are not daemons, then the atexit functions
    threading._shutdown()  # type: ignore[attr-defined]
    import atexit

    atexit._run_exitfuncs()  # type: ignore[attr-defined]
    return code


def _set_title(title: str) -> None:
    """This process's command line as ``ps`` and ``/proc/PID/cmdline`` show it (``setproctitle``)."""
    from setproctitle import setproctitle

    setproctitle(title)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hpcrl.fork_server FD MODULE...`` (:meth:`ForkServer.start_fresh`): import the modules, then
    serve on the inherited socket ``FD``."""
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    conn = Connection(int(argv[0]))
    for name in argv[1:]:
        importlib.import_module(name)
    return _serve(conn, with_parent=False)


if __name__ == "__main__":
    sys.exit(main())
