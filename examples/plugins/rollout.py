"""A rollout function plug-in (``rollout.rollout_function: plugins.rollout.counted_rollout``).

Signature: ``async def rollout(cfg, rollout_id, data_source, ctx) -> RolloutOutput``: one rollout step's kept
groups and metrics (slime ``--rollout-function-path``). This one runs the built-in
:func:`hpcrl.rollout.rollout.generate_rollout` and adds a metric.
"""

from __future__ import annotations

from hpcrl.rollout.rollout import generate_rollout


async def counted_rollout(cfg, rollout_id: int, data_source, ctx):
    """The built-in rollout, plus ``rollout/example_samples``: the number of samples it kept."""
    out = await generate_rollout(cfg, rollout_id, data_source, ctx)
    out.metrics["rollout/example_samples"] = float(sum(len(g) for g in out.groups))
    return out
