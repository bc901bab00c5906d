"""Step metrics: one JSONL line per rollout step, TensorBoard event files, a progress bar, and a PNG at the end.

Files in the run folder: ``metrics.jsonl`` (one JSON object per step, key ``step`` = rollout id),
``tensorboard/`` (event files, one scalar per key) and ``curves.png`` (the series of :data:`CURVE_SERIES` against
step: reward raw and smoothed, eval accuracy, response length, entropy, KL when a KL term is used, the
trainer vs rollout engine log-prob gap, step time by phase).
Times are seconds, throughputs tokens/s.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
CURVES_ENV = "HPCRL_CURVES"
"""``HPCRL_CURVES=0`` in a run's environment: no ``curves.png`` at the end of each attempt (``metrics.jsonl``
and TensorBoard are written as always). matplotlib's import and the drawing take ~1.3-1.5 s of CPU a run on the
developers' 2-core machines; the test suite sets it for its few hundred short runs (``tests/conftest.py``) and
the tests of the curves set it back to ``1``. Any other value, or none, draws them."""


def curves_wanted(environ=os.environ) -> bool:
    """Whether a run draws ``curves.png`` (:data:`CURVES_ENV` is not ``0``)."""
    return environ.get(CURVES_ENV, "1").strip() != "0"


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


class MetricsPosition:
    """Where ``metrics.jsonl`` stands, as a stateful object for the checkpoint manager, kept at the top of
    ``state.json`` (``flat_state``): ``state_dict()`` is ``{"metrics": [...]}``, the rows logged so far (the
    controller's; ``[]`` elsewhere); ``load_state_dict(state)`` drops the rows logged after step ``k``:
    ``state["step"]``, else ``state["rollout_id"]`` (it gets all of ``state.json``), the steps a resumed run
    does again; :meth:`start_fresh` (a new run: ``k = -2``) drops them all, the eval before step 0 included.
    Only ``controller`` touches the file."""

    flat_state = True

    def __init__(self, run_dir: str | os.PathLike, controller: bool) -> None:
        self.run_dir, self.controller = Path(run_dir), controller

    def state_dict(self) -> dict[str, Any]:
        return {"metrics": read_metrics(self.run_dir) if self.controller else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.controller:
            truncate_metrics(self.run_dir, int(state["step"] if "step" in state else state["rollout_id"]))

    def start_fresh(self) -> None:
        """No checkpoint to resume: drop the rows a killed earlier start of this run logged."""
        self.load_state_dict({"step": -2})


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
    run's ``num_rollout``; ``desc`` the progress bar's label (``"sft"`` for a run of ``run.mode: sft``, whose
    steps are optimizer steps on demonstrations, not rollouts). Only the controller (rank 0) creates one.
    """

    def __init__(self, run_dir: str | os.PathLike, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True, desc: str = "rollout"):
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

            self._bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step",
                             dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any], advance: bool = True) -> dict[str, Any]:
        """Append one step's metrics (numbers; non-finite values are written as null) and flush to disk.

        ``advance=False`` logs without moving the progress bar (the eval before the first step, ``step=-1``).
        Returns the row as written (``step``, ``time`` in seconds since the epoch, then the metrics).
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
        return row

    def close(self) -> Optional[Path]:
        """Close files and write ``curves.png``; returns its path (None when there is nothing to plot, or
        :data:`CURVES_ENV` is ``0``)."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
        return plot_curves(self.run_dir) if curves_wanted() else None


@dataclass(frozen=True)
class CurveSeries:
    """One line of ``curves.png``: the metrics key it reads, the panel it is drawn in and its legend label."""

    panel: str
    key: str
    label: str
    smooth: bool = False
    """Draw the exponential moving average (:func:`smoothed`) instead of the raw values."""
    only_with: tuple[str, ...] = ()
    """Draw the series only when the run also logged one of these keys (empty: whenever its key is logged)."""


KL_TERM_KEYS: tuple[str, ...] = ("train/kl_loss", "train/opd_reverse_kl")
"""Keys logged only when the loss or the advantage has a KL term: ``train/kl_loss``
(``algorithm.use_kl_loss``) and ``train/opd_reverse_kl`` (``algorithm.opd.teachers``). Without one the curves
have no KL panel: ``train/ppo_kl`` alone is exactly 0 with one on-policy optimizer step per rollout, a flat
line that says nothing."""

KL_PANEL = "KL (nats/token)"
LOGPROB_GAP_PANEL = "log-prob gap, trainer vs rollout engine (nats/token)"
CRITIC_PANEL = "critic (PPO)"

