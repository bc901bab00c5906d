"""The LoRA quickstart (issue #56 point 7): ``hpcrl run configs/lora-quickstart.yaml`` in a folder holding the
quickstart's shipped warm start (``tests/warm_starts/quickstart``: the LoRA run's warm start is full fine-tuning,
the same cached model), then GRPO on rank-8 adapters alone, the base frozen, the engine serving the adapters
(each sync sends them alone, ``model.lora.sync: adapter``; until 2026-12-07's seventh session they were merged
into a full sync: the gate passed with both, the adapter sync's in the AVX2 CI run of 6efb03a). CI runs 200 of
the config's 300 steps (its cosine over 200).

Asserted: the run trained no SFT of its own; the first eval measures the warm start; the greedy accuracy rises
by at least 10 points (measured 2026-12-07 on an AMD EPYC with AVX-512: 200 steps 0.414 -> 0.425, 0.479, 0.543,
0.581 at steps 49..199, +16.7, 155 s; 150 steps ended +12.5, too close to the line; the config's 300 steps
0.414 -> 0.445, 0.465, 0.563, 0.608, 0.646, 0.670, +25.6, with no dip: full fine-tuning's GRPO dips first); the trainer's
log-probs of the engine's tokens equal the engine's (the engine serves the trained adapters; measured at most
9.5e-7 with the merged sync); the checkpoint holds adapters only (a fraction of the model's bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.warm_starts import run_from_shipped, used_as_shipped

STEPS = 200


@pytest.mark.slow
def test_lora_quickstart_learns_on_adapters_alone(tmp_path: Path):
    rc, shipped = run_from_shipped("lora-quickstart.yaml", "quickstart", tmp_path, f"run.num_rollout={STEPS}")
    assert rc == 0, (tmp_path / "out.log").read_text(errors="replace")[-3000:]
    sft_evals = used_as_shipped(tmp_path, ".cache/models/tiny-qwen2-addition-sft", shipped)
    rows = [json.loads(x) for x in (tmp_path / "runs/lora-quickstart/metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], round(r["eval/accuracy"], 3)) for r in rows if "eval/accuracy" in r]
    print(f"lora quickstart: GRPO eval curve {curve}")
    start, final = curve[0][1], curve[-1][1]
    assert curve[0][0] == -1 and start == pytest.approx(sft_evals[-1][1], abs=0.02)
    assert curve[-1][0] == STEPS - 1 and final >= start + 0.10, curve
    steps = [r for r in rows if r["step"] >= 0]
    assert len(steps) == STEPS and all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in steps)
    from hpcrl.checkpoint import find_latest_checkpoint

    ckpt = find_latest_checkpoint(tmp_path / "runs/lora-quickstart")
    ckpt_bytes = sum(f.stat().st_size for f in (ckpt / "dist").rglob("*") if f.is_file())
    base_bytes = sum(f.stat().st_size for f in shipped["tiny-qwen2-addition-sft"].glob("*.safetensors"))
    assert ckpt_bytes < base_bytes, (ckpt_bytes, base_bytes)  # adapters and their Adam state only
