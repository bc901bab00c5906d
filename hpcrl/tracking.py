"""Weights & Biases tracking of a run (the ``wandb`` section, :class:`hpcrl.config.tracking.WandbSection`).

Only the controller (global rank 0) talks to W&B, through :class:`hpcrl.run_session.RunLog`:
:meth:`WandbTracker.start` when the loop's metrics start, :meth:`WandbTracker.log` for every row written to
``metrics.jsonl`` (as it is written: the W&B charts follow the run live), :meth:`WandbTracker.finish` at the
end of each attempt (``curves.png`` as the summary image ``curves``, then ``wandb.finish``). The ``wandb``
package is imported only when ``wandb.mode`` is not ``disabled``. A W&B failure (no API key, no network, a
full disk) never stops the run: one warning, then the run goes on without W&B (``metrics.jsonl`` has every
step).

Files in the run folder: ``wandb.json`` (the W&B run's ``id``, ``project``, ``entity``, ``group``: every
attempt of the run, requeued or resumed, continues that W&B run with ``resume="allow"``) and ``wandb/`` (W&B's
own folder; offline mode writes one ``wandb/offline-run-<time>-<id>/`` per attempt, which ``hpcrl logs RUN
--wandb-sync`` uploads).

**What W&B holds across resumes: each step's last attempt wins.** A resume truncates ``metrics.jsonl`` back to
its checkpoint and logs the later steps again, but W&B cannot take back what it was sent (offline files are
append-only, and every attempt writes its own). So every row sent carries, besides the ``metrics.jsonl`` keys:

* ``rollout_id``: the row's ``step`` (the rollout id; -1 for the eval before the first step), W&B's x-axis
  for every metric (``define_metric(step_metric=...)``; W&B's own ``_step`` restarts at 0 in each offline
  attempt and is not used);
* ``attempt``: the N of the attempt's ``logs/attempt-N`` folder;
* ``attempt_first_step``: the first step the attempt logs (its resume point; -1 for an attempt that starts the
  run), hidden from W&B's charts.

Reading the history back (:func:`last_attempt_rows`): go through the attempts in order; each one drops what
earlier attempts logged at its ``attempt_first_step`` or later (what the resume truncated from
``metrics.jsonl``), then adds its own rows (the last one of a step wins). The result is ``metrics.jsonl``'s
rows, the same steps with the same values, after any number of preemptions, requeues and failures. (An
attempt still starting, that has logged nothing yet, is not seen until its first row.) In the W&B charts,
which draw every row sent, a killed attempt's steps after its last checkpoint show up twice: its points and
those of the attempt that did them again, told apart by ``attempt``.

What W&B never got is not there: an attempt that ends (done, preempted, out of time, stopped on an error)
finishes its W&B run and waits until W&B has written it out, but a SIGKILLed one (OOM, a dead node) loses
what W&B had not written yet (offline, W&B writes its file every 15 s; online, what was not sent): steps it
logged in its last seconds that the next attempt does not redo (those up to the checkpoint it resumes from)
are then missing from W&B, not wrong.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import string
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

if TYPE_CHECKING:
    from hpcrl.config import Config

log = logging.getLogger("hpcrl.tracking")

WANDB_FILE = "wandb.json"
"""The run folder's record of its W&B run (``id``, ``project``, ``entity``, ``group``)."""
WANDB_DIR = "wandb"
"""W&B's own folder inside the run folder (offline runs: ``wandb/offline-run-*``)."""
STEP_KEY = "rollout_id"
"""W&B's x-axis: the rollout id of a row (``metrics.jsonl``'s ``step``)."""
ATTEMPT_KEY = "attempt"
"""The N of the ``logs/attempt-N`` folder of the attempt that sent a row."""
FIRST_STEP_KEY = "attempt_first_step"
"""The first step of the attempt that sent a row (its resume point; -1 when it started the run)."""
CURVES_KEY = "curves"
"""The summary key of ``curves.png`` (a ``wandb.Image``)."""
_ID_CHARS = string.ascii_lowercase + string.digits  # a new W&B run id: 8 of them, as W&B makes its own


