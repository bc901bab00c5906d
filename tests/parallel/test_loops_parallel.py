"""The loops across pipeline stages and context-parallel ranks (issue #55 point 3): ``hpcrl run`` of a tiny Qwen2
GRPO run on 2 trainer processes and the CPU engine, colocated.

- sync at PP=2 with the ``disk`` weight sync, and at CP=2 (packed micro-batches) with the ``distributed`` one:
  at every step the trainer's log-probs of the rollout's tokens equal the engine's (< 1e-5, fp32), so every
  stage's (or CP rank's) weights reached the engine after every optimizer step;
- async (one step off) and fully async at PP=2, disaggregated (the engine beside the trainer, as those modes
  need), with the ``distributed`` and ``disk`` syncs: every step trains, and the first, on the engine's
  starting weights, matches it (the later ones are off-policy by design: their old log-probs are recomputed;
  fully async with TIS, as it requires, and not deterministic: timing decides which groups finish first).

Each run is short (4 steps) and deterministic; ~20 s each on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # not a package: its helpers
from run_utils import assert_steps_match_the_engine, hpcrl_run, step_rows  # noqa: E402

pytestmark = pytest.mark.integration

STEPS = 4
RUNS = {
    "sync-pp2-disk": ("sync", "pipeline_parallel_size: 2", "disk"),
    "sync-cp2-distributed": ("sync", "context_parallel_size: 2, max_tokens_per_microbatch: 64", "distributed"),
    "async-pp2-distributed": ("async", "pipeline_parallel_size: 2", "distributed"),
    "fully_async-pp2-disk": ("fully_async", "pipeline_parallel_size: 2", "disk"),
}
"""name -> (run.mode, the trainer's layout over its 2 ranks, weights.method); the async modes disaggregated."""


def run(tmp_path: Path, name: str) -> list[dict]:
    mode, layout, method = RUNS[name]
    hpcrl_run(tmp_path, f"""
        run: {{name: {name}, output_dir: {tmp_path / 'runs'}, num_rollout: {STEPS}, seed: 7,
              deterministic: {str(mode != "fully_async").lower()},
              mode: {mode}, placement: {"colocate" if mode == "sync" else "disaggregate"}}}
        model: {{path: {tmp_path / 'qwen2'}, create: tiny-qwen2, tiny_hidden_size: 64}}
        data: {{source: addition, num_train: 200, num_eval: 16}}
        rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, dynamic_filter: null,
                  reward_function: loop_rewards.digit_fraction, eval_interval: 0, router: false}}
        train: {{lr: 3.0e-3, micro_batch_size: 4, {layout}, nprocs: 2, lr_decay_steps: {STEPS}}}
        algorithm: {{use_tis: {str(mode == "fully_async").lower()}}}
        weights: {{method: {method}}}
        checkpoint: {{save_interval: {STEPS}}}
    """, rewards="loop_rewards", log=name)
    return step_rows(tmp_path / "runs", name)


@pytest.mark.parametrize("name", [n for n in RUNS if n.startswith("sync")])
def test_sync_loop_matches_the_engine_at_every_step(tmp_path, name):
    assert_steps_match_the_engine(run(tmp_path, name), STEPS)


@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("sync")])
def test_async_loops_train_every_step(tmp_path, name):
    steps = run(tmp_path, name)
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all(r["train/grad_norm"] > 0 for r in steps)
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-5  # rollout 0: the engine's starting weights
