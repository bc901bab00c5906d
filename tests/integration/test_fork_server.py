"""The CPU engines' fork server (:mod:`hpcrl.fork_server`, issue #52): a process forked from it gets what a
``subprocess.Popen``'d one would (arguments, environment, working directory, CPU set, blocked signals,
``/dev/null`` on stdin and its log on stdout/stderr, no other descriptor, default signal handlers, no logging
handlers, its command line in ``ps``, the thread count of its ``OMP_NUM_THREADS``, ``sys.path`` as ``python -m``
in its folder with its ``PYTHONPATH``), its exit status is reported
as ``Popen.returncode`` is (a code, or minus the signal), and nothing outlives the process that started the
server. A run's engines forked this way train bitwise as ``subprocess`` ones do: the USR2 resume test of
``test_preemption_local`` runs its first part with ``HPCRL_ENGINE_FORK=0`` and its rerun forked, and ends equal
to a forked reference run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.fork_probe import MODULE, gone

pytestmark = pytest.mark.integration


def test_a_forked_process_gets_what_popen_would_give_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", MODULE, "drive", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, HPCRL_ENGINE_FORK="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    report = json.loads((tmp_path / "report.json").read_text())
    assert seen["report_code"] == 3  # main()'s return value is the exit status
    assert report["argv"] == ["report", str(tmp_path / "report.json")]
    assert report["ppid"] == seen["server_pid"] and report["cwd"] == str(tmp_path) != seen["cwd"]
    # as `python -m` in that folder with that PYTHONPATH: the folder first on the path, then PYTHONPATH's entries
    assert report["sys_path"] == [str(tmp_path), str(tmp_path / "extra")]
    assert report["probe_x"] == "x" and report["threads"] == 1  # its env, OMP_NUM_THREADS applied
    assert report["affinity"] == [min(os.sched_getaffinity(0))]
    assert signal.SIGUSR2 in report["blocked"]  # the spawner's mask, as a Popen child inherits it
    assert report["stdin"] == "/dev/null" and len([fd for fd in report["fds"] if fd > 2]) <= 1  # the listing's
    assert report["cmdline"].startswith("probe-title --flag") and report["sigterm_default"]
    assert report["root_handlers"] == 0
    assert (tmp_path / "child.log").read_text() == "a line to the log\n"
    # Popen's returncode: None while running, wait(timeout) raises, minus the signal that ended it
    assert seen["running_poll"] is None and seen["wait_timed_out"]
    assert seen["killed_code"] == -signal.SIGKILL and seen["terminated_code"] == -signal.SIGTERM
    assert 0 < seen["reaped_cpu_s"] < 60  # their CPU (tests/timing.py adds it to the test's)
    # an environment that differs in what libraries read at import is started with subprocess instead
    assert seen["can_run"] == {"OMP_NUM_THREADS": True, "MY_SETTING": True, "TORCH_LOGS": False,
                               "HF_HOME": False, "LD_PRELOAD": False, "PYTHONPATH": True}
    # closing the server ends what it forked (SIGTERM) and the server
    assert seen["left_gone_after_close"] and seen["left_code_after_close"] == -signal.SIGTERM
    assert seen["server_gone"]


def test_nothing_outlives_the_process_that_started_the_server(tmp_path):
    """SIGKILL of the starter (a trainer killed outright) ends the server, and the server's end its children
    (``PR_SET_PDEATHSIG`` on both), as a Popen'd engine dies with its trainer."""
    proc = subprocess.Popen([sys.executable, "-m", MODULE, "orphan", str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pids.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        pids = json.loads((tmp_path / "pids.json").read_text())
        assert not gone(pids["sleeper"], 0.2)
    finally:
        proc.kill()
        proc.wait()
    assert gone(pids["server"], 10) and gone(pids["sleeper"], 10)


def test_a_fresh_server_outlives_the_thread_that_started_it(tmp_path):
    """``ForkServer.start_fresh`` from a test runner's worker thread: ``PR_SET_PDEATHSIG`` would end the server
    with that thread (it fires on the creating thread's exit), and every later command of the test process
    would fail to start; the server ends when the process's end of its socket closes instead."""
    import threading

    from hpcrl.fork_server import ForkServer

    box = []
    starter = threading.Thread(target=lambda: box.append(ForkServer.start_fresh((MODULE,))))
    starter.start()
    starter.join()
    server = box[0]
    try:
        proc = server.spawn(MODULE, ["report", str(tmp_path / "report.json")], dict(os.environ),
                            tmp_path / "child.log")
        assert proc.wait(60) == 3 and not server.dead
    finally:
        server.close()
    assert gone(server.pid, 10)
