"""Weights & Biases tracking (:mod:`hpcrl.tracking`) with the real ``wandb`` package in offline mode (files in
``tmp_path``, no network): the rule "each step's last attempt wins" against ``metrics.jsonl`` across resumes,
the run id kept in ``wandb.json``, ``curves.png``, an online run that cannot start, a sweep's W&B group, and
``hpcrl logs RUN --wandb-sync``. A whole preempted and resumed ``hpcrl run`` is
``tests/integration/test_wandb_offline.py``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.cli import main
from hpcrl.run_session import RunLog
from hpcrl.metrics import MetricsPosition, read_metrics
from hpcrl.tracking import (ATTEMPT_KEY, CURVES_KEY, FIRST_STEP_KEY, STEP_KEY, WANDB_FILE, last_attempt_rows,
                            offline_runs, wandb_identity)
from hpcrl.validate import load_and_check
from tests.unit.wandb_records import history, records, wandb_files

pytest.importorskip("wandb")


def wandb_env(monkeypatch: pytest.MonkeyPatch, home: Path) -> dict[str, str]:
    """W&B's folders inside ``home``, no API key, no W&B output, and curves.png drawn (W&B is sent it; the suite's
    runs skip it otherwise); returns the environment for subprocesses."""
    monkeypatch.setenv("HPCRL_CURVES", "1")
    for k in list(os.environ):
        if k.startswith("WANDB_"):
            monkeypatch.delenv(k)
    home.mkdir(parents=True, exist_ok=True)
    for k, v in {"HOME": str(home), "WANDB_CONFIG_DIR": str(home / "config"), "WANDB_CACHE_DIR":
                 str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"), "WANDB_SILENT": "true",
                 "NETRC": str(home / "netrc")}.items():
        monkeypatch.setenv(k, v)
    return dict(os.environ)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B set up in ``tmp_path/home``; its background service is stopped after the test."""
    import wandb

    wandb_env(monkeypatch, tmp_path / "home")
    yield tmp_path
    wandb.teardown()


def write_config(tmp_path: Path, mode: str = "offline", name: str = "wb") -> Path:
    run_dir = tmp_path / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("")  # a run folder for hpcrl logs
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(f"run: {{name: {name}, output_dir: {tmp_path / 'runs'}, num_rollout: 4}}\n"
                   f"model: {{path: {tmp_path / 'tiny'}, create: tiny-qwen2}}\n"
                   f"wandb: {{mode: {mode}, tags: [unit]}}\n")
    return cfg


def row_metrics(step: int, attempt: int) -> dict:
    """What a step logs (``rollout/reward_mean`` so that curves.png has a panel); a NaN is written as null."""
    return {"rollout/reward_mean": 0.1 * step + 0.01 * attempt, "train/entropy": 1.5 / (step + 3),
            "rollout/n": step + 2, "train/grad_norm": float("nan") if step == 1 else 0.5}


def attempt(run_dir: Path, cfg, n: int, resume_step: int, steps: range, end: str) -> None:
    """One attempt of the run as the loop makes it: ``logs/attempt-n``, ``metrics.jsonl`` truncated to the
    checkpoint ``resume_step`` (-2: none), a :class:`RunLog` from ``resume_step + 1``, the eval row -1 of a
    new run, then ``steps``; ``end``: ``done`` (finish), ``preempted`` (finish with a reason) or ``error``
    (close only, as the loop's ``finally`` does after an error)."""
    (run_dir / "logs" / f"attempt-{n}").mkdir(parents=True)
    MetricsPosition(run_dir, controller=True).load_state_dict({"step": resume_step})
    start = max(resume_step + 1, 0)
    log = RunLog(run_dir, 4, start, controller=True, cfg=cfg)
    assert log.tracker is not None
    if start == 0:
        log.log(-1, {"eval/accuracy": 0.25}, advance=False)
    for step in steps:
        log.log(step, row_metrics(step, n))
    if end == "error":
        log.close()
    else:
        log.finish("preempted" if end == "preempted" else None)


def offline_rows(run_dir: Path) -> list[dict]:
    return [row for f in wandb_files(run_dir) for row in history(f)]


