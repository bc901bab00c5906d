"""Process utilities for the servers hpcrl starts (engines, router, the rollout job step, checkpoint writers):
a free port, an address, a health wait, a log tail, die-with-parent, stop with a grace period.

One module so that :mod:`hpcrl.rollout` and :mod:`hpcrl.checkpoint` (and the launchers) share one copy of each.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional


M_MMAP_THRESHOLD = -3
"""glibc ``mallopt`` parameter number of the mmap threshold (``malloc.h``)."""


def release_freed_memory_eagerly(mmap_threshold: int = 1 << 20) -> bool:
    """Make this process give large freed buffers back to the kernel at once: glibc serves allocations of at
    least ``mmap_threshold`` bytes (default 1 MiB) from their own mappings, unmapped at free.

    By default glibc raises that threshold after the first large free, up to 32 MiB, so CPU tensors below it
    (most activations, gradients and weight-sync buffers of a small model) come from the heap, whose freed
    pages stay resident and, across threads' arenas, are not reused: measured on SmolLM2-135M
    (``benchmarks/memory.py``), the trainer held 4.6 GB between steps instead of 3.2 GB and the CPU engine
    1.8 GB instead of 1.5 GB. A fixed threshold ends that; the cost is a page fault per touched page of each
    large buffer. Called by the trainer loops and the CPU engine at start. Returns False (and changes nothing)
    where the C library is not glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)))


def skip_final_collection() -> None:
    """Called by a process entry point whose work is done (every file written and closed), just before it
    exits: move every live object into the garbage collector's permanent generation (:func:`gc.freeze`), so
    that the interpreter's shutdown does not traverse the whole heap of torch, megatron-core and transformers
    objects once more. atexit handlers, flushes and finalizers still run as before; only the last full
    collection, whose freed memory goes back to the kernel at exit anyway, is skipped. Measured on the tiny
    model (this machine, 2 cores): ``hpcrl run`` exited 2.5 s after its last atexit handler, 0.25 s with
    this; the CPU engine 1.2 s after SIGTERM. Not for a process that goes on (a test process): frozen objects
    are never collected."""
    import gc

    gc.freeze()


