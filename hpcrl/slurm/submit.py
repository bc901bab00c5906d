"""``hpcrl submit CONFIG [key=value ...] [--dry-run] [--plain]``: from a login node to a Slurm job.

Order (nothing is written or queued until every check has passed):

1. load and validate the config with the overrides (:func:`hpcrl.validate.load_raw_and_check`; every error is
   a one-line :class:`~hpcrl.config.ConfigError` naming the field);
2. resolve resources (:mod:`hpcrl.slurm.resources`): ``run.output_dir`` made absolute (the job may start
   anywhere), ``train.nprocs`` set to the trainer's task count on GPU nodes, het groups for a disaggregated
   run;
3. unless ``--dry-run``: ``sbatch`` must be on PATH and the run folder must not have a live job already;
4. write the run folder: ``config.yaml`` (resolved), ``submission.sbatch`` (the exact script), ``logs/``
   (each attempt of the job makes ``logs/attempt-N``);
5. submit: with submitit (:class:`~hpcrl.slurm.executor.HetSlurmExecutor`, function job
   :class:`~hpcrl.slurm.entry.SlurmEntry`), or with ``--plain`` the filled ``sbatch/`` template via
   ``sbatch`` itself; then ``job.json`` records the job.

``--dry-run`` stops after step 4 and returns the script (the CLI prints it).

The ``slurm:`` section maps to sbatch as: ``partition``, ``account``, ``qos``, ``constraint``, ``mem``,
``exclusive`` -> the options of the same name; ``time`` -> ``--time`` in whole minutes, rounded up
(``UNLIMITED`` kept); ``nodes``, ``gpus_per_node``, ``cpus_per_task`` -> the trainer group (one task per GPU);
``signal`` (``USR2@120``) -> ``--signal=USR2@120`` and submitit's preemption signal; ``requeue`` ->
``--requeue``/``--no-requeue`` (and whether submitit requeues on the signal; :mod:`hpcrl.slurm.requeue`);
``extra_sbatch`` -> verbatim ``#SBATCH`` lines; ``setup`` -> shell lines before the job step
(``module load ...``); ``container`` -> the step runs in ``apptainer exec`` (:mod:`hpcrl.slurm.container`);
``rollout`` -> het group 1.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from hpcrl.config import Config, apply_overrides, build, read_config_file, resolve, set_dotted
from hpcrl.validate import check, load_raw_and_check, save_resolved
from hpcrl.slurm import SCRIPT_FILE, SUBMITIT_DIR, SlurmCommandError
from hpcrl.slurm.container import container_prefix, shell_join
from hpcrl.slurm.requeue import MAX_TIME_LIMIT_REQUEUES, sbatch_option
from hpcrl.slurm.resources import JobPlan, gpu_trainer_ranks, group_flags, plan_job, slurm_config
from hpcrl.slurm.state import FINAL_STATES, UNKNOWN, query_states, read_job_file, write_job_file

@dataclass
class SubmitResult:
    """What :func:`submit` did."""

    run_dir: Path
    """Absolute run folder."""
    script_path: Path
    """``run_dir/submission.sbatch``."""
    script: str
    """The sbatch script text (printed by ``--dry-run``)."""
    job_id: Optional[str]
    """Slurm job id; None for a dry run."""
    launcher: str
    """``submitit`` or ``sbatch`` (``--plain``)."""
    plan: JobPlan
    config: Config
    """The resolved config as written to ``run_dir/config.yaml``."""

    @property
    def dry_run(self) -> bool:
        return self.job_id is None


def with_slurm_ranks(raw: dict) -> dict:
    """Set ``train.nprocs`` in a raw config dict to the trainer's rank count on GPU nodes (``nodes x
    gpus_per_node``), so the config is validated against the ranks Slurm will start (``train.nprocs`` is for
    local runs; Slurm runs one rank per GPU). Returns ``raw``. Raises ConfigError for a field of the wrong
    type."""
    world = gpu_trainer_ranks(build(raw))  # typed, not validated yet
    return raw if world is None else set_dotted(raw, "train.nprocs", world)


def raw_config(config: str | os.PathLike | None, overrides: Iterable[str] = ()) -> dict:
    """The config file (None: the defaults) with ``overrides`` applied, as a raw dict: the file is read once
    per command. Raises ConfigError."""
    return apply_overrides({} if config is None else read_config_file(config), overrides)


def prepare_config(config: str | os.PathLike | Config | None, overrides: Iterable[str] = (),
                   cwd: str | os.PathLike | None = None) -> tuple[Config, JobPlan]:
    """Steps 1-2: the resolved config for Slurm (absolute ``run.output_dir``) and its :class:`JobPlan`.

    Args:
        config: a YAML path (or None for the defaults), or a :class:`Config` built in code (no overrides
            then).
        overrides: dotted ``key=value`` strings.
        cwd: the submit directory: a relative ``run.output_dir`` is taken from it (default the current one;
            the files the config names are checked from the current directory).

    Raises:
        ConfigError: any bad field, including the Slurm-only checks of
            :func:`~hpcrl.slurm.resources.plan_job`.
    """
    overrides = list(overrides) if not isinstance(overrides, str) else [overrides]
    if isinstance(config, Config):
        if overrides:
            raise TypeError("overrides apply to a config file; change the Config object instead")
        cfg = copy.deepcopy(config)
        world = gpu_trainer_ranks(cfg)
        if world is not None:
            cfg.train.nprocs = world
        check(cfg)
        cfg = resolve(cfg)
    else:
        cfg = load_raw_and_check(with_slurm_ranks(raw_config(config, overrides)))
    cwd = os.path.abspath(os.getcwd() if cwd is None else cwd)
    cfg.run.output_dir = os.path.normpath(os.path.join(cwd, cfg.run.output_dir))
    cfg = slurm_config(cfg)
    plan = plan_job(cfg)
    from hpcrl.data.datasets import check_data

    check_data(cfg)  # every data row, before anything is queued (remembered across a sweep's points)
    return cfg, plan


def submitit_parameters(plan: JobPlan, run_dir: str | os.PathLike, cwd: str | os.PathLike) -> dict[str, Any]:
    """The plan as keyword arguments of submitit's ``SlurmExecutor.update_parameters`` (het group 0).

    ``time`` is whole minutes (submitit's unit, also used for its time-limit bookkeeping);
    ``additional_parameters`` carries what submitit has no name for (``--signal`` as configured,
    ``--requeue``, ``--chdir``, ``--time=UNLIMITED``).
    """
    t = plan.trainer
    params: dict[str, Any] = dict(
        job_name=plan.job_name, time=plan.time_min, nodes=t.nodes, ntasks_per_node=t.ntasks_per_node,
        cpus_per_task=t.cpus_per_task, signal_delay_s=plan.signal_lead_s,
        setup=[*plan.setup, f"export SUBMITIT_PREEMPT_SIGNAL={plan.signal_name}",
               "export SLURM_KILL_BAD_EXIT=1",  # srun --kill-on-bad-exit: a failed rank ends the step, none hangs
               f"export HPCRL_RUN_DIR={shlex.quote(str(run_dir))}"],
    )
    if t.gpus_per_node > 0:
        params["gpus_per_node"] = t.gpus_per_node
    for key, value in (("partition", t.partition), ("account", plan.account), ("qos", plan.qos),
                       ("mem", t.mem), ("constraint", plan.constraint)):
        if value is not None:
            params[key] = value
    if plan.exclusive:
        params["exclusive"] = True
    if plan.het:  # submitit's step is the trainer: het group 0 (engines and critic go to theirs from inside)
        params["srun_args"] = ["--het-group=0"]
    extra: dict[str, Any] = {"signal": plan.signal, "chdir": str(cwd),
                             sbatch_option(plan.requeue)[2:].replace("-", "_"): True}  # submitit's spelling
    if plan.time_s is None:
        extra["time"] = "UNLIMITED"
    params["additional_parameters"] = extra
    return params


def make_executor(cfg: Config, plan: JobPlan, run_dir: str | os.PathLike, cwd: str | os.PathLike,
                  environ: Mapping[str, str], python: Optional[str] = None, render_only: bool = False):
    """A :class:`~hpcrl.slurm.executor.HetSlurmExecutor` set up for the run (``run_dir/submitit`` folder).

    ``python`` is the shell words that start python in the job when there is no container (default the
    current interpreter); with ``slurm.container`` it is ``apptainer exec ... IMAGE python3``.
    """
    from hpcrl.slurm.executor import HetSlurmExecutor

    prefix = container_prefix(cfg, run_dir, "trainer", cwd=cwd, environ=environ)
    py = shell_join(prefix + ["python3"]) if prefix else (python or shlex.quote(sys.executable))
    components = [group_flags(plan, g) for g in plan.components]
    ex = HetSlurmExecutor(Path(run_dir) / SUBMITIT_DIR, components=components, extra_sbatch=plan.extra_sbatch,
                          max_num_timeout=MAX_TIME_LIMIT_REQUEUES, python=py, render_only=render_only,
                          forward_signal=plan.signal_name)
    ex.update_parameters(**submitit_parameters(plan, run_dir, cwd))
    return ex


def _check_no_live_job(run_dir: Path, name: str) -> Optional[str]:
    """Raise if the run folder's recorded job still runs; return its id (for ``previous_job_ids``)."""
    job = read_job_file(run_dir)
    if not job:
        return None
    job_id = str(job["job_id"])
    state = query_states([job_id]).get(job_id, UNKNOWN)
    if state not in FINAL_STATES and state != UNKNOWN:
        raise SlurmCommandError(f"run.name={name!r}: the run folder {run_dir} already has job {job_id} "
                                f"({state}); wait for it, run `hpcrl cancel {run_dir}` first, or pick "
                                "another run.name")
    return job_id


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sbatch(script_path: Path, cwd: str) -> str:
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True,
                             timeout=120, check=False, cwd=cwd)
    except (OSError, subprocess.SubprocessError) as e:
        raise SlurmCommandError(f"hpcrl submit: sbatch failed: {e}", exit_code=1) from None
    if out.returncode != 0:
        raise SlurmCommandError(f"hpcrl submit: sbatch refused {script_path}: "
                                f"{_one_line(out.stderr or out.stdout)}", exit_code=1)
    return out.stdout.strip().splitlines()[-1].split(";")[0]


