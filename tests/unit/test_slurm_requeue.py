"""hpcrl.slurm.requeue, the one owner of requeueing, without a cluster: which id ``scontrol requeue`` gets,
that task 0 alone asks for it and every task then waits, and that ``slurm.requeue: false`` turns every path
off. (On the local Slurm cluster: ``tests/integration/test_slurm_cluster_submit.py`` and
``tests/integration/test_preemption_slurm.py``.)"""

from __future__ import annotations

import os
import stat
import time

import pytest

from hpcrl.slurm import requeue


@pytest.fixture
def slurm_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "SUBMITIT_", "HPCRL_PREEMPT")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    return monkeypatch


def fake_scontrol(tmp_path, monkeypatch, rc: int = 0):
    d = tmp_path / "bin"
    d.mkdir()
    p = d / "scontrol"
    p.write_text(f'#!/bin/bash\necho "$@" >> {tmp_path / "calls"}\necho refused >&2\nexit {rc}\n')
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{d}:{os.environ['PATH']}")
    return tmp_path / "calls"


def test_job_to_requeue_names_the_array_task():
    assert requeue.job_to_requeue({"SLURM_JOB_ID": "12"}) == "12"
    assert requeue.job_to_requeue({"SLURM_JOB_ID": "15", "SLURM_ARRAY_JOB_ID": "12",
                                   "SLURM_ARRAY_TASK_ID": "3"}) == "12_3"
    with pytest.raises(KeyError):
        requeue.job_to_requeue({})


def test_options_follow_slurm_requeue():
    assert requeue.sbatch_option(True) == "--requeue" and requeue.sbatch_option(False) == "--no-requeue"
    assert requeue.template_values(True) == {"requeue": "1", "exit_requeue": 75}
    assert requeue.template_values(False)["requeue"] == "0"
    assert requeue.submitit_resubmission(print, False) is None
    assert requeue.submitit_resubmission(print, True).function is print


def fake_sleep(monkeypatch, slept: list) -> None:
    """requeue's ``time.sleep`` records its argument instead of sleeping. Only requeue's: patching the shared
    ``time.sleep`` also caught subprocess's own polling sleeps inside ``scontrol``'s ``subprocess.run``."""
    import types

    monkeypatch.setattr(requeue, "time", types.SimpleNamespace(sleep=slept.append, monotonic=time.monotonic,
                                                                time=time.time))


def test_task0_requeues_then_waits(tmp_path, slurm_env, monkeypatch):
    calls = fake_scontrol(tmp_path, monkeypatch)
    slept = []
    fake_sleep(monkeypatch, slept)
    with pytest.raises(RuntimeError, match="job 12 was not requeued within 7 s"):
        requeue.requeue_and_wait(True, wait_s=7)
    assert calls.read_text() == "requeue 12\n" and slept == [7]


def test_other_tasks_only_wait_and_refusal_shortens_the_wait(tmp_path, slurm_env, monkeypatch):
    calls = fake_scontrol(tmp_path, monkeypatch, rc=1)
    slept = []
    fake_sleep(monkeypatch, slept)
    slurm_env.setenv("SLURM_PROCID", "1")
    with pytest.raises(RuntimeError):
        requeue.requeue_and_wait(True)
    assert not calls.exists() and slept == [requeue.WAIT_FOR_REQUEUE_S]
    slurm_env.setenv("SLURM_PROCID", "0")
    with pytest.raises(RuntimeError):  # Slurm is already requeueing it: wait less
        requeue.requeue_and_wait(True)
    assert slept[-1] == requeue.WAIT_WHEN_SLURM_REQUEUES_S


def test_no_requeue_ends_at_once(tmp_path, slurm_env, monkeypatch):
    calls = fake_scontrol(tmp_path, monkeypatch)
    assert requeue.requeue_and_wait(False) == 0
    assert not calls.exists()


WAITING_TASK = """
import signal, sys
from hpcrl.slurm import requeue
signal.signal(signal.SIGTERM, lambda *a: print("bypassing SIGTERM", flush=True))  # as submitit's handler does
try:
    requeue.requeue_and_wait(True, wait_s=60)
except RuntimeError as e:
    print(e, flush=True)
    sys.exit(3)
"""


def test_the_requeues_sigterm_ends_a_waiting_task_at_once(tmp_path, slurm_env, monkeypatch):
    """A task that asked for the requeue and waits to be ended by it exits as soon as Slurm's SIGTERM comes,
    instead of living on (submitit's handler ignores SIGTERM) until the SIGKILL ``KillWait`` seconds later
    (30 s by default), which delays the requeue by as much. A real process; the handler it replaced is back
    once the wait ends otherwise (the other tests here)."""
    import signal
    import subprocess
    import sys

    calls = fake_scontrol(tmp_path, monkeypatch)
    proc = subprocess.Popen([sys.executable, "-c", WAITING_TASK], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout.readline().startswith("[hpcrl] checkpoint written; requeueing job 12")
    deadline = time.monotonic() + 30
    while not calls.exists():  # scontrol has run; the task is now waiting
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - t0 < 5
    assert "this task ends" in proc.stdout.read()
    assert calls.read_text() == "requeue 12\n"


def test_the_sigterm_handler_is_restored_after_the_wait(tmp_path, slurm_env, monkeypatch):
    import signal

    fake_scontrol(tmp_path, monkeypatch)
    fake_sleep(monkeypatch, [])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError):
        requeue.requeue_and_wait(True, wait_s=1)
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("environ", [{"HPCRL_PREEMPT_SIGNAL": "usr1"},
                                     {"SUBMITIT_PREEMPT_SIGNAL": "SIGUSR1"}])
def test_late_signals_named_in_the_environment_are_ignored_in_any_spelling(environ):
    import signal

    before = signal.getsignal(signal.SIGUSR1)
    try:
        requeue.ignore_late_signals(environ=environ)
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, before)
    requeue.ignore_late_signals(environ={"HPCRL_PREEMPT_SIGNAL": "NOSUCH"})  # unknown: nothing, no error
