"""The GLM-4.5 quickstart end to end (issue #35 point 5): ``configs/glm4-moe-quickstart.yaml`` as a
user runs it, in a folder holding the config's shipped warm start (``tests/warm_starts/glm4-moe``: the tiny
GLM-4.5-style MoE - first layer dense, shared expert, sigmoid router with expert bias and 2 groups, partial
RoPE, q/k/v bias - and its SFT until :data:`SFT_TARGET` greedy accuracy, made by ``hpcrl sft`` of this config;
the run finds it in its cache), then GSPO for the config's 200 steps on 2 trainer processes at slime's MoE layout
in small (issue #54 point 5): TP=2 with sequence parallelism x EP=2, ETP 1 (attention split over the two ranks,
four whole experts on each). Measured 2026-12-07 on the dev machine (AMD EPYC AVX2, 2 cores shared with a CI
run), the config by hand: SFT 220 steps to 0.334, then 0.334 -> 0.415, 0.521 (+18.7) at steps 99, 199, GSPO
209 s, train/rollout |logprob diff| <= 7.1e-7. Until 2026-12-07 the config was EP=2 alone (below). The SFT at
EP=2 itself is tests/integration/test_sft_run.py's. Measured 2026-11-27 on the dev machine (2 shared cores): this test 428 s (SFT
320 steps to 0.305), greedy 0.305 -> 0.341, 0.388, 0.392, 0.398, 0.418 at steps 99..499 (+11.3), train/rollout
|logprob diff| <= 6.2e-7; the same curve as a run of the config by hand (847 s on busier cores). Shorter runs
were tried and are less sure of the +10: lr 3e-4 for 300 steps +10.5 (a dip to 0.289 at step 99), lr 3e-4 for
200 steps +10.1, lr 5e-4 for 200 steps +6.1. On main after the merges the config sets ``run.seed: 1``:
0.312 -> 0.497 (+18.5) in 500 steps, 420 s on shared cores; 300 steps: 0.312 -> 0.399, 0.424, 0.458 (+14.6),
228 s on quiet cores; the config now runs 200 steps (CI time): 0.312 -> 0.407, 0.464 (+15.2), measured
2026-11-27 from the same SFT model (docs/performance.md).

Asserted: the run trained no SFT of its own, the warm start stopped on its target, the engine measures the model SFT left, the trainer's log-probs equal the
engine's at every step (fp32: every tensor, the expert bias included, synced across the EP ranks), and the
greedy accuracy on 500 held-out additions rises by at least :data:`MIN_GAIN`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.warm_starts import install, used_as_shipped

ROOT = Path(__file__).resolve().parents[2]
HPCRL = Path(sys.executable).with_name("hpcrl")
STEPS = 200
SFT_TARGET = 0.30
MIN_GAIN = 0.10
"""Greedy accuracy points GSPO must add in :data:`STEPS` steps (issue #35 point 5: >= +10)."""


@pytest.mark.slow
def test_glm4_moe_quickstart_learns_addition_at_tp2_ep2(tmp_path):
    shutil.copy(ROOT / "configs" / "glm4-moe-quickstart.yaml", tmp_path / "glm.yaml")
    cfg = yaml.safe_load((tmp_path / "glm.yaml").read_text())
    assert (cfg["model"]["create"], cfg["train"]["tensor_parallel_size"], cfg["train"]["expert_parallel_size"],
            cfg["train"]["nprocs"], cfg["sft"]["target_accuracy"], cfg["run"]["num_rollout"]) == \
        ("tiny-glm4-moe", 2, 2, 2, SFT_TARGET, STEPS)
    assert "sequence_parallel" not in cfg["train"]  # on by default at TP > 1 (slime's --sequence-parallel)
    shipped = install("glm4-moe", tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    with open(tmp_path / "out.log", "wb") as log:  # a file, not a pipe: torch's shm manager keeps pipes open
        rc = subprocess.run([str(HPCRL), "run", "glm.yaml"], cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=2400).returncode
    seconds = time.perf_counter() - t0
    assert rc == 0, (tmp_path / "out.log").read_text(errors="replace")[-3000:]

    sft_evals = used_as_shipped(tmp_path, cfg["sft"]["output"], shipped)
    rows = [json.loads(x) for x in (tmp_path / "runs" / cfg["run"]["name"] / "metrics.jsonl").read_text()
            .splitlines()]
    curve = [(r["step"], round(r["eval/accuracy"], 3)) for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if r["step"] >= 0]
    diff = max(r["train/train_rollout_logprob_abs_diff"] for r in steps)
    print(f"glm4-moe quickstart: {seconds:.0f} s from the shipped warm start; SFT {len(sft_evals)} evals, last "
          f"{sft_evals[-1]}; GSPO eval curve {curve}; max train/rollout |logprob diff| {diff:.2e}")

    assert all(a < SFT_TARGET for _, a in sft_evals[:-1]) and sft_evals[-1][1] >= SFT_TARGET, sft_evals
    start, final = curve[0][1], curve[-1][1]
    # the engine's eval measures the model SFT left
    assert curve[0][0] == -1 and start == pytest.approx(sft_evals[-1][1], abs=0.02)
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert diff < 1e-5
    assert final >= start + MIN_GAIN, f"greedy accuracy went {start} -> {final}: {curve}"


PP_STEPS = 100
PP_LAYOUT = ("train.nprocs=4", "train.tensor_parallel_size=1", "train.pipeline_parallel_size=2",
             "train.expert_parallel_size=2")
"""Issue #55 point 3: the same config at PP=2 x EP=2 on 4 trainer processes (DP=2: the embedding, the dense
first layer and layer 1 on stage 0, layers 2-3, the final norm and the head on stage 1; four whole experts per EP
rank), for :data:`PP_STEPS` GSPO steps (the cosine schedule over them)."""


@pytest.mark.slow
def test_glm4_moe_quickstart_learns_addition_at_pp2_ep2_on_4_ranks(tmp_path):
    """The GLM-4.5 quickstart's GSPO at pipeline x expert parallelism, from the shipped SFT model as a user
    starts from an SFT'd folder of their own (``sft.enabled=false``, ``model.path`` the folder: the warm start
    cache is per layout, and SFT at this layout would be 220 more steps on 4 ranks). Measured 2026-12-07 on the
    dev machine (AMD EPYC AVX-512, 2 cores, quiet): 0.334 -> 0.395, 0.485 (+15.1) at steps 49, 99, 151 s,
    train/rollout |logprob diff| <= 6.7e-7 (200 steps from an SFT of its own at this layout: 0.318 -> 0.464,
    0.580). Asserted: every step trained at this layout, the trainer's log-probs equal the engine's, and the
    greedy accuracy rises by at least :data:`MIN_GAIN`."""
    shutil.copy(ROOT / "configs" / "glm4-moe-quickstart.yaml", tmp_path / "glm.yaml")
    cfg = yaml.safe_load((tmp_path / "glm.yaml").read_text())
    shipped = install("glm4-moe", tmp_path)
    sft_model = shipped[Path(cfg["sft"]["output"]).name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    with open(tmp_path / "out.log", "wb") as log:  # a file, not a pipe: torch's shm manager keeps pipes open
        rc = subprocess.run([str(HPCRL), "run", "glm.yaml", *PP_LAYOUT, "sft.enabled=false",
                             f"model.path={sft_model}", f"run.num_rollout={PP_STEPS}",
                             f"rollout.eval_interval={PP_STEPS // 2}"],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    seconds = time.perf_counter() - t0
    assert rc == 0, (tmp_path / "out.log").read_text(errors="replace")[-3000:]
    run_dir = tmp_path / "runs" / cfg["run"]["name"]
    used = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    assert (used["nprocs"], used["tensor_parallel_size"], used["pipeline_parallel_size"],
            used["expert_parallel_size"]) == (4, 1, 2, 2)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], round(r["eval/accuracy"], 3)) for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if r["step"] >= 0]
    diff = max(r["train/train_rollout_logprob_abs_diff"] for r in steps)
    print(f"glm4-moe at PP2 x EP2: {seconds:.0f} s; eval curve {curve}; max train/rollout |logprob diff| "
          f"{diff:.2e}")
    assert [r["step"] for r in steps] == list(range(PP_STEPS))
    assert diff < 1e-5
    start, final = curve[0][1], curve[-1][1]
    assert curve[0][0] == -1 and final >= start + MIN_GAIN, f"greedy accuracy went {start} -> {final}: {curve}"
