"""Submitting a sweep: one job array through submitit (or one het job per point for disaggregated points),
its manifest written before anything is queued, and resubmission of failed or named points."""

from __future__ import annotations

import dataclasses
import datetime
import contextlib
import io
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from hpcrl.config import ConfigError
from hpcrl.validate import load_and_check
from hpcrl.slurm import SCRIPT_FILE, SUBMITIT_DIR, SlurmCommandError
from hpcrl.slurm.resources import JobPlan
from hpcrl.slurm.state import Runner, queued_or_running, run_command, write_job_file
from hpcrl.slurm.sweep.manifest import (MANIFEST_VERSION, SWEEP_FILE, SweepStates, check_no_live_jobs,
                                         read_manifest, resubmittable, sweep_states, write_manifest)
from hpcrl.slurm.sweep.plan import check_one_shape, plan_sweep, point_error
from hpcrl.slurm.sweep.points import SweepPoint

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
    still_live: dict[str, str] = dataclasses.field(default_factory=dict)
    """:func:`resubmit_sweep` without named points: the points left out because their job is still queued,
    running or COMPLETING (name -> state), e.g. right after a scancel."""

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
        check_no_live_jobs(old, runner=runner)
    from hpcrl import __version__
    from hpcrl.validate import save_resolved

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

def _select_points(manifest: Mapping[str, Any], names: Optional[Sequence[str]], ss: SweepStates
                   ) -> list[dict]:
    by_name = {p["name"]: p for p in manifest["points"]}
    states = ss.states
    if names is None:
        return [p for p in manifest["points"] if resubmittable(p, states[p["name"]], ss.queue_checked)]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SlurmCommandError(f"--points: {unknown[0]!r} is not a point of {manifest['sweep_dir']}; its "
                                "points: " + ", ".join(by_name))
    picked = [by_name[n] for n in dict.fromkeys(names)]
    live = [(p["name"], states[p["name"]]) for p in picked
            if queued_or_running(states[p["name"]])]
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
        points: point names; default the points whose job ended in one of :data:`RESUBMIT_STATES` and
            those whose job Slurm no longer knows while their run is not done (:func:`resubmittable`: an
            array task cancelled before it started).
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
    ss = sweep_states(manifest, runner)
    picked = _select_points(manifest, points, ss)
    workdir = manifest.get("workdir") or os.getcwd()
    het = bool(manifest.get("het"))
    parallelism = int(manifest.get("array_parallelism") or 1)
    result = SweepResult(sweep_dir=sdir, manifest_path=sdir / SWEEP_FILE, points=[p["name"] for p in picked],
                         job_ids={p["name"]: None for p in picked}, array_job_id=None, het=het, scripts=[],
                         script="", array_parallelism=parallelism)
    if points is None:
        result.still_live = {n: s for n, s in ss.states.items()
                             if queued_or_running(s)}
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
                cfg, plan = prepare_config(load_and_check(Path(q["run_dir"]) / "config.yaml"), cwd=workdir)
            except ConfigError as e:
                raise point_error(q["name"], e) from None
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
            check_one_shape(sweep_points)
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
