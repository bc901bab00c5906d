"""Run folders and their Slurm jobs: ``job.json``, squeue/sacct states, and the ``hpcrl status`` table.

A *run folder* is a folder with ``config.yaml`` or ``job.json`` (``run.output_dir/run.name``). Its job id
comes from ``job.json`` (written by ``hpcrl submit``); the state from ``squeue`` while the job is known to the
controller, else from ``sacct``; the rollout id and the last mean reward from ``metrics.jsonl``; the attempt
count from the ``logs/attempt-N`` folders the run makes each time it starts (requeues included).

Het jobs appear in squeue and sacct as ``<id>+0``, ``<id>+1``; a run's state is its group 0's (the trainer),
unless a component failed.

A local ``hpcrl run`` has no job: it writes ``local_run.json`` (pid, host, state ``RUNNING``) when it starts
and its outcome (``COMPLETED``, ``STOPPED``, ``FAILED``) when it exits (:func:`local_run_record`); ``hpcrl
status`` shows ``RUNNING`` while that process is alive, ``FAILED`` when it died without recording an outcome
(SIGKILL, out of memory), and ``NOT_SUBMITTED`` only for a folder that was never run nor submitted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from hpcrl.fsutil import atomic_write_text
from hpcrl.slurm import JOB_FILE, SlurmCommandError

FINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "TIMEOUT", "REVOKED", "SPECIAL_EXIT",
})
"""Slurm job states after which the job does nothing more (``PREEMPTED`` without requeue is final too)."""
NOT_SUBMITTED = "NOT_SUBMITTED"
"""State of a run folder without ``job.json`` (``hpcrl submit --dry-run``)."""
UNKNOWN = "UNKNOWN"
"""State when neither squeue nor sacct knows the job (or they are not installed), or when a local run's process
is on another host (its liveness cannot be checked from here)."""
RUNNING, COMPLETED, STOPPED, FAILED = "RUNNING", "COMPLETED", "STOPPED", "FAILED"
"""States of a local ``hpcrl run`` (Slurm's words): alive; finished every step; stopped early on purpose
(preemption signal, Ctrl-C; resumable); ended by an error or killed."""
LOCAL_RUN_FILE = "local_run.json"
"""The record of the newest local ``hpcrl run`` in a run folder (:func:`local_run_record`)."""
_BAD_STATES = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "TIMEOUT", "CANCELLED")

def queued_or_running(state: str) -> bool:
    """Whether a job in ``state`` is still pending, running or ending (COMPLETING): not in a final state, and
    neither :data:`UNKNOWN` nor :data:`NOT_SUBMITTED`."""
    return state not in FINAL_STATES and state not in (UNKNOWN, NOT_SUBMITTED)


Runner = Callable[[list[str]], Optional[str]]
"""Runs a command and returns its stdout, or None when it is missing or fails (injectable for tests)."""


def het_base_id(job_id: str) -> str:
    """``"123+1"`` -> ``"123"``; any other id unchanged (``"123"``, ``"123_4"``)."""
    base, plus, offset = job_id.partition("+")
    return base if plus and offset.isdigit() else job_id


_NO_SUCH_JOB = "Invalid job id specified"
"""What ``squeue -j IDS`` says (exit 1) when the controller knows none of the ids: an answer, not a
failure."""


def run_command(argv: list[str], timeout: float = 30.0) -> Optional[str]:
    """stdout of ``argv``, or None when the program is missing, fails or times out (the default Runner).

    An exit 1 with :data:`_NO_SUCH_JOB` on stderr (``squeue -j`` of jobs that have all left the queue) is the
    answer "no such job": its stdout (empty) is returned."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 or _NO_SUCH_JOB in (out.stderr or "") else None


# ------------------------------------------------------------------------------------------------------------
# job.json
# ------------------------------------------------------------------------------------------------------------

def write_job_file(run_dir: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Write ``run_dir/job.json`` atomically (temp file + ``os.replace``). Returns its path."""
    return atomic_write_text(Path(run_dir) / JOB_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_job_file(run_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    """``run_dir/job.json`` as a dict; None when the run was never submitted (or the file is unreadable)."""
    path = Path(run_dir) / JOB_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("job_id") else None


# ------------------------------------------------------------------------------------------------------------
# local_run.json (hpcrl run)
# ------------------------------------------------------------------------------------------------------------

def _proc_start_ticks(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22), or None when
    there is no such process or no /proc. Tells a live process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, start_ticks: Optional[int]) -> bool:
    """Whether ``pid`` runs on this host and (when known) is the process that started at ``start_ticks``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with this pid
        pass
    now = _proc_start_ticks(pid)
    return start_ticks is None or now is None or now == start_ticks


class LocalRun:
    """The running ``hpcrl run``'s record; the caller sets :attr:`exit_code` before the block ends."""

    def __init__(self, run_dir: Path, stopped_codes: Iterable[int]) -> None:
        self.path = Path(run_dir) / LOCAL_RUN_FILE
        self.stopped_codes = frozenset(stopped_codes)
        self.exit_code: Optional[int] = None
        pid = os.getpid()
        self.record: dict[str, Any] = {"state": RUNNING, "pid": pid, "host": socket.gethostname(),
                                       "start_ticks": _proc_start_ticks(pid), "started": time.time()}

    def write(self) -> None:
        atomic_write_text(self.path, json.dumps(self.record, indent=2, sort_keys=True) + "\n")


@contextmanager
def local_run_record(run_dir: str | os.PathLike, stopped_codes: Iterable[int] = ()) -> Iterator[LocalRun]:
    """Record a local ``hpcrl run`` in ``run_dir/local_run.json`` for ``hpcrl status``.

    On entry: state ``RUNNING`` with this process's pid, host and start time. On exit: ``COMPLETED`` when the
    block set ``exit_code`` 0, ``STOPPED`` for a code in ``stopped_codes`` (the preemption exit) or
    KeyboardInterrupt, ``FAILED`` for any other code or exception (re-raised), with ``ended`` (epoch seconds)
    and ``exit_code``. Raises OSError when the folder is not writable.
    """
    run = LocalRun(Path(run_dir), stopped_codes)
    run.write()
    state = FAILED
    try:
        yield run
        state = (COMPLETED if run.exit_code == 0 else
                 STOPPED if run.exit_code in run.stopped_codes else FAILED)
    except KeyboardInterrupt:
        state = STOPPED
        raise
    finally:
        run.record.update(state=state, ended=time.time(), exit_code=run.exit_code)
        run.write()


def read_local_run(run_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    """``run_dir/local_run.json`` as a dict, or None when the folder was never run locally (or it is unreadable)."""
    try:
        data = json.loads((Path(run_dir) / LOCAL_RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("state") else None


def local_state(record: dict[str, Any]) -> str:
    """The state of a local run from its record: the recorded outcome; for ``RUNNING``, ``RUNNING`` while its
    process lives, ``FAILED`` when it died without recording an outcome, ``UNKNOWN`` on another host."""
    state = str(record["state"])
    if state != RUNNING:
        return state
    if record.get("host") != socket.gethostname():
        return UNKNOWN
    try:
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return UNKNOWN
    return RUNNING if _alive(pid, record.get("start_ticks")) else FAILED


# ------------------------------------------------------------------------------------------------------------
# squeue / sacct
# ------------------------------------------------------------------------------------------------------------

_RANGE = r"\d+(?:-\d+)?(?::\d+)?"
_FOLDED_RE = re.compile(rf"(\d+)_\[({_RANGE}(?:,{_RANGE})*)(?:%\d+)?\]")


def expand_array_id(job_id: str) -> list[str]:
    """The task ids of a folded job-array row: ``"3_[2-3%2]"`` -> ``["3_2", "3_3"]``, ``"7_[0,4-5]"`` ->
    ``["7_0", "7_4", "7_5"]`` (a ``%N`` throttle suffix is ignored, a ``:S`` step honoured); any other id is
    returned alone.

    sacct (Slurm 22.05, which cannot expand arrays itself) reports array tasks that never started as one such
    row (``3_[2-3%2]|CANCELLED by 0`` after ``scancel 3``), and ``sacct -j 3_2`` finds nothing for them."""
    m = _FOLDED_RE.fullmatch(job_id)
    if not m:
        return [job_id]
    base, spec = m.groups()
    out: list[str] = []
    for part in spec.split(","):
        span, _, step = part.partition(":")
        lo, _, hi = span.partition("-")
        out += [f"{base}_{i}" for i in range(int(lo), int(hi or lo) + 1, max(int(step or 1), 1))]
    return out


def _merge(states: dict[str, list[str]]) -> dict[str, str]:
    """One state per base id: group 0's, unless another component failed or was cancelled."""
    out = {}
    for base, rows in states.items():
        bad = [s for s in rows[1:] if s in _BAD_STATES]
        out[base] = bad[0] if bad and rows[0] not in FINAL_STATES else rows[0]
    return out


def _collect(rows: Iterable[tuple[str, str]]) -> dict[str, str]:
    states: dict[str, list[tuple[int, str]]] = {}
    folded: dict[str, str] = {}
    for job_id, state in rows:
        if not job_id or "." in job_id:  # job steps (123.batch, 123+0.0)
            continue
        state = state.split()[0] if state.split() else UNKNOWN  # "CANCELLED by 0" -> CANCELLED
        tasks = expand_array_id(job_id)
        if tasks != [job_id]:
            folded.update(dict.fromkeys(tasks, state))
            continue
        base, _, offset = job_id.partition("+")
        states.setdefault(base, []).append((int(offset) if offset.isdigit() else 0, state))
    merged = _merge({b: [s for _, s in sorted(v)] for b, v in states.items()})
    return {**folded, **merged}  # a task's own row wins over a folded one


def parse_squeue(text: str) -> dict[str, str]:
    """``squeue -h -r -o %i|%T`` output -> ``{base job id: state}`` (het components merged, folded array rows
    expanded)."""
    return _collect(tuple(line.split("|", 1)) for line in text.splitlines() if "|" in line)


def parse_sacct(text: str) -> dict[str, str]:
    """``sacct -n -X -P -o JobID,State`` output -> ``{base job id: state}`` (steps skipped, het merged,
    folded array rows such as ``3_[2-3%2]`` expanded into ``3_2``, ``3_3``)."""
    return _collect(tuple(line.split("|")[:2]) for line in text.splitlines() if "|" in line)


def array_of(job_id: str) -> Optional[str]:
    """The array job id of an array task id (``"3_2"`` -> ``"3"``); None for any other id."""
    base, sep, task = job_id.partition("_")
    return base if sep and base.isdigit() and task.isdigit() else None


@dataclass
class JobStates:
    """What squeue and sacct say of some jobs (:func:`job_states`)."""

    states: dict[str, str]
    """Job id (het ids by their base) -> Slurm state; :data:`UNKNOWN` when neither command has the job."""
    why_unknown: dict[str, str]
    """Job id -> one line saying why its state is :data:`UNKNOWN` (only for those ids)."""
    queue_checked: bool
    """squeue answered, so a job it did not list is neither pending nor running (it has ended, or Slurm forgot
    it); False when squeue is missing or failed."""


def job_states(job_ids: Iterable[str], runner: Runner = run_command) -> JobStates:
    """Current state of each job id: squeue first (live jobs), then sacct (finished ones), else UNKNOWN with
    the reason.

    Ids may be plain (``123``), het (``123+1``, reported as ``123``) or job-array tasks (``123_4``). squeue
    runs with ``-r`` so pending tasks are not folded into ``123_[4-7]``; sacct is asked for the tasks' arrays
    too (``-j 123``), since it has no row of its own for a task that never started, only the array's folded
    row, which :func:`parse_sacct` expands. One squeue and at most one sacct call for all ids."""
    ids = sorted({het_base_id(str(j)) for j in job_ids})
    if not ids:
        return JobStates({}, {}, True)
    found: dict[str, str] = {}
    out = runner(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ",".join(ids)])  # -r: one row per array task
    queue_checked = out is not None
    if out is not None:
        found.update({k: v for k, v in parse_squeue(out).items() if k in ids})
    rest = [j for j in ids if j not in found]
    acct: Optional[dict[str, str]] = None
    if rest:
        arrays = {a for j in rest if (a := array_of(j))}
        asked = ",".join(sorted({*rest, *arrays}))
        out = runner(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", asked])
        if out is not None:
            acct = parse_sacct(out)
            found.update({k: v for k, v in acct.items() if k in rest})
    why = {j: _why_unknown(j, queue_checked, acct) for j in ids if j not in found}
    return JobStates({j: found.get(j, UNKNOWN) for j in ids}, why, queue_checked)


def _why_unknown(job_id: str, queue_checked: bool, acct: Optional[dict[str, str]]) -> str:
    queue = "not queued (squeue)" if queue_checked else "squeue could not be run (not on PATH, or it failed)"
    if acct is None:
        return f"{queue}, and sacct could not be run (not on PATH, accounting off or slurmdbd down)"
    array = array_of(job_id)
    if array and any(array_of(k) == array for k in acct):
        return (f"{queue}, and sacct has no record of task {job_id.partition('_')[2]} of array {array} "
                "though it has the array's other tasks (Slurm keeps none for a pending task cancelled by its "
                "own id: it never started)")
    return f"{queue}, and sacct has no record of it (accounting records purged, or never written)"


def query_states(job_ids: Iterable[str], runner: Runner = run_command) -> dict[str, str]:
    """Job id -> state, as :func:`job_states` (without the reasons)."""
    return job_states(job_ids, runner).states


# ------------------------------------------------------------------------------------------------------------
# Run folders
# ------------------------------------------------------------------------------------------------------------

def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run folder (has ``config.yaml`` or ``job.json``)."""
    return (path / "config.yaml").is_file() or (path / JOB_FILE).is_file()


def find_run(run: str, output_dir: str = "runs") -> Path:
    """The run folder named by ``run``: a path to a run folder, or a run name under ``output_dir``.

    Raises SlurmCommandError (exit 2) naming ``RUN`` when neither exists.
    """
    for cand in (Path(run), Path(output_dir) / run):
        if cand.is_dir() and is_run_dir(cand):
            return cand
    raise SlurmCommandError(f"RUN={run!r}: no run folder (looked for {run} and {Path(output_dir) / run}, a "
                            "folder with config.yaml or job.json); give a run folder or a run name under "
                            "--output-dir")


def find_runs(target: Optional[str], output_dir: str = "runs") -> list[Path]:
    """Run folders for ``hpcrl status``: one run (folder or name), every run under a folder, or under
    ``output_dir`` when ``target`` is None. Sorted by path. Raises SlurmCommandError when nothing matches."""
    if target is not None:
        path = Path(target)
        if path.is_dir() and not is_run_dir(path):
            runs = sorted(p for p in path.iterdir() if p.is_dir() and is_run_dir(p))
            if runs:
                return runs
        return [find_run(target, output_dir)]
    base = Path(output_dir)
    if not base.is_dir():
        raise SlurmCommandError(f"--output-dir={output_dir!r}: no such folder; run hpcrl status from the "
                                "folder you submitted from, or pass --output-dir (run.output_dir) or a run "
                                "folder")
    return sorted(p for p in base.iterdir() if p.is_dir() and is_run_dir(p))


def attempt_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """``logs/attempt-N`` folders of a run, in attempt order."""
    logs = Path(run_dir) / "logs"
    if not logs.is_dir():
        return []
    from hpcrl.run_setup import attempt_number

    found = [(n, p) for p in logs.iterdir() if p.is_dir() and (n := attempt_number(p.name)) is not None]
    return [p for _, p in sorted(found)]


def planned_rollouts(run_dir: Path) -> Optional[int]:
    """``run.num_rollout`` from ``run_dir/config.yaml``, or None when the file is missing or unreadable (a
    status table then shows no "/N")."""
    try:
        import yaml

        data = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        return int(data["run"]["num_rollout"])
    except Exception:  # a missing or hand-edited config only loses the "/N" in the table
        return None


def run_finished(run_dir: str | os.PathLike) -> bool:
    """Whether the run's ``metrics.jsonl`` has its last planned step (``run.num_rollout`` from its
    ``config.yaml``); False without metrics or without a readable plan."""
    from hpcrl.metrics import read_metrics

    steps = [r["step"] for r in read_metrics(Path(run_dir)) if isinstance(r.get("step"), int)]
    planned = planned_rollouts(Path(run_dir))
    return bool(steps) and planned is not None and max(steps) + 1 >= planned


@dataclass
class RunStatus:
    """One row of ``hpcrl status``."""

    run: str
    path: Path
    job_id: Optional[str]
    state: str
    rollout_id: Optional[int]
    """The last rollout id in ``metrics.jsonl`` (0-based; None before the first step)."""
    num_rollout: Optional[int]
    last_reward: Optional[float]
    attempts: int
    note: Optional[str] = None
    """Why the state is :data:`UNKNOWN`, when it is for a submitted run (:attr:`JobStates.why_unknown`)."""

    @property
    def steps_done(self) -> int:
        """Rollout steps done: ``rollout_id + 1`` (ids run from 0 without gaps; a resume truncates later rows)."""
        return 0 if self.rollout_id is None else self.rollout_id + 1


def run_status(run_dir: Path, states: dict[str, str], why_unknown: Optional[dict[str, str]] = None
               ) -> RunStatus:
    """The :class:`RunStatus` of one run folder, given job states (and the reasons of UNKNOWN ones) from
    :func:`job_states`.

    State: a live local ``hpcrl run`` (:data:`LOCAL_RUN_FILE`) is ``RUNNING``; else a submitted run's Slurm state;
    else the local run's outcome (:func:`local_state`); else, for a folder with steps but no record (a run from
    before the record existed), ``COMPLETED`` when every step is done and ``STOPPED`` otherwise; else
    ``NOT_SUBMITTED``.
    """
    from hpcrl.metrics import read_metrics

    job = read_job_file(run_dir)
    job_id = str(job["job_id"]) if job else None
    local = read_local_run(run_dir)
    local = local_state(local) if local else None
    rows = [r for r in read_metrics(run_dir) if isinstance(r.get("step"), int) and r["step"] >= 0]
    num_rollout = planned_rollouts(run_dir)
    note = None
    if local == RUNNING or (local and not job_id):
        state = local
    elif job_id:
        state = states.get(het_base_id(job_id), UNKNOWN)
        note = (why_unknown or {}).get(het_base_id(job_id)) if state == UNKNOWN else None
    elif rows:
        state = COMPLETED if num_rollout is not None and rows[-1]["step"] + 1 >= num_rollout else STOPPED
    else:
        state = NOT_SUBMITTED
    rewards = [r["rollout/reward_mean"] for r in rows
               if isinstance(r.get("rollout/reward_mean"), (int, float))]
    return RunStatus(run=run_dir.name, path=run_dir, job_id=job_id, state=state,
                     rollout_id=rows[-1]["step"] if rows else None, num_rollout=num_rollout,
                     last_reward=rewards[-1] if rewards else None, attempts=len(attempt_dirs(run_dir)),
                     note=note)


def collect_status(run_dirs: list[Path], runner: Runner = run_command) -> list[RunStatus]:
    """Status rows for ``run_dirs`` with one squeue and at most one sacct call for all their jobs."""
    ids = [str(j["job_id"]) for d in run_dirs if (j := read_job_file(d))]
    js = job_states(ids, runner)
    return [run_status(d, js.states, js.why_unknown) for d in run_dirs]


def format_table(rows: list[RunStatus]) -> str:
    """Rows as an aligned text table with a header: RUN, JOB, STATE, ROLLOUT (steps done / ``num_rollout``),
    REWARD, ATTEMPTS, PATH; then one line per run whose state is UNKNOWN, saying why (``RUN: UNKNOWN:
    ...``)."""
    header = ("RUN", "JOB", "STATE", "ROLLOUT", "REWARD", "ATTEMPTS", "PATH")
    lines = [header]
    for r in rows:
        rollout = "-" if r.rollout_id is None else str(r.steps_done)
        if r.num_rollout is not None:
            rollout += f"/{r.num_rollout}"
        reward = "-" if r.last_reward is None else f"{r.last_reward:.3f}"
        lines.append((r.run, r.job_id or "-", r.state, rollout, reward, str(r.attempts), str(r.path)))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
    return "\n".join(text + [f"{r.run}: {r.state}: {r.note}" for r in rows if r.note])
