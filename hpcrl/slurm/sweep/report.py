"""Status and report of a sweep: one row per point (state, steps, last reward and eval accuracy), the table of
``hpcrl status SWEEP``, and ``report.csv`` / ``report.png`` of ``hpcrl sweep --report``."""

from __future__ import annotations

import csv
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from hpcrl.slurm.state import Runner, attempt_dirs, run_command
from hpcrl.slurm.sweep.manifest import read_manifest, resubmittable, sweep_states
from hpcrl.slurm.sweep.points import format_value

REPORT_CSV = "report.csv"

REPORT_PNG = "report.png"


# ------------------------------------------------------------------------------------------------------------
# status and report
# ------------------------------------------------------------------------------------------------------------

@dataclass
class PointStatus:
    """One row of ``hpcrl status SWEEP`` and of ``report.csv``."""

    name: str
    overrides: dict[str, Any]
    run_dir: Path
    job_id: Optional[str]
    state: str
    rollout_id: Optional[int]
    """Last rollout id in ``metrics.jsonl`` (None before the first step)."""
    num_rollout: Optional[int]
    steps: int
    """Rollout steps logged (distinct ids >= 0)."""
    final_reward: Optional[float]
    """Last ``rollout/reward_mean``."""
    final_eval: Optional[float]
    """Last ``eval/accuracy`` (None when the run logged no eval)."""
    attempts: int
    curve: list[tuple[int, float]] = field(default_factory=list, repr=False)
    """``(step, rollout/reward_mean)`` of every step, for the report's plot."""
    eval_curve: list[tuple[int, float]] = field(default_factory=list, repr=False)
    note: Optional[str] = None
    """For a point whose state is UNKNOWN: why, whether it ever started, and whether ``hpcrl sweep
    --resubmit`` takes it."""


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def point_status(point: Mapping[str, Any], state: str, why_unknown: Optional[str] = None,
                 resubmit: bool = False) -> PointStatus:
    """The :class:`PointStatus` of one manifest point, from its run folder's ``metrics.jsonl`` and logs;
    ``why_unknown`` (the reason its state is UNKNOWN) and ``resubmit`` (whether ``--resubmit`` takes it) make
    its :attr:`~PointStatus.note`."""
    from hpcrl.metrics import read_metrics
    from hpcrl.slurm.state import planned_rollouts

    run_dir = Path(point["run_dir"])
    rows = [r for r in read_metrics(run_dir) if isinstance(r.get("step"), int)]
    steps = [r for r in rows if r["step"] >= 0]
    curve = [(r["step"], float(r["rollout/reward_mean"])) for r in steps
             if _num(r.get("rollout/reward_mean"))]
    evals = [(r["step"], float(r["eval/accuracy"])) for r in rows if _num(r.get("eval/accuracy"))]
    attempts = len(attempt_dirs(run_dir))
    logged = len({r["step"] for r in steps})
    note = None
    if why_unknown:
        done = "never started" if not attempts and not logged else f"{logged} steps done"
        note = f"{why_unknown}; {done}" + ("; hpcrl sweep --resubmit brings it back" if resubmit else "")
    return PointStatus(name=point["name"], overrides=dict(point.get("overrides") or {}), run_dir=run_dir,
                       job_id=point.get("job_id"), state=state,
                       rollout_id=steps[-1]["step"] if steps else None, num_rollout=planned_rollouts(run_dir),
                       steps=logged, final_reward=curve[-1][1] if curve else None,
                       final_eval=evals[-1][1] if evals else None,
                       attempts=attempts, curve=curve, eval_curve=evals, note=note)


