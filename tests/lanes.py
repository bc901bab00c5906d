"""Two lanes on a 2-core machine (issue #52 point 2): the suite runs on two pytest-xdist workers
(``-n 2 --dist loadgroup``, the README's test command), and this plugin keeps what must not share the machine
apart.

* **Groups** (``xdist_group``, one worker each, in order): ``slurm`` - every test of the local Slurm cluster,
  so one cluster serves the session (a session fixture is made once per worker); ``quickstart`` - the tests of
  the README's quickstart run, made once by its session fixture; every other test in the group of its module,
  so a module's fixtures (engines, trainers, reference runs) are made once: ``--dist loadgroup`` sends ungrouped
  tests one by one, and the first two-lane run built many module fixtures on both workers.
* **One thread a process**: ``tests/conftest.py`` sets ``OMP_NUM_THREADS=1`` for everything the tests start
  (a 2-thread process beside a busy lane thrashes).
* **Exclusive tests** (``@pytest.mark.exclusive``, or :func:`machine` around a block): the machine to
  themselves, for a test that must time something against a tight bound or use every core. Every other test
  holds a shared lock on the machine while it runs; an exclusive one waits for the other lane's test to end
  and keeps the other lane from starting its next one until it is done. Lock order: a turnstile
  (``fcntl.flock`` exclusive, held only while taking the main lock) then the main lock, so a waiting exclusive
  test is not starved by the other lane's stream of shared holders.

The order is the collection order (``--no-loadscope-reorder``): the slow tiers (e2e, then integration, whose
groups hold the Slurm tests and the quickstart) start first and the unit tests fill the lanes' ends; xdist's
default order (most tests first) started the long groups late.

Without xdist (one process) there is one lane and nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

_worker_uid: str | None = None


def _lock_paths() -> tuple[Path, Path] | None:
    if _worker_uid is None:
        return None
    base = Path(tempfile.gettempdir()) / f"hpcrl-lanes-{_worker_uid}"
    return base.with_suffix(".turnstile"), base.with_suffix(".machine")


@contextlib.contextmanager
def machine(exclusive: bool) -> Iterator[None]:
    """Hold the machine for the block: shared (other tests may run in the other lane) or ``exclusive`` (no
    other test runs meanwhile). A no-op outside an xdist worker."""
    paths = _lock_paths()
    if paths is None:
        yield
        return
    turnstile = os.open(paths[0], os.O_RDWR | os.O_CREAT, 0o644)
    main = os.open(paths[1], os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        os.close(main)  # releases the lock
        os.close(turnstile)


def pytest_configure(config):
    global _worker_uid
    config.addinivalue_line("markers", "exclusive: runs with the machine to itself when the suite runs in two "
                            "lanes (tests/lanes.py)")
    worker = getattr(config, "workerinput", None)
    _worker_uid = worker.get("testrunuid") if worker else None


GROUP_OF_FIXTURE = {"slurm_cluster": "slurm", "quickstart_run": "quickstart"}
"""Session fixtures that must be made once: every test using one runs in that fixture's group."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the groups into node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        names = getattr(item, "fixturenames", ())
        group = next((g for fixture, g in GROUP_OF_FIXTURE.items() if fixture in names), None)
        item.add_marker(pytest.mark.xdist_group(group or item.nodeid.split("::", 1)[0]))


@pytest.fixture(autouse=True)
def _lane(request):
    """Every test holds the machine, shared or exclusive (module doc)."""
    with machine(exclusive=request.node.get_closest_marker("exclusive") is not None):
        yield
