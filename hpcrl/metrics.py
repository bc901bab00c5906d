"""Step metrics: one JSONL line per rollout step, TensorBoard event files, a progress bar, and a PNG at the end.

Files in the run folder: ``metrics.jsonl`` (one JSON object per step, key ``step`` = rollout id),
``tensorboard/`` (event files, one scalar per key) and ``curves.png`` (reward and accuracy against step).
Times are seconds, throughputs tokens/s.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read ``metrics.jsonl`` (a file, or a run folder holding one). A torn last line is ignored."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def truncate_metrics(run_dir: str | os.PathLike, last_step: int) -> None:
    """Drop rows with ``step > last_step`` (steps logged after the checkpoint a resumed run starts from).

    Rewritten atomically (temp file + rename).
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    keep = [r for r in read_metrics(path) if r.get("step", -1) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)


@contextmanager
def timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Add the seconds spent in the block to ``metrics[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0


class MetricsLogger:
    """Writes step metrics to JSONL and TensorBoard and drives a progress bar with reward and ETA.

    ``start_step`` is the first rollout id of this attempt (non-zero after a resume); ``total_steps`` the
    run's ``num_rollout``. Only the controller (rank 0) creates one.
    """

    def __init__(self, run_dir: str | os.PathLike, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step)
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="rollout", unit="step",
                             dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any], advance: bool = True) -> None:
        """Append one step's metrics (numbers; non-finite values are written as null) and flush to disk.

        ``advance=False`` logs without moving the progress bar (the eval before the first step, ``step=-1``).
        """
        row = {"step": step, "time": time.time()}
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            row[k] = v
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None:
            post = {k.split("/")[-1]: f"{row[k]:.3f}" for k in ("rollout/reward_mean", "eval/accuracy")
                    if isinstance(row.get(k), (int, float))}
            self._bar.set_postfix(post, refresh=not advance)
            if advance:
                self._bar.update(1)

    def close(self) -> Optional[Path]:
        """Close files and write ``curves.png``; returns its path (None when there is nothing to plot)."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        return plot_curves(self.run_dir)


def plot_curves(run_dir: str | os.PathLike, keys: tuple[str, ...] = ("rollout/reward_mean", "eval/accuracy"),
                out: Optional[str | os.PathLike] = None) -> Optional[Path]:
    """Plot ``keys`` against step from the run's ``metrics.jsonl`` into a PNG (matplotlib, Agg backend).

    Returns the PNG path, or None when none of ``keys`` has a value.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    series = {k: [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.5), squeeze=False)
    for ax, (k, pts) in zip(axes[0], series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_title(k)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / CURVES_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
