"""Dynamic sampling filters: keep or drop a finished group before it counts towards the rollout batch.

With over-sampling, the rollout keeps submitting prompts until ``rollout.batch_size`` groups pass the filter
(slime ``--dynamic-sampling-filter-path``, DAPO's dynamic sampling). A filter is ``fn(group: list[Sample]) ->
bool`` (True = keep). ``rollout.dynamic_filter`` names a built-in (``nonzero_std``) or a dotted import path.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Callable, Optional, Sequence

from hpcrl import names
from hpcrl.data.sample import Sample
from hpcrl.plugin_loader import PluginError, load_function

GroupFilter = Callable[[Sequence[Sample]], bool]

NONZERO_STD_EPS = 1e-6


def nonzero_std(group: Sequence[Sample]) -> bool:
    """Keep the group unless all its rewards are equal: population std of the rewards > 1e-6
    (slime ``check_reward_nonzero_std``; DAPO drops such groups because their GRPO advantages are all 0).

    Dict rewards use their ``"reward"`` entry. Raises ValueError for an unscored sample or an empty group.
    """
    if not group:
        raise ValueError("nonzero_std: empty group")
    values = [s.scalar_reward() for s in group]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return std > NONZERO_STD_EPS


BUILTIN_FILTERS = MappingProxyType({"nonzero_std": nonzero_std})
"""Built-in filters by name (read-only)."""
assert tuple(BUILTIN_FILTERS) == names.FILTERS, \
    "hpcrl.names.FILTERS must list BUILTIN_FILTERS (config validates by it)"


def get_dynamic_filter(name_or_path: Optional[str]) -> Optional[GroupFilter]:
    """The filter named by ``rollout.dynamic_filter``: None for None/empty, a built-in by name, else the
    function at a dotted import path (:func:`hpcrl.plugin_loader.load_function`). Raises PluginError for an unknown
    name without a dot or a path that does not load."""
    if name_or_path is None or not name_or_path.strip():
        return None
    name = name_or_path.strip()
    if name in BUILTIN_FILTERS:
        return BUILTIN_FILTERS[name]
    if "." not in name:
        raise PluginError(name, f"unknown dynamic filter; built-ins: {', '.join(BUILTIN_FILTERS)}, "
                                "or a dotted import path 'pkg.module.fn'")
    return load_function(name)
