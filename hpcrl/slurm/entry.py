"""What runs inside the Slurm allocation: one entry point for submitit and for the plain sbatch templates.

* submitit (``hpcrl submit``) pickles :class:`SlurmEntry` (``SlurmEntry(RUN/config.yaml)``); submitit's
  ``srun`` step runs it in every trainer task.
* the plain templates in ``sbatch/`` (``hpcrl submit --plain``) run ``hpcrl run-slurm RUN/config.yaml`` in an
  ``srun`` step with the same tasks.

Both call :func:`run_slurm`, which loads the run folder's resolved config and hands it to the *bootstrap*:
the in-allocation code that sets up torch.distributed from Slurm's environment, starts the rollout step and
runs the loop (issue #4 point 4). :func:`default_bootstrap` is the stand-in until then: a one-task trainer
runs :func:`hpcrl.loop.main` (the same code as ``hpcrl run``); more tasks stop with a clear error.
``$HPCRL_SLURM_BOOTSTRAP`` (``pkg.module.function``, called as ``f(cfg, run_dir) -> int``) replaces it.

Preemption and the time limit: submitit calls :meth:`SlurmEntry.checkpoint` on the signal (``slurm.signal``)
in task 0 and requeues the job, which starts again from the same run folder (the loop resumes from its newest
checkpoint). With ``slurm.requeue: false`` it returns None and the job ends instead. Without submitit,
:func:`run_slurm` turns the signal into exit status :data:`EXIT_REQUEUE` (a bootstrap that checkpoints first
returns it itself) and the template requeues the job.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from hpcrl.config import Config, load_config

log = logging.getLogger("hpcrl.slurm")

EXIT_REQUEUE = 75
"""Exit status of an entry point that checkpointed on the preemption signal and wants the job requeued
(``EX_TEMPFAIL``); the plain sbatch templates run ``scontrol requeue`` on it."""
BOOTSTRAP_ENV = "HPCRL_SLURM_BOOTSTRAP"
ATTEMPT_MARKER = "[hpcrl] attempt start:"
"""First line each attempt prints to the job's log (``hpcrl logs`` shows the log from the last one)."""

Bootstrap = Callable[[Config, Path], int]


def trainer_world_size() -> int:
    """Tasks of the trainer step (``SLURM_STEP_NUM_TASKS``, else group 0's ``SLURM_NTASKS``); 1 outside
    Slurm."""
    return int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS_HET_GROUP_0")
               or os.environ.get("SLURM_NTASKS") or 1)


def default_bootstrap(cfg: Config, run_dir: Path) -> int:
    """Stand-in for the in-allocation bootstrap: a one-task trainer runs ``hpcrl.loop.main(cfg)``.

    Raises RuntimeError for a multi-task trainer step: torch.distributed from Slurm's environment and the
    rollout job step are issue #4 point 4.
    """
    world = trainer_world_size()
    if world != 1:
        raise RuntimeError(f"the trainer step has {world} tasks; starting torch.distributed and the rollout "
                           "step from Slurm is not implemented yet (issue #4 point 4): set "
                           f"{BOOTSTRAP_ENV} or use one trainer task")
    from hpcrl import loop

    return loop.main(cfg)


def _bootstrap() -> Bootstrap:
    name = os.environ.get(BOOTSTRAP_ENV)
    if not name:
        return default_bootstrap
    from hpcrl.plugins import load_function

    return load_function(name)


def _attempt_banner(run_dir: Path) -> str:
    env = os.environ
    return (f"{ATTEMPT_MARKER} job {env.get('SLURM_JOB_ID', '-')} "
            f"restart {env.get('SLURM_RESTART_COUNT', '0')} task {env.get('SLURM_PROCID', '0')} "
            f"on {socket.gethostname()} run {run_dir}")


class Preempted(BaseException):
    """Raised in the main thread by the plain-sbatch signal handler (see :func:`run_slurm`)."""


def _install_requeue_handler(cfg: Config) -> bool:
    """Outside submitit, in a Slurm job that may be requeued: the preemption signal ends the run with
    :data:`EXIT_REQUEUE` (the template then requeues). A bootstrap that checkpoints first installs its own."""
    if ("SUBMITIT_FOLDER" in os.environ or "SLURM_JOB_ID" not in os.environ or not cfg.slurm.requeue
            or threading.current_thread() is not threading.main_thread()):
        return False
    name = os.environ.get("HPCRL_PREEMPT_SIGNAL") or cfg.slurm.signal.split("@")[0]
    signum = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
    if signum is None:
        return False

    def handler(num, frame):
        raise Preempted(signal.Signals(num).name)

    signal.signal(signum, handler)
    return True


def run_slurm(config_path: str | os.PathLike, bootstrap: Optional[Bootstrap] = None) -> int:
    """Run the job of a run folder inside its allocation; returns the exit status (0 success).

    Under a plain sbatch script (no submitit) with ``slurm.requeue``, the preemption signal
    (``$HPCRL_PREEMPT_SIGNAL``, else ``slurm.signal``'s name) interrupts the bootstrap and the exit status is
    :data:`EXIT_REQUEUE`, so the template requeues the job; the run resumes from its newest checkpoint.

    Args:
        config_path: the run folder's resolved ``config.yaml`` (its folder is the run folder).
        bootstrap: what to run; default ``$HPCRL_SLURM_BOOTSTRAP`` or :func:`default_bootstrap`.

    Raises:
        ConfigError: the config no longer validates here (e.g. a data file missing on the compute node).
    """
    config_path = Path(config_path).absolute()
    run_dir = config_path.parent
    if os.environ.get("SLURM_PROCID", "0") == "0":
        print(_attempt_banner(run_dir), flush=True)
    os.environ.setdefault("HPCRL_RUN_DIR", str(run_dir))
    cfg = load_config(config_path)
    _install_requeue_handler(cfg)
    try:
        result = (bootstrap or _bootstrap())(cfg, run_dir)
    except Preempted as e:
        print(f"[hpcrl] caught {e}: exiting with {EXIT_REQUEUE} so the job is requeued", flush=True)
        return EXIT_REQUEUE
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


class SlurmEntry:
    """The submitit function job of a run: ``SlurmEntry(config_path)()`` is :func:`run_slurm`.

    Checkpointable in submitit's sense: on the preemption/time-limit signal submitit calls :meth:`checkpoint`
    and requeues the returned submission (this same entry; the state is in the run folder).
    """

    def __init__(self, config_path: str | os.PathLike, requeue: bool = True) -> None:
        self.config_path = str(Path(config_path).absolute())
        self.requeue = requeue

    def __call__(self) -> int:
        code = run_slurm(self.config_path)
        if code != 0:  # submitit reports a raised error as the job's failure; a return value would be lost
            raise RuntimeError(f"hpcrl run {self.config_path} exited with status {code}")
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """The submission to requeue with (submitit calls this on the signal); None when not requeueing."""
        if not self.requeue:
            return None
        from submitit.core.utils import DelayedSubmission

        return DelayedSubmission(SlurmEntry(self.config_path, self.requeue))

    def __repr__(self) -> str:
        return f"SlurmEntry({self.config_path!r}, requeue={self.requeue})"


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m hpcrl.slurm.entry CONFIG``: the same as ``hpcrl run-slurm CONFIG``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hpcrl.slurm.entry RUN_FOLDER/config.yaml", file=sys.stderr)
        return 2
    return run_slurm(argv[0])


if __name__ == "__main__":
    sys.exit(main())
