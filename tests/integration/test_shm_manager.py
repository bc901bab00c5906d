"""Weight payloads on a busy machine: torch's shared-memory manager answering late (hpcrl.engine.serialize).

A ``file_system`` block is opened through the sender's ``torch_shm_manager`` daemon, and torch waits one second
for its answer. Under load (a quickstart warm start died so at a load average of 12) that second passes, and
the weight sync failed with "Shared memory manager connection has timed out". Here the daemon is really stopped
(SIGSTOP) for longer than that second while another process opens a staged bucket, then continued (SIGCONT):
torch's own unpickling fails, hpcrl's retries and gets the sender's values.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hpcrl.engine.serialize import StagingArena, serialize_views

pytestmark = pytest.mark.integration

STOPPED_S = 2.5
"""How long the manager is stopped (seconds): more than torch's one-second wait, less than hpcrl's retries."""

RECEIVER = r"""
import base64, pickle, sys
import torch
from hpcrl.engine.serialize import deserialize_flattened_bucket
mode = sys.argv[1]
print("ready", flush=True)
payload = sys.stdin.readline().strip()
try:
    if mode == "torch":
        obj = pickle.loads(base64.b64decode(payload))
        got = obj["flattened_tensor"].view(torch.float32)
    else:
        got = dict(deserialize_flattened_bucket(payload))["w"].reshape(-1)
    print("sum", float(got.sum()), flush=True)
except RuntimeError as e:
    print("error", str(e).splitlines()[0], flush=True)
"""


def manager_pids() -> list[int]:
    """This process's ``torch_shm_manager`` daemons (children named so)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "cmdline").read_bytes().split(b"\0")[0].endswith(b"torch_shm_manager"):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == os.getpid():
                    out.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def open_while_stopped(payload: str, mode: str) -> str:
    """Start a receiver (``mode``: ``torch`` unpickles as torch does, ``hpcrl`` with hpcrl's deserializer),
    stop the manager, hand it the payload, continue the manager after :data:`STOPPED_S`; its answer line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        pids = manager_pids()
        assert pids, "no torch_shm_manager of this process"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(STOPPED_S, lambda: [os.kill(p, signal.SIGCONT) for p in pids])
        timer.start()
        try:
            proc.stdin.write(payload + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline().strip()
        finally:
            timer.join()
        return line
    finally:
        proc.kill()
        proc.wait()


def test_a_late_shared_memory_manager_is_waited_for():
    arena = StagingArena()
    w = torch.arange(64, dtype=torch.float32)
    for mode, expect in (("torch", "error Shared memory manager connection has timed out"),
                         ("hpcrl", f"sum {float(w.sum())}")):
        _, flat, meta = arena.pack([("w", w)])
        t0 = time.monotonic()
        got = open_while_stopped(serialize_views({"flattened_tensor": flat, "metadata": meta}), mode)
        assert got == expect, (mode, got)
        if mode == "hpcrl":
            assert time.monotonic() - t0 >= STOPPED_S  # it did wait for the manager
