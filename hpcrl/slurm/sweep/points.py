"""Sweep points: the product grid x random x seeds (:func:`expand_points`) and their names (:func:`point_names`);
pure functions of the ``sweep:`` section, nothing read or written. The rules are in :mod:`hpcrl.slurm.sweep`."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from hpcrl.config import Config, ConfigError, SweepSection
from hpcrl.slurm.resources import JobPlan

MAX_POINT_NAME = 120
"""Longest point name in characters (longer ones are cut and end with a hash)."""

SEED_KEY = "run.seed"

_NAME_BAD = re.compile(r"[^A-Za-z0-9._+=,@-]")

_UNSWEEPABLE = ("run.name", "run.output_dir")


# ------------------------------------------------------------------------------------------------------------
# Points: expansion and names
# ------------------------------------------------------------------------------------------------------------

@dataclass
class SweepPoint:
    """One point of a sweep."""

    index: int
    """Position in the sweep (0-based; the array task index of the first submission)."""
    name: str
    """Folder and run name (see the module docstring)."""
    overrides: dict[str, Any]
    """Dotted key -> value set on the base config, in point order (grid, random, seed)."""
    run_dir: Optional[Path] = None
    """Absolute run folder ``<sweep folder>/<name>``."""
    config: Optional[Config] = None
    """The resolved config as written to ``run_dir/config.yaml`` (not in the manifest)."""
    plan: Optional[JobPlan] = None
    """Its Slurm plan (not in the manifest)."""


def _random_assignments(sweep: SweepSection) -> list[dict[str, Any]]:
    keys = list(sweep.random_space)
    choices = [sweep.random_space[k] for k in keys]
    total = math.prod(len(c) for c in choices)
    if sweep.num_random > total:
        raise ConfigError("sweep.num_random", sweep.num_random,
                          f"asks for more distinct random points than the {total} combinations of "
                          "sweep.random_space",
                          f"lower sweep.num_random to at most {total} or add choices to sweep.random_space")
    rng = random.Random(sweep.random_seed)
    out = []
    for flat in rng.sample(range(total), sweep.num_random):
        point: dict[str, Any] = {}
        for key, values in reversed(list(zip(keys, choices))):  # mixed radix, the last key varies fastest
            flat, i = divmod(flat, len(values))
            point[key] = values[i]
        out.append({k: point[k] for k in keys})
    return out


def expand_points(sweep: SweepSection) -> list[dict[str, Any]]:
    """The assignments (dotted key -> value) of every point: grid x random x seeds, in that order.

    Deterministic: the same section gives the same list (random points come from
    ``random.Random(sweep.random_seed)``, distinct, without replacement). Sizes: ``prod(len(grid values)) *
    max(num_random, 1 if no random) * max(len(seeds), 1)``.

    Raises:
        ConfigError: nothing to sweep (field ``sweep``); a key in two of grid / random_space / seeds; a swept
            ``run.name`` / ``run.output_dir``; ``num_random`` above the number of distinct random
            combinations.
    """
    if not sweep.grid and not sweep.seeds and sweep.num_random == 0:
        raise ConfigError("sweep", dataclasses.asdict(sweep), "nothing to sweep",
                          "add sweep.grid (dotted key -> list of values), sweep.seeds, or sweep.num_random "
                          "with sweep.random_space")
    for key in list(sweep.grid) + list(sweep.random_space):
        where = "grid" if key in sweep.grid else "random_space"
        if key in _UNSWEEPABLE:
            space = sweep.grid if where == "grid" else sweep.random_space
            raise ConfigError(f"sweep.{where}.{key}", space[key],
                              "the sweep names the run folders of its points "
                              "(run.output_dir/<run.name>/<point>)",
                              "sweep other fields; set run.name and run.output_dir once for the whole sweep")
    both = [k for k in sweep.random_space if k in sweep.grid]
    if both:
        raise ConfigError(f"sweep.random_space.{both[0]}", sweep.random_space[both[0]],
                          "is also in sweep.grid", "sweep each key in the grid or in random_space, not both")
    if sweep.seeds:
        for where, space in (("grid", sweep.grid), ("random_space", sweep.random_space)):
            if SEED_KEY in space:
                raise ConfigError("sweep.seeds", sweep.seeds, f"run.seed is also in sweep.{where}",
                                  "list the seeds in sweep.seeds only")
    grid_keys = list(sweep.grid)
    grid = [dict(zip(grid_keys, combo)) for combo in itertools.product(*(sweep.grid[k] for k in grid_keys))]
    rand = _random_assignments(sweep) if sweep.num_random else [{}]
    seeds = [{SEED_KEY: s} for s in sweep.seeds] or [{}]
    return [{**g, **r, **s} for g in grid for r in rand for s in seeds]


def format_value(value: Any) -> str:
    """A swept value as it appears in point names (see the module docstring)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def key_labels(keys: Iterable[str]) -> dict[str, str]:
    """Dotted key -> its label in point names: the last part, or the whole key where last parts clash."""
    keys = list(dict.fromkeys(keys))
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (leaf if leaves.count(leaf) == 1 else k) for k, leaf in zip(keys, leaves)}


def sanitize_name(text: str, limit: int = MAX_POINT_NAME) -> str:
    """``text`` as a folder and Slurm job name: ``[A-Za-z0-9._+=,@-]`` only (others -> ``_``), starting with a
    letter or digit, at most ``limit`` characters (a longer one is cut and ends with ``-`` + 8 hex digits of
    the SHA-1 of ``text``)."""
    name = _NAME_BAD.sub("_", text)
    if not name or not name[0].isalnum():
        name = "p" + name
    if len(name) > limit:
        digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:8]
        name = name[: limit - 9] + "-" + digest
    return name


def point_names(assignments: Sequence[Mapping[str, Any]]) -> list[str]:
    """Deterministic, unique, sanitized names of the points (see the module docstring)."""
    labels = key_labels(k for a in assignments for k in a)
    names: list[str] = []
    seen: set[str] = set()
    for i, a in enumerate(assignments):
        name = sanitize_name(",".join(f"{labels[k]}={format_value(v)}" for k, v in a.items()) or "base")
        if name in seen:
            name = sanitize_name(f"{name}-{i}")
        seen.add(name)
        names.append(name)
    return names
