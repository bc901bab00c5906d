"""The ``critic`` section (PPO's value model, ``algorithm.advantage_estimator: gae``) and its checks."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from hpcrl.config.checks import non_negative, positive, require


@dataclass
class CriticSection:
    """The value model PPO trains beside the actor (slime's ``--critic-*`` flags): a Megatron model of the
    actor's architecture whose output layer is a scalar value head, on the trainer's ranks with the actor's
    tensor- and data-parallel layout, with its own optimizer and learning rate. Used only with
    ``algorithm.advantage_estimator: gae``."""

    path: Optional[str] = None
    """HF folder the critic starts from (slime ``--critic-load``): a causal LM (its value head starts at 0)
    or a model with a one-output ``score`` head (a reward model), whose head is loaded. null: the actor's
    ``model.path`` (after SFT, the SFT output)."""
    lr: float = 1e-5
    """Peak learning rate of the critic's Adam (slime ``--critic-lr``); the other optimizer settings
    (betas, weight decay, grad clip, bf16) are ``train``'s."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear learning-rate warmup (slime ``--critic-lr-warmup-iters``); constant after."""
    warmup_steps: int = 0
    """Critic-only rollout steps at the start (slime ``--num-critic-only-steps``): the critic trains on them,
    the actor does not (its weights, and so the engines', stay the initial ones)."""
    value_clip: Optional[float] = 0.2
    """Clip of the value loss (slime ``--value-clip``): ``max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2)
    / 2``; null: unclipped."""


def check_critic(cfg: Config) -> None:
    """The critic's own fields, and none changed from its default unless the critic runs (it does exactly
    when ``algorithm.advantage_estimator`` is ``gae``: a critic with ``gspo`` or ``grpo`` cannot be
    configured). The other combinations with ``algorithm`` are in :func:`hpcrl.config.train.check_algorithm`.
    Raises ConfigError naming the first offending field."""
    c = cfg.critic
    est = cfg.algorithm.advantage_estimator
    if est != "gae":
        defaults = CriticSection()
        for f in fields(CriticSection):
            value = getattr(c, f.name)
            require(value == getattr(defaults, f.name), f"critic.{f.name}", value,
                    f"has no effect: the critic trains only with algorithm.advantage_estimator=gae "
                    f"(not {est})",
                    f"set algorithm.advantage_estimator=gae (PPO with a critic), or remove critic.{f.name}")
    positive(cfg, "critic.lr", "critic.value_clip")
    non_negative(cfg, "critic.lr_warmup_steps", "critic.warmup_steps")
    require(c.warmup_steps < cfg.run.num_rollout or cfg.algorithm.advantage_estimator != "gae",
            "critic.warmup_steps", c.warmup_steps,
            f"leaves no rollout step for the actor (run.num_rollout={cfg.run.num_rollout})",
            "use fewer critic-only steps, or more rollout steps")
