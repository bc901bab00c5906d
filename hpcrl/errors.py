"""One line on the terminal for the errors a run knows; the traceback goes to the attempt's log.

When ``hpcrl run`` (in-process or with local trainer workers) or the Slurm job (``hpcrl run-slurm`` /
submitit's :class:`~hpcrl.slurm.entry.SlurmEntry`) stops on a *known* error, stderr gets one line::

    hpcrl run: error: DataError: data/bad.jsonl:2: bad JSON (...); ...; traceback in runs/NAME/logs/attempt-0/trainer.log

and the process exits non-zero (:func:`exit_code_of`). Known errors (matched by class, also subclasses):

* exit 2 (:data:`EXIT_CONFIG`): ``ConfigError`` (a config that no longer validates where the run starts),
  ``DataError`` (a bad dataset file or row);
* exit 75 (:data:`EXIT_RETRY`): ``EnginesLost`` (no engine left and none may restart; the last finished step
  is checkpointed, so the run goes on when started again, and a Slurm job is requeued);
* exit 1 (:data:`EXIT_FAILED`): ``RolloutError`` (a request to the engines failed for good),
  ``ProcessStartError`` (an engine or the router did not start), ``RouterError``, ``RolloutStepError`` (the
  Slurm rollout step did not start or died), ``WeightSyncError`` (an engine refused or lost a weight
  update), ``ModelFolderError`` (a missing model folder),
  ``CheckpointError`` and megatron-core's ``CheckpointingException`` (a checkpoint that cannot be read),
  ``PluginError`` (a plug-in that does not import), ``FilterStarved`` (the dynamic filter kept too few
  groups), ``CriticError`` (PPO's critic on ranks of its own failed or exited), ``CollectiveTimeout`` (a
  trainer rank waited past ``train.collective_timeout_s`` for the others).

Anything else is unexpected and keeps its full traceback on stderr.

The traceback is appended to ``run_dir/logs/attempt-N/trainer.log`` (``trainer-rank<R>.log`` for trainer rank
R > 0), where attempt N is the one this start created (the rollout controller creates it once the engines are
about to start), or a new attempt folder when the run failed before that.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

EXIT_FAILED = 1
"""Exit status of a run stopped by a known error that is not the config's or the data's."""
EXIT_CONFIG = 2
"""Exit status of a run stopped by a config or data error (the same as ``hpcrl validate``'s)."""
EXIT_RETRY = 75
"""Exit status of a run that checkpointed and can go on when started again (``EX_TEMPFAIL``): it stopped
early on the preemption signal or the job's deadline, or no engine was left to generate. ``hpcrl run``
returns it; the Slurm job is requeued on it (:data:`hpcrl.slurm.requeue.EXIT_REQUEUE` is this number)."""

_RETRY_ERRORS = {"hpcrl.rollout.client.EnginesLost"}

_CONFIG_ERRORS = {"hpcrl.config.errors.ConfigError", "hpcrl.data.datasets.DataError"}
_RUN_ERRORS = {
    "hpcrl.rollout.client.RolloutError", "hpcrl.procs.ProcessStartError",
    "hpcrl.rollout.router.RouterError", "hpcrl.slurm.rollout_step.RolloutStepError",
    "hpcrl.models.hf.ModelFolderError", "hpcrl.checkpoint.layout.CheckpointError", "hpcrl.plugin_loader.PluginError",
    "hpcrl.weights.common.WeightSyncError", "hpcrl.rollout.rollout.FilterStarved",
    "hpcrl.train.critic_group.CriticError", "hpcrl.train.parallel.CollectiveTimeout",
    "megatron.core.dist_checkpointing.core.CheckpointingException",
}
_MAX_LINE = 600


class WorkerError(Exception):
    """A known error raised in another process (a local trainer worker), carried as text: ``line`` (what
    :func:`one_line` made of it), ``exit_code`` and ``traceback_text`` (the worker's formatted traceback)."""

    def __init__(self, line: str, exit_code: int, traceback_text: str):
        super().__init__(line)
        self.line = line
        self.exit_code = exit_code
        self.traceback_text = traceback_text


def exit_code_of(exc: BaseException) -> Optional[int]:
    """The exit status for a known error (:data:`EXIT_CONFIG` or :data:`EXIT_FAILED`), None when unexpected."""
    if isinstance(exc, WorkerError):
        return exc.exit_code
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
    if names & _RETRY_ERRORS:
        return EXIT_RETRY
    if names & _CONFIG_ERRORS:
        return EXIT_CONFIG
    if names & _RUN_ERRORS:
        return EXIT_FAILED
    return None


def one_line(exc: BaseException) -> str:
    """``<ErrorClass>: <message>`` on one line: a leading ``config error: ``/``data error: `` and an engine's
    ``--- log tail ---`` are dropped, newlines become spaces, at most 600 characters."""
    if isinstance(exc, WorkerError):
        return exc.line
    text = str(exc).split("\n--- log tail ---")[0]
    text = re.sub(r"^(config|data) error: ", "", text.strip())
    text = re.sub(r"\s*[\r\n]+\s*", " ", text)
    if len(text) > _MAX_LINE:
        text = text[: _MAX_LINE - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def traceback_log(run_dir: Path, first_attempt: int, rank: int = 0) -> Path:
    """Where a failed start writes its traceback: ``logs/attempt-N/trainer.log`` of the newest attempt numbered
    ``first_attempt`` or later (the one this start made), else a new attempt folder. Rank R > 0 never creates
    a folder: ``trainer-rank<R>.log`` in the newest attempt (``logs/`` when there is none)."""
    from hpcrl.run_setup import attempt_dir, attempt_numbers, new_attempt_dir

    run_dir = Path(run_dir)
    nums = attempt_numbers(run_dir)
    if rank > 0:
        folder = attempt_dir(run_dir, nums[-1]) if nums else run_dir / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"trainer-rank{rank}.log"
    mine = [n for n in nums if n >= first_attempt]
    folder = attempt_dir(run_dir, mine[-1]) if mine else new_attempt_dir(run_dir)
    return folder / "trainer.log"


def write_traceback(path: Path, text: str) -> Path:
    """Append ``text`` (a formatted traceback) to ``path`` with a time and pid header; returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: the run stopped on this error\n")
        f.write(text if text.endswith("\n") else text + "\n")
    return path


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (shorter on the terminal)."""
    try:
        return str(Path(path).absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def report_known(prog: str, run_dir: Path, fn: Callable[[], int], rank: int = 0) -> int:
    """Run ``fn()`` (returns an exit status); on a known error (:func:`exit_code_of`) append its traceback to
    the attempt's log (:func:`traceback_log`), print ``<prog>: error: <one line>; traceback in <log>`` on
    stderr and return its exit status. Unexpected errors (and KeyboardInterrupt, SystemExit) propagate."""
    from hpcrl.run_setup import next_attempt

    first = next_attempt(run_dir)
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - sorted into known (reported) and unexpected (re-raised)
        code = exit_code_of(e)
        if code is None:
            raise
        text = e.traceback_text if isinstance(e, WorkerError) else traceback.format_exc()
        try:
            where = "; traceback in " + _shown(write_traceback(traceback_log(run_dir, first, rank), text))
        except OSError as oe:  # the run folder itself is the problem: keep the traceback on the terminal
            sys.stderr.write(text)
            where = f"; cannot write the traceback to the run folder ({oe})"
        print(f"{prog}: error: {one_line(e)}{where}", file=sys.stderr, flush=True)
        return code


# ------------------------------------------------------------------------------------------------------------
# Local trainer workers: a known error travels to the parent as a small JSON file
# ------------------------------------------------------------------------------------------------------------

def worker_report_path(run_dir: Path, rank: int) -> Path:
    """Where local trainer worker ``rank`` leaves its known error for the parent (``logs/.worker-R.error``)."""
    return Path(run_dir) / "logs" / f".worker-{rank}.error"


def run_worker(run_dir: Path, rank: int, fn: Callable[[], object]) -> None:
    """In a local trainer worker: run ``fn()``; on a known error write it (one line, exit status, traceback) to
    :func:`worker_report_path` and exit with its status, printing nothing. Unexpected errors propagate (and
    are printed with their traceback by the worker process)."""
    path = worker_report_path(run_dir, rank)
    path.unlink(missing_ok=True)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - sorted into known (reported) and unexpected (re-raised)
        code = exit_code_of(e)
        if code is None:
            raise
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"line": one_line(e), "exit_code": code,
                                    "traceback": traceback.format_exc()}))
        sys.exit(code)


def worker_error(run_dir: Path, rank: int) -> Optional[WorkerError]:
    """The known error worker ``rank`` reported (the report file is removed), or None."""
    path = worker_report_path(run_dir, rank)
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return WorkerError(d["line"], int(d["exit_code"]), d["traceback"])
