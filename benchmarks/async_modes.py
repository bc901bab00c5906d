"""The three training loops side by side on one workload: sync, one step off (``run.mode: async``) and fully
asynchronous (``run.mode: fully_async``), one table (issue #37 point 7).

Every mode trains the same config from the same SFT warm start (cached in the repository's ``.cache/models``,
made by the first run that needs it) for the same number of rollout steps, disaggregated on this machine
(trainer on ``train.cpus``, engine and router on ``rollout.cpus``: an even split unless the config or
``--set`` says otherwise), one after the other:

- ``--workload longtail`` (default): ``configs/longtail.yaml``, the tiny Qwen2 repeating digit strings whose
  lengths spread 2..40 tokens (:class:`hpcrl.data.tasks.RepeatTask`): generation, and its slowest sample,
  bound the one-step-off loop. Target (issue #37): fully async >= 1.5x one-step-off's trained samples/s,
  engines busy >= 90% of the wall time, accuracy per wall-second no worse.
- ``--workload quickstart``: ``configs/quickstart.yaml`` (3-digit addition, training bounds the step), made
  disaggregated; no target: what the staleness bound allows there.

Fully async runs once per ``--stale-policies`` entry (``rollout.stale_policy``: keep, regenerate, drop), so
the response lengths of what was trained can be compared across the policies (dropping stale groups biases
against long responses).

    python benchmarks/async_modes.py --steps 100                 # sync, async, fully_async (keep)
    python benchmarks/async_modes.py --steps 100 --modes async fully_async --stale-policies keep drop
    python benchmarks/async_modes.py --workload quickstart --steps 100
    python benchmarks/async_modes.py --steps 2 --modes sync async --no-sft     # smoke: seconds, no warm start

Columns, per mode (all read from the run's own ``metrics.jsonl`` except the engine's busy time):

- trained samples/s: samples trained in the timed steps (``rollout.batch_size`` minus ``rollout/groups_short``
  groups, times ``n_samples_per_prompt``) over those steps' seconds (``timing/step_seconds`` minus the eval's
  ``eval/seconds``); the first ``--warmup`` steps are not timed.
- engine busy share: the CPU engine's ``busy_seconds`` (seconds with at least one row being prefilled or
  decoded, ``/get_server_info`` ``internal_states``), polled every second during the run, over the wall time
  between the first and last metrics rows (mean over the engines); ``n/a`` when the engine does not report it.
- trainer idle share: seconds the trainer waited for samples (``timing/rollout_wait_seconds``; sync: the whole
  ``rollout/seconds``) over the step seconds of the timed steps.
- staleness mean / max: ``rollout/staleness_mean|max`` (weight versions between the sampling and the training
  policy, token-weighted), else ``rollout/lag_mean|max`` (per sample: oldest version); mean of the per-step
  means, max of the maxima.
- greedy accuracy: ``eval/accuracy`` before the first and after the last step, and the end accuracy per
  wall-minute (wall: first to last metrics row, so the start-up is not counted, the evals are).
- response length, trained: mean and p90 over the steps of ``rollout/response_length`` (the trained samples'
  mean per step); sampled: the same of ``rollout/sampled_response_length`` (every finished sample, filtered or
  dropped ones included) when the loop logs it, else ``n/a``.

Prints the machine header (threads: the trainer's and the engine's, one per CPU of their sets), then the
table; ``--out`` also writes it to a file. Results in docs/performance.md ("Sync, one step off, fully async").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from algorithms import run_one  # noqa: E402
from machine import machine_header  # noqa: E402
from vs_trl import proc_kind, process_tree  # noqa: E402

MODES = ("sync", "async", "fully_async")
STALE_POLICIES = ("keep", "regenerate", "drop")
WORKLOADS = {"longtail": "configs/longtail.yaml", "quickstart": "configs/quickstart.yaml"}
STALENESS_KEYS = (("rollout/staleness_mean", "rollout/staleness_max"),
                  ("rollout/lag_mean", "rollout/lag_max"))
"""Staleness metrics, first present pair wins (token-level versions, else the per-sample lag)."""
TRAINED_LENGTH_KEY = "rollout/response_length"
SAMPLED_LENGTH_KEY = "rollout/sampled_response_length"
CACHE_PATHS = ("model.path", "sft.output")
"""Relative cache paths of the configs, made absolute to the repository so every run reuses one warm start."""


class EngineBusyPoller:
    """Polls every CPU engine below this process once a second: ``/get_server_info``'s ``busy_seconds``
    (``(time.time(), busy_seconds)`` per engine URL, with the run's API key from the engine's
    ``--api-key-file``; nothing when the engine does not report it) and the engine process's CPU seconds (user
    + system, per pid), the fallback measure."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self.cpu: dict[int, list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "EngineBusyPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _urls(self) -> list[tuple[str, dict]]:
        urls = []
        for p in process_tree(os.getpid())[1:]:
            try:
                if proc_kind(p) != "engine":
                    continue
                argv = p.cmdline()
                t = p.cpu_times()
                self.cpu.setdefault(p.pid, []).append((time.time(), t.user + t.system))
            except Exception:  # noqa: BLE001 - it exited meanwhile
                continue
            opts = dict(zip(argv, argv[1:]))
            if "--port" not in opts:
                continue
            headers = {}
            if "--api-key-file" in opts:
                try:
                    key_file = Path(p.cwd()) / opts["--api-key-file"]  # relative to the engine's folder
                    headers["Authorization"] = "Bearer " + key_file.read_text().strip()
                except (OSError, psutil.Error):
                    continue
            urls.append((f"http://{opts.get('--host', '127.0.0.1')}:{opts['--port']}", headers))
        return urls

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for url, headers in self._urls():
                try:
                    request = urllib.request.Request(url + "/get_server_info", headers=headers)
                    with urllib.request.urlopen(request, timeout=2) as r:
                        info = json.load(r)
                    busy = (info.get("internal_states") or [{}])[0].get("busy_seconds")
                except Exception:  # noqa: BLE001 - starting, stopping or busy: the next poll tries again
                    continue
                if isinstance(busy, (int, float)):
                    self.samples.setdefault(url, []).append((time.time(), float(busy)))

    @staticmethod
    def _share(series: list[list[tuple[float, float]]], t0: float, t1: float) -> Optional[float]:
        shares = []
        for pts in series:
            inside = [(t, b) for t, b in pts if t0 <= t <= t1]
            if len(inside) >= 2 and inside[-1][0] > inside[0][0] and inside[-1][1] >= inside[0][1]:
                shares.append((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]))
        return statistics.fmean(shares) if shares else None

    def share(self, t0: float, t1: float) -> Optional[float]:
        """Mean over the engines of busy seconds over wall seconds between the first and the last poll inside
        ``[t0, t1]`` (epoch seconds); None without two such polls."""
        return self._share(list(self.samples.values()), t0, t1)

    def cpu_share(self, t0: float, t1: float, threads: int) -> Optional[float]:
        """The same for the engines' CPU seconds, divided by ``threads`` (an engine's threads): the share of
        its CPUs the engine kept busy. A stand-in for ``busy_seconds``: it also counts the engine's HTTP and
        scheduling work, and a decode step that waits on memory counts in both."""
        share = self._share(list(self.cpu.values()), t0, t1)
        return None if share is None else share / max(1, threads)


