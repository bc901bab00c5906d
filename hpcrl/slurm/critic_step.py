"""The critic job step: PPO's critic on ranks of its own (``critic.nprocs > 0``) inside a Slurm job, started by
the controller (trainer rank 0) with ``srun --het-group=K`` on het group ``slurm.critic`` (K = 1 colocated, 2
disaggregated; :attr:`hpcrl.slurm.resources.JobPlan.critic_het_group`).

Every task runs ``python -m hpcrl.train.critic_worker`` (its rank from ``SLURM_PROCID``, its device
``SLURM_LOCALID`` of the group's ``CUDA_VISIBLE_DEVICES``), inside ``slurm.container`` when one is set, and logs
to ``ATTEMPT/critic-<task>.log``. ``--kill-on-bad-exit``: a task that fails ends the step, and the controller,
which watches the ``srun`` process (:meth:`CriticStep.failure`), raises instead of waiting. The step blocks the
preemption signal (the critic outlives it until the controller checkpointed it) and ends with the job or when
the controller stops it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional

from hpcrl.config import Config


def srun_command(cfg: Config, attempt_dir: Path, run_dir: Path, args: list[str],
                 environ: Optional[Mapping[str, str]] = None, python: str = sys.executable) -> list[str]:
    """The ``srun`` command line of the critic step (see the module doc); ``args`` are the worker's
    (:func:`hpcrl.train.critic_group.worker_args`). ``environ`` (default ``os.environ``) gives
    ``SLURM_JOB_ID``. Raises ConfigError when the config has no critic het group."""
    from hpcrl.slurm.container import container_prefix
    from hpcrl.slurm.resources import critic_tasks_per_node

    environ = os.environ if environ is None else environ
    g = cfg.slurm.critic
    per_node = critic_tasks_per_node(cfg)
    het = 1 + int(cfg.run.placement == "disaggregate" and cfg.slurm.rollout is not None)
    cmd = ["srun", "--mem=0", f"--het-group={het}", f"--nodes={g.nodes}", f"--ntasks={g.nodes * per_node}",
           f"--ntasks-per-node={per_node}", f"--cpus-per-task={g.cpus_per_task}", "--kill-on-bad-exit=1",
           "--unbuffered", f"--job-name={cfg.run.name}-critic", f"--output={attempt_dir}/critic-%t.log"]
    if environ.get("SLURM_JOB_ID"):
        cmd.append(f"--jobid={environ['SLURM_JOB_ID']}")
    if g.gpus_per_node:
        cmd.append(f"--gres=gpu:{g.gpus_per_node}")
    cmd += container_prefix(cfg, run_dir, "critic")
    return cmd + [python, "-m", "hpcrl.train.critic_worker", *args]


class CriticStep:
    """The running critic step (the ``srun`` process), as :class:`hpcrl.train.critic_group.CriticProcesses`."""

    def __init__(self, cfg: Config, attempt_dir: Path, args: list[str]) -> None:
        from hpcrl.procs import die_with_parent

        run_dir = Path(os.environ.get("HPCRL_RUN_DIR") or attempt_dir.parents[1])
        self.attempt_dir = attempt_dir
        self.log = attempt_dir / "critic-step.log"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(srun_command(cfg, attempt_dir, run_dir, args), stdout=out,
                                            stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def failure(self) -> Optional[str]:
        from hpcrl.procs import log_tail

        if self.process.poll() is None:
            return None
        tails = "\n".join(f"--- {p.name}:\n{log_tail(p, 2000)}"
                          for p in [self.log, *sorted(self.attempt_dir.glob("critic-[0-9]*.log"))])
        return (f"the critic step (srun, pid {self.process.pid}) exited with status {self.process.returncode} "
                f"(logs: {self.attempt_dir}/critic-*.log)\n--- log tail ---\n{tails}")

    def stop(self, grace_s: float = 10.0) -> None:
        from hpcrl.procs import stop_process

        stop_process(self.process, grace_s)


def launch_critic_step(cfg: Config, attempt_dir: Path, args: list[str]) -> CriticStep:
    """The Slurm :data:`~hpcrl.train.critic_group.CriticLauncher`: :class:`CriticStep`."""
    return CriticStep(cfg, attempt_dir, args)
