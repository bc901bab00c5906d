"""Planning a sweep (:func:`plan_sweep`): load the base config once, expand the points, validate every point as
``hpcrl submit`` would and check that they share one Slurm shape. Writes and queues nothing."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from hpcrl.config import (FILE_FIELD, OVERRIDE_FIELD, Config, ConfigError, SweepSection, build, check_sweep,
                          set_dotted)
from hpcrl.validate import load_raw_and_check
from hpcrl.slurm.sweep.points import SweepPoint, expand_points, point_names

# ------------------------------------------------------------------------------------------------------------
# Planning: load, expand, validate every point
# ------------------------------------------------------------------------------------------------------------

@dataclass
class SweepPlan:
    """Everything :func:`submit_sweep` needs, computed before anything is written."""

    name: str
    """Sweep name (the base ``run.name``)."""
    sweep_dir: Path
    """Absolute ``run.output_dir/<name>``."""
    base: Config
    """The base config with the overrides (its ``sweep`` section is the sweep)."""
    points: list[SweepPoint]
    het: bool
    """All points are disaggregated: one het job per point instead of an array."""
    base_config: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    workdir: str = ""


def point_error(name: str, e: ConfigError) -> ConfigError:
    return type(e)(e.field, e.value, f"sweep point {name!r}: {e.problem}", e.fix)  # keeps a data error's shape


def _slurm_signature(point: SweepPoint) -> tuple:
    assert point.plan is not None and point.config is not None
    return dataclasses.replace(point.plan, job_name=""), point.config.slurm


def check_one_shape(points: list[SweepPoint], sweep: Optional[SweepSection] = None) -> None:
    """All points of an array must ask Slurm for the same thing (one array has one shape).

    Raises ConfigError naming the swept key that changes the Slurm request (``sweep.grid.slurm.nodes``), or
    ``run.placement`` when colocated and disaggregated points are mixed."""
    first = points[0]
    for p in points[1:]:
        if _slurm_signature(p) == _slurm_signature(first):
            continue
        if p.plan.het != first.plan.het:  # type: ignore[union-attr]
            raise ConfigError("run.placement", p.config.run.placement,  # type: ignore[union-attr]
                              f"sweep points {first.name!r} and {p.name!r} mix colocated and disaggregated "
                              "runs: one job array cannot hold both, and Slurm cannot make an array of "
                              "heterogeneous jobs",
                              "sweep colocated and disaggregated runs in separate sweeps")
        where, values = "sweep", None
        if sweep is not None:
            spaces = [("grid", sweep.grid), ("random_space", sweep.random_space)]
            found = [(f"sweep.{name}.{k}", v) for name, space in spaces for k, v in space.items()
                     if k.startswith(("slurm.", "train.nprocs"))]
            if found:
                where, values = found[0]
        raise ConfigError(where, values,
                          f"sweep points {first.name!r} and {p.name!r} need different Slurm resources, but "
                          "one job array gives every task the same",
                          "sweep Slurm resources in separate sweeps (one per shape)")


def plan_sweep(config: str | os.PathLike | None, overrides: Iterable[str] = (),
               cwd: str | os.PathLike | None = None) -> SweepPlan:
    """Load the sweep file, expand its points and validate each one as ``hpcrl submit`` would.

    Args:
        config: the sweep YAML (a run config with a ``sweep:`` section), or None for the defaults.
        overrides: dotted ``key=value`` overrides applied to the base before expanding (also to the sweep
            section, e.g. ``sweep.seeds=[1,2]``).
        cwd: the submit directory (a relative ``run.output_dir`` is taken from it; default the current one).

    Returns:
        A :class:`SweepPlan` whose points carry their resolved configs and Slurm plans. Writes nothing.

    Raises:
        ConfigError: the base's types or sweep section are bad, or a point is (the message names the point and
            the field; a problem of the base that every point keeps is reported as the base's), or points need
            different Slurm resources (not allowed in one array).
    """
    from hpcrl.slurm.submit import prepare_config, raw_config, with_slurm_ranks

    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    cwd = os.path.abspath(os.getcwd() if cwd is None else cwd)
    raw = raw_config(config, overrides)
    base_error: Optional[ConfigError] = None
    try:
        base = load_raw_and_check(with_slurm_ranks(copy.deepcopy(raw)))
        from hpcrl.data.datasets import check_data

        check_data(base)  # a bad data row of the base is the base's error, not every point's
    except ConfigError as e:
        # The base is never run, only its points: a base that is invalid as it stands (num_rollout below
        # lr_warmup_steps, with num_rollout swept) is fine when every point is valid. Its sweep section and
        # types must be right, though.
        if e.field.split(".")[0] == "sweep" or e.field in (FILE_FIELD, OVERRIDE_FIELD):
            raise
        base, base_error = build(raw), e
        check_sweep(base)
    assignments = expand_points(base.sweep)
    names = point_names(assignments)
    output_dir = os.path.normpath(os.path.join(cwd, base.run.output_dir))
    sweep_dir = Path(output_dir) / base.run.name
    raw.pop("sweep", None)
    points = []
    for i, (name, values) in enumerate(zip(names, assignments)):
        try:
            raw_p = copy.deepcopy(raw)
            for key, value in values.items():
                set_dotted(raw_p, key, copy.deepcopy(value))
            set_dotted(raw_p, "run.name", name)
            set_dotted(raw_p, "run.output_dir", str(sweep_dir))
            cfg = build(raw_p)
            if cfg.wandb.mode != "disabled" and cfg.wandb.group is None:
                cfg.wandb.group = base.run.name  # a sweep's points share a W&B group (hpcrl.tracking)
            cfg, plan = prepare_config(cfg, cwd=cwd)
        except ConfigError as e:
            if base_error is not None and e.field == base_error.field:
                raise base_error from None  # the base's own problem, not one the sweep made
            raise point_error(name, e) from None
        points.append(SweepPoint(index=i, name=name, overrides=dict(values), run_dir=sweep_dir / name,
                                 config=cfg, plan=plan))
    het = all(p.plan.het for p in points)  # type: ignore[union-attr]
    if not het:
        check_one_shape(points, base.sweep)
    return SweepPlan(name=base.run.name, sweep_dir=sweep_dir, base=base, points=points, het=het,
                     base_config=None if config is None else os.path.abspath(config), overrides=overrides,
                     workdir=cwd)