def _num(row: dict, key: str) -> Optional[float]:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _p90(xs: list[float]) -> Optional[float]:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else None


def summarize(rows: list[dict], batch_size: int, group_size: int, warmup: int) -> dict[str, Any]:
    """The table's numbers for one run from its metrics rows (``metrics.jsonl``: ``step`` -1 is the start's
    eval). Missing metrics give None."""
    steps = [r for r in rows if r.get("step", -1) >= 0 and "timing/step_seconds" in r]
    timed = steps[warmup:] or steps
    out: dict[str, Any] = {"steps": len(steps), "timed": len(timed)}
    secs = [(_num(r, "timing/step_seconds") or 0.0) - (_num(r, "eval/seconds") or 0.0) for r in timed]
    trained = [(batch_size - (_num(r, "rollout/groups_short") or 0.0)) * group_size for r in timed]
    out["samples_s"] = sum(trained) / sum(secs) if sum(secs) > 0 else None
    waits = [_num(r, "timing/rollout_wait_seconds") for r in timed]
    if any(w is None for w in waits):  # sync: the trainer waits for the whole rollout
        waits = [_num(r, "rollout/seconds") for r in timed]
    out["idle"] = sum(waits) / sum(secs) if sum(secs) > 0 and all(w is not None for w in waits) else None
    for mean_key, max_key in STALENESS_KEYS:
        means = [m for m in (_num(r, mean_key) for r in timed) if m is not None]
        if means:
            out["stale_mean"] = statistics.fmean(means)
            out["stale_max"] = max(m for m in (_num(r, max_key) for r in timed) if m is not None)
            break
    evals = [r for r in rows if _num(r, "eval/accuracy") is not None]
    out["acc0"] = _num(evals[0], "eval/accuracy") if evals else None
    out["acc1"] = _num(evals[-1], "eval/accuracy") if len(evals) > 1 else None
    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    out["t0"], out["t1"] = (times[0], times[-1]) if times else (None, None)
    out["wall_s"] = times[-1] - times[0] if len(times) > 1 else None
    if out["acc1"] is not None and out["wall_s"]:
        out["acc_per_min"] = out["acc1"] / (out["wall_s"] / 60)
    for name, key in (("len_trained", TRAINED_LENGTH_KEY), ("len_sampled", SAMPLED_LENGTH_KEY)):
        xs = [x for x in (_num(r, key) for r in timed) if x is not None]
        out[name] = (statistics.fmean(xs), _p90(xs)) if xs else None
    return out


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def table(cols: list[tuple[str, dict]]) -> list[str]:
    """Markdown lines: one row per measure, one column per run."""
    def pair(v: Optional[tuple], spec: str) -> str:
        return "n/a" if v is None else f"{format(v[0], spec)} / {format(v[1], spec)}"

    measures = [
        ("trained samples/s", lambda c: _fmt(c.get("samples_s"), ".1f")),
        ("engine busy share of wall time", lambda c: _fmt(c.get("busy"), ".0%")),
        ("engine CPU share of its CPUs", lambda c: _fmt(c.get("engine_cpu"), ".0%")),
        ("trainer idle share of step time", lambda c: _fmt(c.get("idle"), ".0%")),
        ("staleness mean / max (versions)", lambda c: pair((c["stale_mean"], c["stale_max"]), ".2f")
         if "stale_mean" in c else "n/a"),
        ("greedy accuracy start -> end",
         lambda c: f"{_fmt(c.get('acc0'), '.3f')} -> {_fmt(c.get('acc1'), '.3f')}"),
        ("end accuracy per wall-minute", lambda c: _fmt(c.get("acc_per_min"), ".4f")),
        ("wall s (first to last metrics row)", lambda c: _fmt(c.get("wall_s"), ".0f")),
        ("response length trained: mean / p90", lambda c: pair(c.get("len_trained"), ".1f")),
        ("response length sampled: mean / p90", lambda c: pair(c.get("len_sampled"), ".1f")),
        ("steps (timed)", lambda c: f"{c.get('steps')} ({c.get('timed')})"),
    ]
    cells = [[cell(c) if "error" not in c else f"failed ({c['error']})" for _, c in cols]
             for _, cell in measures]
    width = max(12, *(len(name) for name, _ in cols), *(len(x) for row in cells for x in row))
    lines = [f"| {'':38} | " + " | ".join(f"{name:>{width}}" for name, _ in cols) + " |",
             "|" + "-" * 40 + "|" + "|".join("-" * (width + 2) for _ in cols) + "|"]
    for (label, _), row in zip(measures, cells):
        lines.append(f"| {label:38} | " + " | ".join(f"{x:>{width}}" for x in row) + " |")
    lines.append("(response lengths: the mean and p90 over the timed steps of each step's mean, in tokens)")
    return lines


