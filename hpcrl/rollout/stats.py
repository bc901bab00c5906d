"""The ``rollout/*`` statistics of one rollout step's trained samples (reward, accuracy, lengths, throughput,
agent episodes) and the policy lag of a sample, added to the rollout function's own metrics by
:meth:`hpcrl.rollout.manager.RolloutManager.generate`."""

from __future__ import annotations

from typing import Any


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
    return m


def sample_lag(sample) -> "int | None":
    """How many optimizer-step versions the policy that generated ``sample`` is behind the one it is trained
    for: its rollout id minus the oldest weight version its tokens came from (0 in sync mode, 1 one step off,
    more for a partial rollout continued across steps); None when the engine's versions are not integers."""
    try:
        return sample.rollout_id - min(int(v) for v in sample.weight_versions)
    except ValueError:  # no versions, or not integers (an engine's own version names)
        return None
