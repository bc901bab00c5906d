"""Metrics files: JSONL rows, TensorBoard events, truncation on resume, the curves PNG."""

import json

import matplotlib.pyplot as plt
import pytest

from hpcrl.metrics import (CURVE_SERIES, CURVES_ENV, MetricsLogger, draw_curves, plot_curves, read_metrics,
                           smoothed, timed, truncate_metrics)


def drawn(fig) -> dict[str, list[str]]:
    """Panel title -> labels of the lines drawn in it."""
    return {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in fig.axes}


def test_logger_writes_jsonl_tensorboard_and_png(tmp_path, monkeypatch):
    monkeypatch.setenv(CURVES_ENV, "1")  # the suite's default is 0 (tests/conftest.py)
    log = MetricsLogger(tmp_path, total_steps=5, progress=False)
    for step in range(5):
        log.log(step, {"rollout/reward_mean": step / 10, "eval/accuracy": 0.3 + step / 100,
                       "train/grad_norm": float("nan")})
    png = log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[3]["rollout/reward_mean"] == 0.3
    assert rows[0]["train/grad_norm"] is None  # non-finite -> null, still valid JSON
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


@pytest.mark.parametrize("value, drawn", [("0", False), ("1", True), ("", True), (None, True)])
def test_hpcrl_curves_0_skips_the_png_and_nothing_else(tmp_path, monkeypatch, value, drawn):
    if value is None:
        monkeypatch.delenv(CURVES_ENV, raising=False)
    else:
        monkeypatch.setenv(CURVES_ENV, value)
    log = MetricsLogger(tmp_path, total_steps=2, progress=False)
    for step in range(2):
        log.log(step, {"rollout/reward_mean": step / 10})
    png = log.close()
    assert (png is not None) is drawn and (tmp_path / "curves.png").exists() is drawn
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_curves_plot_reward_eval_length_entropy_kl_and_step_phases(tmp_path):
    """Issue #9 point 11: curves.png draws what the loop logs; a key the run never logged is left out."""
    keys = {"rollout/reward_mean", "eval/accuracy", "rollout/response_length", "train/entropy", "train/ppo_kl",
            "train/kl_loss", "train/opd_reverse_kl", "train/train_rollout_logprob_abs_diff", "rollout/seconds",
            "train/seconds", "sync/seconds", "timing/step_seconds", "critic/value_loss",
            "critic/explained_variance", "critic/seconds"}
    assert {s.key for s in CURVE_SERIES} == keys
    critic = {"critic/value_loss", "critic/explained_variance", "critic/seconds"}
    rows = [{"step": -1, "eval/accuracy": 0.2}] + [
        {"step": i, **{k: 0.1 * i for k in keys - {"train/opd_reverse_kl"} - critic}, "eval/accuracy": None}
        for i in range(20)]
    fig = draw_curves(rows)
    got = drawn(fig)
    plt.close(fig)
    assert sorted(l for labels in got.values() for l in labels) == sorted(
        s.label for s in CURVE_SERIES if s.key != "train/opd_reverse_kl" and s.key not in critic)
    assert got["step time (s)"] == ["rollout", "train", "weight sync", "whole step"]
    assert "critic (PPO)" not in got  # no critic logged (not PPO): no critic panel
    fig = draw_curves([{**r, **{k: 0.5 for k in critic}} for r in rows if r["step"] >= 0])
    got = drawn(fig)
    plt.close(fig)
    assert got["critic (PPO)"] == ["value loss", "explained variance"]
    assert got["step time (s)"] == ["rollout", "train", "critic (in train)", "weight sync", "whole step"]
    assert got["reward (mean over the step's samples)"] == ["reward", "reward (smoothed)"]
    assert draw_curves([{"step": 0, "other": 1.0}]) is None
    assert smoothed([1.0, 1.0, 1.0]) == [1.0, 1.0, 1.0]  # bias-corrected: no ramp from 0
    assert smoothed([0.0, 1.0], weight=0.0) == [0.0, 1.0]


def test_kl_panel_only_with_a_kl_term_and_logprob_gap_panel_always(tmp_path):
    """Issue #34 point 5: the quickstart (no KL term, one on-policy step) logs ``train/ppo_kl`` exactly 0: no
    KL panel for it. With ``algorithm.use_kl_loss`` (``train/kl_loss`` logged) or on-policy distillation
    (``train/opd_reverse_kl``) the KL panel is back with ppo_kl in it. The trainer vs engine log-prob gap,
    non-zero on-policy, has its own panel either way; the PNG is written from ``metrics.jsonl``."""
    base = [{"step": i, "rollout/reward_mean": 0.1 * i, "train/entropy": 1.0, "train/ppo_kl": 0.0,
             "train/train_rollout_logprob_abs_diff": 2e-3 + 1e-4 * i, "train/seconds": 1.0} for i in range(4)]
    gap = {"log-prob gap, trainer vs rollout engine (nats/token)": ["mean |trainer - engine|"]}
    fig = draw_curves(base)
    got = drawn(fig)
    plt.close(fig)
    assert "KL (nats/token)" not in got and "ppo_kl (policy vs rollout policy)" not in str(got)
    assert gap.items() <= got.items()
    with_kl = [dict(r, **{"train/kl_loss": 1e-3 * r["step"]}) for r in base]
    fig = draw_curves(with_kl)
    got = drawn(fig)
    plt.close(fig)
    assert got["KL (nats/token)"] == ["ppo_kl (policy vs rollout policy)", "kl_loss (policy vs reference)"]
    assert gap.items() <= got.items()
    with_opd = [dict(r, **{"train/opd_reverse_kl": 0.5}) for r in base]
    fig = draw_curves(with_opd)
    got = drawn(fig)
    plt.close(fig)
    assert got["KL (nats/token)"] == ["ppo_kl (policy vs rollout policy)",
                                      "opd_reverse_kl (rollout policy vs teacher)"]
    # the file path (MetricsLogger.close / hpcrl plot) reads the same rows back
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in base))
    png = plot_curves(tmp_path)
    assert png == tmp_path / "curves.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_truncate_drops_steps_after_checkpoint_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "x"')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4, 5]
    truncate_metrics(tmp_path, last_step=3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]


def test_timed_accumulates_seconds():
    m = {}
    with timed(m, "t"):
        sum(range(10000))
    with timed(m, "t"):
        pass
    assert m["t"] > 0


def test_progress_bar_is_labelled_by_the_run_mode(tmp_path, capsys):
    from hpcrl.config import Config
    from hpcrl.run_session import RunLog

    cfg = Config()
    for mode, label in (("sync", "rollout"), ("sft", "sft")):
        cfg.run.mode = mode
        log = RunLog(tmp_path / mode, total_steps=2, start_step=0, controller=True, cfg=cfg)
        log.log(0, {"rollout/reward_mean": 0.5})
        log.close()
        assert capsys.readouterr().err.lstrip("\r").startswith(f"{label}:"), mode
