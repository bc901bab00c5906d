"""What runs inside the Slurm allocation: one entry point for submitit and for the plain sbatch templates.

* submitit (``hpcrl submit``) pickles :class:`SlurmEntry` (``SlurmEntry(RUN/config.yaml)``); submitit's
  ``srun`` step runs it in every trainer task.
* the plain templates in ``sbatch/`` (``hpcrl submit --plain``) run ``hpcrl run-slurm RUN/config.yaml`` in an
  ``srun`` step with the same tasks.

Both call :func:`run_slurm`, which loads the run folder's resolved config and hands it to the *bootstrap*:
the in-allocation code (:func:`slurm_bootstrap`) that sets up torch.distributed from Slurm's environment,
prepares the model on rank 0, and runs the loop, whose controller starts the engines as the rollout job step.
``$HPCRL_SLURM_BOOTSTRAP`` (``pkg.module.function``, called as ``f(cfg, run_dir) -> int``) replaces it.

Preemption and the time limit: the bootstrap returns :data:`~hpcrl.slurm.requeue.EXIT_REQUEUE` after a
checkpoint; whether and how the job is then requeued is decided and done by :mod:`hpcrl.slurm.requeue`
(the submitit job through :meth:`SlurmEntry.__call__` and :meth:`SlurmEntry.checkpoint`, the plain templates
through the exit status).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from hpcrl.config import Config
from hpcrl.validate import load_and_check
from hpcrl.slurm.requeue import (EXIT_REQUEUE, exit_for_requeue_on_signal, ignore_late_signals,
                                  requeue_after_checkpoint, submitit_resubmission)

log = logging.getLogger("hpcrl.slurm")

BOOTSTRAP_ENV = "HPCRL_SLURM_BOOTSTRAP"
ATTEMPT_MARKER = "[hpcrl] attempt start:"
"""First line each attempt prints to the job's log (``hpcrl logs`` shows the log from the last one)."""

Bootstrap = Callable[[Config, Path], int]


def export_torch_env(environ: Optional[dict] = None) -> dict[str, str]:
    """torch.distributed's variables from Slurm's, for the trainer step's task
    (:class:`~hpcrl.slurm.torch_env.TrainerStepEnvironment`, submitit's ``TorchDistributedEnvironment`` for
    hpcrl's trainer step): ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` = the step's tasks, ``LOCAL_RANK`` =
    ``SLURM_LOCALID``, ``MASTER_ADDR`` = the step's first node (``SLURM_STEP_NODELIST``, else
    ``SLURM_JOB_NODELIST``), and ``MASTER_PORT`` = a port in [20000, 32768) drawn from the job id (the same on
    every task, and again after a requeue; below Linux's ephemeral port range). Variables already set win
    (e.g. a site's launcher). Updates ``environ`` (default ``os.environ``) and returns what it set.
    ``CUDA_VISIBLE_DEVICES`` is left as Slurm set it; each rank picks device ``LOCAL_RANK`` of it. Raises
    ValueError for a Slurm variable that should be an integer and is not.
    """
    from hpcrl.slurm.torch_env import TrainerStepEnvironment

    return TrainerStepEnvironment(environ).export().exported


def slurm_bootstrap(cfg: Config, run_dir: Path) -> int:
    """The trainer step's task inside the allocation (issue #4 point 4).

    Every task: torch.distributed from Slurm's environment (:func:`export_torch_env`; gloo with hpcrl's CPU
    compat module on CPU nodes, NCCL on GPUs), ``SLURM_CPUS_PER_TASK`` torch threads on CPU nodes unless
    ``OMP_NUM_THREADS`` says how many (as the critic's ranks and the engines read it). Rank 0 prepares the
    base model (creation, GGUF conversion; cached in the run's paths) while the others wait at a
    barrier, then every rank runs the warm start when enabled (an SFT run of the Megatron trainer, cached:
    :mod:`hpcrl.sft`) and the loop of ``run.mode`` (:func:`hpcrl.stages.run_stages`), whose
    controller (rank 0) starts the engines
    as the rollout job step (:mod:`hpcrl.slurm.rollout_step`) and a critic with ranks of its own as the critic
    job step (:mod:`hpcrl.slurm.critic_step`), waits for their health, runs the loop and stops the steps at
    the end. Returns 0, or :data:`EXIT_REQUEUE` when the loop stopped on the preemption signal or
    the job's deadline after writing a checkpoint (:mod:`hpcrl.preempt`); errors propagate (the job fails).
    """
    import torch
    import torch.distributed as dist

    from hpcrl.run_setup import quiet_logs
    from hpcrl.stages import prepare_base, run_stages
    from hpcrl.slurm.critic_step import launch_critic_step
    from hpcrl.slurm.rollout_step import launch_engine_step
    from hpcrl.train.parallel import init_distributed

    export_torch_env()
    # OMP_NUM_THREADS, when the job has it, is the user's choice (torch reads it itself): the test suite's two
    # lanes run every process on one thread, and a 2-thread trainer beside a busy lane thrashed
    threads = int(os.environ.get("SLURM_CPUS_PER_TASK") or 0) if "OMP_NUM_THREADS" not in os.environ else 0
    if threads > 0 and not torch.cuda.is_available():
        torch.set_num_threads(threads)
    quiet_logs()
    # megatron-core is imported after the rollout step started
    env = init_distributed(megatron=False, timeout_s=cfg.train.collective_timeout_s)
    if env.world_size != cfg.train.nprocs:
        log.warning("the trainer step has %d tasks, train.nprocs is %d: using the step's", env.world_size,
                    cfg.train.nprocs)
        cfg.train.nprocs = env.world_size
    if cfg.train.cpus is not None or cfg.rollout.cpus is not None:
        log.warning("train.cpus / rollout.cpus are for local runs; on Slurm the het groups place trainer and "
                    "engines (ignored)")
        cfg.train.cpus = cfg.rollout.cpus = None
    base = prepare_base(cfg) if env.rank == 0 else None
    if env.world_size > 1:
        box = [str(base) if base is not None else None]
        dist.broadcast_object_list(box, src=0)
        base = Path(box[0])
    # the warm start (an SFT run of its own, cached) on every rank, then the loop
    result = run_stages(cfg, run_dir, Path(base), launch_engines=launch_engine_step,
                        launch_critic=launch_critic_step)
    if result.get("preempted"):
        return EXIT_REQUEUE
    return 0


