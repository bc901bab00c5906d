"""The ``critic`` section (PPO's value model, ``algorithm.advantage_estimator: gae``) and its checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from hpcrl.config.checks import non_negative, positive, require
from hpcrl.config.environment import Environment
from hpcrl.config.errors import ConfigError


@dataclass
class CriticSection:
    """The value model PPO trains beside the actor (slime's ``--critic-*`` flags): a Megatron model of the
    actor's architecture whose output layer is a scalar value head, with its own optimizer and learning rate;
    on the trainer's ranks with the actor's tensor- and data-parallel layout (``nprocs: 0``), or on ranks of
    its own that train while the actor trains (``nprocs > 0``, :mod:`hpcrl.train.critic_group`). Used only
    with ``algorithm.advantage_estimator: gae``."""

    nprocs: int = 0
    """Ranks of the critic's own (slime ``--critic-num-nodes`` x ``--critic-num-gpus-per-node``). 0: the
    critic lives on the actor's trainer ranks, with their layout, and trains after the actor on each rollout.
    N > 0: N processes of its own, a second Megatron world that computes values and trains beside the actor
    (local ``hpcrl run``: processes on this machine, sharing its CPUs, or the GPUs after the trainer's; on
    Slurm: het group ``slurm.critic``, where on GPU nodes N is set to its nodes x gpus_per_node)."""
    tensor_parallel_size: Optional[int] = None
    """The critic's tensor-parallel size on ranks of its own (``nprocs > 0``); null: the actor's
    ``train.tensor_parallel_size``. Its data-parallel size is what remains of ``nprocs``."""

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
    the actor does not (its weights, and so the engines', stay the initial ones); the actor's learning-rate
    schedule (``train.lr_warmup_steps``, the decay over the run) starts at its first step, as in slime."""
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
    positive(cfg, "critic.lr", "critic.value_clip", "critic.tensor_parallel_size")
    non_negative(cfg, "critic.lr_warmup_steps", "critic.warmup_steps", "critic.nprocs")
    require(c.tensor_parallel_size is None or c.nprocs > 0, "critic.tensor_parallel_size",
            c.tensor_parallel_size, "has no effect: with critic.nprocs=0 the critic shares the actor's ranks "
            "and their layout (train.tensor_parallel_size)",
            "give the critic ranks of its own (critic.nprocs), or remove critic.tensor_parallel_size")
    if c.nprocs > 0:
        tp, ep = critic_tensor_parallel_size(cfg), cfg.train.expert_parallel_size
        expert = cfg.train.expert_tensor_parallel_size * ep
        require(c.nprocs % tp == 0 and c.nprocs % expert == 0, "critic.nprocs", c.nprocs,
                f"the critic's ranks split into tensor-parallel groups of {tp} and expert groups of "
                f"train.expert_tensor_parallel_size x expert_parallel_size = {expert}, which {c.nprocs} is not "
                "a multiple of both", f"use a multiple of {math.lcm(tp, expert)} ranks, or another "
                "critic.tensor_parallel_size")
    require(c.warmup_steps < cfg.run.num_rollout or cfg.algorithm.advantage_estimator != "gae",
            "critic.warmup_steps", c.warmup_steps,
            f"leaves no rollout step for the actor (run.num_rollout={cfg.run.num_rollout})",
            "use fewer critic-only steps, or more rollout steps")


def critic_tensor_parallel_size(cfg: Config) -> int:
    """The critic's tensor-parallel size: ``critic.tensor_parallel_size`` on ranks of its own, else (and when
    null) the actor's ``train.tensor_parallel_size``."""
    c = cfg.critic
    return (c.tensor_parallel_size if c.nprocs > 0 and c.tensor_parallel_size else
            cfg.train.tensor_parallel_size)


def check_critic_model(cfg: Config, check_files: bool, env: Optional[Environment] = None) -> None:
    """What a PPO run (``algorithm.advantage_estimator: gae``) would refuse of its critic's folder, checked on
    the login node when ``check_files``. With ``critic.path`` set: an HF model folder (``config.json``) that
    the trainer supports (``env.model_folder_problem``), whose attention and key/value heads the critic's
    tensor-parallel size divides (:func:`critic_tensor_parallel_size`), and, when the actor's folder exists,
    with the actor's tokenizer (``env.tokenizer_difference``): the critic reads the actor's token ids, so
    another vocabulary would value other tokens (or index past its embedding). Null (the actor's folder,
    checked as ``model.path``): only the heads against a ``critic.tensor_parallel_size`` of its own, when the
    folder exists. Raises ConfigError naming ``critic.path`` (or ``critic.tensor_parallel_size``)."""
    import json
    from pathlib import Path

    path = cfg.critic.path
    if cfg.algorithm.advantage_estimator != "gae" or not check_files:
        return
    tp = critic_tensor_parallel_size(cfg)
    if not path:
        actor_config = Path(cfg.model.path or "") / "config.json"
        if tp != cfg.train.tensor_parallel_size and cfg.model.path and actor_config.is_file():
            try:
                _check_heads(json.loads(actor_config.read_text()), tp, "critic.tensor_parallel_size", tp,
                             f"model.path's {cfg.model.path}")
            except (OSError, ValueError) as e:
                if isinstance(e, ConfigError):
                    raise
        return
    folder = Path(path)
    require((folder / "config.json").is_file(), "critic.path", path,
            "no such folder" if not folder.exists() else "not an HF model folder (no config.json)",
            "point it at an HF model folder (a causal LM or a one-output reward model), or null for model.path")
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("critic.path", path, f"unreadable config.json ({e})", "fix or replace the folder")
    if env is not None:
        problem = env.model_folder_problem(path)
        if problem is not None:
            raise ConfigError("critic.path", path, *problem)
    _check_heads(hf, tp, "critic.path", path, "it")
    actor = Path(cfg.model.path or "")
    if env is not None and cfg.model.path and (actor / "config.json").is_file():
        why = env.tokenizer_difference(actor, folder)
        require(why is None, "critic.path", path,
                f"has another tokenizer than the actor's model.path ({why}), so it would value other tokens",
                "use a critic of the actor's model family (same tokenizer)")


def _check_heads(hf: dict, tp: int, field_name: str, value: object, whose: str) -> None:
    """The critic's tensor-parallel size ``tp`` must divide the attention and key/value heads of the HF
    ``config.json`` content ``hf`` (MLA: the attention heads only)."""
    heads = int(hf.get("num_attention_heads") or 0)
    groups = heads if hf.get("kv_lora_rank") else int(hf.get("num_key_value_heads") or heads)
    for key, n in (("num_attention_heads", heads), ("num_key_value_heads", groups)):
        require(n % tp == 0, field_name, value,
                f"{whose} config.json has {key}={n}, which the critic's tensor-parallel size {tp} does not "
                "divide", f"use a critic whose {key} is a multiple of {tp}, or another tensor-parallel size")
