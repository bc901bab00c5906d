"""The whole loop with the tiny GLM-4.5-style policy (issue #35 point 3, ``glm4_moe``): ``hpcrl run`` with GSPO,
``train.expert_parallel_size: 2`` over 2 trainer processes and the CPU engine, rollout routing replay on
(``algorithm.routing_replay``: the engine's ``return_routed_experts`` of its sigmoid grouped router, for the MoE
layers after the dense first one, replayed by the trainer's routers).

Asserted at every step: the trainer's log-probs of the rollout's tokens equal the engine's
(``train/train_rollout_logprob_abs_diff`` < 1e-5 in fp32: every tensor, the expert bias included, synced across
the EP ranks after each step), and training moved the weights (a non-zero gradient norm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REWARD_MODULE = '''
def digit_fraction(args, sample):
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)
'''
STEPS = 3


@pytest.mark.timeout(900)
def test_ep2_run_with_routing_replay_matches_the_engine(tmp_path: Path):
    (tmp_path / "glm_rewards.py").write_text(REWARD_MODULE)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent(f"""
        run: {{name: glm, output_dir: {tmp_path / 'runs'}, num_rollout: {STEPS}, seed: 7, deterministic: true}}
        model: {{path: {tmp_path / 'glm'}, create: tiny-glm4-moe, tiny_hidden_size: 64, tiny_num_layers: 3,
                tiny_num_experts: 8, tiny_moe_intermediate_size: 64, tiny_intermediate_size: 128}}
        data: {{source: addition, num_train: 200, num_eval: 16}}
        rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, router: false,
                  reward_function: glm_rewards.digit_fraction, eval_interval: 0}}
        train: {{lr: 3.0e-3, micro_batch_size: 4, expert_parallel_size: 2, nprocs: 2, lr_decay_steps: {STEPS}}}
        algorithm: {{advantage_estimator: gspo, eps_clip: 3.0e-4, eps_clip_high: 4.0e-4, routing_replay: true}}
        checkpoint: {{save_interval: 0}}
    """))
    log = tmp_path / "run.log"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    with open(log, "ab") as f:
        rc = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(cfg)], cwd=tmp_path, stdout=f,
                            stderr=subprocess.STDOUT, timeout=600, env=env).returncode
    assert rc == 0, log.read_text(errors="replace")[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "glm" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 0]
    print([(r["step"], r["train/train_rollout_logprob_abs_diff"]) for r in steps])
    assert len(steps) == STEPS
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in steps), steps
    assert all(r["train/grad_norm"] > 0 for r in steps)
