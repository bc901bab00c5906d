"""The main job on real input: the README's quickstart command from a fresh folder (no cached models) on the
CPU. The tiny Qwen2 is created, warm-started by SFT until its greedy accuracy on 500 held-out 3-digit additions
reaches ``sft.target_accuracy`` (checked every ``sft.eval_interval`` steps, every
``sft.eval_interval_near_target`` near the target), then trained by GRPO through the
real loop (CPU engine, Megatron trainer, weight sync) (issue #9 points 1 and 2).

Nothing here is a CPU-specific constant: the SFT's stopping step and the exact accuracies move with the CPU's
rounding; what is asserted is that SFT stopped at the first eval that met the target, that the engine measures
the model SFT left, and issue #9's target for the rise: >= 60% greedy and >= +15 points over the start. The
five-seed table is a benchmark (``benchmarks/quickstart_seeds.py``, docs/performance.md), not a test.
"""

from __future__ import annotations

import json

import pytest
import yaml


@pytest.mark.slow
def test_quickstart_learns_from_a_fresh_folder(quickstart_run):
    tmp_path, seconds, out = quickstart_run.folder, quickstart_run.seconds, quickstart_run.output
    assert quickstart_run.returncode == 0, out[-3000:]
    cfg = yaml.safe_load((tmp_path / "quickstart.yaml").read_text())

    sft = [json.loads(line) for line in (quickstart_run.sft_model / "sft_metrics.jsonl").read_text().splitlines()]
    sft_evals = [(r["step"], r["eval_accuracy"]) for r in sft if "eval_accuracy" in r]
    target, interval = cfg["sft"]["target_accuracy"], cfg["sft"]["eval_interval"]
    near = cfg["sft"].get("eval_interval_near_target") or interval
    run = tmp_path / "runs" / "quickstart"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], round(r["eval/accuracy"], 3)) for r in rows if "eval/accuracy" in r]
    print(f"quickstart: {seconds:.0f} s from a fresh folder; SFT evals {sft_evals}; GRPO eval curve {curve}")

    # SFT ends on accuracy: the mean of the last `window` evals (`sft.target_window`) is below the target until
    # the last eval, where it meets it; evals come every `interval` steps, then every `near` steps from the first
    # eval at a quarter of the target on.
    from hpcrl.sft_recipe import NEAR_TARGET_FRACTION

    # With `sft.anneal_steps: K` the eval that met the target is followed by K steps of lr decay and one more
    # eval, which ends SFT.
    anneal = cfg["sft"].get("anneal_steps", 0)
    met = sft_evals[:-1] if anneal else sft_evals
    if anneal:
        assert sft_evals[-1][0] - sft_evals[-2][0] == anneal, sft_evals
    gaps = [b - a for (a, _), (b, _) in zip(met, met[1:])]
    assert sft_evals[0][0] == 0
    near_from = next(i for i, (_, acc) in enumerate(met) if acc >= NEAR_TARGET_FRACTION * target)
    assert gaps == [interval if i < near_from else near for i in range(len(gaps))], sft_evals
    window = cfg["sft"].get("target_window", 1)
    means = [sum(a for _, a in met[i + 1 - window:i + 1]) / window for i in range(window - 1, len(met))]
    assert all(m < target for m in means[:-1]) and means[-1] >= target, (means, sft_evals)
    assert sft_evals[-1][0] < cfg["sft"]["steps"], "SFT hit its step cap instead of the target"

    start, final = curve[0][1], curve[-1][1]
    assert curve[0][0] == -1 and start == pytest.approx(sft_evals[-1][1], abs=0.02)  # engine eval == SFT's own
    # RL learns from wherever SFT left it (issue #9 point 2, issue #40 point 3; seeds 1-5 in docs/performance.md
    # end 0.65-0.93 from 0.41-0.48 at 16 prompts x 600 steps, seed 5 with a 9-point dip in its first 100).
    assert final >= 0.60 and final >= start + 0.15, f"greedy accuracy went {start} -> {final}: {curve}"
    steps = [r for r in rows if r["step"] >= 0]
    assert [r["step"] for r in steps] == list(range(cfg["run"]["num_rollout"]))
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-3 for r in steps)
    assert (run / "curves.png").stat().st_size > 0 and (run / "config.yaml").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("iter_")) == \
        [f"iter_{cfg['run']['num_rollout'] - 1:07d}"]
