"""The whole loop with the tiny GLM-4.5-style (``glm4_moe``) and DeepSeek-V3-style (``deepseek_v3``:
multi-latent attention with YaRN, the GLM-4.5 router family) policies (issue #35 point 3): ``hpcrl run`` with
GSPO, ``train.expert_parallel_size: 2`` over 2 trainer processes (GLM-4.5 also at ``tensor_parallel_size: 2``
with sequence parallelism) and the CPU engine, rollout routing replay on
(``algorithm.routing_replay``: the engine's ``return_routed_experts`` of its sigmoid grouped router, for the
MoE layers after the dense first one, replayed by the trainer's routers). DeepSeek-V3 also packs its
micro-batches (``train.max_tokens_per_microbatch``: MLA through hpcrl's packed attention, q/k heads wider than
v heads).

Asserted at every step: the trainer's log-probs of the rollout's tokens equal the engine's
(``train/train_rollout_logprob_abs_diff`` < 1e-5 in fp32: every tensor, the expert bias included, synced
across the EP ranks after each step), and training moved the weights (a non-zero gradient norm). Measured for
DeepSeek-V3: 0.98e-7, 0.89e-7, 1.04e-7 at the 3 steps (107 s on a shared 2-core machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/integration is not a package
from run_utils import assert_steps_match_the_engine, hpcrl_run, step_rows  # noqa: E402

pytestmark = pytest.mark.integration

STEPS = 3
FAMILIES = {
    "tiny-glm4-moe": "",
    "tiny-deepseek-v3": ", max_tokens_per_microbatch: 128",
}
"""``model.create`` -> what its run adds to the ``train`` section."""
LAYOUTS = {"ep2": "expert_parallel_size: 2", "tp2sp": "tensor_parallel_size: 2"}
"""The trainer's 2 ranks: experts split by EP, or TP=2 with sequence parallelism (each rank routes, and
replays the engine's routing of, its half of the tokens)."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family,layout", [(f, "ep2") for f in FAMILIES] + [("tiny-glm4-moe", "tp2sp")])
def test_run_with_routing_replay_matches_the_engine(tmp_path: Path, family: str, layout: str):
    name = family.removeprefix("tiny-").replace("-", "_")
    hpcrl_run(tmp_path, f"""
        run: {{name: {name}, output_dir: {tmp_path / 'runs'}, num_rollout: {STEPS}, seed: 7, deterministic: true}}
        model: {{path: {tmp_path / name}, create: {family}, tiny_hidden_size: 64, tiny_num_layers: 3,
                tiny_num_experts: 8, tiny_moe_intermediate_size: 64, tiny_intermediate_size: 128}}
        data: {{source: addition, num_train: 200, num_eval: 16}}
        rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, router: false,
                  reward_function: {name}_rewards.digit_fraction, eval_interval: 0}}
        train: {{lr: 3.0e-3, micro_batch_size: 4, {LAYOUTS[layout]}, nprocs: 2,
                lr_decay_steps: {STEPS}{FAMILIES[family]}}}
        algorithm: {{advantage_estimator: gspo, eps_clip: 3.0e-4, eps_clip_high: 4.0e-4,
                    routing_replay: true}}
        checkpoint: {{save_interval: 0}}
    """, rewards=f"{name}_rewards")
    assert_steps_match_the_engine(step_rows(tmp_path / "runs", name), STEPS)
