"""Preemption and the time limit: when to stop at a step boundary, checkpoint and leave for a requeue.

Two triggers, checked by the loop after every step (:meth:`PreemptionWatch.local_reason`), and agreed on by
all trainer ranks with one collective (:func:`agree`, an all-reduce MAX), so every rank stops at the same
step:

* the **signal** (``slurm.signal``'s name, USR2 by default; ``$HPCRL_PREEMPT_SIGNAL`` overrides), which Slurm
  sends ``LEAD`` seconds before the time limit and on preemption (``preempt_send_user_signal``), and which
  ``scancel --signal=USR2`` sends by hand. The handler only sets a flag. The signal is also *blocked* in the
  trainer's main thread for the whole run, so every process the trainer starts (engines, the router,
  torch's shared-memory manager, the checkpoint writer) inherits a blocked mask and is not killed by it
  (USR2's default action is to terminate); a pending blocked signal is seen with ``sigpending``.
* the **deadline**: the job's end time (``squeue -o %e``) minus the time one more step and a save take
  (the slowest seen so far, x1.5, plus 10 s). So a run saves in time even when no signal comes (a short
  ``--signal`` lead, a site that sends none).

Inside a Slurm job, **SIGTERM** is watched too: Slurm sends it when it ends the job now (``scancel``, a node
of the job that failed or was set DOWN, preemption without the user signal) and SIGKILLs ``KillWait`` seconds
later (30 s by default). It also sets the flag (the run checkpoints at the end of its step), and
:meth:`PreemptionWatch.job_ending` says so to the rollout's health monitor, which then restarts no engine:
with none left the rollout stops at once and the last finished step is checkpointed
(:class:`hpcrl.rollout.client.EnginesLost`). SIGTERM is not blocked (children must stay stoppable by it);
a handler is not inherited across ``exec``.

Outside Slurm there is no deadline; the signal still works (``kill -USR2 PID`` checkpoints and stops a local
``hpcrl run``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from typing import Optional

log = logging.getLogger("hpcrl.preempt")

SIGNAL_ENV = "HPCRL_PREEMPT_SIGNAL"
DEADLINE_MARGIN_S = 10.0
DEADLINE_FACTOR = 1.5
DEFAULT_SAVE_S = 30.0
"""Assumed seconds for a checkpoint until one has been timed."""


def signal_from_config(slurm_signal: str) -> signal.Signals:
    """The preemption signal: ``$HPCRL_PREEMPT_SIGNAL`` or the name in ``slurm.signal`` (``USR2@120``).
    Raises ValueError for an unknown name."""
    return signal_by_name(os.environ.get(SIGNAL_ENV) or slurm_signal.split("@")[0])


def signal_by_name(name: str) -> signal.Signals:
    """The signal a name gives, with or without ``SIG``, any case (``usr2``, ``SIGUSR2``). Raises ValueError
    for an unknown name."""
    name = name.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown preemption signal {name!r} (slurm.signal or ${SIGNAL_ENV})") from None


def take_pending(signum: signal.Signals) -> bool:
    """Whether ``signum``, blocked in this thread, was pending; a pending one is consumed (``sigtimedwait``),
    so it neither fires when unblocked nor is seen twice. Raises nothing."""
    if signum not in signal.sigpending():
        return False
    signal.sigtimedwait({signum}, 0)
    return True


def job_end_time(job_id: Optional[str] = None) -> Optional[float]:
    """Unix seconds at which the Slurm job ends (its time limit), from ``squeue -h -j ID -o %e``; None outside
    a job, for an unlimited job, or when squeue does not answer in 10 s."""
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True,
                             timeout=10).stdout.split()
        return time.mktime(time.strptime(out[0], "%Y-%m-%dT%H:%M:%S")) if out else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


class PreemptionWatch:
    """The signal flag and the deadline of one trainer rank (see the module doc).

    Use :meth:`install` in the main thread at start-up and :meth:`uninstall` at the end; :meth:`record_step`
    and :meth:`record_save` feed the deadline estimate (seconds).
    """

    def __init__(self, signum: signal.Signals, end_time: Optional[float] = None) -> None:
        self.signum = signum
        self.end_time = end_time
        self.requested = False
        self.max_step_s = 0.0
        self.max_save_s: Optional[float] = None
        self.ending = False
        """SIGTERM came (inside a Slurm job): the job is being ended; see :meth:`job_ending`."""
        self._old_handler = None
        self._old_term = None
        self._old_mask: Optional[set] = None

    @classmethod
    def from_config(cls, cfg, is_controller: bool = True) -> "PreemptionWatch":
        """The watch of a run: its signal, and the job's end time on the controller (others agree through it)."""
        return cls(signal_from_config(cfg.slurm.signal), job_end_time() if is_controller else None)

    def _handler(self, signum, frame) -> None:
        self.requested = True
        log.warning("got %s: checkpoint and stop at the end of this step", signal.Signals(signum).name)

    def _term_handler(self, signum, frame) -> None:
        self.ending = self.requested = True
        log.warning("got SIGTERM: Slurm is ending the job (scancel, a failed node, preemption); checkpoint "
                    "the last finished step and stop, no engine is restarted")

    def job_ending(self) -> bool:
        """Whether Slurm is ending the job (SIGTERM came): nothing should be restarted, only saved."""
        return self.ending

    def install(self) -> bool:
        """Set the flag handler and block the signal in this thread, and inside a Slurm job a SIGTERM handler;
        False (nothing done) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._old_handler = signal.signal(self.signum, self._handler)
        self._old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {self.signum})
        if os.environ.get("SLURM_JOB_ID") and self.signum != signal.SIGTERM:
            self._old_term = signal.signal(signal.SIGTERM, self._term_handler)
        return True

    def uninstall(self) -> None:
        """Restore the previous handler and mask; a signal still pending is consumed first (it was seen)."""
        if self._old_mask is None:
            return
        take_pending(self.signum)
        signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)
        signal.signal(self.signum, self._old_handler)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        self._old_mask = None

    def record_step(self, seconds: float) -> None:
        self.max_step_s = max(self.max_step_s, float(seconds))

    def record_save(self, seconds: float) -> None:
        self.max_save_s = max(self.max_save_s or 0.0, float(seconds))

    def local_reason(self, now: Optional[float] = None) -> Optional[str]:
        """Why this rank wants to stop now: ``"signal"``, ``"deadline"`` or None."""
        if not self.requested and self._old_mask is not None and take_pending(self.signum):
            self._handler(self.signum, None)
        if self.requested:
            return "signal"
        if self.end_time is not None:
            now = time.time() if now is None else now
            need = (self.max_step_s + (self.max_save_s if self.max_save_s is not None else DEFAULT_SAVE_S))
            if now + need * DEADLINE_FACTOR + DEADLINE_MARGIN_S >= self.end_time:
                return "deadline"
        return None


REASONS = (None, "signal", "deadline")


def agree(reason: Optional[str]) -> Optional[str]:
    """The reason to stop that any trainer rank has (all-reduce MAX over the default process group; a
    no-op without torch.distributed or with one rank)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return reason
    code = torch.tensor([REASONS.index(reason)], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        code = code.cuda()
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    return REASONS[int(code.item())]
