"""The sweep folder's manifest (:data:`SWEEP_FILE`, ``sweep.json``): write it atomically, find and read it, the
Slurm state of each point, and point names given on the command line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from hpcrl.fsutil import atomic_write_text
from hpcrl.slurm import SlurmCommandError
from hpcrl.slurm.state import FINAL_STATES, NOT_SUBMITTED, UNKNOWN, Runner, query_states, run_command

SWEEP_FILE = "sweep.json"
"""The sweep folder's manifest."""

MANIFEST_VERSION = 1

RESUBMIT_STATES = frozenset({"FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                             "DEADLINE", "PREEMPTED"})
"""Final Slurm states after which ``hpcrl sweep --resubmit`` resubmits a point by default."""


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


def point_states(manifest: Mapping[str, Any], runner: Runner = run_command) -> dict[str, str]:
    """Point name -> Slurm state of its job (:data:`~hpcrl.slurm.state.NOT_SUBMITTED` without one), with one
    squeue and at most one sacct call for the whole sweep (array tasks ``<id>_<i>``)."""
    ids = [str(p["job_id"]) for p in manifest["points"] if p.get("job_id")]
    states = query_states(ids, runner)
    return {p["name"]: states.get(str(p["job_id"]), UNKNOWN) if p.get("job_id") else NOT_SUBMITTED
            for p in manifest["points"]}


def check_no_live_jobs(manifest: Optional[Mapping[str, Any]], names: Optional[set[str]] = None,
                        runner: Runner = run_command) -> None:
    if not manifest:
        return
    states = point_states(manifest, runner)
    live = [(n, s) for n, s in states.items()
            if (names is None or n in names) and s not in FINAL_STATES and s not in (UNKNOWN, NOT_SUBMITTED)]
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
