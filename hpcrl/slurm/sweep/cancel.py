"""``hpcrl cancel SWEEP_FOLDER [--points NAME ...]``: cancel what a sweep has queued or running.

The whole sweep: every job array the sweep submitted that still has a point queued or running is cancelled by
its array id (``scancel <array>``: its running tasks and those that never started alike), and for a het sweep
each point's het job. ``--points``: only those points' jobs (``scancel <array>_<i>``, or the het job id).

A point counts as queued or running unless its job is in a final state, was never submitted, or is UNKNOWN
while squeue answered (Slurm no longer has it); when squeue could not be run, an UNKNOWN point's job is
cancelled too (scancel is silent for a job that has ended). scancel only asks: the tasks then spend a few
seconds COMPLETING (their processes are being killed), so the command waits for them to end
(:func:`wait_ended`), and a ``--resubmit`` right after it finds them CANCELLED. The run folders keep their
checkpoints: ``hpcrl sweep --resubmit`` brings the cancelled points back (those that never started included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from hpcrl.slurm.state import UNKNOWN, Runner, queued_or_running, run_command
from hpcrl.slurm.sweep.manifest import SweepStates, sweep_states


@dataclass
class CancelPlan:
    """What :func:`plan_cancel` found to cancel in a sweep."""

    job_ids: list[str]
    """Ids for one ``scancel`` call: array ids (whole sweep), ``<array>_<i>`` (``--points``), het job ids."""
    lines: list[str]
    """One line per job id: the job and its points with their states (``job array 7: a (RUNNING), ...``)."""
    points: list[str]
    """Names of the points whose job is cancelled."""
    states: dict[str, str] = field(default_factory=dict)
    """Every point's state before the cancel (point name -> Slurm state)."""


def _live(state: str, ss: SweepStates) -> bool:
    return queued_or_running(state) or (state == UNKNOWN and not ss.queue_checked)


def plan_cancel(manifest: Mapping[str, Any], names: Optional[Sequence[str]] = None,
                runner: Runner = run_command) -> CancelPlan:
    """The jobs to cancel for the whole sweep (``names`` None) or for the named points (resolved names, see
    :func:`~hpcrl.slurm.sweep.manifest.resolve_point_names`), from one squeue and at most one sacct call.

    Returns:
        A :class:`CancelPlan`; empty ``job_ids`` when no chosen point is queued or running.
    """
    ss = sweep_states(manifest, runner)
    chosen = {p["name"] for p in manifest["points"]} if names is None else set(names)
    live = [p for p in manifest["points"] if p["name"] in chosen and _live(ss.states[p["name"]], ss)]
    groups: dict[str, list[dict]] = {}
    for p in live:
        whole_array = names is None and p.get("array_job_id")
        groups.setdefault(str(p["array_job_id"] if whole_array else p["job_id"]), []).append(p)
    lines = []
    for job, pts in groups.items():
        what = f"job array {job}" if names is None and pts[0].get("array_job_id") else f"job {job}"
        lines.append(f"{what}: " + ", ".join(f"{p['name']} ({ss.states[p['name']]})" for p in pts))
    return CancelPlan(job_ids=list(groups), lines=lines, points=[p["name"] for p in live],
                      states=dict(ss.states))


def cancel_sweep(plan: CancelPlan) -> None:
    """``scancel`` the jobs of ``plan`` in one call (nothing when it is empty).

    Raises:
        SlurmCommandError: scancel is missing (exit 2) or fails (exit 1).
    """
    from hpcrl.slurm.control import scancel

    if plan.job_ids:
        scancel(plan.job_ids)


def wait_ended(manifest: Mapping[str, Any], points: Sequence[str], timeout_s: float = 60.0,
               poll_s: float = 1.0, runner: Runner = run_command) -> dict[str, str]:
    """Poll the states of ``points`` until none is queued, running or COMPLETING (at most ``timeout_s``
    seconds, every ``poll_s``). Returns point name -> state, as last seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        ss = sweep_states(manifest, runner)
        states = {n: ss.states[n] for n in points}
        if not any(_live(s, ss) for s in states.values()) or time.monotonic() >= deadline:
            return states
        time.sleep(poll_s)