def runs_of(modes: list[str], policies: list[str]) -> list[tuple[str, str, list[str]]]:
    """``(run name, column title, overrides)`` per run: each mode, fully_async once per stale policy (with
    ``algorithm.use_tis``, which the mode requires)."""
    out = []
    for mode in modes:
        if mode != "fully_async":
            out.append((mode, mode, [f"run.mode={mode}"]))
            continue
        for policy in policies:
            name = mode if len(policies) == 1 else f"{mode}-{policy}"
            out.append((name, name, [f"run.mode={mode}", f"rollout.stale_policy={policy}",
                                     "algorithm.use_tis=true"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="longtail")
    p.add_argument("--steps", type=int, default=100, help="rollout steps per mode (default 100)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed first steps (default: 5, or 0 under 10 steps)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--stale-policies", nargs="+", choices=STALE_POLICIES, default=["keep"],
                   help="fully_async: one run per rollout.stale_policy (default: keep)")
    p.add_argument("--no-sft", action="store_true",
                   help="start from the base model, no dynamic filter (smoke tests: no warm start)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    p.add_argument("--folder", default=None, help="work folder (default: a new temporary one, deleted after)")
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else (5 if args.steps >= 10 else 0)
    from hpcrl.config import load_config
    from hpcrl.placement import run_cpu_sets

    src = ROOT / WORKLOADS[args.workload]
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="hpcrl-async-modes-"))
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, folder / src.name)
    cfg = load_config(str(src))
    common = ["run.placement=disaggregate", "checkpoint.save_interval=0"]
    for key in CACHE_PATHS:  # one warm start for every run (and for hpcrl run from the repository)
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if value and not os.path.isabs(value):
            common.append(f"{key}={ROOT / value}")
    if args.no_sft:
        common += ["sft.enabled=false", "rollout.dynamic_filter=null"]  # a random model: all rewards 0
    if args.steps <= cfg.train.lr_warmup_steps:  # short runs (smoke tests): the config refuses the warmup
        common.append("train.lr_warmup_steps=0")
    common += args.set
    cfg.run.placement = "disaggregate"
    for item in args.set:
        key, _, value = item.partition("=")
        if key in ("train.cpus", "rollout.cpus"):
            setattr(cfg.train if key.startswith("train") else cfg.rollout, "cpus", value)
    cpus = run_cpu_sets(cfg)
    cols: list[tuple[str, dict]] = []
    for name, title, overrides in runs_of(args.modes, args.stale_policies):
        with EngineBusyPoller() as poller:
            row = run_one(folder, name, [*common, *overrides], args.steps, config=src.name)
        print(f"[{name}] rc {row['rc']} in {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
        if row["rc"] != 0:
            print(row.get("tail", ""), file=sys.stderr)
            cols.append((title, {"error": row["rc"]}))
            continue
        metrics = folder / "runs" / name / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        col = summarize(rows, cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, warmup)
        if col["t0"] is not None:
            col["busy"] = poller.share(col["t0"], col["t1"])
            col["engine_cpu"] = poller.cpu_share(col["t0"], col["t1"], len(cpus.rollout))
        cols.append((title, col))
    lines = [machine_header(threads=len(cpus.train), precision=cfg.model.dtype),
             f"# {WORKLOADS[args.workload]} ({cfg.data.source}), {args.steps} rollout steps of "
             f"{cfg.rollout.batch_size} x {cfg.rollout.n_samples_per_prompt} samples per mode, "
             f"{warmup} untimed, trainer on CPUs {list(cpus.train)} ({len(cpus.train)} threads), engine on "
             f"{list(cpus.rollout)} ({len(cpus.rollout)} threads), "
             f"{'no SFT' if args.no_sft else 'SFT warm start'}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}",
             *table(cols)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = all("error" not in c for _, c in cols)
    if not args.folder and ok:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
