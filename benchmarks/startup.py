"""Where a short run's time goes before its first step and after its last (issue #52 point 2, "start-up once").

Runs ``hpcrl run`` of a tiny 3-step GRPO config (the quickstart's task and model, created beforehand so that model
creation is not timed; one engine, no router, no SFT) ``--repeats`` times and prints the median seconds of each
stretch, from the launcher's clock, the run's ``logs/attempt-0/timeline.json`` (:class:`hpcrl.run_session.Timeline`),
its ``metrics.jsonl`` and its engine's log::

    python benchmarks/startup.py [--repeats 3] [--threads 1] [--router] [--no-curves]

Every test of the suite that starts a run pays these stretches, so they are what "start-up" cuts cut. The
last line is the CPU of the whole command (trainer, engine and the rest, core-seconds): the suite is bound by
CPU work on its 2 cores, so that, not the wall time, is what each of its runs costs it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402

HPCRL = Path(sys.executable).with_name("hpcrl")
STEPS = 3
CONFIG = """\
run: {{name: r{i}, num_rollout: {steps}, seed: 1}}
model: {{path: {model}, create: tiny-qwen2}}
data: {{source: addition}}
rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 8, eval_interval: 0, router: {router}}}
train: {{lr_warmup_steps: 0, micro_batch_size: 16}}
"""

STRETCHES = [
    ("start to session", "launch", "session", "imports, config checks, base model found"),
    ("session to engines launched", "session", "engines_launched", "engine (and router) processes spawned"),
    ("to trainer built", "engines_launched", "trainer_built", "torch + megatron-core imports, model, optimizer, data"),
    ("to engines up", "trainer_built", "engines_up", "waiting for the engine's /health beyond that"),
    ("to first sync done", "engines_up", "first_sync", "the first weight sync"),
    ("to first eval done", "first_sync", "first_eval", "the eval before the first step"),
    ("to first step start", "first_eval", "first_step", ""),
    (f"{STEPS} steps", "first_step", "last_step", "rollout, train, sync"),
    ("to loop end", "last_step", "loop_end", "the last step's checkpoint"),
    ("to log closed", "loop_end", "log_closed", "metrics files, curves.png"),
    ("to rollout stopped", "log_closed", "rollout_stopped", "engines and router stopped"),
    ("to session closed", "rollout_stopped", "closed", "process groups"),
    ("to exit", "closed", "exit", "interpreter shutdown"),
]


def engine_ready(log: Path) -> float | None:
    """Wall-clock time of the engine's "ready at" line (its log's timestamps are local time, ms)."""
    for line in log.read_text(errors="replace").splitlines():
        if " ready at http" in line:
            stamp = " ".join(line.split()[:2])
            return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def one_run(work: Path, i: int, model: Path, threads: int, router: bool) -> dict[str, float]:
    """One whole ``hpcrl run``; its events as seconds since launch, and ``cpu_s``: the CPU seconds of the
    command and every process it started and reaped (the trainer, the engine, the router), user + system."""
    cfg = work / f"r{i}.yaml"
    cfg.write_text(CONFIG.format(i=i, steps=STEPS, model=model, router=str(router).lower()))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    before = os.times()
    launch = time.time()
    with open(work / f"r{i}.log", "wb") as out:
        rc = subprocess.run([str(HPCRL), "run", str(cfg)], cwd=work, stdout=out, stderr=subprocess.STDOUT,
                            env=env).returncode
    end = time.time()
    after = os.times()
    cpu_s = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    if rc != 0:
        raise SystemExit(f"run {i} failed ({rc}): {(work / f'r{i}.log').read_text(errors='replace')[-2000:]}")
    attempt = work / "runs" / f"r{i}" / "logs" / "attempt-0"
    ev = json.loads((attempt / "timeline.json").read_text())
    rows = [json.loads(x) for x in (work / "runs" / f"r{i}" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 0]
    ev.update(launch=launch, exit=end, first_step=steps[0]["time"] - steps[0]["timing/step_seconds"],
              last_step=steps[-1]["time"])
    ready = engine_ready(attempt / "engine-0.log")
    if ready is not None:
        ev["engine_ready"] = ready
    return dict({k: v - launch for k, v in ev.items()}, cpu_s=cpu_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer and the engine")
    p.add_argument("--router", action="store_true", help="with sglang-router in front of the engine")
    p.add_argument("--no-curves", action="store_true",
                   help="HPCRL_CURVES=0, as the test suite runs: no curves.png at the end")
    a = p.parse_args()
    print(machine_header(threads=a.threads, precision="float32"))
    with tempfile.TemporaryDirectory(prefix="hpcrl-startup-") as tmp:
        work = Path(tmp)
        model = work / "tiny-qwen2"
        from hpcrl.models.tiny import create_tiny_qwen2

        create_tiny_qwen2(model, seed=1)
        if a.no_curves:
            os.environ["HPCRL_CURVES"] = "0"
        runs = [one_run(work, i, model, a.threads, a.router) for i in range(a.repeats)]
    print(f"# hpcrl run of a tiny {STEPS}-step GRPO config (4 prompts x 4 samples, one engine, router "
          f"{'on' if a.router else 'off'}{', HPCRL_CURVES=0' if a.no_curves else ''}), "
          f"median of {a.repeats} runs, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print(f"| {'stretch':<28} | {'seconds':>7} | what happens in it")
    print(f"|{'-' * 30}|{'-' * 9}|{'-' * 50}")
    for label, a_, b_, what in STRETCHES:
        vals = [r[b_] - r[a_] for r in runs if a_ in r and b_ in r]
        if vals:
            print(f"| {label:<28} | {statistics.median(vals):>7.2f} | {what}")
    total = statistics.median(r["exit"] for r in runs)
    steps = statistics.median(r["last_step"] - r["first_step"] for r in runs)
    before = statistics.median(r["first_step"] for r in runs)
    print(f"| {'whole command':<28} | {total:>7.2f} | before the first step {before:.2f} s, steps {steps:.2f} s, "
          f"after the last {total - before - steps:.2f} s")
    cpu = statistics.median(r["cpu_s"] for r in runs)
    print(f"| {'CPU of the whole command':<28} | {cpu:>7.2f} | core-seconds of the trainer, the engine and "
          f"the rest ({cpu / total:.2f} cores busy on average): what a CPU-bound test suite pays a run")
    ready = [r["engine_ready"] for r in runs if "engine_ready" in r]
    if ready:
        print(f"\nthe engine answered /health {statistics.median(ready):.2f} s after launch (its own import and "
              f"model load, beside the trainer's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
