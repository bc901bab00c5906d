"""The plain sbatch templates (``sbatch/colocate.sbatch``, ``sbatch/disaggregate.sbatch``), filled from a
config.

For users who do not use submitit: ``hpcrl submit --plain CONFIG`` writes the filled template as the run's
``submission.sbatch`` and gives it to ``sbatch`` itself. The script runs the same entry point as the submitit
job (``python -m hpcrl run-slurm RUN/config.yaml``, see :mod:`hpcrl.slurm.entry`), in the same container
wrapping (:mod:`hpcrl.slurm.container`).

The templates are jinja2 (``{{ nodes }}``, ``{{ run_dir | quote }}`` for shell quoting, ``{% for option in
sbatch_options %}`` for the zero or more optional ``#SBATCH`` lines and setup lines), rendered with
``StrictUndefined``: a variable the template uses and :func:`template_variables` does not give raises.
Templates are read from ``$HPCRL_HOME/sbatch`` (the modulefile and the image set it), else from the
``sbatch/`` folder beside the ``hpcrl`` package (a source checkout).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

import jinja2

from hpcrl.config import Config
from hpcrl.slurm import SlurmCommandError
from hpcrl.slurm.container import container_prefix, shell_join
from hpcrl.slurm.requeue import sbatch_option, template_values
from hpcrl.slurm.resources import GroupPlan, JobPlan, plan_job

TEMPLATES = {"colocate": "colocate.sbatch", "disaggregate": "disaggregate.sbatch"}


def template_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    """The folder holding the templates; raises SlurmCommandError when none is found."""
    environ = os.environ if environ is None else environ
    candidates = []
    if environ.get("HPCRL_HOME"):
        candidates.append(Path(environ["HPCRL_HOME"]) / "sbatch")
    candidates.append(Path(__file__).resolve().parents[2] / "sbatch")
    for c in candidates:
        if (c / TEMPLATES["colocate"]).is_file():
            return c
    raise SlurmCommandError("no sbatch templates found (looked in " + ", ".join(map(str, candidates))
                            + "); set HPCRL_HOME to the hpcrl source folder (module load hpcrl does)")


def _optional_options(plan: JobPlan, group: GroupPlan, first: bool) -> list[str]:
    lines = []
    if group.gpus_per_node > 0:
        lines.append(f"--gpus-per-node={group.gpus_per_node}")
    for key, value in (("mem", group.mem), ("partition", group.partition), ("account", plan.account),
                       ("qos", plan.qos)):
        if value is not None:
            lines.append(f"--{key}={shlex.quote(str(value))}")
    if first and plan.constraint is not None:
        lines.append(f"--constraint={shlex.quote(plan.constraint)}")
    if plan.exclusive:
        lines.append("--exclusive")
    if first:
        lines.append(sbatch_option(plan.requeue))
        lines += plan.extra_sbatch
    return lines


def launch_command(cfg: Config, run_dir: str | os.PathLike, cwd: str | os.PathLike,
                   environ: Mapping[str, str], python: Optional[str] = None) -> str:
    """The shell words before ``run-slurm``: ``PYTHON -m hpcrl``, inside the container when one is set."""
    prefix = container_prefix(cfg, run_dir, "trainer", cwd=cwd, environ=environ)
    if prefix:
        return shell_join(prefix + ["python3", "-m", "hpcrl"])
    return f"{python or shlex.quote(sys.executable)} -m hpcrl"


def template_variables(cfg: Config, run_dir: str | os.PathLike, cwd: str | os.PathLike,
                       environ: Mapping[str, str], python: Optional[str], plan: JobPlan) -> dict[str, Any]:
    """What the templates are rendered with (``sbatch/README.md`` lists them): the trainer group's ``nodes``,
    ``ntasks_per_node``, ``cpus_per_task``; ``job_name``, ``time``, ``signal`` (``USR2@120``),
    ``signal_name``, ``run_dir``, ``workdir`` (unquoted: the templates quote them), ``launch`` (shell words),
    ``requeue`` and ``exit_requeue`` (:func:`hpcrl.slurm.requeue.template_values`), the lists
    ``sbatch_options`` (without ``#SBATCH``) and ``setup``; for a disaggregated run also ``rollout_nodes``,
    ``rollout_cpus_per_task`` and ``rollout_sbatch_options``; always ``critic_nodes`` (0 without a critic
    on ranks of its own: no critic het group), ``critic_ntasks_per_node``, ``critic_cpus_per_task`` and
    ``critic_sbatch_options``."""
    t = plan.trainer
    values: dict[str, Any] = {
        "job_name": plan.job_name, "nodes": t.nodes, "ntasks_per_node": t.ntasks_per_node,
        "cpus_per_task": t.cpus_per_task, "time": plan.time, "signal": plan.signal,
        "signal_name": plan.signal_name, "run_dir": str(run_dir), "workdir": str(cwd),
        "launch": launch_command(cfg, run_dir, cwd, environ, python),
        "sbatch_options": _optional_options(plan, t, first=True), "setup": list(plan.setup),
        **template_values(plan.requeue),
    }
    if plan.rollout is not None:
        values.update(rollout_nodes=plan.rollout.nodes, rollout_cpus_per_task=plan.rollout.cpus_per_task,
                      rollout_sbatch_options=_optional_options(plan, plan.rollout, first=False))
    c = plan.critic
    values.update(critic_nodes=c.nodes if c is not None else 0,
                  critic_ntasks_per_node=c.ntasks_per_node if c is not None else 0,
                  critic_cpus_per_task=c.cpus_per_task if c is not None else 0,
                  critic_sbatch_options=_optional_options(plan, c, first=False) if c is not None else [])
    return values


def _environment(folder: Path) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                             autoescape=False)
    env.filters["quote"] = lambda value: shlex.quote(str(value))
    return env


def render_template(cfg: Config, run_dir: str | os.PathLike, cwd: str | os.PathLike | None = None,
                    environ: Optional[Mapping[str, str]] = None, python: Optional[str] = None,
                    plan: Optional[JobPlan] = None) -> str:
    """The plain sbatch script of a run: its placement's template rendered with :func:`template_variables`.

    Args:
        cfg: the resolved config (as written to the run folder).
        run_dir: absolute run folder.
        cwd: the job's working directory (``--chdir``; default the current one).
        environ: environment for the container wrapping (default ``os.environ``).
        python: shell words that run python without a container (default the current interpreter).
        plan: the job's :class:`~hpcrl.slurm.resources.JobPlan` (default ``plan_job(cfg)``).

    Raises:
        ConfigError: from :func:`~hpcrl.slurm.resources.plan_job`.
        SlurmCommandError: the templates are not found.
        jinja2.TemplateError: a template is malformed or uses a variable that is not given
            (``jinja2.UndefinedError``).
    """
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else str(cwd)
    plan = plan_job(cfg) if plan is None else plan
    template = _environment(template_dir(environ)).get_template(TEMPLATES[plan.placement])
    return template.render(template_variables(cfg, run_dir, cwd, environ, python, plan))
