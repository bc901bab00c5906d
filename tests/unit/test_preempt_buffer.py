"""The preemption watch (signal flag, blocked mask, deadline) and the HDF5 data buffer, on real signals and
real HDF5 files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest

from hpcrl.data.buffer import read_buffer, trained_rows, write_buffer
from hpcrl.data.sample import Sample, Status
from hpcrl.preempt import PreemptionWatch, agree, signal_from_config


def test_signal_from_config(monkeypatch):
    monkeypatch.delenv("HPCRL_PREEMPT_SIGNAL", raising=False)
    assert signal_from_config("USR2@120") == signal.SIGUSR2
    assert signal_from_config("SIGTERM@30") == signal.SIGTERM
    monkeypatch.setenv("HPCRL_PREEMPT_SIGNAL", "usr1")
    assert signal_from_config("USR2@120") == signal.SIGUSR1
    monkeypatch.setenv("HPCRL_PREEMPT_SIGNAL", "NOPE")
    with pytest.raises(ValueError, match="SIGNOPE"):
        signal_from_config("USR2@1")


def test_signal_sets_the_flag_and_children_are_immune():
    watch = PreemptionWatch(signal.SIGUSR2)
    assert watch.install()
    try:
        # a child started now inherits the blocked mask: USR2 (default action: terminate) does not kill it
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        time.sleep(0.3)
        os.kill(child.pid, signal.SIGUSR2)
        time.sleep(0.3)
        assert child.poll() is None, "the child died of USR2"
        child.kill()
        child.wait()
        assert watch.local_reason() is None
        # sent to the main thread, where it is blocked: pending until the step boundary looks (a signal sent to
        # the process may go to another thread, e.g. pytest-xdist's I/O thread, and run the handler later)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
        assert signal.SIGUSR2 in signal.sigpending()
        assert watch.local_reason() == "signal" and watch.requested
        assert signal.SIGUSR2 not in signal.sigpending()
    finally:
        watch.uninstall()
    assert signal.SIGUSR2 not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_sigterm_in_a_slurm_job_means_the_job_is_ending(monkeypatch):
    """Inside a Slurm job SIGTERM (Slurm ending the job: scancel, a failed node) sets the flag and
    ``job_ending``, unblocked (a child stays stoppable by it); outside one it is left alone; uninstall puts
    the previous handler back."""
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    outside = PreemptionWatch(signal.SIGUSR2)
    outside.install()
    try:
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        outside.uninstall()
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    watch = PreemptionWatch(signal.SIGUSR2)
    assert watch.install()
    try:
        assert not watch.job_ending() and watch.local_reason() is None
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        time.sleep(0.3)
        child.terminate()
        assert child.wait(timeout=10) == -signal.SIGTERM  # not blocked, not handled in the child
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10  # the handler runs in the main thread soon after (any thread may take it)
        while not watch.job_ending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.job_ending() and watch.local_reason() == "signal"
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


def test_deadline_counts_a_step_and_a_save():
    now = 1_000_000.0
    watch = PreemptionWatch(signal.SIGUSR2, end_time=now + 100)
    watch.record_step(20)
    watch.record_save(10)
    assert watch.local_reason(now) is None  # 100 s left > (20 + 10) * 1.5 + 10
    assert watch.local_reason(now + 46) == "deadline"  # 54 s left < 55
    assert PreemptionWatch(signal.SIGUSR2).local_reason(now) is None  # no deadline outside Slurm
    unsaved = PreemptionWatch(signal.SIGUSR2, end_time=now + 55)
    unsaved.record_step(1)
    assert unsaved.local_reason(now) == "deadline"  # no save timed yet: 30 s assumed, (1 + 30) * 1.5 + 10 > 55


def test_agree_without_distributed_is_local():
    assert agree(None) is None and agree("signal") == "signal"


def _sample(i: int, group: int, status=Status.COMPLETED) -> Sample:
    return Sample(group_index=group, index=i, prompt=f"{i}+1=", label=str(i + 1), tokens=[1, 2, 3, 4],
                  response="é4", response_length=2, loss_mask=[1, 0], rollout_log_probs=[-0.5, -1.25],
                  reward=1.0 if status is Status.COMPLETED else None, status=status, weight_versions=["3"])


def test_buffer_round_trip_keeps_partial_and_finished_groups_exactly(tmp_path):
    groups = [[_sample(0, 0), _sample(1, 0)], [_sample(2, 1, Status.ABORTED), _sample(3, 1, Status.PENDING)]]
    rows = trained_rows(5, [_sample(7, 3), _sample(8, 3)])
    write_buffer(tmp_path / "b.h5", groups, rows)
    back, trained = read_buffer(tmp_path / "b.h5")
    assert [[s.to_dict() for s in g] for g in back] == [[s.to_dict() for s in g] for g in groups]
    assert trained.dtype == np.int64 and trained.tolist() == [[5, 3, 7], [5, 3, 8]]
    write_buffer(tmp_path / "empty.h5", [], [])
    assert read_buffer(tmp_path / "empty.h5")[0] == [] and read_buffer(tmp_path / "empty.h5")[1].shape == (0, 3)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(ValueError, match="not an hpcrl-buffer"):
        read_buffer(tmp_path / "other.h5")
    with pytest.raises(FileNotFoundError):
        read_buffer(tmp_path / "missing.h5")


def test_buffer_stores_groups_as_arrays_and_odd_fields_come_back(tmp_path):
    chat = Sample(group_index=4, index=9, prompt=[{"role": "user", "content": "2+2?"}], label={"answer": 4},
                  tokens=[5, 6, 7], response="4", response_length=1, loss_mask=[1], rollout_log_probs=[-0.1],
                  reward={"reward": 0.5, "format": 1.0}, status=Status.TRUNCATED, metadata={"turns": 2})
    split = _sample(12, 5)  # an agent episode of two chains (Sample.segments)
    split.tokens, split.response_length, split.segments = [1, 2, 3, 4, 8, 9], 4, [3, 3]
    split.loss_mask, split.rollout_log_probs = [1, 0, 1, 1], [-0.5, 0.0, -0.25, -1.5]
    groups = [[chat, _sample(10, 4, Status.ABORTED)], [_sample(11, 5), split]]
    write_buffer(tmp_path / "b.h5", groups, [])
    back, _ = read_buffer(tmp_path / "b.h5")
    assert [[s.to_dict() for s in g] for g in back] == [[s.to_dict() for s in g] for g in groups]
    with h5py.File(tmp_path / "b.h5", "r") as f:
        g = f["groups"]
        assert f.attrs["version"] == 2 and g["group_sizes"][()].tolist() == [2, 2]
        assert g["tokens"].dtype == np.int64 and g["tokens"][()].tolist() == [5, 6, 7] + [1, 2, 3, 4] * 2 + [
            1, 2, 3, 4, 8, 9]
        assert g["segments"][()].tolist() == [3, 3] and g["segments_len"][()].tolist() == [0, 0, 0, 2]
        assert g["rollout_log_probs"].dtype == np.float64 and g["loss_mask"].shape == (1 + 2 * 2 + 4,)
        assert g["index"][()].tolist() == [9, 10, 11, 12]
        assert g["status"].asstr()[()].tolist() == ["truncated", "aborted", "completed", "completed"]
        assert np.isnan(g["reward"][0]) and g["reward"][()].tolist()[2:] == [1.0, 1.0]


def test_version_1_buffers_still_load(tmp_path):
    """A checkpoint written before the columns (one JSON string per sample) resumes as before."""
    import json

    groups = [[_sample(0, 0), _sample(1, 0)], [_sample(2, 1, Status.ABORTED), _sample(3, 1, Status.PENDING)]]
    with h5py.File(tmp_path / "v1.h5", "w") as f:  # the version 1 writer, as it was
        f.attrs["format"] = "hpcrl-buffer"
        f.attrs["version"] = 1
        g = f.create_group("groups")
        for i, group in enumerate(groups):
            g.create_dataset(f"{i:06d}", data=[json.dumps(s.to_dict()) for s in group],
                             dtype=h5py.string_dtype("utf-8"))
        f.create_dataset("trained", data=np.asarray([[0, 7, 70]], dtype=np.int64), maxshape=(None, 3))
    back, trained = read_buffer(tmp_path / "v1.h5")
    assert [[s.to_dict() for s in g] for g in back] == [[s.to_dict() for s in g] for g in groups]
    assert trained.tolist() == [[0, 7, 70]]


def test_pending_rollout_round_trips_through_the_buffer_and_the_manager_state(tmp_path):
    """An async run's next rollout (``pending/``) comes back exactly; a buffer without it reads as None."""
    from hpcrl.data.buffer import read_pending
    from hpcrl.loop_async import PendingRollout

    pending = PendingRollout()
    samples = [_sample(20, 6), _sample(21, 6), _sample(22, 7), _sample(23, 7)]
    pending.put(4, samples, {"rollout/reward_mean": 0.25, "rollout/weight_version": "3"})
    state = pending.state_dict()
    write_buffer(tmp_path / "b.h5", [[_sample(1, 0)]], [], pending=state.pop("groups"))
    assert read_buffer(tmp_path / "b.h5")[0][0][0].index == 1  # the held-back groups are unchanged
    back = PendingRollout()
    back.load_state_dict({**state, "groups": read_pending(tmp_path / "b.h5")})
    got, metrics = back.take(4)
    assert [s.to_dict() for s in got] == [s.to_dict() for s in samples] and metrics["rollout/weight_version"] == "3"
    with pytest.raises(RuntimeError, match="rollout 4 is due but the pending rollout is None"):
        back.take(4)
    write_buffer(tmp_path / "sync.h5", [], [])
    assert read_pending(tmp_path / "sync.h5") is None


def test_sample_lag_is_the_rollout_id_minus_the_oldest_weight_version():
    from hpcrl.rollout.manager import sample_lag

    s = _sample(0, 0)
    s.rollout_id, s.weight_versions = 5, ["4"]
    assert sample_lag(s) == 1
    s.weight_versions = ["3", "4"]  # a partial rollout continued after a weight sync
    assert sample_lag(s) == 2
    s.weight_versions = []
    assert sample_lag(s) is None
    s.weight_versions = ["default"]  # an engine's own version name
    assert sample_lag(s) is None
