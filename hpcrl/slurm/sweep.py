"""``hpcrl sweep``: a hyperparameter sweep as one Slurm job array, its status, report and resubmission.

A sweep file is a normal run config with a ``sweep:`` section (:class:`hpcrl.config.SweepSection`)::

    run: {name: lr-sweep, output_dir: runs}
    ...                              # the base run, as for hpcrl submit
    sweep:
      grid: {train.lr: [3.0e-5, 1.0e-4], rollout.temperature: [0.8, 1.0]}   # cartesian product
      seeds: [1, 2, 3]                                                      # product over run.seed
      num_random: 4                  # random points drawn from random_space (without replacement)
      random_space: {algorithm.eps_clip: [0.1, 0.2, 0.3], train.weight_decay: [0.0, 0.01]}
      random_seed: 0
      array_parallelism: 8           # at most this many array tasks run at once

Points
    The points are the product *grid x random x seeds*, a missing factor counting as one empty assignment:
    every grid combination (keys in file order, the last key varying fastest), combined with each of the
    ``num_random`` random assignments, each run once per seed. Random assignments pick one value per
    ``random_space`` key; they are ``num_random`` distinct combinations drawn without replacement with
    ``random.Random(random_seed)``, so the same file gives the same points. ``random_space`` lists the
    choices of each key (for a log-uniform learning rate, list the values: ``[1.0e-5, 3.0e-5, 1.0e-4]``).
    A key may appear in only one of grid / random_space / seeds (``seeds`` is ``run.seed``); ``run.name``,
    ``run.output_dir`` and ``sweep.*`` cannot be swept.

Point names
    ``<key>=<value>`` for each swept key, joined with ``,`` in point order (grid keys, random keys, then
    ``seed``): ``lr=3e-05,seed=1``. ``<key>`` is the last part of the dotted key, or the whole dotted key
    where two swept keys share their last part (``train.lr`` and ``sft.lr``). Values: integers as is, floats
    as Python's shortest round-trip repr (``3e-05``, ``0.00015``), booleans ``true``/``false``, null ``null``,
    strings as is, lists/mappings as compact JSON. Characters outside ``[A-Za-z0-9._+=,@-]`` become ``_``; a
    name longer than :data:`MAX_POINT_NAME` is cut and ends with 8 hex digits of its SHA-1; a name equal to an
    earlier one after that gets ``-<point index>``. The point name is the run's ``run.name``.

Folders
    ``run.output_dir/<sweep name>/`` (``<sweep name>`` is the base ``run.name``) holds :data:`SWEEP_FILE`
    (the manifest), ``submission.sbatch`` (the array script as submitted; ``resubmission-K.sbatch`` for later
    submissions), ``submitit/`` (pickles and task logs ``<array id>_<index>_0_log.{out,err}``), and one run
    folder per point, ``<sweep name>/<point name>/``, with its resolved ``config.yaml`` (the base with the
    point's values; the ``sweep`` section emptied), ``logs/`` and, once submitted, ``job.json`` (job id
    ``<array id>_<index>``), so ``hpcrl status|logs|cancel POINT_FOLDER`` work on one point.

Order of :func:`submit_sweep` (nothing is written or queued until every check has passed): load the base
config with the overrides (its types and sweep section must be valid; a base that fails another check is
accepted when every point passes, since only the points run: e.g. ``train.lr_warmup_steps`` above the base's
``run.num_rollout`` with ``run.num_rollout`` swept); expand the points; validate every point as ``hpcrl
submit`` would (a bad point is a one-line :class:`~hpcrl.config.ConfigError` naming the point and the field;
a point failing on the field the base failed on gets the base's error, naming no point); check that every
point asks Slurm for the same resources (one array has one shape); then write the folders and the manifest
and submit one job array with submitit's ``executor.submit_array``
(``--array=0-<N-1>%<sweep.array_parallelism>``) whose task *i* runs :class:`~hpcrl.slurm.entry.SlurmEntry`
of point *i*'s ``config.yaml``: the very function job ``hpcrl submit`` pickles for that config, so each task
is preempted, requeued (``scontrol requeue <id>_<i>``, never the bare raw job id, which for the array's last
task requeues every task) and resumed like a single run. The array's parameters are those ``hpcrl submit``
would use for the first point (every point has the same, see above), with the job name ``<sweep name>``, a
per-task ``HPCRL_RUN_DIR`` and, with ``slurm.container``, the folders of every point bound into the
container.

Disaggregated runs (``run.placement: disaggregate``) are heterogeneous jobs, and Slurm cannot make a job array
of heterogeneous jobs. A sweep whose points are all disaggregated is submitted as **one het job per point**
(each exactly what ``hpcrl submit`` submits for that point); ``sweep.array_parallelism`` does not apply to
them (all are queued at once) and the manifest has ``"het": true`` and no array ids. A sweep mixing colocated
and disaggregated points is a ConfigError.

Manifest (``sweep.json``, rewritten atomically)::

    {"version": 1, "name": "lr-sweep", "sweep_dir": "/abs/runs/lr-sweep", "workdir": "/abs/submit/dir",
     "base_config": "/abs/lr-sweep.yaml", "overrides": ["run.num_rollout=50"],
     "sweep": {... the sweep section ...}, "het": false, "array_parallelism": 8,
     "created_at": "2026-...+00:00", "hpcrl_version": "...",
     "submissions": [{"kind": "array", "array_job_id": "123", "points": ["lr=3e-05,seed=1", ...],
                      "script": "/abs/.../submission.sbatch", "submitted_at": "..."}],
     "points": [{"index": 0, "name": "lr=3e-05,seed=1", "overrides": {"train.lr": 3e-05, "run.seed": 1},
                 "run_dir": "/abs/runs/lr-sweep/lr=3e-05,seed=1", "job_id": "123_0", "array_job_id": "123",
                 "task_index": 0, "previous_job_ids": []}, ...]}

``job_id``/``array_job_id``/``task_index`` are null after ``--dry-run`` (and ``submissions`` empty); for a het
sweep ``job_id`` is the point's het job id and ``array_job_id``/``task_index`` are null.

Resubmission (:func:`resubmit_sweep`): points whose job ended FAILED, TIMEOUT, CANCELLED, NODE_FAIL,
OUT_OF_MEMORY, BOOT_FAIL, DEADLINE or PREEMPTED (:data:`RESUBMIT_STATES`), or the points named, go into a new
job array of just those points (task *j* = the *j*-th of them; each run folder resumes from its newest
checkpoint, as a requeued job does); the manifest records the new ids, the old ones in ``previous_job_ids``.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import datetime
import hashlib
import io
import contextlib
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from hpcrl.config import (FILE_FIELD, OVERRIDE_FIELD, Config, ConfigError, SweepSection, build, check_sweep,
                          load_config, load_raw, set_dotted)
from hpcrl.fsutil import atomic_write_text
from hpcrl.slurm import SCRIPT_FILE, SUBMITIT_DIR, SlurmCommandError
from hpcrl.slurm.resources import JobPlan
from hpcrl.slurm.state import (FINAL_STATES, NOT_SUBMITTED, UNKNOWN, Runner, attempt_dirs, query_states,
                               run_command, write_job_file)

SWEEP_FILE = "sweep.json"
"""The sweep folder's manifest."""
REPORT_CSV = "report.csv"
REPORT_PNG = "report.png"
MANIFEST_VERSION = 1
MAX_POINT_NAME = 120
"""Longest point name in characters (longer ones are cut and end with a hash)."""
SEED_KEY = "run.seed"
RESUBMIT_STATES = frozenset({"FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                             "DEADLINE", "PREEMPTED"})
"""Final Slurm states after which ``hpcrl sweep --resubmit`` resubmits a point by default."""
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


def _point_error(name: str, e: ConfigError) -> ConfigError:
    return type(e)(e.field, e.value, f"sweep point {name!r}: {e.problem}", e.fix)  # keeps a data error's shape


def _slurm_signature(point: SweepPoint) -> tuple:
    assert point.plan is not None and point.config is not None
    return dataclasses.replace(point.plan, job_name=""), point.config.slurm


def _check_one_shape(points: list[SweepPoint], sweep: Optional[SweepSection] = None) -> None:
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
        base = load_raw(with_slurm_ranks(copy.deepcopy(raw)))
        from hpcrl.data.sources import check_data

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
            cfg, plan = prepare_config(build(raw_p), cwd=cwd)
        except ConfigError as e:
            if base_error is not None and e.field == base_error.field:
                raise base_error from None  # the base's own problem, not one the sweep made
            raise _point_error(name, e) from None
        points.append(SweepPoint(index=i, name=name, overrides=dict(values), run_dir=sweep_dir / name,
                                 config=cfg, plan=plan))
    het = all(p.plan.het for p in points)  # type: ignore[union-attr]
    if not het:
        _check_one_shape(points, base.sweep)
    return SweepPlan(name=base.run.name, sweep_dir=sweep_dir, base=base, points=points, het=het,
                     base_config=None if config is None else os.path.abspath(config), overrides=overrides,
                     workdir=cwd)


# ------------------------------------------------------------------------------------------------------------
# The array job
# ------------------------------------------------------------------------------------------------------------

def run_dir_setup_line(run_dirs: Sequence[str | os.PathLike]) -> str:
    """The setup line that exports ``HPCRL_RUN_DIR`` of array task ``$SLURM_ARRAY_TASK_ID`` (a bash array
    of the run folders, indexed by the task id)."""
    words = " ".join(shlex.quote(str(d)) for d in run_dirs)
    return f'_hpcrl_runs=({words}); export HPCRL_RUN_DIR="${{_hpcrl_runs[$SLURM_ARRAY_TASK_ID]}}"'


def make_array_executor(points: Sequence[SweepPoint], name: str, sweep_dir: Path, array_parallelism: int,
                        cwd: str, environ: Mapping[str, str], python: Optional[str] = None,
                        render_only: bool = False):
    """The :class:`~hpcrl.slurm.executor.HetSlurmExecutor` of one array over ``points`` (in task order).

    The parameters are those of a single run of the first point (all points share them, see
    :func:`plan_sweep`) with the job name ``name``, submitit's folder ``sweep_dir/submitit``,
    ``array_parallelism`` and a per-task ``HPCRL_RUN_DIR``; ``always_array`` so one point is an array too.
    """
    from hpcrl.slurm.container import BINDS_ENV, container_binds
    from hpcrl.slurm.submit import make_executor

    first = points[0]
    assert first.config is not None and first.plan is not None
    plan = dataclasses.replace(first.plan, job_name=name)
    if first.config.slurm.container:  # bind what every point needs, not only the first one's files
        binds = [b for p in points
                 for b in container_binds(p.config, sweep_dir, cwd, environ)]  # type: ignore[arg-type]
        environ = {**environ, BINDS_ENV: ",".join(dict.fromkeys(binds))}
    ex = make_executor(first.config, plan, sweep_dir, cwd, environ, python=python, render_only=render_only)
    setup = [line for line in ex.parameters["setup"] if not line.startswith("export HPCRL_RUN_DIR=")]
    setup.append(run_dir_setup_line([p.run_dir for p in points]))  # type: ignore[misc]
    ex.update_parameters(setup=setup, array_parallelism=array_parallelism)
    ex.always_array = True
    return ex


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _submit_array(points: Sequence[SweepPoint], name: str, sweep_dir: Path, array_parallelism: int, cwd: str,
                  environ: Mapping[str, str], python: Optional[str], dry_run: bool, script_path: Path
                  ) -> tuple[str, Optional[str]]:
    """Render (and unless ``dry_run`` submit) one array over ``points``. Returns ``(script, array job
    id)``."""
    ex = make_array_executor(points, name, sweep_dir, array_parallelism, cwd, environ, python,
                             render_only=dry_run)
    script = ex.render(map_count=len(points))
    script_path.write_text(script, encoding="utf-8")
    if dry_run:
        return script, None
    from hpcrl.slurm.entry import SlurmEntry

    requeue = points[0].plan.requeue  # type: ignore[union-attr]
    entries = [SlurmEntry(p.run_dir / "config.yaml", requeue=requeue)  # type: ignore[operator]
               for p in points]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit also prints sbatch's stderr
            jobs = ex.submit_array(entries)
    except Exception as e:  # submitit wraps sbatch's error; report it as one line
        why = " ".join(str(e).split())[:400]
        raise SlurmCommandError(f"hpcrl sweep: sbatch refused the job array: {why}", exit_code=1) from None
    return script, str(jobs[0].job_id).split("_")[0]


def _point_job_record(point: dict, sweep_dir: Path, script: Path, workdir: str, plan: JobPlan) -> dict:
    from hpcrl import __version__

    logs = sweep_dir / SUBMITIT_DIR
    job_id = point["job_id"]
    return {"job_id": job_id, "launcher": "submitit-array", "placement": plan.placement, "het": False,
            "job_name": plan.job_name, "config": str(Path(point["run_dir"]) / "config.yaml"),
            "script": str(script), "stdout": str(logs / f"{job_id}_0_log.out"),
            "stderr": str(logs / f"{job_id}_0_log.err"), "workdir": workdir, "submitted_at": _now(),
            "hpcrl_version": __version__, "previous_job_ids": list(point.get("previous_job_ids", [])),
            "sweep": str(sweep_dir), "array_job_id": point["array_job_id"], "task_index": point["task_index"]}


# ------------------------------------------------------------------------------------------------------------
# Manifest
# ------------------------------------------------------------------------------------------------------------

def write_manifest(sweep_dir: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    """Write ``sweep_dir/sweep.json`` atomically (temp file + ``os.replace``). Returns its path."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(sweep_dir / SWEEP_FILE, json.dumps(manifest, indent=2) + "\n")


def find_sweep(target: str | os.PathLike) -> Optional[Path]:
    """The sweep folder named by ``target`` (the folder, or its ``sweep.json``); None when it is not one."""
    path = Path(target)
    if path.name == SWEEP_FILE and path.is_file():
        return path.parent
    return path if (path / SWEEP_FILE).is_file() else None


def read_manifest(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    """``sweep_dir/sweep.json`` (``sweep_dir`` may also be the file itself).

    Raises SlurmCommandError (exit 2) when it is missing or unreadable."""
    found = find_sweep(sweep_dir)
    if found is None:
        raise SlurmCommandError(f"SWEEP={str(sweep_dir)!r}: not a sweep folder (no {SWEEP_FILE}); give the "
                                "folder hpcrl sweep wrote, run.output_dir/<run.name>")
    try:
        data = json.loads((found / SWEEP_FILE).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("points"), list):
            raise ValueError("no points")
    except (OSError, ValueError) as e:
        raise SlurmCommandError(f"SWEEP={str(sweep_dir)!r}: cannot read {found / SWEEP_FILE} ({e})") from None
    data["sweep_dir"] = str(found.absolute())
    return data


def point_states(manifest: Mapping[str, Any], runner: Runner = run_command) -> dict[str, str]:
    """Point name -> Slurm state of its job (:data:`~hpcrl.slurm.state.NOT_SUBMITTED` without one), with one
    squeue and at most one sacct call for the whole sweep (array tasks ``<id>_<i>``)."""
    ids = [str(p["job_id"]) for p in manifest["points"] if p.get("job_id")]
    states = query_states(ids, runner)
    return {p["name"]: states.get(str(p["job_id"]), UNKNOWN) if p.get("job_id") else NOT_SUBMITTED
            for p in manifest["points"]}


def _check_no_live_jobs(manifest: Optional[Mapping[str, Any]], names: Optional[set[str]] = None,
                        runner: Runner = run_command) -> None:
    if not manifest:
        return
    states = point_states(manifest, runner)
    live = [(n, s) for n, s in states.items()
            if (names is None or n in names) and s not in FINAL_STATES and s not in (UNKNOWN, NOT_SUBMITTED)]
    if live:
        shown = ", ".join(f"{n} ({s})" for n, s in live[:5]) + (" ..." if len(live) > 5 else "")
        raise SlurmCommandError(f"hpcrl sweep: {manifest['sweep_dir']} has points still queued or running: "
                                f"{shown}; wait for them or scancel them first")


# ------------------------------------------------------------------------------------------------------------
# submit
# ------------------------------------------------------------------------------------------------------------

@dataclass
class SweepResult:
    """What :func:`submit_sweep` / :func:`resubmit_sweep` did."""

    sweep_dir: Path
    manifest_path: Path
    points: list[str]
    """Names of the points submitted (all of them, or the resubmitted ones)."""
    job_ids: dict[str, Optional[str]]
    """Point name -> its job id (``<array>_<i>``, or the het job id); None for a dry run."""
    array_job_id: Optional[str]
    """The array's job id; None for a dry run or a het sweep."""
    het: bool
    scripts: list[Path]
    """The sbatch scripts written (one for an array; one per point, in the run folders, for a het sweep)."""
    script: str
    """The array's sbatch text (a het sweep: the scripts one after another, each under a comment line)."""
    array_parallelism: int

    @property
    def dry_run(self) -> bool:
        return all(v is None for v in self.job_ids.values())


def _het_submit(points: Sequence[SweepPoint], dry_run: bool, cwd: str, environ: Mapping[str, str],
                python: Optional[str], ids: dict[str, Optional[str]]) -> tuple[list[Path], str]:
    """One ``hpcrl submit`` per point (disaggregated: Slurm has no arrays of het jobs). Fills ``ids`` (point
    name -> job id) as it goes, so a caller still knows the jobs queued before a refusal."""
    from hpcrl.slurm.submit import submit

    paths, texts = [], []
    for p in points:
        r = submit(p.config, dry_run=dry_run, cwd=cwd, environ=environ, python=python)
        ids[p.name] = r.job_id
        paths.append(r.script_path)
        texts.append(f"# ---- point {p.name}: {r.script_path}\n{r.script}")
    return paths, "".join(t if t.endswith("\n") else t + "\n" for t in texts)


def submit_sweep(config: str | os.PathLike | None, overrides: Iterable[str] = (), dry_run: bool = False, *,
                 cwd: str | os.PathLike | None = None, environ: Optional[Mapping[str, str]] = None,
                 python: Optional[str] = None, runner: Runner = run_command) -> SweepResult:
    """Validate every point, write the sweep folder and submit one job array (or only write it, ``dry_run``).

    Args:
        config: the sweep YAML; overrides: dotted ``key=value`` overrides of the base (see
            :func:`plan_sweep`).
        dry_run: write the point folders (``config.yaml``, ``logs/``), ``submission.sbatch`` and
            ``sweep.json`` (no job ids) but submit nothing (needs no Slurm).
        cwd: the submit directory (default the current one); environ: for the container wrapping (default
            ``os.environ``); python: shell words that start python in the job (default this interpreter).
        runner: runs squeue/sacct for the live-job check (injectable for tests).

    Returns:
        A :class:`SweepResult`.

    Raises:
        ConfigError: a bad base, sweep section or point (nothing written or queued).
        SlurmCommandError: no ``sbatch`` on PATH, points of an earlier submission to the same sweep folder
            still queued or running, or ``dry_run`` over a sweep folder that was submitted (its manifest would
            lose the job ids) (exit 2, nothing written or queued); sbatch refused the array (exit 1; the
            folders and the manifest are written, without job ids; for a het sweep the manifest records the
            points queued before the refusal).
        OSError: the folders cannot be written.
    """
    environ = os.environ if environ is None else environ
    cwd = os.path.abspath(os.getcwd() if cwd is None else cwd)
    sp = plan_sweep(config, overrides, cwd)
    manifest_path = sp.sweep_dir / SWEEP_FILE
    if not dry_run and shutil.which("sbatch") is None:
        raise SlurmCommandError("hpcrl sweep: sbatch not found on PATH; submit from a Slurm login node (or "
                                "module load slurm), or use --dry-run to only write the sweep folder")
    old: Optional[dict] = read_manifest(sp.sweep_dir) if manifest_path.is_file() else None
    if dry_run and old and old.get("submissions"):
        raise SlurmCommandError(f"hpcrl sweep --dry-run: {sp.sweep_dir} holds a submitted sweep; a dry run "
                                f"would overwrite its {SWEEP_FILE} and lose its job ids; preview under "
                                f"another name (run.name={sp.name}-preview)")
    if not dry_run:
        _check_no_live_jobs(old, runner=runner)
    from hpcrl import __version__
    from hpcrl.config import save_resolved

    parallelism = sp.base.sweep.array_parallelism
    sp.sweep_dir.mkdir(parents=True, exist_ok=True)
    for p in sp.points:
        (p.run_dir / "logs").mkdir(parents=True, exist_ok=True)  # type: ignore[operator]
        save_resolved(p.config, p.run_dir)  # type: ignore[arg-type]
    previous = {q["name"]: [*q.get("previous_job_ids", []), *([q["job_id"]] if q.get("job_id") else [])]
                for q in (old or {}).get("points", [])}
    manifest: dict[str, Any] = {
        "version": MANIFEST_VERSION, "name": sp.name, "sweep_dir": str(sp.sweep_dir), "workdir": cwd,
        "base_config": sp.base_config, "overrides": sp.overrides, "sweep": dataclasses.asdict(sp.base.sweep),
        "het": sp.het, "array_parallelism": parallelism, "created_at": _now(), "hpcrl_version": __version__,
        "submissions": [],
        "points": [{"index": p.index, "name": p.name, "overrides": p.overrides, "run_dir": str(p.run_dir),
                    "job_id": None, "array_job_id": None, "task_index": None,
                    "previous_job_ids": previous.get(p.name, [])} for p in sp.points],
    }
    write_manifest(sp.sweep_dir, manifest)  # before submitting: a refused array leaves a readable sweep
    if sp.het:
        ids: dict[str, Optional[str]] = {}
        try:
            scripts, script = _het_submit(sp.points, dry_run, cwd, environ, python, ids)
        finally:  # also when sbatch refused a point: record the jobs already queued
            for q in manifest["points"]:
                q["job_id"] = ids.get(q["name"])
            if not dry_run and any(ids.values()):
                manifest["submissions"].append({"kind": "het", "array_job_id": None,
                                                "points": [n for n, j in ids.items() if j], "job_ids": ids,
                                                "submitted_at": _now()})
                write_manifest(sp.sweep_dir, manifest)
        array_id = None
    else:
        script_path = sp.sweep_dir / SCRIPT_FILE
        script, array_id = _submit_array(sp.points, sp.name, sp.sweep_dir, parallelism, cwd, environ, python,
                                         dry_run, script_path)
        scripts = [script_path]
        ids = {p.name: (f"{array_id}_{p.index}" if array_id else None) for p in sp.points}
        if array_id is not None:
            plan = dataclasses.replace(sp.points[0].plan, job_name=sp.name)  # type: ignore[arg-type]
            for q in manifest["points"]:
                q.update(job_id=f"{array_id}_{q['index']}", array_job_id=array_id, task_index=q["index"])
                write_job_file(q["run_dir"], _point_job_record(q, sp.sweep_dir, script_path, cwd, plan))
            manifest["submissions"].append({"kind": "array", "array_job_id": array_id,
                                            "points": [p.name for p in sp.points], "script": str(script_path),
                                            "submitted_at": _now()})
    write_manifest(sp.sweep_dir, manifest)
    return SweepResult(sweep_dir=sp.sweep_dir, manifest_path=manifest_path,
                       points=[p.name for p in sp.points], job_ids=ids, array_job_id=array_id, het=sp.het,
                       scripts=scripts, script=script, array_parallelism=parallelism)


# ------------------------------------------------------------------------------------------------------------
# resubmit
# ------------------------------------------------------------------------------------------------------------

def _select_points(manifest: Mapping[str, Any], names: Optional[Sequence[str]], states: Mapping[str, str]
                   ) -> list[dict]:
    by_name = {p["name"]: p for p in manifest["points"]}
    if names is None:
        return [p for p in manifest["points"] if states.get(p["name"]) in RESUBMIT_STATES]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SlurmCommandError(f"--points: {unknown[0]!r} is not a point of {manifest['sweep_dir']}; its "
                                "points: " + ", ".join(by_name))
    picked = [by_name[n] for n in dict.fromkeys(names)]
    live = [(p["name"], states[p["name"]]) for p in picked
            if states[p["name"]] not in FINAL_STATES and states[p["name"]] not in (UNKNOWN, NOT_SUBMITTED)]
    if live:
        raise SlurmCommandError(f"--points: {live[0][0]!r} is still {live[0][1]} (job "
                                f"{by_name[live[0][0]]['job_id']}); wait for it or scancel it first")
    return picked


def resubmit_sweep(sweep_dir: str | os.PathLike, points: Optional[Sequence[str]] = None,
                   dry_run: bool = False, *, environ: Optional[Mapping[str, str]] = None,
                   python: Optional[str] = None, runner: Runner = run_command) -> SweepResult:
    """Resubmit some points of a sweep as a new job array of just those points (or one het job each).

    Runs in the sweep's submit directory (``workdir`` in the manifest), as the first submission did. Each
    point's ``config.yaml`` is validated again; its run folder resumes from its newest checkpoint.

    Args:
        sweep_dir: the sweep folder (or its ``sweep.json``).
        points: point names; default the points whose job ended in one of :data:`RESUBMIT_STATES`.
        dry_run: write the array script (``resubmission-K.sbatch``) but submit nothing and keep the manifest.
        environ, python, runner: as for :func:`submit_sweep`.

    Returns:
        A :class:`SweepResult` whose ``points`` are the resubmitted ones (empty: nothing to resubmit).

    Raises:
        SlurmCommandError: not a sweep folder, an unknown point name, a named point still queued or running,
            no sbatch (exit 2); sbatch refused the array (exit 1).
        ConfigError: a point's ``config.yaml`` no longer validates (the message names the point).
    """
    from hpcrl.slurm.submit import prepare_config

    manifest = read_manifest(sweep_dir)
    sdir = Path(manifest["sweep_dir"])
    environ = os.environ if environ is None else environ
    states = point_states(manifest, runner)
    picked = _select_points(manifest, points, states)
    workdir = manifest.get("workdir") or os.getcwd()
    het = bool(manifest.get("het"))
    parallelism = int(manifest.get("array_parallelism") or 1)
    result = SweepResult(sweep_dir=sdir, manifest_path=sdir / SWEEP_FILE, points=[p["name"] for p in picked],
                         job_ids={p["name"]: None for p in picked}, array_job_id=None, het=het, scripts=[],
                         script="", array_parallelism=parallelism)
    if not picked:
        return result
    if not dry_run and shutil.which("sbatch") is None:
        raise SlurmCommandError("hpcrl sweep --resubmit: sbatch not found on PATH; run it on a Slurm login "
                                "node")
    chdir = contextlib.chdir(workdir) if os.path.isdir(workdir) else contextlib.nullcontext()
    with chdir:
        sweep_points = []
        for j, q in enumerate(picked):
            try:
                cfg, plan = prepare_config(load_config(Path(q["run_dir"]) / "config.yaml"), cwd=workdir)
            except ConfigError as e:
                raise _point_error(q["name"], e) from None
            sweep_points.append(SweepPoint(index=j, name=q["name"], overrides=q.get("overrides", {}),
                                           run_dir=Path(q["run_dir"]), config=cfg, plan=plan))
        if het:
            ids = {}
            try:
                scripts, script = _het_submit(sweep_points, dry_run, workdir, environ, python, ids)
            except SlurmCommandError:
                if not dry_run and any(ids.values()):  # record the jobs queued before the refusal
                    _record_resubmission(manifest, sdir, [q for q in picked if ids.get(q["name"])], ids, None,
                                         [], True, workdir, None)
                raise
            array_id = None
        else:
            _check_one_shape(sweep_points)
            k = len(manifest.get("submissions", []))
            script_path = sdir / f"resubmission-{max(k, 1)}.sbatch"
            script, array_id = _submit_array(sweep_points, manifest["name"], sdir, parallelism, workdir,
                                             environ, python, dry_run, script_path)
            scripts = [script_path]
            ids = {p.name: (f"{array_id}_{p.index}" if array_id else None) for p in sweep_points}
    result.job_ids, result.array_job_id, result.scripts, result.script = ids, array_id, scripts, script
    if dry_run:
        return result
    plan = None if het else dataclasses.replace(sweep_points[0].plan,  # type: ignore[arg-type]
                                                job_name=manifest["name"])
    _record_resubmission(manifest, sdir, picked, ids, array_id, scripts, het, workdir, plan)
    return result


def _record_resubmission(manifest: dict, sdir: Path, picked: Sequence[dict], ids: Mapping[str, Optional[str]],
                         array_id: Optional[str], scripts: Sequence[Path], het: bool, workdir: str,
                         plan: Optional[JobPlan]) -> None:
    """Point records of a resubmission (old ids to ``previous_job_ids``), the array points' ``job.json``, and
    the submission in the manifest, which is rewritten."""
    for j, q in enumerate(picked):
        if q.get("job_id"):
            q["previous_job_ids"] = [*q.get("previous_job_ids", []), q["job_id"]]
        q["job_id"] = ids[q["name"]]
        q["array_job_id"], q["task_index"] = (array_id, j) if array_id else (None, None)
        if array_id and plan is not None:
            write_job_file(q["run_dir"], _point_job_record(q, sdir, scripts[0], workdir, plan))
    manifest.setdefault("submissions", []).append(
        {"kind": "het" if het else "array", "array_job_id": array_id, "points": [q["name"] for q in picked],
         **({"job_ids": dict(ids)} if het else {"script": str(scripts[0])}), "submitted_at": _now(),
         "resubmit": True})
    write_manifest(sdir, manifest)


# ------------------------------------------------------------------------------------------------------------
# status and report
# ------------------------------------------------------------------------------------------------------------

@dataclass
class PointStatus:
    """One row of ``hpcrl status SWEEP`` and of ``report.csv``."""

    name: str
    overrides: dict[str, Any]
    run_dir: Path
    job_id: Optional[str]
    state: str
    rollout_id: Optional[int]
    """Last rollout id in ``metrics.jsonl`` (None before the first step)."""
    num_rollout: Optional[int]
    steps: int
    """Rollout steps logged (distinct ids >= 0)."""
    final_reward: Optional[float]
    """Last ``rollout/reward_mean``."""
    final_eval: Optional[float]
    """Last ``eval/accuracy`` (None when the run logged no eval)."""
    attempts: int
    curve: list[tuple[int, float]] = field(default_factory=list, repr=False)
    """``(step, rollout/reward_mean)`` of every step, for the report's plot."""
    eval_curve: list[tuple[int, float]] = field(default_factory=list, repr=False)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def point_status(point: Mapping[str, Any], state: str) -> PointStatus:
    """The :class:`PointStatus` of one manifest point, from its run folder's ``metrics.jsonl`` and logs."""
    from hpcrl.metrics import read_metrics
    from hpcrl.slurm.state import planned_rollouts

    run_dir = Path(point["run_dir"])
    rows = [r for r in read_metrics(run_dir) if isinstance(r.get("step"), int)]
    steps = [r for r in rows if r["step"] >= 0]
    curve = [(r["step"], float(r["rollout/reward_mean"])) for r in steps
             if _num(r.get("rollout/reward_mean"))]
    evals = [(r["step"], float(r["eval/accuracy"])) for r in rows if _num(r.get("eval/accuracy"))]
    return PointStatus(name=point["name"], overrides=dict(point.get("overrides") or {}), run_dir=run_dir,
                       job_id=point.get("job_id"), state=state,
                       rollout_id=steps[-1]["step"] if steps else None, num_rollout=planned_rollouts(run_dir),
                       steps=len({r["step"] for r in steps}), final_reward=curve[-1][1] if curve else None,
                       final_eval=evals[-1][1] if evals else None,
                       attempts=len(attempt_dirs(run_dir)), curve=curve, eval_curve=evals)


def sweep_status(sweep_dir: str | os.PathLike, runner: Runner = run_command
                 ) -> tuple[dict, list[PointStatus]]:
    """``(manifest, rows)``: one :class:`PointStatus` per point, in point order.

    Raises SlurmCommandError when ``sweep_dir`` is not a sweep folder."""
    manifest = read_manifest(sweep_dir)
    states = point_states(manifest, runner)
    return manifest, [point_status(p, states[p["name"]]) for p in manifest["points"]]


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def format_sweep_table(manifest: Mapping[str, Any], rows: Sequence[PointStatus]) -> str:
    """The ``hpcrl status SWEEP`` text: a header line, then POINT, JOB, STATE, ROLLOUT (steps done /
    ``num_rollout``), REWARD (last
    ``rollout/reward_mean``), EVAL (last ``eval/accuracy``), ATTEMPTS, then a count of points per state."""
    arrays = [s["array_job_id"] for s in manifest.get("submissions", []) if s.get("array_job_id")]
    kind = ("one het job per point" if manifest.get("het") else
            ("job array " + ", ".join(arrays) if arrays else "not submitted"))
    lines = [f"sweep {manifest['name']}: {len(rows)} points, {kind} ({manifest['sweep_dir']})"]
    table = [("POINT", "JOB", "STATE", "ROLLOUT", "REWARD", "EVAL", "ATTEMPTS")]
    for r in rows:
        rollout = "-" if r.rollout_id is None else str(r.rollout_id + 1)  # steps done (ids start at 0)
        if r.num_rollout is not None:
            rollout += f"/{r.num_rollout}"
        table.append((r.name, r.job_id or "-", r.state, rollout, _fmt(r.final_reward), _fmt(r.final_eval),
                      str(r.attempts)))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return "\n".join(lines)


REPORT_COLUMNS = ("point", "job_id", "state", "steps", "final_reward_mean", "final_eval_accuracy", "run_dir")
"""Columns of ``report.csv`` after ``point``'s swept keys (inserted after ``point``, one per dotted key)."""


def write_report(sweep_dir: str | os.PathLike, runner: Runner = run_command) -> tuple[Path, Optional[Path]]:
    """Write ``report.csv`` and ``report.png`` into the sweep folder.

    ``report.csv``: one row per point: ``point``, one column per swept dotted key (its value), ``job_id``,
    ``state``, ``steps`` (rollout steps logged), ``final_reward_mean`` (last ``rollout/reward_mean``),
    ``final_eval_accuracy`` (last ``eval/accuracy``; empty when none), ``run_dir``.
    ``report.png`` (matplotlib, Agg): ``rollout/reward_mean`` against rollout step, one line per point, and a
    second panel of ``eval/accuracy`` when any point logged one.

    Returns:
        ``(csv path, png path)``; the PNG is None (and not written) when no point has a reward yet.

    Raises:
        SlurmCommandError: not a sweep folder.
    """
    manifest, rows = sweep_status(sweep_dir, runner)
    sdir = Path(manifest["sweep_dir"])
    keys = list(dict.fromkeys(k for r in rows for k in r.overrides))
    csv_path = sdir / REPORT_CSV
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow([REPORT_COLUMNS[0], *keys, *REPORT_COLUMNS[1:]])
        for r in rows:
            values = [format_value(r.overrides[k]) if k in r.overrides else "" for k in keys]
            w.writerow([r.name, *values, r.job_id or "", r.state, r.steps,
                        "" if r.final_reward is None else repr(r.final_reward),
                        "" if r.final_eval is None else repr(r.final_eval), str(r.run_dir)])
    return csv_path, plot_report(rows, sdir / REPORT_PNG, title=f"sweep {manifest['name']}")


def plot_report(rows: Sequence[PointStatus], out: Path, title: str = "") -> Optional[Path]:
    """Reward curves of the points (one line each) and, when any, their eval accuracy, into ``out``.

    Returns ``out``, or None (nothing written) when no point has a reward."""
    if not any(r.curve for r in rows):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("rollout/reward_mean", "curve")] + ([("eval/accuracy", "eval_curve")]
                                                   if any(r.eval_curve for r in rows) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (label, attr) in zip(axes[0], panels):
        for r in rows:
            pts = getattr(r, attr)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=r.name,
                        marker="." if len(pts) < 50 else None)
        ax.set_title(label)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize="small",
               frameon=False)
    if title:
        fig.suptitle(title)
    nrows = math.ceil(len(labels) / 3)
    fig.tight_layout(rect=(0, min(0.06 * nrows + 0.02, 0.5), 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def resolve_point_names(manifest: Mapping[str, Any], values: Iterable[str]) -> list[str]:
    """Point names from ``--points`` values. A value is one point name, or several joined with ``,``; since
    names contain ``,`` themselves (``lr=3e-05,seed=1``), the pieces are joined back greedily (shortest known
    name first). Raises SlurmCommandError (exit 2) naming a piece that is no point, with the known names."""
    known = [p["name"] for p in manifest["points"]]
    names: list[str] = []
    for value in values:
        if value in known:
            names.append(value)
            continue
        pieces, start = value.split(","), 0
        while start < len(pieces):
            for end in range(start + 1, len(pieces) + 1):
                if ",".join(pieces[start:end]) in known:
                    names.append(",".join(pieces[start:end]))
                    start = end
                    break
            else:
                raise SlurmCommandError(f"--points={value!r}: {','.join(pieces[start:])!r} is not a point of "
                                        f"{manifest['sweep_dir']}; its points: " + "; ".join(known))
    return list(dict.fromkeys(names))
