"""The rollout's extension points, resolved in one place (slime's ``--rollout-function-path``,
``--custom-generate-function-path``, ``--custom-rm-path``, ``--dynamic-sampling-filter-path``,
``--data-source-path``).

Every plug-in field is a dotted import path whose default is hpcrl's built-in; the reward and the filter also
take the names of their built-ins (owned by :mod:`hpcrl.rewards.resolve` and :mod:`hpcrl.rollout.filters`):

==========================  ==============================================  ===========================================
field                       default                                         called as
==========================  ==============================================  ===========================================
``rollout.data_source``     ``hpcrl.data.source.DataSource``                ``cls(items, n_samples_per_prompt, seed=,
                                                                            shuffle=)``, then ``get_samples(n)``,
                                                                            ``add_samples(groups)``, ``state_dict()``,
                                                                            ``load_state_dict(state)``
``rollout.rollout_function``  ``hpcrl.rollout.rollout.generate_rollout``    ``async (cfg, rollout_id, data_source, ctx)
                                                                            -> RolloutOutput``
``rollout.generate_function`` ``hpcrl.rollout.generate.generate``          ``async (client, sample, sampling_params)
                                                                            -> Sample``
``rollout.reward_function``   ``task`` (or another built-in name)           ``[async] (cfg, sample) -> float | dict``
``rollout.dynamic_filter``    none (keep every group)                        ``(group) -> bool``
==========================  ==============================================  ===========================================

:func:`resolve_plugins` turns a config into the callables; config validation loads the same paths with the
same loader (:func:`hpcrl.plugin_loader.load_function`), so a bad path fails on the login node. The signatures are
pinned by ``tests/plugin_contracts/``; ``examples/plugins/`` has one working plug-in per point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from hpcrl.names import DEFAULT_DATA_SOURCE, DEFAULT_GENERATE_FUNCTION, DEFAULT_ROLLOUT_FUNCTION
from hpcrl.plugin_loader import load_function

if TYPE_CHECKING:
    from hpcrl.config import Config
    from hpcrl.data.tasks import Task


@dataclass
class RolloutPlugins:
    """The resolved extension points of a run (callables; see the module doc for their signatures)."""

    rollout_fn: Callable[..., Any]
    generate_fn: Callable[..., Any]
    reward_fn: Callable[..., Any]
    dynamic_filter: Optional[Callable[..., bool]]


def builtin_or_load(path: Optional[str], default_path: str, builtin: Any) -> Any:
    """``builtin`` itself when ``path`` is unset or names it (``default_path``, e.g.
    :data:`hpcrl.names.DEFAULT_ROLLOUT_FUNCTION`), so the default is a name a reader can follow; else the
    plug-in ``path`` loaded by :func:`~hpcrl.plugin_loader.load_function` (the same object for the default
    path: ``tests/unit/test_plugins.py`` checks it). Raises PluginError for a path that does not load."""
    return builtin if path in (None, default_path) else load_function(path)


def make_data_source(cfg: "Config", items: Sequence[dict[str, Any]]):
    """The run's data source: ``rollout.data_source`` (default :class:`hpcrl.data.source.DataSource`) built on
    the train ``items`` with ``rollout.n_samples_per_prompt``, ``run.seed`` and ``data.shuffle``. Raises
    :class:`~hpcrl.plugin_loader.PluginError` for a path that does not load, and what the class raises."""
    from hpcrl.data.source import DataSource

    cls = builtin_or_load(cfg.rollout.data_source, DEFAULT_DATA_SOURCE, DataSource)
    return cls(items, cfg.rollout.n_samples_per_prompt, seed=cfg.run.seed, shuffle=cfg.data.shuffle)


def resolve_plugins(cfg: "Config", task: Optional["Task"] = None) -> RolloutPlugins:
    """Every extension point of ``cfg.rollout`` as a callable; ``task`` is the data source's task (for the
    ``task`` reward). Raises :class:`~hpcrl.plugin_loader.PluginError` for a dotted path that does not load,
    ValueError for an unknown built-in name."""
    from hpcrl.rewards import get_reward_function
    from hpcrl.rollout.filters import get_dynamic_filter
    from hpcrl.rollout.generate import generate, get_generate_function
    from hpcrl.rollout.rollout import generate_rollout

    rc = cfg.rollout
    return RolloutPlugins(
        rollout_fn=builtin_or_load(rc.rollout_function, DEFAULT_ROLLOUT_FUNCTION, generate_rollout),
        generate_fn=get_generate_function(builtin_or_load(rc.generate_function, DEFAULT_GENERATE_FUNCTION,
                                                          generate)),
        reward_fn=get_reward_function(cfg, task),
        dynamic_filter=get_dynamic_filter(rc.dynamic_filter))
