"""W&B offline across a preemption and a resume (issue #34 point 4): a real tiny ``hpcrl run`` with
``wandb.mode=offline`` gets USR2 after a step, stops with a checkpoint (exit 75) and is run again. W&B's own
offline files under the run folder, read by the rule of :mod:`hpcrl.tracking` (each step's last attempt
wins), hold the same rows as ``metrics.jsonl``; both attempts continued one W&B run (``wandb.json``), with
the resolved config; ``curves.png`` was sent at the end. No network: W&B writes only files, in ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from hpcrl.tracking import ATTEMPT_KEY, CURVES_KEY, STEP_KEY, WANDB_FILE, last_attempt_rows, offline_runs
from tests.integration.test_preemption_local import finish, start, steps_done, wait_steps
from tests.unit.test_tracking import wandb_env
from tests.unit.wandb_records import history, records, wandb_files

pytestmark = pytest.mark.integration
pytest.importorskip("wandb")

STEPS = 4


def test_offline_wandb_across_preemption_and_resume_holds_metrics_jsonl(tmp_path, monkeypatch):
    wandb_env(monkeypatch, tmp_path / "home")
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: nothing may go to a server
    args = (f"run.num_rollout={STEPS}", "wandb.mode=offline", "wandb.tags=[ci]")
    run_dir = tmp_path / "runs" / "wb"
    proc = start(tmp_path, "wb", *args, curves=True)
    wait_steps(proc, run_dir, 1)
    os.kill(proc.pid, signal.SIGUSR2)
    assert finish(proc) == 75, (tmp_path / "wb.log").read_text()[-3000:]  # stopped with a checkpoint
    stopped_at = steps_done(run_dir)
    assert 1 <= stopped_at < STEPS
    proc = start(tmp_path, "wb", *args, curves=True)
    assert finish(proc) == 0, (tmp_path / "wb.log").read_text()[-3000:]
    log = (tmp_path / "wb.log").read_text()
    assert "resumed from" in log and "wandb:" not in log  # W&B says nothing on the terminal

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(-1, STEPS))
    files = wandb_files(run_dir)
    assert len(files) == 2 and offline_runs(run_dir) == [f.parent for f in files]
    sent = [history(f) for f in files]
    assert last_attempt_rows(row for h in sent for row in h) == rows  # same steps, same values
    assert [[(r[STEP_KEY], r[ATTEMPT_KEY]) for r in h] for h in sent] == [
        [(s, 0) for s in range(-1, stopped_at)], [(s, 1) for s in range(stopped_at, STEPS)]]

    ident = json.loads((run_dir / WANDB_FILE).read_text())
    for f in files:
        assert f.name == f"run-{ident['id']}.wandb"
        (run,) = [r.run for r in records(f) if r.WhichOneof("record_type") == "run"]
        assert run.run_id == ident["id"] and run.project == "wb" and list(run.tags) == ["ci"]
        config = {u.key: json.loads(u.value_json) for u in run.config.update}
        assert config["run"]["num_rollout"] == STEPS and config["rollout"]["batch_size"] == 4
    for f in files:  # each attempt sent the curves.png it drew at its end
        summary = [json.loads(i.value_json) for r in records(f) if r.WhichOneof("record_type") == "summary"
                   for i in r.summary.update if i.key == CURVES_KEY]
        assert summary and (f.parent / "files" / summary[-1]["path"]).is_file()
