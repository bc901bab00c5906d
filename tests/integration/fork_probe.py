"""A module for hpcrl's engine fork server to fork (``main``: what the forked process sees) and the driver that
starts a server in a fresh process, with no test-runner threads (``python -m tests.integration.fork_probe
drive DIR`` or ``orphan DIR``); used by tests/integration/test_fork_server.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MODULE = "tests.integration.fork_probe"


def main(argv: list[str]) -> int:
    """The forked process: ``report OUT`` writes what it sees to OUT and exits 3; ``sleep`` sleeps."""
    if argv[0] == "sleep":
        time.sleep(600)
        return 0
    import logging

    import torch

    fds = os.listdir("/proc/self/fd")  # (the listing's own descriptor is among them)
    info = {"argv": argv, "cwd": os.getcwd(), "probe_x": os.environ.get("PROBE_X"),
            "affinity": sorted(os.sched_getaffinity(0)),
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "fds": sorted(int(f) for f in fds), "stdin": os.readlink("/proc/self/fd/0"),
            "cmdline": Path("/proc/self/cmdline").read_text(), "threads": torch.get_num_threads(),
            "root_handlers": len(logging.getLogger().handlers), "ppid": os.getppid(),
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "sys_path": sys.path[:2]}
    print("a line to the log", flush=True)
    Path(argv[1]).write_text(json.dumps(info))
    return 3


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split(")")[1].split()[0] == "Z":  # ended, not yet reaped
            return True
        time.sleep(0.05)
    return False


def drive(folder: Path) -> dict:
    """Start a fork server here and fork probes from it; what was seen."""
    from hpcrl.fork_server import ForkServer

    server = ForkServer.start(preload=("torch", MODULE))
    assert server is not None, "no fork server (a GPU node, HPCRL_ENGINE_FORK=0, or threads)"
    out: dict = {"server_pid": server.pid, "cwd": os.getcwd()}
    env = dict(os.environ, PROBE_X="x", OMP_NUM_THREADS="1")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # blocked at the spawn: blocked in the child
    cpu = min(os.sched_getaffinity(0))
    extra = folder / "extra"
    report = server.spawn(MODULE, ["report", str(folder / "report.json")],
                          dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(extra), env.get("PYTHONPATH")]))),
                          folder / "child.log", cpus=[cpu], title=["probe-title", "--flag"], cwd=folder)
    out["report_pid"] = report.pid
    out["report_code"] = report.wait(30)
    killed = server.spawn(MODULE, ["sleep"], env, folder / "sleep.log")
    time.sleep(0.3)
    out["running_poll"] = killed.poll()
    try:
        killed.wait(0.2)
        out["wait_timed_out"] = False
    except subprocess.TimeoutExpired:
        out["wait_timed_out"] = True
    killed.kill()
    out["killed_code"] = killed.wait(10)
    terminated = server.spawn(MODULE, ["sleep"], env, folder / "sleep.log")
    time.sleep(0.3)
    terminated.terminate()
    out["terminated_code"] = terminated.wait(10)
    out["reaped_cpu_s"] = server.reaped_cpu_s  # the report's and the two sleepers' CPU, reported when reaped
    out["can_run"] = {k: server.can_run(dict(os.environ, **{k: "1"})) for k in
                      ("OMP_NUM_THREADS", "MY_SETTING", "TORCH_LOGS", "HF_HOME", "LD_PRELOAD", "PYTHONPATH")}
    left = server.spawn(MODULE, ["sleep"], env, folder / "sleep.log")
    time.sleep(0.3)
    server.close()  # the one still running gets SIGTERM from the kernel when the server ends
    out["left_gone_after_close"] = gone(left.pid, 10)
    out["left_code_after_close"] = left.wait(10)
    out["server_gone"] = gone(server.pid, 10)
    return out


def orphan(folder: Path) -> None:
    """Start a server, fork a sleeper, write both pids, then wait to be killed."""
    from hpcrl.fork_server import ForkServer

    server = ForkServer.start(preload=(MODULE,))
    assert server is not None
    sleeper = server.spawn(MODULE, ["sleep"], dict(os.environ), folder / "sleep.log")
    (folder / "pids.json").write_text(json.dumps({"server": server.pid, "sleeper": sleeper.pid}))
    time.sleep(600)


if __name__ == "__main__":
    where = Path(sys.argv[2])
    if sys.argv[1] == "drive":
        print(json.dumps(drive(where)))
    else:
        orphan(where)
