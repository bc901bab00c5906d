"""The SFT recipe's constants and learning-rate schedule, shared by the SFT trainer
(:mod:`hpcrl.train.supervised`), the SFT loop (:mod:`hpcrl.loop_sft`) and the warm start (:mod:`hpcrl.sft`,
where the measurements that chose them are): AdamW betas 0.9 / 0.999, no weight decay, gradient norm clipped
to 1.0, a linear warmup then cosine decay to a tenth of ``sft.lr`` over ``sft.steps``. A leaf module: the
modules that use it import one another.
"""

from __future__ import annotations

import math

NEAR_TARGET_FRACTION = 0.25
"""Once an eval reaches this fraction of ``sft.target_accuracy``, evals run every
``sft.eval_interval_near_target`` steps (3-digit addition: 10% of a 40% target, ~15 steps before it)."""
WARMUP_FRACTION = 0.05
MAX_WARMUP_STEPS = 50
MIN_LR_RATIO = 0.1
"""Cosine decay from ``sft.lr`` to ``MIN_LR_RATIO * sft.lr`` at ``sft.steps``."""
GRAD_CLIP = 1.0
ADAM_BETAS = (0.9, 0.999)
WEIGHT_DECAY = 0.0


def lr_at(step: int, total_steps: int, lr: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``: linear warmup over
    ``min(MAX_WARMUP_STEPS, WARMUP_FRACTION * total_steps)`` steps (at least 1), then cosine to
    ``MIN_LR_RATIO * lr``."""
    warmup = max(1, min(MAX_WARMUP_STEPS, int(WARMUP_FRACTION * total_steps)))
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))