def test_offline_attempts_hold_metrics_jsonl_rows_by_the_last_attempt_rule(offline):
    """Attempt 0 logs -1..2 and dies (checkpoint at 0); attempt 1 redoes 1 and is preempted there (step 2 of
    attempt 0 is no longer in metrics.jsonl, and must not come back from W&B); attempt 2 finishes. After each
    attempt, the offline files read by the rule are metrics.jsonl, value for value (null for NaN)."""
    cfg = load_and_check(write_config(offline))
    run_dir = offline / "runs" / "wb"
    attempt(run_dir, cfg, 0, -2, range(0, 3), "error")
    assert [r["step"] for r in read_metrics(run_dir)] == [-1, 0, 1, 2]
    assert last_attempt_rows(offline_rows(run_dir)) == read_metrics(run_dir)
    attempt(run_dir, cfg, 1, 0, range(1, 2), "preempted")
    assert [r["step"] for r in read_metrics(run_dir)] == [-1, 0, 1]
    assert last_attempt_rows(offline_rows(run_dir)) == read_metrics(run_dir)
    attempt(run_dir, cfg, 2, 1, range(2, 4), "done")
    rows = read_metrics(run_dir)
    assert [(r["step"], r.get("rollout/reward_mean")) for r in rows] == [
        (-1, None), (0, 0.0), (1, pytest.approx(0.11)), (2, pytest.approx(0.22)), (3, pytest.approx(0.32))]
    assert rows[2]["train/grad_norm"] is None
    assert last_attempt_rows(offline_rows(run_dir)) == rows

    # every attempt continued the W&B run of wandb.json, with the resolved config; W&B's _step restarts
    files = wandb_files(run_dir)
    ident = json.loads((run_dir / WANDB_FILE).read_text())
    assert ident["project"] == "wb" and len(files) == 3 and offline_runs(run_dir) == [f.parent for f in files]
    assert {f.name for f in files} == {f"run-{ident['id']}.wandb"}
    for f in files:
        (run,) = [r.run for r in records(f) if r.WhichOneof("record_type") == "run"]
        assert run.run_id == ident["id"] and run.display_name == "wb" and list(run.tags) == ["unit"]
        config = {u.key: json.loads(u.value_json) for u in run.config.update}
        assert config["run"]["num_rollout"] == 4 and config["wandb"]["mode"] == "offline"
    sent = [history(f) for f in files]
    assert [[(r[STEP_KEY], r[ATTEMPT_KEY], r[FIRST_STEP_KEY], r["_step"]) for r in h] for h in sent] == [
        [(-1, 0, -1, 0), (0, 0, -1, 1), (1, 0, -1, 2), (2, 0, -1, 3)], [(1, 1, 1, 0)],
        [(2, 2, 2, 0), (3, 2, 2, 1)]]

    # curves.png is the summary image of the attempts that drew it; the x-axis is the rollout id
    last = list(records(files[-1]))
    kinds = [r.WhichOneof("record_type") for r in last]
    summaries = [{i.key: json.loads(i.value_json) for i in r.summary.update} for r in last
                 if r.WhichOneof("record_type") == "summary"]
    curves = [s[CURVES_KEY] for s in summaries if CURVES_KEY in s]
    assert curves and curves[-1]["_type"] == "image-file" and curves[-1]["path"].endswith(".png")
    assert (files[-1].parent / "files" / curves[-1]["path"]).is_file()
    metrics = [r.metric for r in last if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == STEP_KEY for m in metrics)
    exits = [r.exit.exit_code for r in last if r.WhichOneof("record_type") == "exit"]
    assert kinds[-1] == "exit" and exits == [0]
    first = list(records(files[0]))
    assert [r.exit.exit_code for r in first if r.WhichOneof("record_type") == "exit"] == [1]
    assert "preempting" in [r.WhichOneof("record_type") for r in records(files[1])]


def test_rule_drops_what_a_resume_truncated_and_keeps_the_last_row_of_a_step():
    """Attempts in any order; each attempt's first step hides what earlier attempts logged from there on; two
    rows of one step in one attempt: the later wins; rows W&B logged itself, or without an attempt, are not
    metrics rows."""
    def sent(step, att, first, **m):
        return {STEP_KEY: step, ATTEMPT_KEY: att, FIRST_STEP_KEY: first, "_step": 9, "_runtime": 1.0, **m}

    history = [sent(2, 3, 2, x=32), sent(-1, 0, -1, x=0), sent(0, 0, -1, x=1), sent(1, 0, -1, x=2),
               sent(2, 0, -1, x=3), sent(3, 0, -1, x=4), sent(1, 1, 1, x=11), sent(1, 1, 1, x=12),
               {"_step": 5, "curves": 1}, {STEP_KEY: 7, "x": 99}]
    assert last_attempt_rows(history) == [{"step": -1, "x": 0}, {"step": 0, "x": 1}, {"step": 1, "x": 12},
                                          {"step": 2, "x": 32}]
    # a run started over (no checkpoint: first step -1) hides everything before it
    assert last_attempt_rows(history + [sent(-1, 4, -1, x=40)]) == [{"step": -1, "x": 40}]
    assert last_attempt_rows([]) == []


