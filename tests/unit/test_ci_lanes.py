"""The suite's two lanes and its time report (issue #52 points 2-3): ``tests/lanes.py`` gives an exclusive test
the machine only when no other test holds it, and keeps new tests out while it waits; ``.ci/timing_report.py``
prints the time per tier and the slowest tests from ``tests/timing.py``'s records and flags a tier over its
budget; the budgets in ``.ci/budgets.json`` are the ones docs/performance.md states.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import lanes
from tests.timing import tier_of

ROOT = Path(__file__).resolve().parents[2]


def _report_module():
    spec = importlib.util.spec_from_file_location("timing_report", ROOT / ".ci" / "timing_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hold(uid: str, exclusive: bool, seconds: float, events, name: str) -> None:
    lanes._worker_uid = uid
    with lanes.machine(exclusive=exclusive):
        events.put((name, "in", time.monotonic()))
        time.sleep(seconds)
        events.put((name, "out", time.monotonic()))


def _locked(path: Path) -> bool:
    """Whether another process holds an exclusive ``flock`` on ``path``."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock it took
    return False


def test_an_exclusive_test_waits_for_the_shared_holder_and_holds_off_the_next(tmp_path):
    uid = f"unit-{tmp_path.name}"
    ctx = mp.get_context("fork")
    events = ctx.Queue()
    shared = ctx.Process(target=_hold, args=(uid, False, 0.6, events, "shared"))
    shared.start()
    assert events.get(timeout=10)[:2] == ("shared", "in")
    exclusive = ctx.Process(target=_hold, args=(uid, True, 0.6, events, "exclusive"))
    exclusive.start()
    # until the exclusive one holds the turnstile (waiting for the shared holder): polled, not a fixed sleep,
    # which a loaded machine outran (a 0.2 s sleep failed beside a CI run, 2026-12-07); 10 s is ample
    lanes._worker_uid, saved = uid, lanes._worker_uid
    try:
        turnstile_path = lanes._lock_paths()[0]
    finally:
        lanes._worker_uid = saved
    deadline = time.monotonic() + 10
    while not _locked(turnstile_path):
        assert time.monotonic() < deadline, "the exclusive test never took the turnstile"
        time.sleep(0.01)
    later = ctx.Process(target=_hold, args=(uid, False, 0.1, events, "later"))
    later.start()
    for p in (shared, exclusive, later):
        p.join(timeout=20)
    got = [events.get(timeout=5) for _ in range(4)]
    # in the order of the times each took inside or outside the lock: a Queue's put is sent by a feeder thread,
    # so one put under the lock can arrive after the next holder's (seen once, the unit tier beside a CI run)
    order = [(n, what) for n, what, _ in sorted(got, key=lambda e: e[2])]
    assert order == [("shared", "out"), ("exclusive", "in"), ("exclusive", "out"), ("later", "in")], order


def test_outside_xdist_nothing_is_locked():
    assert lanes._worker_uid is None or lanes._lock_paths() is not None
    saved, lanes._worker_uid = lanes._worker_uid, None
    try:
        with lanes.machine(exclusive=True), lanes.machine(exclusive=True):  # would deadlock if it locked
            pass
    finally:
        lanes._worker_uid = saved


def test_tier_of_a_node_id():
    assert tier_of("tests/e2e/test_quickstart.py::test_x@quickstart") == "e2e"
    assert tier_of("tests/unit/test_a.py::test_b[x]") == "unit"


def test_timing_report_prints_tiers_slowest_and_what_is_over_budget(tmp_path, capsys):
    report = _report_module()
    records = [
        {"nodeid": "tests/e2e/test_a.py::test_slow", "tier": "e2e", "wall": 300.0, "cpu": 250.0,
         "machine_busy_cores": 1.8, "outcome": "passed", "worker": "gw0", "group": None, "start": 1000.0},
        {"nodeid": "tests/unit/test_b.py::test_fast", "tier": "unit", "wall": 2.0, "cpu": 1.9,
         "machine_busy_cores": 1.0, "outcome": "failed", "worker": "gw1", "group": None, "start": 1001.0},
    ]
    (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    budgets = tmp_path / "budgets.json"
    budgets.write_text(json.dumps({"tiers": {"e2e": 200, "unit": 100}}))
    assert report.main([str(tmp_path), "--budgets", str(budgets), "--slowest", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"e2e\s+1\s+300\s+250\s+300\s+200", out), out
    assert "OVER BUDGET: tier e2e took 300" in out and "tier unit" not in out.split("OVER BUDGET")[-1]
    assert "lane 0 300 s, lane 1 2 s; the machine's busy cores 1.79 on average" in out, out
    assert re.search(r"1\s+300\s+250\s+0.83\s+tests/e2e/test_a.py", out), out
    slow = out.split("slowest tests")[1]
    assert "tests/e2e/test_a.py::test_slow" in slow and "test_fast" not in slow
    assert report.main([str(tmp_path / "none")]) == 2


def test_the_budgets_are_the_ones_the_docs_state():
    budgets = json.loads((ROOT / ".ci" / "budgets.json").read_text())["tiers"]
    docs = (ROOT / "docs" / "performance.md").read_text()
    table = docs.split("<!-- tier budgets -->")[1]  # the rows after the marker: | tier | seconds | ...
    stated = {m.group(1): float(m.group(2).replace(",", ""))
              for m in re.finditer(r"^\| (\w+) \| ([\d,]+) \|", table.split("\n\n")[0], re.M)}
    assert stated == {k: float(v) for k, v in budgets.items()}, (stated, budgets)


def test_the_groups_take_effect_under_xdist(tmp_path):
    """tests/lanes.py's groups reach xdist's scheduler: a pytest of two lanes over a suite whose two tests share
    a group fixture runs them on one worker (with pytest 9.2 and pytest-xdist 3.8 no test was grouped)."""
    (tmp_path / "conftest.py").write_text(
        "import pytest\npytest_plugins = ['tests.lanes']\n"
        "@pytest.fixture(scope='session')\ndef quickstart_run():\n    return 1\n")
    (tmp_path / "test_g.py").write_text(
        "import os\n" + "".join(f"def test_{n}({'quickstart_run' if n in 'ab' else ''}):\n"
                                 f"    open(os.path.join({str(tmp_path)!r}, '{n}'), 'w').write("
                                 f"os.environ['PYTEST_XDIST_WORKER'])\n" for n in "abcd"))
    out = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path), "-n", "2", "--dist", "loadgroup", "-v",
                          "-p", "no:cacheprovider", "--rootdir", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "test_a@quickstart" in out.stdout, out.stdout[-3000:]
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text()
    assert "test_c@test_g.py" in out.stdout  # the others in their module's group


@pytest.mark.parametrize("path", [".ci/run", "README.md"])
def test_ci_runs_the_readme_test_command_in_two_lanes(path):
    assert "pytest tests -n 2 --dist loadgroup --no-loadscope-reorder" in (ROOT / path).read_text()
