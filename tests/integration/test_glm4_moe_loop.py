"""The whole loop with the tiny GLM-4.5-style policy (issue #35 point 3, ``glm4_moe``): ``hpcrl run`` with
GSPO, ``train.expert_parallel_size: 2`` over 2 trainer processes and the CPU engine, rollout routing replay on
(``algorithm.routing_replay``: the engine's ``return_routed_experts`` of its sigmoid grouped router, for the
MoE layers after the dense first one, replayed by the trainer's routers).

Asserted at every step: the trainer's log-probs of the rollout's tokens equal the engine's
(``train/train_rollout_logprob_abs_diff`` < 1e-5 in fp32: every tensor, the expert bias included, synced
across the EP ranks after each step), and training moved the weights (a non-zero gradient norm).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/integration is not a package
from run_utils import assert_steps_match_the_engine, hpcrl_run, step_rows  # noqa: E402

pytestmark = pytest.mark.integration

STEPS = 3


@pytest.mark.timeout(900)
def test_ep2_run_with_routing_replay_matches_the_engine(tmp_path: Path):
    hpcrl_run(tmp_path, f"""
        run: {{name: glm, output_dir: {tmp_path / 'runs'}, num_rollout: {STEPS}, seed: 7,
              deterministic: true}}
        model: {{path: {tmp_path / 'glm'}, create: tiny-glm4-moe, tiny_hidden_size: 64, tiny_num_layers: 3,
                tiny_num_experts: 8, tiny_moe_intermediate_size: 64, tiny_intermediate_size: 128}}
        data: {{source: addition, num_train: 200, num_eval: 16}}
        rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, router: false,
                  reward_function: glm_rewards.digit_fraction, eval_interval: 0}}
        train: {{lr: 3.0e-3, micro_batch_size: 4, expert_parallel_size: 2, nprocs: 2,
                lr_decay_steps: {STEPS}}}
        algorithm: {{advantage_estimator: gspo, eps_clip: 3.0e-4, eps_clip_high: 4.0e-4,
                    routing_replay: true}}
        checkpoint: {{save_interval: 0}}
    """, rewards="glm_rewards")
    assert_steps_match_the_engine(step_rows(tmp_path / "runs", "glm"), STEPS)
