"""hpcrl's CPU engine against real SGLang on this CPU, side by side in one run (issue #53 point 5).

For each engine, started exactly as ``hpcrl run`` starts it (:func:`hpcrl.rollout.engines.spawn_engine`: the CPU
engine's line, or SGLang's CPU line with its runtime from ``tests/sglang_cpu`` on the server's path, one torch
thread each), on the same model and the same requests:

- **start**: seconds from the process start to ``/health`` answering 200 (imports and model load);
- **tokens/s** at batch (requests in flight) 1, 16 and 64: ``/generate`` with ``--prompt-len`` random prompt
  tokens and exactly ``--new-tokens`` sampled tokens (temperature 1, ``ignore_eos``), after one warm-up round;
- **memory**: the engine's process tree's resident set (MiB) once healthy and its peak while generating (sampled
  every 50 ms; SGLang is three processes: server, scheduler, detokenizer);
- **quickstart step**: ``hpcrl run configs/quickstart.yaml`` from its shipped SFT warm start
  (``tests/warm_starts``) for ``--steps`` GRPO steps on that engine (sync, colocated, the README's recipe), the
  median of ``timing/step_seconds`` and its rollout / train / sync parts over the steps after the first three.

Both engines run on the same cores one after the other, never together. Needs SGLang's CPU runtime
(``bash .ci/install --sglang``)::

    python benchmarks/engines_side_by_side.py [--steps 30] [--batches 1 16 64] [--skip-quickstart]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
sys.path.insert(0, str(ROOT))  # tests.sglang_cpu, tests.warm_starts
from engine_throughput import run_level  # noqa: E402 - the same /generate load as the CPU engine's benchmark
from machine import machine_header  # noqa: E402

HPCRL = Path(sys.executable).with_name("hpcrl")
ENGINES = ("cpu", "sglang")


def tree_rss_mib(pid: int) -> float:
    """Resident set of process ``pid`` and all its descendants, MiB (0 when it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


class PeakRss:
    """Samples :func:`tree_rss_mib` of ``pid`` every ``interval`` seconds in a thread while in the ``with``."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.pid, self.interval, self.peak = pid, interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_mib(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def engine_rollout_cfg(engine: str) -> SimpleNamespace:
    """What :func:`hpcrl.rollout.engines.spawn_engine` reads of ``cfg.rollout`` for ``engine``."""
    env = {}
    if engine == "sglang":
        from tests import sglang_cpu

        env = sglang_cpu.engine_env()
    return SimpleNamespace(engine=engine, engine_env=env)


def serve_and_measure(engine: str, model_path: Path, args: argparse.Namespace, log_dir: Path) -> dict:
    """Start ``engine`` on ``model_path`` as a run would, measure start, tokens/s per batch and memory."""
    from hpcrl.rollout.engines import spawn_engine, wait_engine

    vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    eng = spawn_engine(engine_rollout_cfg(engine), {"random_seed": 1}, model_path, engine=engine,
                       log_path=log_dir / f"{engine}.log", cpus=[0])
    try:
        wait_engine(eng, startup_timeout_s=600)
        out: dict = {"start_s": time.perf_counter() - t0}
        asyncio.run(run_level(eng.url, 4, 4, args.prompt_len, 2, vocab, seed=0))  # warm-up
        out["rss_ready_mib"] = tree_rss_mib(eng.process.pid)
        with PeakRss(eng.process.pid) as peak:
            for batch in args.batches:
                n = max(args.min_requests, batch * args.rounds)
                _, tokens, secs = asyncio.run(run_level(eng.url, batch, n, args.prompt_len, args.new_tokens,
                                                        vocab, seed=batch))
                out[f"tps_{batch}"] = tokens / secs
        out["rss_peak_mib"] = peak.peak
        return out
    finally:
        eng.stop()


def quickstart_steps(engine: str, work: Path, steps: int) -> dict:
    """``hpcrl run configs/quickstart.yaml`` from the shipped warm start for ``steps`` steps on ``engine``;
    medians of the step time and its parts over the steps after the first three. Raises RuntimeError
    when the run fails (with the tail of its output)."""
    from tests import sglang_cpu

    overrides = [f"run.num_rollout={steps}", f"run.name=qs-{engine}", "rollout.eval_interval=0",
                 f"rollout.engine={engine}", "train.lr_warmup_steps=0"]  # the config's 50 need a longer run
    if engine == "sglang":
        overrides.append("rollout.engine_env=" + json.dumps(sglang_cpu.engine_env(), separators=(",", ":")))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(work / f"{engine}.out", "w") as log:
        rc = subprocess.run([str(HPCRL), "run", "quickstart.yaml", *overrides], cwd=work, stdout=log,
                            stderr=subprocess.STDOUT, env=env, timeout=3600).returncode
    if rc != 0:
        raise RuntimeError(f"the quickstart on {engine} failed ({rc}):\n"
                           + (work / f"{engine}.out").read_text(errors="replace")[-3000:])
    rows = [json.loads(line) for line in (work / "runs" / f"qs-{engine}" / "metrics.jsonl").open()]
    rows = [r for r in rows if isinstance(r.get("step"), int) and r["step"] >= 3 and "timing/step_seconds" in r]
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("timing/step_seconds", "rollout/seconds", "train/seconds", "sync/seconds")}
    return {"steps": len(rows), **med}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="requests in flight")
    p.add_argument("--rounds", type=int, default=2, help="requests per level = max(min_requests, batch*rounds)")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=30, help="quickstart GRPO steps per engine")
    p.add_argument("--skip-quickstart", action="store_true")
    args = p.parse_args(argv)

    from tests import sglang_cpu
    from tests.warm_starts import install

    if not sglang_cpu.available():
        sys.exit("SGLang's CPU runtime is not installed: bash .ci/install --sglang")
    started = datetime.datetime.now(datetime.timezone.utc)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hpcrl-engines-") as tmp:
        work = Path(tmp)
        (work / "quickstart.yaml").write_text((ROOT / "configs" / "quickstart.yaml").read_text())
        placed = install("quickstart", work)
        model = Path(placed["tiny-qwen2-addition-sft"])  # the warm start: the quickstart's GRPO start
        for engine in ENGINES:
            results[engine] = serve_and_measure(engine, model, args, work)
            if not args.skip_quickstart:
                results[engine].update(quickstart_steps(engine, work, args.steps))

    print(machine_header(threads=1, precision="float32 on both engines"))
    print(f"# tiny Qwen2 of the quickstart (its shipped SFT warm start), one torch thread per engine process, "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (temperature 1, ignore_eos); "
          f"quickstart: {args.steps} GRPO steps each, medians after 3; {started:%Y-%m-%d %H:%M} UTC, "
          f"load average {os.getloadavg()[0]:.1f}")
    rows = [("start to /health (s)", "start_s", "{:.1f}"),
            *[(f"tokens/s at batch {b}", f"tps_{b}", "{:.0f}") for b in args.batches],
            ("RSS when ready (MiB)", "rss_ready_mib", "{:.0f}"),
            ("RSS peak generating (MiB)", "rss_peak_mib", "{:.0f}")]
    if not args.skip_quickstart:
        rows += [("quickstart step (s)", "timing/step_seconds", "{:.2f}"),
                 ("  rollout (s)", "rollout/seconds", "{:.2f}"),
                 ("  train (s)", "train/seconds", "{:.2f}"),
                 ("  weight sync (s)", "sync/seconds", "{:.3f}")]
    print(f"| {'':28} | {'hpcrl CPU engine':>16} | {'SGLang ' + sglang_cpu.SGLANG_VERSION:>16} | SGLang / CPU |")
    print(f"|{'-' * 30}|{'-' * 18}|{'-' * 18}|--------------|")
    for label, key, fmt in rows:
        a, b = results["cpu"].get(key), results["sglang"].get(key)
        ratio = f"{b / a:.2f}x" if a and b else ""
        print(f"| {label:28} | {fmt.format(a) if a is not None else '':>16} | "
              f"{fmt.format(b) if b is not None else '':>16} | {ratio:>12} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
