"""hpcrl on Slurm: submit from a login node, heterogeneous jobs, status and control.

Modules, one job each (imported lazily by :mod:`hpcrl.cli`; only :mod:`.executor` and :mod:`.torch_env` import
submitit when they are imported, the others inside functions):

* :mod:`.resources`: the ``slurm:`` config section -> submitit parameters and het-job components
  (:func:`~hpcrl.slurm.resources.plan_job`); login-node checks that need the whole config.
* :mod:`.container`: ``slurm.container`` -> the ``apptainer exec --nv --bind ... --env ... IMAGE`` prefix.
* :mod:`.executor`: :class:`~hpcrl.slurm.executor.HetSlurmExecutor`, submitit's Slurm executor extended with
  heterogeneous jobs (``#SBATCH hetjob``) and sacct's ``<id>+N`` rows.
* :mod:`.submit`: ``hpcrl submit``: validate, write the run folder, submit (or ``--dry-run``).
* :mod:`.templates`: the plain sbatch templates in ``sbatch/``, filled from a config
  (``hpcrl submit --plain``).
* :mod:`.entry`: what runs inside the allocation (``hpcrl run-slurm CONFIG`` and the submitit function job):
  torch.distributed from Slurm's variables, the loop.
* :mod:`.torch_env`: :class:`~hpcrl.slurm.torch_env.TrainerStepEnvironment`, submitit's
  ``TorchDistributedEnvironment`` for the trainer step (the step's world size, a port below the ephemeral
  range).
* :mod:`.requeue`: the one owner of requeueing: the exit status of a run that stopped with a checkpoint, who
  runs ``scontrol requeue`` on each path (submitit, plain template), ``slurm.requeue: false``.
* :mod:`.rollout_step`: the rollout job step (engines via ``srun --overlap`` or ``--het-group=1``) that
  trainer rank 0 starts, health-checks and tears down.
* :mod:`.sweep`: ``hpcrl sweep``: points, one run folder each, one job array; status, report, resubmit.
* :mod:`.state`: run folders, ``job.json``, squeue/sacct states, the ``hpcrl status`` table.
* :mod:`.control`: ``hpcrl logs`` and ``hpcrl cancel``.

Run folder files written here: ``config.yaml`` (resolved), ``submission.sbatch`` (the exact script given to
sbatch), ``job.json`` (job id, launcher, log paths; absent after ``--dry-run``), ``logs/`` (``attempt-N`` are
made by the run itself), ``submitit/`` (submitit's pickles and task logs ``<jobid>_<task>_log.{out,err}``).
"""

from __future__ import annotations


class SlurmCommandError(Exception):
    """A problem with a command's input or with Slurm, reported as one line (no traceback).

    Attributes:
        exit_code: the exit status ``hpcrl`` returns (2: bad input, nothing was queued; 1: Slurm failed).
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __str__(self) -> str:
        return " ".join(str(self.args[0]).split())


JOB_FILE = "job.json"
"""The run folder's record of its Slurm job (written by :func:`hpcrl.slurm.submit.submit`)."""
SCRIPT_FILE = "submission.sbatch"
"""The sbatch script of the run, exactly as submitted (also written by ``--dry-run``)."""
SUBMITIT_DIR = "submitit"
"""submitit's folder inside the run folder: pickles and the job's task logs."""
