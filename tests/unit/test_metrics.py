"""Metrics files: JSONL rows, TensorBoard events, truncation on resume, the curves PNG."""

import json

from hpcrl.metrics import MetricsLogger, read_metrics, timed, truncate_metrics


def test_logger_writes_jsonl_tensorboard_and_png(tmp_path):
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
