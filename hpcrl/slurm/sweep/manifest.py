"""The sweep folder's manifest (:data:`SWEEP_FILE`, ``sweep.json``): write it atomically, find and read it, the
Slurm state of each point, and point names given on the command line."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from hpcrl.fsutil import atomic_write_text
from hpcrl.slurm import SlurmCommandError
from hpcrl.slurm.state import (NOT_SUBMITTED, UNKNOWN, Runner, job_states, queued_or_running, run_command,
                               run_finished)

SWEEP_FILE = "sweep.json"
"""The sweep folder's manifest."""

MANIFEST_VERSION = 1

RESUBMIT_STATES = frozenset({"FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                             "DEADLINE", "PREEMPTED"})
"""Final Slurm states after which ``hpcrl sweep --resubmit`` resubmits a point by default (and, see
:func:`resubmittable`, a point whose job Slurm no longer knows and whose run is not done)."""


# ------------------------------------------------------------------------------------------------------------
# Manifest
# ------------------------------------------------------------------------------------------------------------

def write_manifest(sweep_dir: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    """Write ``sweep_dir/sweep.json`` atomically (temp file + ``os.replace``). Returns its path."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(sweep_dir / SWEEP_FILE, json.dumps(manifest, indent=2) + "\n")


def find_sweep(target: str | os.PathLike) -> Optional[Path]:
    """The sweep folder named by ``target`` (the folder, or its ``sweep.json``); None when it is not one."""
    path = Path(target)
    if path.name == SWEEP_FILE and path.is_file():
        return path.parent
    return path if (path / SWEEP_FILE).is_file() else None


def read_manifest(sweep_dir: str | os.PathLike) -> dict[str, Any]:
    """``sweep_dir/sweep.json`` (``sweep_dir`` may also be the file itself).

    Raises SlurmCommandError (exit 2) when it is missing or unreadable."""
    found = find_sweep(sweep_dir)
    if found is None:
        raise SlurmCommandError(f"SWEEP={str(sweep_dir)!r}: not a sweep folder (no {SWEEP_FILE}); give the "
                                "folder hpcrl sweep wrote, run.output_dir/<run.name>")
    try:
        data = json.loads((found / SWEEP_FILE).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("points"), list):
            raise ValueError("no points")
    except (OSError, ValueError) as e:
        raise SlurmCommandError(f"SWEEP={str(sweep_dir)!r}: cannot read {found / SWEEP_FILE} ({e})") from None
    data["sweep_dir"] = str(found.absolute())
    return data


@dataclass
class SweepStates:
    """The Slurm state of each point of a sweep (:func:`sweep_states`)."""

    states: dict[str, str]
    """Point name -> state of its current job (:data:`~hpcrl.slurm.state.NOT_SUBMITTED` without one)."""
    why_unknown: dict[str, str]
    """Point name -> why its state is :data:`~hpcrl.slurm.state.UNKNOWN` (only for those points)."""
    queue_checked: bool
    """squeue answered: an UNKNOWN point's job is neither pending nor running."""


def sweep_states(manifest: Mapping[str, Any], runner: Runner = run_command) -> SweepStates:
    """The state of every point's job, with one squeue and at most one sacct call for the whole sweep (array
    tasks ``<id>_<i>``, including those that never started: see :func:`~hpcrl.slurm.state.job_states`)."""
    ids = [str(p["job_id"]) for p in manifest["points"] if p.get("job_id")]
    js = job_states(ids, runner)
    states, why = {}, {}
    for p in manifest["points"]:
        job = str(p["job_id"]) if p.get("job_id") else None
        states[p["name"]] = js.states.get(job, UNKNOWN) if job else NOT_SUBMITTED
        if job in js.why_unknown:
            why[p["name"]] = f"job {job}: {js.why_unknown[job]}"
    return SweepStates(states, why, js.queue_checked)


def point_states(manifest: Mapping[str, Any], runner: Runner = run_command) -> dict[str, str]:
    """Point name -> Slurm state of its job, as :func:`sweep_states` (without the reasons)."""
    return sweep_states(manifest, runner).states


def resubmittable(point: Mapping[str, Any], state: str, queue_checked: bool) -> bool:
    """Whether ``hpcrl sweep --resubmit`` takes ``point`` by default: its job ended in one of
    :data:`RESUBMIT_STATES`, or Slurm no longer knows its job (``state`` UNKNOWN while squeue answered, so it
    is not queued) and its run has not logged every step, as for an array task that never started and was
    cancelled on its own (Slurm 22.05 keeps no record of it)."""
    if state in RESUBMIT_STATES:
        return True
    return state == UNKNOWN and queue_checked and not run_finished(Path(point["run_dir"]))


def check_no_live_jobs(manifest: Optional[Mapping[str, Any]], names: Optional[set[str]] = None,
                        runner: Runner = run_command) -> None:
    if not manifest:
        return
    states = point_states(manifest, runner)
    live = [(n, s) for n, s in states.items()
            if (names is None or n in names) and queued_or_running(s)]
    if live:
        shown = ", ".join(f"{n} ({s})" for n, s in live[:5]) + (" ..." if len(live) > 5 else "")
        raise SlurmCommandError(f"hpcrl sweep: {manifest['sweep_dir']} has points still queued or running: "
                                f"{shown}; wait for them or scancel them first")


def resolve_point_names(manifest: Mapping[str, Any], values: Iterable[str]) -> list[str]:
    """Point names from ``--points`` values. A value is one point name, or several joined with ``,``; since
    names contain ``,`` themselves (``lr=3e-05,seed=1``), the pieces are joined back greedily (shortest known
    name first). Raises SlurmCommandError (exit 2) naming a piece that is no point, with the known names."""
    known = [p["name"] for p in manifest["points"]]
    names: list[str] = []
    for value in values:
        if value in known:
            names.append(value)
            continue
        pieces, start = value.split(","), 0
        while start < len(pieces):
            for end in range(start + 1, len(pieces) + 1):
                if ",".join(pieces[start:end]) in known:
                    names.append(",".join(pieces[start:end]))
                    start = end
                    break
            else:
                raise SlurmCommandError(f"--points={value!r}: {','.join(pieces[start:])!r} is not a point of "
                                        f"{manifest['sweep_dir']}; its points: " + "; ".join(known))
    return list(dict.fromkeys(names))
