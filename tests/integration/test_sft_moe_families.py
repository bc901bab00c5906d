"""SFT of every MoE family at expert parallelism 2 (issue #52 point 2): the e2e tests of the MoE families start
from shipped warm starts (tests/warm_starts), so the SFT run that makes them is covered here, short, per family.

For the tiny Qwen3-MoE, GLM-4.5 and DeepSeek-V3 (hidden 64, 2 layers, 4 experts: the first GLM and DeepSeek
layer dense), ``hpcrl run`` of ``run.mode: sft`` on 2 trainer processes with ``train.expert_parallel_size: 2``
(GLM-4.5 also at ``tensor_parallel_size: 2`` with sequence parallelism and at ``pipeline_parallel_size: 2``) and the CPU engine for its evals: the loss falls over :data:`STEPS` steps, and a run stopped by USR2 after its
second step (exit 75, checkpoints every step) and run again ends with every step's loss and the weights
bitwise equal to the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.hpcrl_process import popen_hpcrl

from tests.integration.test_preemption_local import finish, steps_done, wait_steps, weights

pytestmark = pytest.mark.integration

STEPS = 6
FAMILIES = ("tiny-qwen3-moe", "tiny-glm4-moe", "tiny-deepseek-v3")
CONFIG = """\
run: {{name: x, output_dir: {out}, num_rollout: 2, seed: 7, deterministic: true, mode: sft}}
model: {{path: {base}, create: {family}, tiny_hidden_size: 64, tiny_num_layers: 2, tiny_num_experts: 4,
        tiny_moe_intermediate_size: 64, tiny_intermediate_size: 128}}
data: {{source: addition, num_train: 400, num_eval: 16}}
sft: {{steps: {steps}, batch_size: 32, lr: 3.0e-3, eval_interval: {steps}}}
rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, eval_interval: 0, dynamic_filter: null,
          router: false}}
train: {{lr: 1.0e-4, lr_warmup_steps: 0, micro_batch_size: 16, {layout}, nprocs: 2}}
checkpoint: {{save_interval: 1, keep_last: 2}}
"""


LAYOUTS = {"ep2": "expert_parallel_size: 2", "tp2sp": "tensor_parallel_size: 2", "pp2": "pipeline_parallel_size: 2"}
"""The trainer's 2 ranks: experts split by EP, TP=2 with sequence parallelism (issue #54 point 5), or two
pipeline stages of one layer each (issue #55 point 3: GLM-4.5's dense first layer on stage 0, its MoE layer on
stage 1; the checkpoint saved from both stages is read back into one stage by the HF export)."""


def start(folder: Path, family: str, name: str, layout: str = "ep2") -> subprocess.Popen:
    """``hpcrl run`` of the family's SFT run as ``run.name=name`` in ``folder`` at ``layout`` (:data:`LAYOUTS`;
    one torch thread a process: the two ranks and the engine share the cores); output appended to
    ``folder/<name>.log``."""
    cfg = folder / "run.yaml"
    cfg.write_text(CONFIG.format(out=folder / "runs", base=folder / "base", family=family, steps=STEPS,
                                 layout=LAYOUTS[layout]))
    return popen_hpcrl(["run", str(cfg), f"run.name={name}"], cwd=folder, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       log=folder / f"{name}.log")


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]


@pytest.mark.parametrize("family,layout", [(f, "ep2") for f in FAMILIES] + [("tiny-glm4-moe", "tp2sp"),
                                                                            ("tiny-glm4-moe", "pp2")])
def test_moe_sft_learns_and_resumes_bitwise(tmp_path, family, layout):
    proc = start(tmp_path, family, "ref", layout)
    assert finish(proc) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    ref = losses(tmp_path / "runs" / "ref")
    assert [s for s, _ in ref] == list(range(STEPS))
    assert ref[-1][1] < 0.9 * ref[0][1], ref  # it learns
    run_dir = tmp_path / "runs" / "sft"
    proc = start(tmp_path, family, "sft", layout)
    wait_steps(proc, run_dir, 2)
    os.kill(proc.pid, signal.SIGUSR2)
    assert finish(proc) == 75, (tmp_path / "sft.log").read_text()[-3000:]
    assert 2 <= steps_done(run_dir) < STEPS
    proc = start(tmp_path, family, "sft", layout)
    assert finish(proc) == 0, (tmp_path / "sft.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "sft.log").read_text()
    assert losses(run_dir) == ref
    want, got = weights(tmp_path, "ref"), weights(tmp_path, "sft")
    assert want.keys() == got.keys() and all(got[k].equal(want[k]) for k in want), "the resumed SFT diverged"