def submit(config: str | os.PathLike | Config | None, overrides: Iterable[str] = (), dry_run: bool = False,
           plain: bool = False, *, cwd: str | os.PathLike | None = None,
           environ: Optional[Mapping[str, str]] = None, python: Optional[str] = None) -> SubmitResult:
    """Validate, write the run folder and submit the run to Slurm (or only write it, ``dry_run``).

    Args:
        config: the run's YAML file (or None for the defaults), or a :class:`Config`.
        overrides: dotted ``key=value`` overrides.
        dry_run: write ``config.yaml``, ``submission.sbatch`` and ``logs/`` but do not submit (needs no
            Slurm).
        plain: submit the filled plain template from ``sbatch/`` with ``sbatch`` instead of submitit.
        cwd: the submit directory: relative paths of the config and the job's working directory (default the
            current one).
        environ: environment for the container wrapping (default ``os.environ``).
        python: shell words that start python in the job without a container (default this interpreter).

    Returns:
        A :class:`SubmitResult`; ``job_id`` is None for a dry run.

    Raises:
        ConfigError: any bad config field (nothing written or queued).
        SlurmCommandError: no ``sbatch`` on PATH, a live job already in the run folder (exit 2, nothing
            written or queued); sbatch refused the job (exit 1; the run folder is written, without
            ``job.json``).
        OSError: the run folder cannot be written.
    """
    environ = os.environ if environ is None else environ
    cwd = os.path.abspath(os.getcwd() if cwd is None else cwd)
    cfg, plan = prepare_config(config, overrides, cwd)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    previous: Optional[str] = None
    if not dry_run:
        if shutil.which("sbatch") is None:
            raise SlurmCommandError("hpcrl submit: sbatch not found on PATH; submit from a Slurm login node "
                                    "(or module load slurm), or use --dry-run to only write the run folder")
        previous = _check_no_live_job(run_dir, cfg.run.name)
    executor = None
    if plain:
        from hpcrl.slurm.templates import render_template

        script = render_template(cfg, run_dir, cwd=cwd, environ=environ, python=python, plan=plan)
    else:
        executor = make_executor(cfg, plan, run_dir, cwd, environ, python=python, render_only=dry_run)
        script = executor.render()

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = save_resolved(cfg, run_dir)
    script_path = run_dir / SCRIPT_FILE
    script_path.write_text(script, encoding="utf-8")
    result = SubmitResult(run_dir=run_dir, script_path=script_path, script=script, job_id=None,
                          launcher="sbatch" if plain else "submitit", plan=plan, config=cfg)
    if dry_run:
        return result

    if plain:
        job_id = _sbatch(script_path, cwd)
        stdout, stderr = run_dir / "logs" / f"slurm-{job_id}.out", None
    else:
        from hpcrl.slurm.entry import SlurmEntry

        try:
            with contextlib.redirect_stderr(io.StringIO()):  # submitit also prints sbatch's stderr
                job = executor.submit(SlurmEntry(config_path, requeue=plan.requeue))
        except Exception as e:  # submitit wraps sbatch's error; report it as one line
            raise SlurmCommandError(f"hpcrl submit: sbatch refused the job: {_one_line(e)}",
                                    exit_code=1) from None
        job_id = str(job.job_id)
        stdout, stderr = job.paths.stdout, job.paths.stderr
    history = list((read_job_file(run_dir) or {}).get("previous_job_ids", []))
    if previous is not None:
        history.append(previous)
    from hpcrl import __version__

    write_job_file(run_dir, {
        "job_id": job_id, "launcher": result.launcher, "placement": plan.placement, "het": plan.het,
        "job_name": plan.job_name, "config": str(config_path), "script": str(script_path),
        "stdout": str(stdout), "stderr": str(stderr) if stderr else None, "workdir": cwd,
        "submitted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hpcrl_version": __version__, "previous_job_ids": history,
    })
    result.job_id = job_id
    return result
