"""Where the suite's time goes (issue #52 points 2-3): a pytest plugin that records, for every test, its wall
seconds (set-up + call + tear-down, so a session fixture's cost lands on the first test that asks for it), the
CPU seconds of this worker's process tree, and how many of the machine's cores were busy meanwhile.

Loaded by ``tests/conftest.py``. With ``HPCRL_TEST_TIMING=DIR`` each pytest process (the controller and every
xdist worker) appends one JSON line per test to ``DIR/<worker>.jsonl``; ``.ci/timing_report.py DIR`` reads
them and prints the time per tier, the slowest tests and the tiers over their budget. Without the variable the
plugin does nothing.

Process-tree CPU seconds come from ``os.times()``: this process plus every descendant already reaped (an
engine server stopped by its ``hpcrl run``, that run by the test), and the ``hpcrl`` commands the test forked
from its fork server (``tests/hpcrl_process.py``: the server reports each one's CPU when it reaps it). Slurm job
steps are not descendants (slurmd starts them), so a Slurm test's tree CPU is only its client's; nor are
processes forked by a multiprocessing fork server
(``hpcrl run``'s trainer ranks at ``train.nprocs > 1``, the multi-rank tests' ranks: the server reaps them, and
is reaped late or never by the test), so those tests' tree CPU leaves their ranks out. The machine's busy cores
(``/proc/stat``) count everything, and are the test's own only while nothing else runs beside it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

TIMING_ENV = "HPCRL_TEST_TIMING"


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from the first line of ``/proc/stat``; (0, 0) elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return total - idle, total


def tree_cpu_seconds() -> float:
    """User + system seconds of this process and of its reaped descendants, with the ``hpcrl`` commands its
    fork server forked and reaped (:func:`tests.hpcrl_process.forked_cpu_seconds`)."""
    from tests.hpcrl_process import forked_cpu_seconds

    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + forked_cpu_seconds()


def tier_of(nodeid: str) -> str:
    """The tier a test belongs to, from its path: ``tests/<tier>/...`` (unit, integration, e2e, ...)."""
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


class TestTimer:
    """Appends one record per test to ``directory/<worker>.jsonl``: nodeid, tier, wall, cpu, cores busy,
    outcome, worker and xdist group."""

    def __init__(self, directory: Path, worker: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{worker}.jsonl"
        self.worker = worker
        self.outcomes: dict[str, str] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall0, cpu0, (busy0, total0) = time.perf_counter(), tree_cpu_seconds(), machine_jiffies()
        yield
        wall = time.perf_counter() - wall0
        busy1, total1 = machine_jiffies()
        cores = os.cpu_count() or 1
        group = item.get_closest_marker("xdist_group")
        record = {
            "nodeid": item.nodeid, "tier": tier_of(item.nodeid), "wall": round(wall, 3),
            "cpu": round(tree_cpu_seconds() - cpu0, 3),
            "machine_busy_cores": round(cores * (busy1 - busy0) / max(total1 - total0, 1), 3),
            "outcome": self.outcomes.pop(item.nodeid, "passed"), "worker": self.worker,
            "group": (group.args[0] if group.args else group.kwargs.get("name")) if group else None,
            "start": round(time.time() - wall, 1),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def pytest_runtest_logreport(self, report):
        if report.outcome != "passed" and self.outcomes.get(report.nodeid) != "failed":
            self.outcomes[report.nodeid] = report.outcome


def pytest_configure(config):
    directory = os.environ.get(TIMING_ENV)
    if directory:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        config.pluginmanager.register(TestTimer(Path(directory), worker), "hpcrl-test-timer")
