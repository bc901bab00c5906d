"""The ``rollout/*`` statistics of one rollout step's trained samples (reward, accuracy, lengths, throughput,
agent episodes), the policy lag of a sample, and the staleness of its tokens, added to the rollout function's
own metrics by :meth:`hpcrl.rollout.manager.RolloutManager.generate`.

Staleness (docs/algorithms.md, "Fully asynchronous training"): a response token sampled by engine weights of
version ``v`` and trained at optimizer step ``k`` (the trainer at step ``k`` holds version ``k``) has
staleness ``k - v``; a group's age, which ``rollout.max_staleness`` bounds, is that of its oldest trainable
token.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


def rollout_metrics(cfg, samples: list, metrics: dict[str, float], trained_groups: int,
                    held_groups: int) -> dict[str, Any]:
    """The ``rollout/*`` metrics of one step's trained samples, added to the rollout function's own:
    reward mean and std (:meth:`hpcrl.data.sample.Sample.scalar_reward`), accuracy (share of rewards >= 1),
    mean response length (tokens), truncated share, tokens per second, weight version, groups held and short,
    and the policy lag of the samples (``rollout/lag_mean``, ``rollout/lag_max``: :func:`sample_lag`)."""
    rewards = [s.scalar_reward() for s in samples]
    n = max(len(samples), 1)
    lengths = [s.response_length for s in samples]
    secs = metrics.get("rollout/seconds", 0.0)
    m = dict(metrics)
    m["rollout/groups_held"] = m.get("rollout/groups_held", 0) + held_groups
    m["rollout/groups_short"] = cfg.rollout.batch_size - trained_groups
    m.update({
        "rollout/reward_mean": sum(rewards) / n,
        "rollout/reward_std": (sum((r - sum(rewards) / n) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/accuracy": sum(r >= 1.0 for r in rewards) / n,
        "rollout/response_length": sum(lengths) / n,
        "rollout/truncated": sum(s.status.value == "truncated" for s in samples) / n,
        "rollout/tokens_per_s": sum(lengths) / secs if secs > 0 else 0.0,
        "rollout/weight_version": samples[0].weight_version if samples else None,
    })
    if cfg.rollout.agent.enabled:
        m.update({
            "rollout/agent_failed": sum("agent_failure" in s.metadata for s in samples) / n,
            "rollout/agent_calls": sum(s.metadata.get("agent_calls", 0) for s in samples) / n,
            "rollout/agent_tool_call_rate":
                sum(s.metadata.get("agent_tool_calls", 0) > 0 for s in samples) / n,
            "rollout/agent_split_episodes": sum(s.metadata.get("agent_chains", 1) > 1 for s in samples) / n,
        })
    lags = [lag for lag in (sample_lag(s) for s in samples) if lag is not None]
    if lags:
        m["rollout/lag_mean"], m["rollout/lag_max"] = sum(lags) / len(lags), max(lags)
    if any(has_token_versions(s) for s in samples):
        m.update(staleness_metrics(samples))
    return m


def sample_lag(sample) -> "int | None":
    """How many optimizer-step versions the policy that generated ``sample`` is behind the one it is trained
    for, counted per generate call: its rollout id minus the oldest version of its calls (0 in sync mode, 1 one
    step off, more for a partial rollout continued across steps); None when the engine's versions are not
    integers. A call that a weight update aborted before it sampled a token counts too, so this can read
    higher than the per-token ``rollout/staleness_*`` (:func:`staleness_metrics`), which the
    ``rollout.max_staleness`` bound uses."""
    try:
        return sample.rollout_id - min(int(v) for v in sample.weight_versions)
    except ValueError:  # no versions, or not integers (an engine's own version names)
        return None


def has_token_versions(sample) -> bool:
    """Whether ``sample.rollout_token_versions`` labels at least one response token (a version >= 0)."""
    return any(v >= 0 for v in sample.rollout_token_versions)


def _call_versions(sample) -> list[int]:
    """The sample's per-call ``weight_versions`` as integers; [] when there are none or one is not an integer
    (an engine's own version name)."""
    try:
        return [int(v) for v in sample.weight_versions]
    except ValueError:
        return []


def trainable_token_versions(sample) -> list[int]:
    """The weight version of each trainable response token (``loss_mask`` 1) whose version is known, in
    order. From ``Sample.rollout_token_versions`` (-1, unknown, left out); when no trainable token has a known
    version there (older buffers, generate functions that do not label tokens), every trainable token gets the
    oldest of the sample's per-call ``weight_versions`` (as :func:`sample_lag` counts: staleness then
    over-, never under-estimated); [] when neither is known."""
    n = sample.response_length
    mask = sample.loss_mask if len(sample.loss_mask) == n else [1] * n
    tv = sample.rollout_token_versions
    if len(tv) == n:
        known = [v for v, m in zip(tv, mask) if m and v >= 0]
        if known:
            return known
    calls = _call_versions(sample)
    return [min(calls)] * sum(1 for m in mask if m) if calls else []


def oldest_version(sample) -> Optional[int]:
    """The oldest weight version among the sample's trainable tokens (:func:`trainable_token_versions`);
    None when unknown."""
    versions = trainable_token_versions(sample)
    return min(versions) if versions else None


def group_oldest_version(group: Sequence) -> Optional[int]:
    """A group's oldest trainable-token weight version over its samples: what its age, and so the
    ``rollout.max_staleness`` bound, is counted from. None when no sample's versions are known."""
    versions = [v for v in (oldest_version(s) for s in group) if v is not None]
    return min(versions) if versions else None


def group_staleness(group: Sequence, step: int) -> Optional[int]:
    """``step - group_oldest_version(group)``: the group's staleness if trained at optimizer step ``step``
    (admissible under ``rollout.max_staleness: K`` iff ``<= K``); None when its versions are unknown."""
    oldest = group_oldest_version(group)
    return None if oldest is None else step - oldest


def is_mixed_version(sample) -> bool:
    """Whether the sample's response tokens were sampled by more than one weight version: its known token
    versions (``rollout_token_versions``, -1 left out), or, when none is known, its per-call
    ``weight_versions`` (a response continued after a weight sync)."""
    known = {v for v in sample.rollout_token_versions if v >= 0}
    return len(known) > 1 if known else len(set(_call_versions(sample))) > 1


def staleness_metrics(samples: Sequence, step: Optional[int] = None) -> dict[str, Any]:
    """Staleness of the trainable tokens of ``samples`` trained at optimizer step ``step`` (default: each
    sample's ``rollout_id``, the step that trains it): ``rollout/staleness_mean`` (``step - version`` averaged
    over the trainable tokens of known version, token-weighted; in weight versions), ``rollout/staleness_max``
    and ``rollout/mixed_version_share`` (the share of the samples of known versions whose tokens come from
    more than one version, :func:`is_mixed_version`). Versions from :func:`trainable_token_versions` (token
    labels, else the per-call fallback). {} when no sample has a known version."""
    total, count, worst, mixed, known = 0, 0, None, 0, 0
    for s in samples:
        versions = trainable_token_versions(s)
        if not versions and not has_token_versions(s):
            continue
        known += 1
        mixed += is_mixed_version(s)
        k = s.rollout_id if step is None else step
        for v in versions:
            total += k - v
            count += 1
            worst = k - v if worst is None else max(worst, k - v)
    if not known:
        return {}
    out = {"rollout/mixed_version_share": mixed / known}
    if count:
        out["rollout/staleness_mean"], out["rollout/staleness_max"] = total / count, worst
    return out