def test_identity_is_kept_across_attempts_and_defaults(offline):
    cfg = load_and_check(write_config(offline))
    run_dir = offline / "runs" / "wb"
    first = wandb_identity(cfg, run_dir)
    assert first["project"] == "wb" and first["entity"] is None and first["group"] is None and first["id"]
    cfg.wandb.project, cfg.wandb.group = "other", "g"
    assert wandb_identity(cfg, run_dir) == first == json.loads((run_dir / WANDB_FILE).read_text())


def test_online_run_that_cannot_start_warns_once_and_the_run_goes_on(offline, monkeypatch, caplog):
    """No API key (and no server): the metrics are written, W&B is left out with one warning."""
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    cfg = load_and_check(write_config(offline, mode="online"))
    run_dir = offline / "runs" / "wb"
    (run_dir / "logs" / "attempt-0").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="hpcrl.tracking"):
        log = RunLog(run_dir, 4, 0, controller=True, cfg=cfg)
        log.log(0, row_metrics(0, 0))
        log.finish(None)
    assert log.tracker is None and [r["step"] for r in read_metrics(run_dir)] == [0]
    warned = [r.getMessage() for r in caplog.records if r.name == "hpcrl.tracking"]
    assert len(warned) == 1 and "W&B start failed, the run goes on without W&B" in warned[0], warned
    assert "API key" in warned[0]


def test_disabled_imports_nothing_and_other_ranks_send_nothing(offline):
    cfg = load_and_check(write_config(offline, mode="disabled"))
    run_dir = offline / "runs" / "wb"
    assert RunLog(run_dir, 4, 0, controller=True, cfg=cfg).tracker is None
    cfg.wandb.mode = "offline"
    assert RunLog(run_dir, 4, 0, controller=False, cfg=cfg).tracker is None
    assert not (run_dir / WANDB_FILE).exists() and not (run_dir / "wandb").exists()
    code = "import hpcrl.loop, hpcrl.tracking, hpcrl.cli, sys; print('wandb' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


SWEEP = """\
run: {{name: wbsweep, num_rollout: 4}}
model: {{create: tiny-qwen2}}
slurm: {{time: "01:00:00"}}
wandb: {wandb}
sweep: {{grid: {{train.lr: [1.0e-4, 3.0e-4]}}}}
"""


@pytest.mark.parametrize("wandb,groups", [("{mode: offline}", ["wbsweep", "wbsweep"]),
                                          ("{mode: offline, group: mine}", ["mine", "mine"]),
                                          ("{mode: disabled}", [None, None])])
def test_sweep_points_share_a_wandb_group(tmp_path, monkeypatch, wandb, groups):
    from hpcrl.slurm.sweep import plan_sweep

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweep.yaml").write_text(SWEEP.format(wandb=wandb))
    plan = plan_sweep(tmp_path / "sweep.yaml", cwd=tmp_path)
    assert [p.config.wandb.group for p in plan.points] == groups


def test_wandb_sync_with_no_offline_run_is_one_line(offline, capsys):
    write_config(offline)
    run_dir = offline / "runs" / "wb"
    assert main(["logs", str(run_dir), "--wandb-sync"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds no offline W&B run" in err and "wandb.mode=offline" in err, err
    assert main(["logs", str(run_dir), "--wandb-sync", "--follow"]) == 2
    assert "drop --follow" in capsys.readouterr().err


def test_wandb_sync_runs_wandb_sync_on_every_attempt(offline, monkeypatch):
    """The real wandb CLI sees both attempts and stops at the missing API key (exit 1, one line from hpcrl
    after wandb's own); with a stand-in ``wandb`` on PATH for the upload itself, the command line is ``wandb
    sync`` of the two offline runs, oldest first, and hpcrl exits 0."""
    cfg = load_and_check(write_config(offline))
    run_dir = offline / "runs" / "wb"
    attempt(run_dir, cfg, 0, -2, range(0, 2), "preempted")
    attempt(run_dir, cfg, 1, 1, range(2, 4), "done")
    runs = offline_runs(run_dir)
    assert len(runs) == 2
    env = dict(os.environ, PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                                if not (Path(p) / "wandb").exists()))
    cmd = [sys.executable, "-m", "hpcrl", "logs", str(run_dir), "--wandb-sync"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "No API key configured" in out.stderr and all(f"{r.name}/" in out.stderr for r in runs), out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("hpcrl logs --wandb-sync: wandb sync exited with 1")

    fake = offline / "bin"
    fake.mkdir()
    (fake / "wandb").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {offline / 'argv'}\n")
    (fake / "wandb").chmod(0o755)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (offline / "argv").read_text().splitlines() == ["sync", *map(str, runs)]
