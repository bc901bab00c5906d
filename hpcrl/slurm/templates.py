"""The plain sbatch templates (``sbatch/colocate.sbatch``, ``sbatch/disaggregate.sbatch``), filled from a
config.

For users who do not use submitit: ``hpcrl submit --plain CONFIG`` writes the filled template as the run's
``submission.sbatch`` and gives it to ``sbatch`` itself. The script runs the same entry point as the submitit
job (``python -m hpcrl run-slurm RUN/config.yaml``, see :mod:`hpcrl.slurm.entry`), in the same container
wrapping (:mod:`hpcrl.slurm.container`).

Tokens are ``@@NAME@@``; a line ``#@@NAME@@`` is replaced by zero or more lines (optional ``#SBATCH`` options,
setup lines). Templates are read from ``$HPCRL_HOME/sbatch`` (the modulefile and the image set it), else from
the ``sbatch/`` folder beside the ``hpcrl`` package (a source checkout).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Mapping, Optional

from hpcrl.config import Config
from hpcrl.slurm import SlurmCommandError
from hpcrl.slurm.container import container_prefix, shell_join
from hpcrl.slurm.requeue import sbatch_option
from hpcrl.slurm.resources import GroupPlan, JobPlan, plan_job

TEMPLATES = {"colocate": "colocate.sbatch", "disaggregate": "disaggregate.sbatch"}
_TOKEN_RE = re.compile(r"@@[A-Z_]+@@")


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


def _optional_lines(plan: JobPlan, group: GroupPlan, first: bool) -> list[str]:
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
    return [f"#SBATCH {line}" for line in lines]


def launch_command(cfg: Config, run_dir: str | os.PathLike, cwd: str | os.PathLike,
                   environ: Mapping[str, str], python: Optional[str] = None) -> str:
    """The shell words before ``run-slurm``: ``PYTHON -m hpcrl``, inside the container when one is set."""
    prefix = container_prefix(cfg, run_dir, "trainer", cwd=cwd, environ=environ)
    if prefix:
        return shell_join(prefix + ["python3", "-m", "hpcrl"])
    return f"{python or shlex.quote(sys.executable)} -m hpcrl"


def render_template(cfg: Config, run_dir: str | os.PathLike, cwd: str | os.PathLike | None = None,
                    environ: Optional[Mapping[str, str]] = None, python: Optional[str] = None,
                    plan: Optional[JobPlan] = None) -> str:
    """The plain sbatch script of a run: its placement's template with every token filled.

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
    """
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else str(cwd)
    plan = plan_job(cfg) if plan is None else plan
    text = (template_dir(environ) / TEMPLATES[plan.placement]).read_text(encoding="utf-8")
    t = plan.trainer
    values = {
        "JOB_NAME": shlex.quote(plan.job_name), "NODES": str(t.nodes),
        "NTASKS_PER_NODE": str(t.ntasks_per_node),
        "CPUS_PER_TASK": str(t.cpus_per_task), "TIME": plan.time, "SIGNAL": plan.signal,
        "SIGNAL_NAME": plan.signal_name, "RUN_DIR": shlex.quote(str(run_dir)), "WORKDIR": shlex.quote(cwd),
        "REQUEUE": "1" if plan.requeue else "0",
        "LAUNCH": launch_command(cfg, run_dir, cwd, environ, python),
    }
    blocks = {"SBATCH_OPTIONS": _optional_lines(plan, t, first=True), "SETUP": list(plan.setup)}
    if plan.rollout is not None:
        values.update(ROLLOUT_NODES=str(plan.rollout.nodes),
                      ROLLOUT_CPUS_PER_TASK=str(plan.rollout.cpus_per_task))
        blocks["ROLLOUT_SBATCH_OPTIONS"] = _optional_lines(plan, plan.rollout, first=False)
    out_lines = []
    for line in text.split("\n"):
        name = line[3:-2] if line.startswith("#@@") and line.endswith("@@") else None
        if name is not None and name in blocks:
            out_lines += blocks[name]
        else:
            out_lines.append(line)
    out = _TOKEN_RE.sub(lambda m: values[m.group(0)[2:-2]], "\n".join(out_lines))
    return out