def wandb_identity(cfg: Config, run_dir: str | os.PathLike) -> dict[str, Any]:
    """The W&B run of the run folder: ``wandb.json`` when an earlier attempt wrote it (its values win over the
    config's, so that every attempt continues the same W&B run), else a new id with the config's project
    (default ``run.name``), entity and group, written to ``wandb.json`` (atomically) before it is used.

    Raises OSError when the run folder is not writable.
    """
    from hpcrl.fsutil import atomic_write_text

    path = Path(run_dir) / WANDB_FILE
    try:
        ident = json.loads(path.read_text())
        if isinstance(ident, dict) and isinstance(ident.get("id"), str) and ident["id"]:
            return ident
    except (OSError, ValueError):
        pass
    w = cfg.wandb
    new_id = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
    ident = {"id": new_id, "project": w.project or cfg.run.name, "entity": w.entity, "group": w.group}
    atomic_write_text(path, json.dumps(ident, indent=1) + "\n", fsync=True)
    return ident


def current_attempt(run_dir: str | os.PathLike) -> int:
    """The N of the newest ``logs/attempt-N`` folder (this attempt's on the controller), 0 without one."""
    from hpcrl.run_setup import attempt_numbers

    nums = attempt_numbers(Path(run_dir))
    return nums[-1] if nums else 0


class WandbTracker:
    """The controller's W&B run for one attempt (:meth:`start`). Every method swallows W&B's errors: the first
    one is logged as a warning and the tracker goes quiet (the run itself goes on)."""

    def __init__(self, run: Any, attempt: int, first_step: int) -> None:
        self.run, self.attempt, self.first_step = run, attempt, first_step
        self.warned = False

    @classmethod
    def start(cls, cfg: Config, run_dir: str | os.PathLike, start_step: int) -> Optional["WandbTracker"]:
        """``wandb.init`` for this attempt of the run (``start_step``: the first rollout id it runs, 0 for a
        new run), or None when ``wandb.mode`` is ``disabled`` or W&B failed to start (warned). The W&B run:
        the id of :func:`wandb_identity`, ``resume="allow"``, files under ``run_dir/wandb/``, the resolved
        config, the run name, no console capture and no W&B output on the terminal."""
        if cfg.wandb.mode == "disabled":
            return None
        try:
            import wandb

            from hpcrl.config import config_to_dict

            ident = wandb_identity(cfg, run_dir)
            run = wandb.init(
                id=ident["id"], project=ident.get("project"), entity=ident.get("entity"),
                group=ident.get("group"), name=cfg.run.name, tags=list(cfg.wandb.tags) or None,
                mode=cfg.wandb.mode, resume="allow", dir=str(run_dir), config=config_to_dict(cfg),
                settings=wandb.Settings(console="off", silent=True))
            run.define_metric(STEP_KEY)
            run.define_metric(FIRST_STEP_KEY, step_metric=STEP_KEY, hidden=True)
            run.define_metric("*", step_metric=STEP_KEY)
        except Exception as e:  # noqa: BLE001 - W&B is optional: the run goes on without it
            _warn("start", e)
            return None
        return cls(run, current_attempt(run_dir), start_step if start_step > 0 else -1)

    def log(self, row: dict[str, Any]) -> None:
        """Send one ``metrics.jsonl`` row (``step`` becomes ``rollout_id``; ``attempt`` and
        ``attempt_first_step`` are added; see the module's rule)."""
        run = self.run
        if run is None:
            return
        data = {k: v for k, v in row.items() if k != "step"}
        data.update({STEP_KEY: row["step"], ATTEMPT_KEY: self.attempt, FIRST_STEP_KEY: self.first_step})
        if not self._call("log", lambda: run.log(data)):
            self.run = None

    def finish(self, curves: Optional[Path], stopped: bool = False, failed: bool = False) -> None:
        """End this attempt's W&B run: ``curves`` (``curves.png``, when it exists) as the summary image
        ``curves``; ``stopped`` (preempted or out of time, to be resumed) marks the run as preempting;
        ``failed`` (the run stopped on an error) finishes it with exit code 1. Then W&B's service process
        is stopped (``wandb.teardown``), which waits until it has written everything out: ``wandb.finish``
        returns before the offline file is complete, and a Slurm requeue right after the attempt may kill the
        service. Later calls do nothing."""
        run, self.run = self.run, None
        if run is None:
            return
        import wandb

        if curves is not None and Path(curves).is_file():
            self._call("curves.png", lambda: run.summary.update({CURVES_KEY: wandb.Image(str(curves))}))
        if stopped:
            self._call("mark_preempting", run.mark_preempting)
        self._call("finish", lambda: run.finish(exit_code=1 if failed else 0))
        self._call("teardown", wandb.teardown)

    def _call(self, what: str, fn: Callable[[], Any]) -> bool:
        """``fn()``; False when it raised (the first failure of this tracker is warned about)."""
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - W&B is optional: the run goes on without it
            if not self.warned:
                _warn(what, e)
            self.warned = True
            return False


