"""A dynamic filter plug-in (``rollout.dynamic_filter: plugins.filters.any_rewarded``).

Signature: ``def keep(group: list[Sample]) -> bool``, called on each finished, scored group; groups it rejects
are dropped and the rollout over-samples to fill the batch (slime ``--dynamic-sampling-filter-path``).
"""

from __future__ import annotations


def any_rewarded(group) -> bool:
    """Keep a group in which at least one sample earned some reward (``Sample.scalar_reward() > 0``): an
    all-zero group gives GRPO nothing to learn from."""
    return any(s.scalar_reward() > 0 for s in group)