def sweep_status(sweep_dir: str | os.PathLike, runner: Runner = run_command
                 ) -> tuple[dict, list[PointStatus]]:
    """``(manifest, rows)``: one :class:`PointStatus` per point, in point order.

    Raises SlurmCommandError when ``sweep_dir`` is not a sweep folder."""
    manifest = read_manifest(sweep_dir)
    ss = sweep_states(manifest, runner)
    return manifest, [point_status(p, ss.states[p["name"]], ss.why_unknown.get(p["name"]),
                                   resubmittable(p, ss.states[p["name"]], ss.queue_checked))
                      for p in manifest["points"]]


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def format_sweep_table(manifest: Mapping[str, Any], rows: Sequence[PointStatus]) -> str:
    """The ``hpcrl status SWEEP`` text: a header line, then POINT, JOB, STATE, ROLLOUT (steps done /
    ``num_rollout``), REWARD (last
    ``rollout/reward_mean``), EVAL (last ``eval/accuracy``), ATTEMPTS, then a count of points per state, then
    one line per point whose state is UNKNOWN, saying why (``POINT: UNKNOWN: ...``)."""
    arrays = [s["array_job_id"] for s in manifest.get("submissions", []) if s.get("array_job_id")]
    kind = ("one het job per point" if manifest.get("het") else
            ("job array " + ", ".join(arrays) if arrays else "not submitted"))
    lines = [f"sweep {manifest['name']}: {len(rows)} points, {kind} ({manifest['sweep_dir']})"]
    table = [("POINT", "JOB", "STATE", "ROLLOUT", "REWARD", "EVAL", "ATTEMPTS")]
    for r in rows:
        rollout = "-" if r.rollout_id is None else str(r.rollout_id + 1)  # steps done (ids start at 0)
        if r.num_rollout is not None:
            rollout += f"/{r.num_rollout}"
        table.append((r.name, r.job_id or "-", r.state, rollout, _fmt(r.final_reward), _fmt(r.final_eval),
                      str(r.attempts)))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines.append(state_counts(r.state for r in rows))
    return "\n".join(lines + [f"{r.name}: {r.state}: {r.note}" for r in rows if r.note])


def state_counts(states: Iterable[str]) -> str:
    """How many of each state, in state order: ``"1 CANCELLED, 2 RUNNING"``."""
    return ", ".join(f"{n} {s}" for s, n in sorted(Counter(states).items()))


REPORT_COLUMNS = ("point", "job_id", "state", "steps", "final_reward_mean", "final_eval_accuracy", "run_dir",
                  "note")
"""Columns of ``report.csv`` after ``point``'s swept keys (inserted after ``point``, one per dotted key)."""


def write_report(sweep_dir: str | os.PathLike, runner: Runner = run_command) -> tuple[Path, Optional[Path]]:
    """Write ``report.csv`` and ``report.png`` into the sweep folder.

    ``report.csv``: one row per point: ``point``, one column per swept dotted key (its value), ``job_id``,
    ``state``, ``steps`` (rollout steps logged), ``final_reward_mean`` (last ``rollout/reward_mean``),
    ``final_eval_accuracy`` (last ``eval/accuracy``; empty when none), ``run_dir``, ``note`` (why the state is
    UNKNOWN; empty otherwise).
    ``report.png`` (matplotlib, Agg): ``rollout/reward_mean`` against rollout step, one line per point, and a
    second panel of ``eval/accuracy`` when any point logged one.

    Returns:
        ``(csv path, png path)``; the PNG is None (and not written) when no point has a reward yet.

    Raises:
        SlurmCommandError: not a sweep folder.
    """
    manifest, rows = sweep_status(sweep_dir, runner)
    sdir = Path(manifest["sweep_dir"])
    keys = list(dict.fromkeys(k for r in rows for k in r.overrides))
    csv_path = sdir / REPORT_CSV
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow([REPORT_COLUMNS[0], *keys, *REPORT_COLUMNS[1:]])
        for r in rows:
            values = [format_value(r.overrides[k]) if k in r.overrides else "" for k in keys]
            w.writerow([r.name, *values, r.job_id or "", r.state, r.steps,
                        "" if r.final_reward is None else repr(r.final_reward),
                        "" if r.final_eval is None else repr(r.final_eval), str(r.run_dir), r.note or ""])
    return csv_path, plot_report(rows, sdir / REPORT_PNG, title=f"sweep {manifest['name']}")


def plot_report(rows: Sequence[PointStatus], out: Path, title: str = "") -> Optional[Path]:
    """Reward curves of the points (one line each) and, when any, their eval accuracy, into ``out``.

    Returns ``out``, or None (nothing written) when no point has a reward."""
    if not any(r.curve for r in rows):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("rollout/reward_mean", "curve")] + ([("eval/accuracy", "eval_curve")]
                                                   if any(r.eval_curve for r in rows) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (label, attr) in zip(axes[0], panels):
        for r in rows:
            pts = getattr(r, attr)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=r.name,
                        marker="." if len(pts) < 50 else None)
        ax.set_title(label)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize="small",
               frameon=False)
    if title:
        fig.suptitle(title)
    nrows = math.ceil(len(labels) / 3)
    fig.tight_layout(rect=(0, min(0.06 * nrows + 0.02, 0.5), 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