def _warn(what: str, e: BaseException) -> None:
    log.warning("W&B %s failed, the run goes on without W&B (metrics.jsonl has every step): %s: %s",
                what, type(e).__name__, " ".join(str(e).split())[:300])


def last_attempt_rows(history: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rule of this module: W&B history rows (each a dict of the keys sent, in the order they were
    written within each attempt; attempts in any order) back to ``metrics.jsonl`` rows.

    Attempts are taken in order of ``attempt``; each drops the rows of earlier attempts at its
    ``attempt_first_step`` or later, then adds its own (the last row of a step wins). Rows without
    ``rollout_id`` and ``attempt`` (not sent by :meth:`WandbTracker.log`) are ignored, and so are W&B's own
    keys (``_step``, ``_runtime``, ``_timestamp``, ...). Returns ``{"step": rollout_id, **metrics}`` rows by
    step.
    """
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for row in history:
        if STEP_KEY in row and ATTEMPT_KEY in row:
            by_attempt.setdefault(int(row[ATTEMPT_KEY]), []).append(row)
    kept: dict[int, dict[str, Any]] = {}
    for attempt in sorted(by_attempt):
        rows = by_attempt[attempt]
        first = min(int(r.get(FIRST_STEP_KEY, r[STEP_KEY])) for r in rows)
        kept = {step: r for step, r in kept.items() if step < first}
        for r in rows:
            kept[int(r[STEP_KEY])] = r
    skip = (STEP_KEY, ATTEMPT_KEY, FIRST_STEP_KEY)
    return [dict({"step": step}, **{k: v for k, v in kept[step].items()
                                    if k not in skip and not k.startswith("_")})
            for step in sorted(kept)]


def offline_runs(run_dir: str | os.PathLike) -> list[Path]:
    """The offline W&B runs of a run folder (``wandb/offline-run-*`` folders holding a ``.wandb`` file; one
    per attempt that ran with ``wandb.mode=offline``), oldest first (the folder names start with the time)."""
    base = Path(run_dir) / WANDB_DIR
    if not base.is_dir():
        return []
    return sorted(p for p in base.glob("offline-run-*") if p.is_dir() and any(p.glob("*.wandb")))


def wandb_command() -> Optional[str]:
    """The ``wandb`` command: the one on PATH (an activated virtualenv puts its own first), else the one
    installed beside this Python (``hpcrl[wandb]``), else None."""
    return shutil.which("wandb") or shutil.which("wandb", path=str(Path(sys.executable).parent))
