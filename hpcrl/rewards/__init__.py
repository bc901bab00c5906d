"""Rewards: rule-based verifiers, a remote reward model, custom functions, and the resolver the loop uses.

``get_reward_function(cfg, task)`` turns ``cfg.rollout.reward_function`` into one ``async fn(sample)``.
"""

from hpcrl.rewards.remote import RemoteRewardError, remote_rm
from hpcrl.rewards.resolve import (
    BUILTIN_REWARDS,
    RewardFn,
    countdown_problem,
    get_reward_function,
    item_from_sample,
)
from hpcrl.rewards.verifiers import (
    countdown,
    exact_match,
    extract_answer_text,
    extract_math_answer,
    math_answer,
    parse_number,
)

__all__ = [
    "BUILTIN_REWARDS",
    "RemoteRewardError",
    "RewardFn",
    "countdown",
    "countdown_problem",
    "exact_match",
    "extract_answer_text",
    "extract_math_answer",
    "get_reward_function",
    "item_from_sample",
    "math_answer",
    "parse_number",
    "remote_rm",
]
