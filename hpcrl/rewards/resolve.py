"""From ``cfg.rollout.reward_function`` to one ``async fn(sample) -> float | dict``.

Accepted values:

- ``task``: the data source's own scorer, ``task.score(sample.response, item)`` with the item rebuilt from the
  sample (:func:`item_from_sample`). Reasoning-gym tasks score with the dataset's ``score_answer``.
- ``exact_match`` / ``math_answer``: :mod:`hpcrl.rewards.verifiers` against ``sample.label``.
- ``countdown``: reasoning-gym's Countdown scorer; numbers and target come from :func:`countdown_problem`.
- ``remote_rm:URL``: POST to a reward server (slime ``--rm-type remote_rm --rm-url URL``), with
  ``rollout.request_timeout_s`` per attempt and ``rollout.max_retries`` retries.
- a dotted path ``pkg.module.rm``: slime's ``--custom-rm-path`` signature ``async def rm(args, sample) ->
  float | dict``; plain ``def`` functions are accepted too (called in the event loop, so keep them fast).
  ``args`` is the hpcrl :class:`~hpcrl.config.Config`.
"""

from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Optional, Union

from hpcrl import names
from hpcrl.data.sample import Sample
from hpcrl.plugin_loader import load_function
from hpcrl.rewards import verifiers
from hpcrl.rewards.remote import remote_rm

if TYPE_CHECKING:
    from hpcrl.config import Config
    from hpcrl.data.tasks import Task

Reward = Union[float, dict[str, float]]
RewardFn = Callable[[Sample], Awaitable[Reward]]


def item_from_sample(sample: Sample) -> dict[str, Any]:
    """The data item a sample was made from: ``{"prompt", "label", "metadata"}``."""
    return {"prompt": sample.prompt, "label": sample.label, "metadata": sample.metadata}


def countdown_problem(sample: Sample) -> tuple[list[int], float]:
    """``(numbers, target)`` of a Countdown sample, looked up in ``sample.label`` (a dict with ``numbers`` and
    ``target``), the reasoning-gym entry in ``sample.metadata["reasoning_gym"]["metadata"]``, or
    ``sample.metadata`` itself. Raises ValueError when none has both keys."""
    rg = sample.metadata.get("reasoning_gym")
    candidates = [sample.label, rg.get("metadata") if isinstance(rg, dict) else None, sample.metadata]
    for c in candidates:
        if isinstance(c, dict) and "numbers" in c and "target" in c:
            return list(c["numbers"]), c["target"]
    raise ValueError(f"countdown reward: sample {sample.index} has no 'numbers' and 'target' in its label or "
                     "metadata; use a reasoning_gym:countdown source or put them in the label")


def _check(value: Any, what: str) -> Reward:
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    raise TypeError(f"reward function {what} returned {type(value).__name__} {value!r:.80}; "
                    "expected a float or a dict of floats")


def _task_reward(cfg: "Config", task: Optional["Task"]) -> RewardFn:
    """``task``: the data source's own scorer."""
    if task is None:
        raise ValueError("rollout.reward_function: 'task' needs the data source's task; got none")

    async def task_reward(sample: Sample) -> Reward:
        return _check(task.score(sample.response, item_from_sample(sample)), f"{task.name}.score")

    return task_reward


def _exact_match_reward(cfg: "Config", task: Optional["Task"]) -> RewardFn:
    """``exact_match``: :func:`hpcrl.rewards.verifiers.exact_match` against the label."""
    async def exact_match_reward(sample: Sample) -> Reward:
        return verifiers.exact_match(sample.response, sample.label)

    return exact_match_reward


def _math_answer_reward(cfg: "Config", task: Optional["Task"]) -> RewardFn:
    """``math_answer``: :func:`hpcrl.rewards.verifiers.math_answer` against the label."""
    async def math_answer_reward(sample: Sample) -> Reward:
        return verifiers.math_answer(sample.response, sample.label)

    return math_answer_reward


def _countdown_reward(cfg: "Config", task: Optional["Task"]) -> RewardFn:
    """``countdown``: reasoning-gym's Countdown scorer on :func:`countdown_problem`."""
    from reasoning_gym.factory import get_score_answer_fn

    scorer = get_score_answer_fn("countdown")

    async def countdown_reward(sample: Sample) -> Reward:
        numbers, target = countdown_problem(sample)
        return verifiers.countdown(sample.response, numbers, target, scorer=scorer)

    return countdown_reward


BUILTIN_REWARD_FACTORIES: Mapping[str, Callable[["Config", Optional["Task"]], RewardFn]] = MappingProxyType({
    "task": _task_reward, "exact_match": _exact_match_reward, "math_answer": _math_answer_reward,
    "countdown": _countdown_reward})
"""The built-in rewards by ``rollout.reward_function`` name: ``factory(cfg, task) -> async fn(sample)``
(read-only); ``remote_rm:<url>`` and dotted paths are resolved by :func:`get_reward_function`."""
assert tuple(BUILTIN_REWARD_FACTORIES) == names.REWARDS, \
    "hpcrl.names.REWARDS must list BUILTIN_REWARD_FACTORIES (config validates by it)"
BUILTIN_REWARDS = names.REWARD_CHOICES
"""What ``rollout.reward_function`` may name besides a dotted path (:data:`hpcrl.names.REWARD_CHOICES`)."""


def get_reward_function(cfg: "Config", task: Optional["Task"] = None) -> RewardFn:
    """Resolve ``cfg.rollout.reward_function`` (module docstring) to ``async fn(sample) -> float | dict``.

    Raises ValueError for an unknown name (listing the built-ins) or ``task`` without a task, and
    :class:`~hpcrl.plugin_loader.PluginError` for a dotted path that does not load.
    """
    name = cfg.rollout.reward_function.strip()
    if name in BUILTIN_REWARD_FACTORIES:
        return BUILTIN_REWARD_FACTORIES[name](cfg, task)

    url = names.remote_rm_url(name)
    if url is not None:
        if not url:
            raise ValueError(f"rollout.reward_function: {name!r} needs the server URL, "
                             "e.g. 'remote_rm:http://127.0.0.1:8000/reward'")
        timeout_s, retries = cfg.rollout.request_timeout_s, cfg.rollout.max_retries

        async def remote_reward(sample: Sample) -> Reward:
            return await remote_rm(url, sample.prompt, sample.response, sample.label,
                                   timeout_s=timeout_s, max_retries=retries)

        return remote_reward

    if "." in name:
        custom = load_function(name)

        async def custom_reward(sample: Sample) -> Reward:
            value = custom(cfg, sample)
            if inspect.isawaitable(value):
                value = await value
            return _check(value, name)

        return custom_reward

    raise ValueError(f"rollout.reward_function: unknown reward {name!r}; "
                     f"known: {', '.join(BUILTIN_REWARDS)}, or a dotted import path 'pkg.module.rm'")
