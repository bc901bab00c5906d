"""``hpcrl logs RUN [--follow | --wandb-sync]`` and ``hpcrl cancel RUN`` (a sweep's:
:mod:`hpcrl.slurm.sweep.cancel`).

Logs of a run's newest attempt: the job's main log (task 0's stdout and stderr, from the last
``[hpcrl] attempt start`` line on, since a requeued job appends to the same file), then every file of the
newest ``logs/attempt-N`` folder (engine, router, phase logs), each under a ``==> path <==`` header like
``tail``.
``--follow`` keeps printing what is appended, picks up new files and newer attempts, and stops once the job is
in a final state (or on Ctrl-C).
``--wandb-sync`` uploads the run's offline W&B runs (``wandb.mode=offline``, one per attempt, under
``RUN/wandb/``) with ``wandb sync``, from a node with internet (:func:`wandb_sync`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

from hpcrl.slurm import SlurmCommandError
from hpcrl.slurm.entry import ATTEMPT_MARKER
from hpcrl.slurm.state import (FINAL_STATES, NOT_SUBMITTED, UNKNOWN, attempt_dirs, het_base_id, query_states,
                               read_job_file)


def job_log_files(run_dir: Path) -> list[Path]:
    """The job's main log files from ``job.json`` (stdout, then stderr), those that exist."""
    job = read_job_file(run_dir) or {}
    return [Path(p) for p in (job.get("stdout"), job.get("stderr")) if p and Path(p).is_file()]


def newest_attempt_files(run_dir: Path) -> list[Path]:
    """Files of the newest ``logs/attempt-N`` folder, sorted by name (empty before the first attempt)."""
    attempts = attempt_dirs(run_dir)
    if not attempts:
        return []
    return sorted(p for p in attempts[-1].rglob("*") if p.is_file())


def _from_last_attempt(text: str) -> str:
    """The part of a job log from the last attempt marker line on (all of it without one)."""
    at = text.rfind(ATTEMPT_MARKER)
    if at < 0:
        return text
    return text[text.rfind("\n", 0, at) + 1:]