CURVE_SERIES: tuple[CurveSeries, ...] = (
    CurveSeries("reward (mean over the step's samples)", "rollout/reward_mean", "reward"),
    CurveSeries("reward (mean over the step's samples)", "rollout/reward_mean", "reward (smoothed)", smooth=True),
    CurveSeries("eval accuracy (greedy)", "eval/accuracy", "eval accuracy"),
    CurveSeries("response length (tokens, mean)", "rollout/response_length", "response length"),
    CurveSeries("entropy (nats/token)", "train/entropy", "entropy"),
    CurveSeries(KL_PANEL, "train/ppo_kl", "ppo_kl (policy vs rollout policy)", only_with=KL_TERM_KEYS),
    CurveSeries(KL_PANEL, "train/kl_loss", "kl_loss (policy vs reference)"),
    CurveSeries(KL_PANEL, "train/opd_reverse_kl", "opd_reverse_kl (rollout policy vs teacher)"),
    CurveSeries(LOGPROB_GAP_PANEL, "train/train_rollout_logprob_abs_diff", "mean |trainer - engine|"),
    CurveSeries(CRITIC_PANEL, "critic/value_loss", "value loss"),
    CurveSeries(CRITIC_PANEL, "critic/explained_variance", "explained variance"),
    CurveSeries("step time (s)", "rollout/seconds", "rollout"),
    CurveSeries("step time (s)", "train/seconds", "train"),
    CurveSeries("step time (s)", "critic/seconds", "critic (in train)"),
    CurveSeries("step time (s)", "sync/seconds", "weight sync"),
    CurveSeries("step time (s)", "timing/step_seconds", "whole step"),
)
"""What ``curves.png`` plots, panel by panel, from the loop's ``metrics.jsonl`` keys. A series whose key a run
never logged is left out (``train/kl_loss`` needs ``algorithm.use_kl_loss``; eval needs ``eval_interval``),
and so is one whose :attr:`CurveSeries.only_with` keys were never logged: the KL panel is drawn only with a
KL term (:data:`KL_TERM_KEYS`); the critic's panel only with PPO's critic (``advantage_estimator: gae``):
its value loss, and the explained variance of its values (1: they predict the returns; 0 or below: no better
than a constant). The log-prob gap (``train/train_rollout_logprob_abs_diff``, mean over loss
tokens of ``|trainer - engine|`` log-probs of the sampled tokens) is a health signal with its own panel: it is
not 0 even on-policy when the trainer and the engine compute differently (kernels, precision), and it grows
when weights fail to sync or the run goes off-policy."""


def smoothed(values: Sequence[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average with TensorBoard's bias correction: ``weight`` in ``[0, 1)`` (0 = raw)."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg = weight * avg + (1.0 - weight) * float(v)
        norm = weight * norm + (1.0 - weight)
        out.append(avg / norm)
    return out


def draw_curves(rows: Sequence[dict[str, Any]], series: Sequence[CurveSeries] = CURVE_SERIES):
    """A matplotlib figure with one panel per :attr:`CurveSeries.panel` and one labelled line per series that
    has a value in ``rows`` (``metrics.jsonl`` rows), and with :attr:`CurveSeries.only_with` where one of those
    keys has a value too; against rollout step. Returns None when no series is drawn. The figure is built
    without pyplot (a ``matplotlib.figure.Figure``, saved through the Agg canvas): nothing to close, and a run's
    end does not import pyplot and its backends (~0.5 s on the CI's CPUs, in every run)."""
    from matplotlib.figure import Figure

    def points(key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in rows
                if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
                and isinstance(r.get("step"), int)]

    panels: dict[str, list[tuple[CurveSeries, list[tuple[int, float]]]]] = {}
    for sr in series:
        if sr.only_with and not any(points(k) for k in sr.only_with):
            continue
        pts = points(sr.key)
        if pts:
            panels.setdefault(sr.panel, []).append((sr, pts))
    if not panels:
        return None
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5 * ncols, 3.5 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (title, lines) in zip(flat, panels.items()):
        for sr, pts in lines:
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            faint = any(o.smooth and o.key == sr.key for o, _ in lines) and not sr.smooth
            ax.plot(xs, smoothed(ys) if sr.smooth else ys, label=sr.label, alpha=0.35 if faint else 1.0,
                    marker="." if len(pts) < 50 else None)
        ax.set_title(title)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize="small")
    for ax in flat[len(panels):]:
        fig.delaxes(ax)
    fig.tight_layout()
    return fig


def plot_curves(run_dir: str | os.PathLike, out: Optional[str | os.PathLike] = None,
                series: Sequence[CurveSeries] = CURVE_SERIES) -> Optional[Path]:
    """Draw :func:`draw_curves` of the run's ``metrics.jsonl`` into ``out`` (default ``run_dir/curves.png``).

    Returns the PNG path, or None when none of ``series`` has a value.
    """
    fig = draw_curves(read_metrics(run_dir), series)
    if fig is None:
        return None
    out = Path(out) if out else Path(run_dir) / CURVES_FILE
    fig.savefig(out, dpi=100)  # a PNG through the Agg canvas (no pyplot, no backend to pick)
    return out
