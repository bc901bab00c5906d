"""The one owner of requeueing: whether a job that stopped early goes back to the queue, and who asks Slurm.

A run stops early with a checkpoint when :mod:`hpcrl.preempt` says so (the preemption signal,
``slurm.signal``, or the job's deadline); the trainer then returns :data:`EXIT_REQUEUE`. What happens next
depends on how the job was submitted, and every one of those paths is here (``docs/slurm.md``, "Preemption
and requeue"):

* **submitit job, hpcrl checkpointed** (:class:`~hpcrl.slurm.entry.SlurmEntry` got :data:`EXIT_REQUEUE`):
  :func:`requeue_after_checkpoint` - late copies of the signal are ignored, task 0 runs ``scontrol requeue``
  and every task waits to be ended by it (:func:`requeue_and_wait`).
* **submitit job, signal before the loop watches it** (model preparation): submitit's own handler runs in task
  0, calls ``SlurmEntry.checkpoint``, which returns :func:`submitit_resubmission`, and submitit runs
  ``scontrol requeue``. On a time-limit signal submitit counts down :data:`MAX_TIME_LIMIT_REQUEUES`.
* **plain sbatch template** (``hpcrl submit --plain``): :func:`exit_for_requeue_on_signal` turns the signal
  into :data:`EXIT_REQUEUE` when nothing else handles it, and the template's batch shell runs
  ``scontrol requeue`` on that status when :func:`template_values` says ``requeue`` is ``1``.
* **local run** (``hpcrl run``): nothing requeues; the exit status :data:`EXIT_REQUEUE` says "run it again".

``slurm.requeue: false`` turns all of them off: the job is submitted with ``--no-requeue``
(:func:`sbatch_option`), so Slurm never requeues it either (a ``PreemptMode=REQUEUE`` partition cancels it
when preempted), ``SlurmEntry.checkpoint`` returns None, the trainer ends after its checkpoint and the
template does not requeue. With ``slurm.requeue: true`` Slurm may requeue a preempted job itself
(``PreemptMode=REQUEUE``); the ``scontrol requeue`` here then fails, saying so, and the tasks wait for Slurm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from hpcrl.config import Config
from hpcrl.errors import EXIT_RETRY

EXIT_REQUEUE = EXIT_RETRY
"""Exit status of a run that stopped early with a checkpoint and wants to continue in a requeued job: the
one number :data:`hpcrl.errors.EXIT_RETRY` (75, ``EX_TEMPFAIL``), under the name docs/slurm.md uses; the
plain sbatch templates run ``scontrol requeue`` on it, ``hpcrl run`` returns it."""
MAX_TIME_LIMIT_REQUEUES = 100
"""How often submitit requeues a run that reached its time limit (its ``max_num_timeout``; preemptions do not
count)."""
WAIT_FOR_REQUEUE_S = 600.0
"""Seconds every task waits, after ``scontrol requeue``, for Slurm to end it."""
WAIT_WHEN_SLURM_REQUEUES_S = 120.0
"""Seconds every task waits when ``scontrol requeue`` failed (Slurm is already requeueing the job)."""


class Preempted(BaseException):
    """Raised in the main thread by the plain-sbatch signal handler (:func:`exit_for_requeue_on_signal`); a
    BaseException so that ``except Exception`` in the bootstrap does not swallow it."""


def sbatch_option(requeue: bool) -> str:
    """The sbatch option for ``slurm.requeue``: ``--requeue`` or ``--no-requeue``."""
    return "--requeue" if requeue else "--no-requeue"


def template_values(requeue: bool) -> dict[str, Any]:
    """What the plain sbatch templates need to requeue: ``requeue`` (``"1"`` or ``"0"``: ``slurm.requeue``)
    and ``exit_requeue`` (:data:`EXIT_REQUEUE`, the step's status on which the batch shell runs ``scontrol
    requeue``)."""
    return {"requeue": "1" if requeue else "0", "exit_requeue": EXIT_REQUEUE}


def job_to_requeue(environ: Optional[dict] = None) -> str:
    """The id ``scontrol requeue`` takes for this job: ``<array id>_<task>`` in a job array (the raw job id of
    an array's last task would requeue every task), else ``SLURM_JOB_ID``. Reads ``environ`` (default
    ``os.environ``); raises KeyError outside a Slurm job."""
    environ = os.environ if environ is None else environ
    if environ.get("SLURM_ARRAY_JOB_ID"):
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ["SLURM_JOB_ID"]


def _install_plain_handler(cfg: Config) -> bool:
    """Outside submitit, in a Slurm job that may be requeued: the preemption signal raises :class:`Preempted`
    in the main thread. A bootstrap that checkpoints first (the loop's watch) installs its own handler over
    this one. False (nothing installed) under submitit, outside a job, with ``slurm.requeue: false``, off the
    main thread, or for an unknown signal name."""
    if ("SUBMITIT_FOLDER" in os.environ or "SLURM_JOB_ID" not in os.environ or not cfg.slurm.requeue
            or threading.current_thread() is not threading.main_thread()):
        return False
    from hpcrl.preempt import signal_from_config

    try:
        signum = signal_from_config(cfg.slurm.signal)
    except ValueError:
        return False

    def handler(num, frame):
        raise Preempted(signal.Signals(num).name)

    signal.signal(signum, handler)
    return True


def exit_for_requeue_on_signal(cfg: Config, run: Callable[[], Any]) -> Any:
    """Call ``run()`` and return its result; under a plain sbatch script (no submitit) with ``slurm.requeue``,
    the preemption signal (``$HPCRL_PREEMPT_SIGNAL``, else ``slurm.signal``'s name) that reaches no other
    handler interrupts it and :data:`EXIT_REQUEUE` is returned instead, so the template requeues the job (the
    run resumes from its newest checkpoint). Errors of ``run`` propagate."""
    _install_plain_handler(cfg)
    try:
        return run()
    except Preempted as e:
        print(f"[hpcrl] caught {e}: exiting with {EXIT_REQUEUE} so the job is requeued", flush=True)
        return EXIT_REQUEUE


def ignore_late_signals(environ: Optional[dict] = None, slurm_signal: Optional[str] = None) -> None:
    """Once a task's run is over (finished, or checkpointed for a requeue): ignore further copies of the
    preemption signal - with ``slurm_signal`` (``slurm.signal``), the one :func:`hpcrl.preempt.signal_from_config`
    names; else ``$HPCRL_PREEMPT_SIGNAL``, else ``$SUBMITIT_PREEMPT_SIGNAL``, else USR2 (read from ``environ``).
    They may come from the steps, ``srun``, the batch shell's trap or the time limit's ``--signal`` while the
    task exits; unhandled, submitit's own checkpoint-and-requeue handler would run as well, or the default
    action (Python restores it at shutdown) would kill a finished task and Slurm would mark the job FAILED.
    Does nothing off the main thread or for an unknown name."""
    from hpcrl.preempt import SIGNAL_ENV, signal_by_name, signal_from_config

    environ = os.environ if environ is None else environ
    try:
        signum = (signal_from_config(slurm_signal) if slurm_signal is not None else
                  signal_by_name(environ.get(SIGNAL_ENV) or environ.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2"))
    except ValueError:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_IGN)


def requeue_and_wait(requeue: bool, wait_s: float = WAIT_FOR_REQUEUE_S) -> int:
    """After a checkpoint: task 0 (``SLURM_PROCID`` 0) asks Slurm to requeue the job (``scontrol requeue``
    :func:`job_to_requeue`), then every task waits (``wait_s`` seconds; at most
    :data:`WAIT_WHEN_SLURM_REQUEUES_S` when ``scontrol`` refused because Slurm is already requeueing it) to be
    ended by the requeue, so no task finishes first and lets the job complete. The requeue's SIGTERM ends a
    waiting task at once (:func:`_exit_on_sigterm`).

    Returns 0 at once when ``requeue`` is False (``slurm.requeue: false``: the job just ends). Raises
    RuntimeError if the requeue did not end the job in time, KeyError outside a Slurm job, and
    subprocess.TimeoutExpired if ``scontrol`` did not answer in 60 s.
    """
    if not requeue:
        print("[hpcrl] stopped with a checkpoint; slurm.requeue is false: not requeueing", flush=True)
        return 0
    job = job_to_requeue()
    if os.environ.get("SLURM_PROCID", "0") == "0":
        print(f"[hpcrl] checkpoint written; requeueing job {job}", flush=True)
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:  # e.g. Slurm is already requeueing it (preemption): it ends us in GraceTime
            print(f"[hpcrl] scontrol requeue {job}: {out.stderr.strip()}; waiting for Slurm to end the job",
                  flush=True)
            wait_s = min(wait_s, WAIT_WHEN_SLURM_REQUEUES_S)
    previous = _exit_on_sigterm()
    try:
        time.sleep(wait_s)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    raise RuntimeError(f"job {job} was not requeued within {wait_s:.0f} s")


def _exit_on_sigterm() -> Any:
    """While a task waits for the requeue to end it: SIGTERM, which Slurm sends to every task of a job it
    requeues, ends the task at once (status 0; the checkpoint is written, nothing else is pending). Without
    it submitit's handler ignores SIGTERM ("Bypassing signal SIGTERM") and Slurm waits ``KillWait`` (30 s by
    default) before its SIGKILL, and only then requeues. Returns the handler it replaced (None off the main
    thread, where nothing is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(num, frame):
        print("[hpcrl] SIGTERM from the requeue: this task ends", flush=True)
        sys.stderr.flush()
        os._exit(0)

    return signal.signal(signal.SIGTERM, handler)


def requeue_after_checkpoint(requeue: bool, wait_s: float = WAIT_FOR_REQUEUE_S) -> int:
    """What a submitit task does once the run stopped with :data:`EXIT_REQUEUE`: :func:`ignore_late_signals`,
    then :func:`requeue_and_wait` (same return value and errors)."""
    ignore_late_signals()
    return requeue_and_wait(requeue, wait_s)


def submitit_resubmission(entry: Callable[[], Any], requeue: bool) -> Any:
    """What a submitit function job's ``checkpoint`` returns when submitit's own handler got the signal: a
    ``DelayedSubmission`` of ``entry`` (submitit then runs ``scontrol requeue``), or None with
    ``slurm.requeue: false`` (submitit then ends the job)."""
    if not requeue:
        return None
    from submitit.core.utils import DelayedSubmission

    return DelayedSubmission(entry)