class _Tail:
    """Prints files with headers, remembering how far each was printed."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.offsets: dict[Path, int] = {}
        self.current: Optional[Path] = None

    def emit(self, path: Path, first_cut: Callable[[str], str] = lambda t: t) -> bool:
        try:
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
        except OSError:
            return False
        if not data:
            self.offsets.setdefault(path, 0)
            return False
        text = data.decode("utf-8", errors="replace")
        if path not in self.offsets:
            text = first_cut(text)
        self.offsets[path] = self.offsets.get(path, 0) + len(data)
        if not text:
            return False
        if self.current != path:
            self.out.write(f"==> {path} <==\n")
            self.current = path
        self.out.write(text if text.endswith("\n") else text + "\n")
        self.out.flush()
        return True


def _job_state(job_id: str) -> str:
    return query_states([job_id]).get(het_base_id(job_id), UNKNOWN)


def print_logs(run_dir: Path, follow: bool = False, out: TextIO = sys.stdout, poll_s: float = 1.0,
               state_every_s: float = 5.0, max_s: Optional[float] = None,
               job_state: Callable[[str], str] = _job_state) -> int:
    """Print the newest attempt's logs of ``run_dir``; with ``follow``, keep printing until the job ends.

    Args:
        run_dir: the run folder.
        follow: keep following (poll every ``poll_s`` seconds; the job state every ``state_every_s`` seconds).
        out: where to print.
        max_s: stop following after this many seconds (None: until the job ends or Ctrl-C).
        job_state: job id -> Slurm state (injectable for tests).

    Returns:
        0. Prints a note to stderr when there is nothing to show yet.
    """
    tail = _Tail(out)
    job = read_job_file(run_dir)
    job_id = str(job["job_id"]) if job else None

    def sweep() -> bool:
        printed = False
        for path in job_log_files(run_dir):
            printed |= tail.emit(path, _from_last_attempt)
        for path in newest_attempt_files(run_dir):
            printed |= tail.emit(path)
        return printed

    if not sweep() and not follow:
        state = "not submitted" if job_id is None else f"job {job_id}"
        print(f"hpcrl logs: no logs yet in {run_dir} ({state})", file=sys.stderr)
    if not follow:
        return 0
    start = last_state_check = time.monotonic()
    state = NOT_SUBMITTED if job_id is None else job_state(job_id)
    try:
        while True:
            sweep()
            now = time.monotonic()
            if max_s is not None and now - start >= max_s:
                return 0
            if job_id is None or state in FINAL_STATES:
                sweep()
                return 0
            if now - last_state_check >= state_every_s:
                state, last_state_check = job_state(job_id), now
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return 0


def wandb_sync(run_dir: Path, command: Optional[str] = None) -> int:
    """Upload the run's offline W&B runs (:func:`hpcrl.tracking.offline_runs`, oldest first: W&B syncs the
    attempts of one run in order of start time) with ``wandb sync DIR...``, its output on the terminal; W&B
    skips attempts it already synced. ``command``: the ``wandb`` executable (default
    :func:`hpcrl.tracking.wandb_command`). Returns 0 once ``wandb sync`` succeeded.

    Raises:
        SlurmCommandError: the run has no offline W&B run, or the ``wandb`` command is missing (exit 2);
            ``wandb sync`` failed (exit 1; its own message is printed above, e.g. no API key).
    """
    from hpcrl.tracking import WANDB_DIR, offline_runs, wandb_command

    runs = offline_runs(run_dir)
    if not runs:
        raise SlurmCommandError(f"hpcrl logs --wandb-sync: {run_dir}/{WANDB_DIR}/ holds no offline W&B run "
                                "(offline-run-*): only a run with wandb.mode=offline writes them; nothing to "
                                "sync")
    command = command or wandb_command()
    if command is None:
        raise SlurmCommandError("hpcrl logs --wandb-sync: the wandb command is not installed; pip install "
                                "'hpcrl[wandb]' (or run: wandb sync "
                                f"{' '.join(str(p) for p in runs)})")
    print(f"hpcrl logs: wandb sync of {len(runs)} offline W&B run(s) of {run_dir}", file=sys.stderr,
          flush=True)
    try:
        rc = subprocess.run([command, "sync", *map(str, runs)], cwd=run_dir, check=False).returncode
    except OSError as e:
        raise SlurmCommandError(f"hpcrl logs --wandb-sync: {command} did not start: {e}",
                                exit_code=1) from None
    if rc != 0:
        raise SlurmCommandError(f"hpcrl logs --wandb-sync: wandb sync exited with {rc} (its message is "
                                "above); log in with wandb login or set WANDB_API_KEY, on a node with "
                                "internet",
                                exit_code=1)
    return 0


def scancel(job_ids: list[str]) -> None:
    """``scancel`` the jobs in one call (array ids cancel every task, ``<array>_<i>`` one task, a het job id
    every component). Slurm 22.05's scancel is silent (exit 0) for jobs that have already ended.

    Raises:
        SlurmCommandError: scancel is missing (exit 2) or fails (exit 1), with its message on one line.
    """
    shown = " ".join(job_ids)
    try:
        out = subprocess.run(["scancel", *job_ids], capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise SlurmCommandError("hpcrl cancel: scancel not found on PATH; run it on a Slurm login node"
                                ) from None
    except subprocess.SubprocessError as e:
        raise SlurmCommandError(f"hpcrl cancel: scancel {shown} failed: {e}", exit_code=1) from None
    if out.returncode != 0:
        msg = " ".join((out.stderr or out.stdout).split())
        raise SlurmCommandError(f"hpcrl cancel: scancel {shown} failed: {msg}", exit_code=1)


def cancel(run_dir: Path) -> str:
    """``scancel`` the run's job (all het components). Returns the job id.

    Raises:
        SlurmCommandError: the run was never submitted (exit 2), scancel is missing (exit 2) or fails
            (exit 1).
    """
    job = read_job_file(run_dir)
    if not job:
        raise SlurmCommandError(f"RUN={str(run_dir)!r}: has no job.json, so it was never submitted; nothing "
                                "to cancel (hpcrl submit without --dry-run submits it)")
    job_id = het_base_id(str(job["job_id"]))
    scancel([job_id])
    return job_id
