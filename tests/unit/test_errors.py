"""hpcrl.errors: which errors are known, their one line, where the traceback goes, the Slurm entry's status."""

from __future__ import annotations

import pytest

from hpcrl import errors
from hpcrl.checkpoint import CheckpointError
from hpcrl.config import ConfigError
from hpcrl.data.datasets import DataError
from hpcrl.models.hf import ModelFolderError
from hpcrl.procs import ProcessStartError
from hpcrl.slurm import entry
from hpcrl.validate import load_and_check, save_resolved
from hpcrl.weights.common import WeightSyncError


def test_every_known_error_name_is_a_class_where_it_says():
    """The known errors are matched by qualified name; a class that moved module would silently become
    unknown (a traceback instead of one line)."""
    import importlib

    for name in sorted(errors._CONFIG_ERRORS | errors._RUN_ERRORS):
        module, _, cls = name.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), cls), type), name
        assert f"{getattr(importlib.import_module(module), cls).__module__}.{cls}" == name


def test_known_errors_and_their_line():
    assert errors.exit_code_of(DataError("d.jsonl", 2, "bad JSON", "fix it")) == errors.EXIT_CONFIG
    assert errors.exit_code_of(ConfigError("data.source", "x", "bad", "fix")) == errors.EXIT_CONFIG
    assert errors.exit_code_of(CheckpointError("iter_1: truncated")) == errors.EXIT_FAILED
    assert errors.exit_code_of(ModelFolderError("no model")) == errors.EXIT_FAILED
    assert errors.exit_code_of(WeightSyncError("http://h:1", "/update_weights_from_tensor", "timed out")) == \
        errors.EXIT_FAILED
    assert errors.exit_code_of(ZeroDivisionError()) is None
    assert errors.exit_code_of(FileNotFoundError("x")) is None  # only the model folder's is known
    assert errors.one_line(DataError("d.jsonl", 2, "bad JSON", "fix it")) == "DataError: d.jsonl:2: bad JSON; fix it"
    e = ProcessStartError("engine http://h:1 exited with code 2", "line 1\nline 2")
    assert errors.one_line(e) == "ProcessStartError: engine http://h:1 exited with code 2"


def raising(exc):
    def fn():
        raise exc
    return fn


def test_traceback_goes_to_this_start_attempt(tmp_path, capsys):
    (tmp_path / "logs" / "attempt-0").mkdir(parents=True)

    def fails():
        (tmp_path / "logs" / "attempt-1").mkdir()  # what the rollout controller makes at start
        raise DataError("d.jsonl", 3, "bad JSON", "fix it")

    assert errors.report_known("hpcrl run", tmp_path, fails) == 2
    log = tmp_path / "logs" / "attempt-1" / "trainer.log"
    assert capsys.readouterr().err == f"hpcrl run: error: DataError: d.jsonl:3: bad JSON; fix it; traceback in {log}\n"
    assert "Traceback (most recent call last)" in log.read_text() and "def fails" not in log.read_text()
    # failed before the attempt folder existed: a new one; rank 1 writes beside rank 0, making none
    assert errors.report_known("x", tmp_path, raising(CheckpointError("c"))) == 1
    assert (tmp_path / "logs" / "attempt-2" / "trainer.log").is_file()
    assert errors.report_known("x", tmp_path, raising(ModelFolderError("m")), rank=1) == 1
    assert (tmp_path / "logs" / "attempt-2" / "trainer-rank1.log").is_file()
    with pytest.raises(ZeroDivisionError):
        errors.report_known("x", tmp_path, raising(ZeroDivisionError("boom")))


def test_slurm_entry_status_for_known_and_unexpected(tmp_path, monkeypatch, capsys):
    cfg = load_and_check(None, [f"run.output_dir={tmp_path}", "run.name=r", "model.create=tiny-qwen2",
                                f"model.path={tmp_path / 'm'}"])
    path = save_resolved(cfg, tmp_path / "r")
    (tmp_path / "boots.py").write_text("from hpcrl.data.datasets import DataError\n"
                                       "def bad(cfg, run_dir):\n    raise DataError('d.jsonl', 4, 'bad', 'fix')\n"
                                       "def crash(cfg, run_dir):\n    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.setenv(entry.BOOTSTRAP_ENV, "boots.bad")
    assert entry.run_slurm(path) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcrl job: error: DataError: d.jsonl:4: bad; fix; traceback in ") and err.count("\n") == 1
    with pytest.raises(SystemExit) as ei:  # under submitit: the task ends with the status, no wrapper traceback
        entry.SlurmEntry(path)()
    assert ei.value.code == 2
    monkeypatch.setenv(entry.BOOTSTRAP_ENV, "boots.crash")
    with pytest.raises(ZeroDivisionError):
        entry.run_slurm(path)


def test_a_collective_timeout_is_known_by_gloos_and_nccls_words_and_through_its_causes():
    """gloo's and NCCL's timeout messages (NCCL cannot run here: its watchdog's words) become one known line
    (exit 1); another RuntimeError stays unexpected; a timeout that caused the error raised is found too."""
    from hpcrl.errors import EXIT_FAILED, exit_code_of, one_line
    from hpcrl.train.parallel import CollectiveTimeout, is_collective_timeout

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms "
                        "for recv operation to complete")
    nccl = RuntimeError("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                        "OpType=ALLTOALL_BASE, Timeout(ms)=600000) ran for 600041 milliseconds before timing out.")
    for exc in (gloo, nccl):
        assert is_collective_timeout(exc)
        t = CollectiveTimeout(3, 7, "training", 600.0, "iter_0000006")
        assert exit_code_of(t) == EXIT_FAILED and is_collective_timeout(t)
        assert one_line(t).startswith("CollectiveTimeout: trainer rank 3 waited more than 600 s "
                                      "(train.collective_timeout_s) for the other ranks in a collective of step 7 "
                                      "(training)") and "(iter_0000006)" in one_line(t)
    assert not is_collective_timeout(RuntimeError("CUDA out of memory"))
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("the step failed") from e
    except ValueError as outer:
        assert is_collective_timeout(outer)
    assert "no checkpoint was written yet" in str(CollectiveTimeout(1, 0, "rollout", 5.0, None))
    # the wait for the controller's hand-over (hpcrl.train.parallel.handoff_group) names its own key
    waited = CollectiveTimeout(1, 4, "the rollout's samples sent to every rank", 10800.0, None, for_controller=True)
    assert one_line(waited).startswith("CollectiveTimeout: trainer rank 1 waited more than 10800 s "
                                       "(train.rollout_wait_timeout_s) for the controller (rank 0) in a collective "
                                       "of step 4") and "raise train.rollout_wait_timeout_s if" in one_line(waited)
