"""The names the config accepts for hpcrl's built-ins, in one leaf module that imports nothing from hpcrl.

:mod:`hpcrl.config` validates a run against these names without importing the modules that implement them
(config is the bottom layer); each implementing registry asserts at import time that its keys are exactly
these, in this order (the order of the "known: ..." lists in error messages):

- tasks (``data.source``): :data:`hpcrl.data.tasks.BUILTIN_TASKS`
- rewards (``rollout.reward_function``): :data:`hpcrl.rewards.resolve.BUILTIN_REWARD_FACTORIES`, besides
  ``remote_rm:<url>`` (:func:`remote_rm_url`, the one parser of it)
- dynamic filters (``rollout.dynamic_filter``): :data:`hpcrl.rollout.filters.BUILTIN_FILTERS`
- advantage estimators, KL estimators, policy losses, MIS levels (``algorithm.*``):
  :mod:`hpcrl.train.algorithms`
- the default plug-in paths (``rollout.data_source``, ``rollout.rollout_function``,
  ``rollout.generate_function``): :mod:`hpcrl.rollout.plugins`
- LoRA target modules (``model.lora.target_modules``): :mod:`hpcrl.train.lora` adapts them, the CPU engine
  (:mod:`hpcrl.engine.lora`) serves adapters on them
"""

from __future__ import annotations

import re
from typing import Literal, Optional, get_args

PEFT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""PEFT's names of a dense decoder layer's linear modules: the values ``model.lora.target_modules`` takes, and the
modules the CPU engine's ``--lora-target-modules`` takes (``all``: these)."""

TASKS: tuple[str, ...] = ("addition", "repeat")
"""Built-in task generators by ``data.source`` name, besides ``reasoning_gym:<name>``."""

VERIFIER_REWARDS: tuple[str, ...] = ("exact_match", "math_answer", "countdown")
"""The built-in rewards that are rule-based verifiers (:mod:`hpcrl.rewards.verifiers`): they also score the rows
of a data file (:class:`hpcrl.data.tasks.VerifierTask`)."""

REWARDS: tuple[str, ...] = ("task", *VERIFIER_REWARDS)
"""Built-in rewards by ``rollout.reward_function`` name, besides ``remote_rm:<url>``: the task's own verifier
and the rule-based ones."""

REMOTE_RM_PREFIX = "remote_rm:"
"""``rollout.reward_function: remote_rm:<url>`` POSTs each sample to the reward server at ``<url>``."""

REWARD_CHOICES: tuple[str, ...] = (*REWARDS, REMOTE_RM_PREFIX + "<url>")
"""What ``rollout.reward_function`` may name besides a plug-in path, as error messages list it."""

FILTERS: tuple[str, ...] = ("nonzero_std",)
"""Built-in dynamic filters by ``rollout.dynamic_filter`` name."""

Estimator = Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "gae"]
"""``algorithm.advantage_estimator`` (``gae``: PPO with a learned critic, slime's ``ppo``; ``rloo``: RLOO's
leave-one-out baseline, Ahmadian et al. 2024)."""
LossReduction = Literal["rollout_token_mean", "token_mean", "sequence_mean", "seq_mean_token_sum",
                        "seq_mean_token_sum_norm"]
"""``algorithm.loss_reduction``: how per-token losses become a step's loss (veRL's ``loss_agg_mode`` names where
they exist; ``seq_mean_token_sum_norm`` is Dr. GRPO's constant normaliser)."""
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
"""``algorithm.kl_loss_type``."""
PolicyLoss = Literal["ppo_clip", "cispo"]
"""``algorithm.policy_loss``."""
MISLevel = Literal["token", "sequence", "geometric"]
"""``algorithm.mis_level`` (null: no masked importance sampling)."""

ESTIMATORS: tuple[str, ...] = get_args(Estimator)
KL_KINDS: tuple[str, ...] = get_args(KLKind)
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)
MIS_LEVELS: tuple[str, ...] = get_args(MISLevel)
LOSS_REDUCTIONS: tuple[str, ...] = get_args(LossReduction)

DEFAULT_DATA_SOURCE = "hpcrl.data.source.DataSource"
"""Default of ``rollout.data_source`` (its null means this too)."""
DEFAULT_ROLLOUT_FUNCTION = "hpcrl.rollout.rollout.generate_rollout"
"""Default of ``rollout.rollout_function`` (its null means this too)."""
DEFAULT_GENERATE_FUNCTION = "hpcrl.rollout.generate.generate"
"""Default of ``rollout.generate_function`` (its null means this too)."""


def remote_rm_url(name: str) -> Optional[str]:
    """The reward server's URL in a ``rollout.reward_function`` value of the form ``remote_rm:<url>``.

    Surrounding blanks of ``name`` and of the URL are ignored. Returns None when ``name`` names no remote
    reward model (neither ``remote_rm`` nor ``remote_rm:...``), and ``""`` when it does but the URL is missing
    or does not start with ``http://`` or ``https://``. Raises nothing."""
    name = name.strip()
    if name != REMOTE_RM_PREFIX[:-1] and not name.startswith(REMOTE_RM_PREFIX):
        return None
    url = name.partition(":")[2].strip()
    return url if url.startswith(("http://", "https://")) else ""


FILE_FORM_RE = re.compile(r"(?P<file>[^:]+\.py):(?P<attr>[A-Za-z_]\w*)")
"""``path/to/module.py:attr``: a plug-in named by its file (:mod:`hpcrl.plugin_loader` loads it; the config accepts
this form besides a dotted ``pkg.module.attr``)."""