class ProcessStartError(RuntimeError):
    """A server subprocess died or never became healthy. ``log_tail`` holds the end of its log."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(f"{message}\n--- log tail ---\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail


SERVICE_PORT_LOW = 20000
"""Lowest port hpcrl picks for a server it starts later (an engine task's, ``MASTER_PORT``): the range from
here to the kernel's ephemeral ports (:func:`ephemeral_port_range`) is never handed out by ``bind(0)``."""


def env_rank() -> int:
    """The rank :func:`hpcrl.train.parallel.init_distributed` will take (``RANK``, 0 without it), known before
    the process group forms (and before torch is imported)."""
    return int(os.environ.get("RANK", 0))


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Device nodes without which no GPU is usable by torch: NVIDIA's driver (``/dev/nvidiactl``), ROCm's
(``/dev/kfd``, which torch reports through ``torch.cuda`` too) and WSL2's paravirtualised GPU
(``/dev/dxg``)."""


def cuda_possible(nodes: tuple[str, ...] = GPU_DEVICE_NODES) -> bool:
    """False when none of ``nodes`` exists, so ``torch.cuda.is_available()`` is certainly False here and a
    caller that only needs that answer can skip importing torch (~1.5 s on a 2-core CPU machine, before the
    engines are launched). True means only "ask torch"."""
    return any(os.path.exists(n) for n in nodes)


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, importing torch only where :func:`cuda_possible` says a GPU may exist:
    what the steps before the engines launch ask (``rollout.engine: auto``, torch-memory-saver's hook)."""
    if not cuda_possible():
        return False
    import torch

    return torch.cuda.is_available()


def _tcp_socket(host: str) -> socket.socket:
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; another process may take it later)."""
    with _tcp_socket(host) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range of ephemeral ports (``/proc/sys/net/ipv4/ip_local_port_range``; Linux's default
    32768-60999 where it cannot be read): the ports ``bind(port 0)`` and outgoing connections take."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def find_free_service_port(host: str = "", low: int = SERVICE_PORT_LOW, attempts: int = 200) -> int:
    """A TCP port free on ``host`` right now, drawn at random from [``low``, start of the ephemeral range) so
    that no ``bind(0)`` or outgoing connection of another process (a trainer's gloo connections, ``srun``) can
    be handed it in the seconds before the server that will listen on it binds it (what :func:`find_free_port`
    allows; a Slurm engine task picks its port, then starts the engine, which binds it once loaded). Skips
    ``$MASTER_PORT`` and ports already bound; after ``attempts`` misses, or when the range is empty, falls
    back to :func:`find_free_port`."""
    import random

    top, _ = ephemeral_port_range()
    master = os.environ.get("MASTER_PORT", "")
    rng = random.SystemRandom()
    for _ in range(attempts if top > low else 0):
        port = rng.randrange(low, top)
        if str(port) == master:
            continue
        with _tcp_socket(host) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return find_free_port(host)


PORT_ATTEMPTS = 5
"""Starts of one server on a fresh port, at most, when its bind fails because another process took the port
between the pick and the bind (:func:`port_taken`)."""


def port_taken(log_text: str) -> bool:
    """Whether a server's log says its bind failed because the port was in use (``EADDRINUSE``: Python's
    ``[Errno 98] ... address already in use``, Rust's ``Address already in use (os error 98)``)."""
    return "address already in use" in log_text.lower()


def log_size(path: Optional[Path]) -> int:
    """The size of ``path`` in bytes (0 when it does not exist): where the next start's lines begin."""
    try:
        return os.path.getsize(path) if path is not None else 0
    except OSError:
        return 0


def log_since(path: Optional[Path], offset: int, max_bytes: int = 64_000) -> str:
    """The text ``path`` gained after ``offset`` bytes (its last ``max_bytes`` at most; '' if unreadable):
    one start's lines in a log that several starts append to."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(offset, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` or one of its descendants has a TCP socket listening on ``port`` (psutil): that
    the server it runs bound the port itself, not another process that took it first. False when ``pid`` is
    gone."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return False
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return False


def url_for(host: str, port: int) -> str:
    """``http://host:port``; a wildcard bind address (0.0.0.0, ::) becomes this machine's host name."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def log_tail(path: Optional[Path], max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` bytes of a log file as text ('' if unreadable)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def http_status(url: str, api_key: Optional[str] = None, timeout_s: float = 5.0) -> Optional[int]:
    """GET ``url`` and return its HTTP status, or None if nothing answered within ``timeout_s`` seconds."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError, ValueError):
        return None


POLL_S = 0.05
"""Seconds between start-up probes of a local server (:func:`wait_for_http_ok`): a refused connection costs
well under a millisecond, while a 0.5 s interval left an engine up for 0.25 s on average unused at every
start and restart."""


def wait_for_http_ok(url: str, process: subprocess.Popen, timeout_s: float, log_path: Optional[Path],
                     what: str, api_key: Optional[str] = None, poll_s: float = POLL_S) -> None:
    """Poll ``url`` until it answers 200, while ``process`` lives (every ``poll_s`` seconds).

    Raises ProcessStartError (with the log tail) if the process exits first or ``timeout_s`` seconds pass.
    """
    deadline = time.monotonic() + timeout_s
    last: Optional[int] = None
    while True:
        rc = process.poll()
        if rc is not None:
            raise ProcessStartError(f"{what} exited with code {rc} before {url} answered", log_tail(log_path))
        last = http_status(url, api_key, timeout_s=max(0.1, min(5.0, deadline - time.monotonic())))
        if last == 200:
            return
        if time.monotonic() + poll_s > deadline:
            state = f"last status {last}" if last is not None else "no answer"
            raise ProcessStartError(f"{what} did not answer 200 on {url} within {timeout_s:g} s ({state})",
                                    log_tail(log_path))
        time.sleep(poll_s)


LAUNCHER_PID_ENV = "HPCRL_LAUNCHER_PID"
"""The local launcher's PID, set by :func:`hpcrl.launch_local.worker_context` for the trainer processes' fork server
(:mod:`hpcrl.train.forkserver_guard` exits if its parent is not that process any more)."""


def die_with_parent() -> None:
    """``preexec_fn`` for server children: on Linux the kernel sends SIGTERM to the child when the process that
    started it dies (``PR_SET_PDEATHSIG``), so a trainer killed with SIGKILL (a preempted or crashed job) leaves
    no engine, router or step holding ports and memory. A no-op elsewhere."""
    import ctypes
    import signal as _signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(_signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def child_preexec(cpus=None):
    """The ``preexec_fn`` of a server child: :func:`die_with_parent`, and with ``cpus`` (CPU ids) also pinned
    to them (``sched_setaffinity``; :mod:`hpcrl.placement`)."""
    if cpus is None:
        return die_with_parent
    cpus = set(cpus)

    def preexec() -> None:
        die_with_parent()
        os.sched_setaffinity(0, cpus)

    return preexec


def stop_process(process: subprocess.Popen, grace_s: float = 10.0) -> Optional[int]:
    """SIGTERM ``process`` (its PID only), SIGKILL it if it is still alive after ``grace_s`` seconds.

    Returns the exit code (None only if it could not be reaped)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            try:
                process.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                return None
    return process.returncode


def open_log(log_path: Optional[str | os.PathLike], prefix: str) -> tuple[Path, IO[bytes]]:
    """Open ``log_path`` for appending (parents created), or a new temporary file named ``prefix*.log``."""
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".log")
        return Path(name), os.fdopen(fd, "ab")
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, open(path, "ab")


# ---------------------------------------------------------------------------------------------- command lines


@dataclass
class ManagedProcess:
    """A server process hpcrl started (an engine, the router): its base ``url``, the ``process`` and its
    combined stdout/stderr ``log_path`` (``_log_file`` the open handle). A context manager that stops it."""

    url: str
    process: subprocess.Popen
    log_path: Path
    _log_file: Optional[IO[bytes]] = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """Process id of the server."""
        return int(self.process.pid)

    def alive(self) -> bool:
        """True while the server process runs."""
        return self.process.poll() is None

    def terminate(self) -> None:
        """SIGTERM the server (its PID only) and return at once: :meth:`stop` waits. Lets a caller shut
        several servers down side by side (each takes ~0.2-1 s). Harmless on an exited server."""
        if self.process.poll() is None:
            self.process.terminate()

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM the server (its PID only), SIGKILL after ``grace_s`` seconds; returns its exit code
        (:func:`stop_process`) and closes the log. Idempotent."""
        rc = stop_process(self.process, grace_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return rc

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
