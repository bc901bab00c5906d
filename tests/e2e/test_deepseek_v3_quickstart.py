"""The DeepSeek-V3 quickstart (issue #35 point 5): ``hpcrl run configs/deepseek-v3-quickstart.yaml`` in a
folder holding the config's shipped warm start (``tests/warm_starts/deepseek-v3``: the tiny DeepSeek-V3-style
model - multi-latent attention with YaRN, grouped sigmoid router with expert bias, shared expert, dense first
layer - and its SFT to 30% greedy, made by ``hpcrl sft`` of this config; the run finds it in its cache as it
finds its own), then GSPO with its experts over 2 trainer processes (EP=2) beside the CPU engine. The SFT at
EP=2 itself is tests/integration/test_sft_run.py's.

Asserted: the run trained no SFT of its own, the warm start had met its target, the engine's first eval measures the SFT model, the greedy accuracy rises by
at least 10 points (measured 2026-11-28 with the config's seed 3 and the SFT on the Megatron trainer:
0.382 -> 0.547, +16.5), and the trainer's log-probs match the engine's at every step (fp32; measured at most
5.9e-7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.warm_starts import run_from_shipped


@pytest.mark.slow
def test_deepseek_v3_quickstart_learns_at_ep2(tmp_path: Path):
    rc, shipped = run_from_shipped("deepseek-v3-quickstart.yaml", "deepseek-v3", tmp_path)
    assert rc == 0, (tmp_path / "out.log").read_text(errors="replace")[-3000:]
    assert not list(shipped["tiny-deepseek-v3-addition-sft"].parent.glob("*.run")), "the run trained its own SFT"
    sft = tmp_path / ".cache/models/tiny-deepseek-v3-addition-sft" / "sft_metrics.jsonl"
    sft_evals = [r["eval_accuracy"] for r in map(json.loads, sft.read_text().splitlines())
                 if "eval_accuracy" in r]
    assert sft_evals[-1] >= 0.30 and all(a < 0.30 for a in sft_evals[:-1]), sft_evals
    metrics = tmp_path / "runs/deepseek-v3-quickstart/metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    curve = [(r["step"], round(r["eval/accuracy"], 3)) for r in rows if "eval/accuracy" in r]
    print(f"deepseek-v3 quickstart: SFT evals {sft_evals}; GSPO eval curve {curve}")
    start, final = curve[0][1], curve[-1][1]
    assert curve[0][0] == -1 and start == pytest.approx(sft_evals[-1], abs=0.02)
    assert final >= start + 0.10, curve
    steps = [r for r in rows if r["step"] >= 0]
    assert len(steps) == 150 and all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in steps)