def default_bootstrap(cfg: Config, run_dir: Path) -> int:
    """The bootstrap :func:`run_slurm` uses unless ``$HPCRL_SLURM_BOOTSTRAP`` names another:
    :func:`slurm_bootstrap`."""
    return slurm_bootstrap(cfg, run_dir)


def _bootstrap() -> Bootstrap:
    name = os.environ.get(BOOTSTRAP_ENV)
    if not name:
        return default_bootstrap
    from hpcrl.plugin_loader import load_function

    return load_function(name)


def _attempt_banner(run_dir: Path) -> str:
    env = os.environ
    return (f"{ATTEMPT_MARKER} job {env.get('SLURM_JOB_ID', '-')} "
            f"restart {env.get('SLURM_RESTART_COUNT', '0')} task {env.get('SLURM_PROCID', '0')} "
            f"on {socket.gethostname()} run {run_dir}")


def run_slurm(config_path: str | os.PathLike, bootstrap: Optional[Bootstrap] = None) -> int:
    """Run the job of a run folder inside its allocation; returns the exit status (0 success).

    Under a plain sbatch script (no submitit) with ``slurm.requeue``, the preemption signal
    (``$HPCRL_PREEMPT_SIGNAL``, else ``slurm.signal``'s name) interrupts the bootstrap and the exit status is
    :data:`~hpcrl.slurm.requeue.EXIT_REQUEUE`, so the template requeues the job; the run resumes from its
    newest checkpoint (:func:`hpcrl.slurm.requeue.exit_for_requeue_on_signal`).

    Args:
        config_path: the run folder's resolved ``config.yaml`` (its folder is the run folder).
        bootstrap: what to run; default ``$HPCRL_SLURM_BOOTSTRAP`` or :func:`default_bootstrap`.

    A known error (:mod:`hpcrl.errors`: the config no longer validates here, e.g. a data file missing on the
    compute node; a bad data row; an engine or the rollout step that did not start; an unreadable checkpoint)
    prints one line on stderr (``hpcrl job: error: ...; traceback in RUN/logs/attempt-N/trainer.log``) and
    returns its exit status (2 config/data, 1 others); unexpected errors propagate with their traceback.
    """
    return _run(config_path, bootstrap)[0]


def _run(config_path: str | os.PathLike, bootstrap: Optional[Bootstrap] = None) -> tuple[int, bool]:
    """:func:`run_slurm`, and whether a known error was reported (one line already on stderr)."""
    from hpcrl.errors import report_known

    config_path = Path(config_path).absolute()
    run_dir = config_path.parent
    rank = int(os.environ.get("SLURM_PROCID", "0") or 0)
    if rank == 0:
        print(_attempt_banner(run_dir), flush=True)
    os.environ.setdefault("HPCRL_RUN_DIR", str(run_dir))
    state = {"reported": True}

    def run() -> int:
        cfg = load_and_check(config_path)
        result = exit_for_requeue_on_signal(cfg, lambda: (bootstrap or _bootstrap())(cfg, run_dir))
        state["reported"] = False
        # The run is over (finished, or checkpointed for a requeue). Slurm may still signal the step (the time
        # limit's USR2@N can land while the task exits, and Python resets its handlers to the default, which
        # kills, at shutdown): a finished task must not end as FAILED by it.
        if "SLURM_JOB_ID" in os.environ:
            ignore_late_signals(slurm_signal=cfg.slurm.signal)
        return result if isinstance(result, int) and not isinstance(result, bool) else 0

    code = report_known("hpcrl job", run_dir, run, rank=rank)
    return code, state["reported"]


class SlurmEntry:
    """The submitit function job of a run: ``SlurmEntry(config_path)()`` is :func:`run_slurm`.

    Checkpointable in submitit's sense: on the preemption/time-limit signal submitit calls :meth:`checkpoint`
    and requeues the returned submission (this same entry; the state is in the run folder).
    """

    def __init__(self, config_path: str | os.PathLike, requeue: bool = True) -> None:
        self.config_path = str(Path(config_path).absolute())
        self.requeue = requeue

    def __call__(self) -> int:
        code, reported = _run(self.config_path)
        if code == EXIT_REQUEUE:  # checkpointed: requeue (or, with slurm.requeue false, end)
            return requeue_after_checkpoint(self.requeue)
        if reported:  # one line is on stderr, the traceback in the attempt's log: end the task with the
            raise SystemExit(code)  # status, past submitit's handler (it would print a traceback of this call)
        if code != 0:  # submitit reports a raised error as the job's failure; a return value would be lost
            raise RuntimeError(f"hpcrl run {self.config_path} exited with status {code}")
        if "SUBMITIT_FOLDER" in os.environ:  # a submitit task, which writes the result and exits next
            from hpcrl.procs import skip_final_collection

            skip_final_collection()  # ~2 s sooner
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """The submission to requeue with (submitit calls this on the signal when the loop is not watching it
        yet); None when not requeueing (:func:`hpcrl.slurm.requeue.submitit_resubmission`)."""
        return submitit_resubmission(SlurmEntry(self.config_path, self.requeue), self.requeue)

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
