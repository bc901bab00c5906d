"""Engine fault recovery (issue #12 point 4): seconds from an engine's death to it serving again at the current
weight version, and what a kill costs the step it hits. Target: < 10 s locally.

A local ``hpcrl run`` (tiny random Qwen2, hidden 64, 2 layers; addition; 4 prompts x 4 samples; the real CPU
engine and sglang-router; heartbeat ``--interval`` / ``--timeout``) is started per mode; ``--kills`` times, at
evenly spread steps, this script SIGKILLs the engine process (or SIGSTOPs it: ``--signal STOP``, a hung
engine) and waits until the replacement serves. Per kill, from the run's log (``hpcrl.health`` lines) and
metrics:

* ``found``: seconds from the signal to the monitor declaring the engine dead (a SIGKILLed process is seen by
  the request that fails on it or by the next probe; a hung one after ``--timeout``);
* ``serving``: seconds from the signal to the new engine in rotation, loaded with the current weights (it
  starts from the weight snapshot, ``hpcrl.weights.snapshot``);
* ``version ok``: the next step's rollout came from the weight version the loop expects
  (``rollout/weight_version``: step k in sync mode, k-1 in async);
* ``step cost``: ``timing/step_seconds`` of the first step logged after the recovery (the one the kill hit)
  minus the median step of the run.

    python benchmarks/fault_recovery.py [--kills 5] [--steps 300] [--modes sync,async] [--signal KILL|STOP]
        [--set KEY=VALUE ...] [--slurm]

``--slurm``: the same runs submitted with ``hpcrl submit`` to the Slurm cluster this machine talks to (the
local one of tests/cluster/: ``python3 tests/cluster/local_slurm.py start``): sync colocated on one node,
async as a het job (trainer on one node, the engine's job step on another). The engine process of the
rollout job step is SIGKILLed (found by its ``HPCRL_RUN_DIR``); a new one-engine ``srun`` step replaces it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402

LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) hpcrl\.health WARNING engine 0 (at \S+ is dead|serves again)")


def _children(pid: int) -> list[int]:
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]

    def ppid(p: int) -> int:
        try:
            return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return -1

    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p in pids if ppid(p) in frontier}
        out.extend(frontier)
    return out


def _engines(pid: int) -> list[int]:
    out = []
    for p in _children(pid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"hpcrl.engine.server" in cmd and state not in ("Z", "T"):
            out.append(p)
    return out


def _tail(path: Path) -> str:
    """The end of a run's log, progress bars folded (what a failed run printed)."""
    lines = path.read_text(errors="replace").replace("\r", "\n").splitlines()
    return "\n".join(x for x in lines if "rollout:" not in x)[-3000:]


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]  # not a line being written
    return [r for r in map(json.loads, lines) if r["step"] >= 0]


def _slurm_engines(run_dir: Path) -> list[int]:
    """Live engine processes of a Slurm run (their environment names the run folder)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if b"hpcrl.engine.server" not in (p / "cmdline").read_bytes():
                continue
            if f"HPCRL_RUN_DIR={run_dir}".encode() not in (p / "environ").read_bytes().split(b"\0"):
                continue
            if (p / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "T"):
                continue
        except OSError:
            continue
        out.append(int(p.name))
    return out


class _SlurmRun:
    """``hpcrl submit`` of a run config; ``poll()``/``returncode``/``wait()`` as a Popen, engines by
    :func:`_slurm_engines`, the log the controller writes (submitit's stderr of task 0)."""

    def __init__(self, cfg: Path, work: Path, name: str, overrides: list[str]):
        het = ["run.placement=disaggregate", "train.nprocs=1", "slurm.cpus_per_task=1",
               "slurm.rollout={nodes: 1, cpus_per_task: 2}"] if "run.mode=async" in overrides else []
        out = subprocess.run([sys.executable, "-m", "hpcrl", "submit", str(cfg), "slurm.cpus_per_task=2",
                              "slurm.time=01:00:00", *het, *overrides], cwd=work, capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise SystemExit(f"hpcrl submit failed: {out.stderr}")
        words = out.stdout.split()
        self.job_id, self.run_dir = words[words.index("job") + 1], Path(words[words.index("job") + 3])
        self.returncode = None

    def poll(self):
        from hpcrl.slurm.state import FINAL_STATES, query_states

        state = query_states([self.job_id])[self.job_id]
        if state in FINAL_STATES:
            self.returncode = 0 if state == "COMPLETED" else 1
        return self.returncode

    def wait(self):
        while self.poll() is None:
            time.sleep(1)
        return self.returncode

    def engines(self) -> list[int]:
        return _slurm_engines(self.run_dir)

    def log_text(self) -> str:
        logs = sorted((self.run_dir / "submitit").glob("*_0_log.err"))
        return "\n".join(p.read_text(errors="replace") for p in logs)


def one_mode(work: Path, mode: str, args) -> list[dict]:
    cfg = work / f"{mode}.yaml"
    cfg.write_text(f"""
run: {{name: {mode}, output_dir: {work / 'runs'}, num_rollout: {args.steps}, seed: 7,
      mode: {mode}, placement: {'disaggregate' if mode == 'async' else 'colocate'}}}
model: {{path: {work / 'tiny'}, create: tiny-qwen2, tiny_hidden_size: 64, tiny_num_layers: 2}}
data: {{source: addition, num_train: 5000, num_eval: 16}}
rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, eval_interval: 0,
          heartbeat_interval_s: {args.interval}, heartbeat_timeout_s: {args.timeout}, max_engine_restarts: 100}}
train: {{lr: 1.0e-3, micro_batch_size: 8}}
checkpoint: {{save_interval: 0, keep_last: 1}}
""")
    log_path = work / f"{mode}.log"
    if args.slurm:
        proc = _SlurmRun(cfg, work, mode, [f"run.mode={mode}", *args.set])
        run_dir, engines = proc.run_dir, proc.engines
        log_path.write_text("")
    else:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.Popen([sys.executable, "-m", "hpcrl", "run", str(cfg), *args.set], cwd=work, env=env,
                                stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
        run_dir = work / "runs" / mode
        engines = lambda: _engines(proc.pid)  # noqa: E731
    sig = signal.SIGKILL if args.signal == "KILL" else signal.SIGSTOP
    kills = []

    def ended(what: str) -> SystemExit:
        if args.slurm:
            log_path.write_text(proc.log_text())
        return SystemExit(f"{mode}: the run {what} ({proc.returncode}):\n{_tail(log_path)}")

    for i in range(args.kills):
        target = int((i + 1) * args.steps / (args.kills + 1))
        while len(_steps(run_dir)) < target or not engines():
            if proc.poll() is not None:
                raise ended("ended")
            time.sleep(0.01)
        victim = engines()[0]
        t = time.time()
        os.kill(victim, sig)
        kills.append({"t": t, "step": len(_steps(run_dir))})
        while [p for p in engines() if p != victim] == [] or victim in engines():
            if proc.poll() is not None:
                raise ended("ended")
            time.sleep(0.01)
    if proc.wait() != 0:
        raise ended("failed")
    if args.slurm:
        log_path.write_text(proc.log_text())
    text = log_path.read_text(errors="replace")
    events = [(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), m.group(2).startswith("at"))
              for m in LINE.finditer(text)]
    dead = [t for t, is_dead in events if is_dead]
    back = [t for t, is_dead in events if not is_dead]
    steps = _steps(run_dir)
    median = statistics.median(r["timing/step_seconds"] for r in steps)
    off = 1 if mode == "async" else 0
    rows = []
    for k, (d, b) in enumerate(zip(dead, back)):
        kill = kills[k]
        hit = next((r for r in steps if r["time"] >= b), steps[-1])  # the first step logged after recovery
        nxt = next((r for r in steps if r["step"] > hit["step"]), hit)
        rows.append({"mode": mode, "kill": k + 1, "step": hit["step"], "found": d - kill["t"],
                     "serving": b - kill["t"], "version_ok": nxt["rollout/weight_version"] == str(max(nxt["step"] - off, 0)),
                     "step_cost": hit["timing/step_seconds"] - median})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--signal", choices=["KILL", "STOP"], default="KILL")
    p.add_argument("--interval", type=float, default=1.0, help="rollout.heartbeat_interval_s")
    p.add_argument("--timeout", type=float, default=3.0, help="rollout.heartbeat_timeout_s")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--slurm", action="store_true", help="submit to the (local) Slurm cluster instead")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more `hpcrl run` overrides (on a GPU: rollout.engine=cpu run.placement=disaggregate)")
    args = p.parse_args()
    print(machine_header(threads=args.threads, precision="fp32"))
    if args.set:
        print("overrides:", " ".join(args.set))
    print(f"SIG{args.signal} x {args.kills} per run, {args.steps} steps, heartbeat {args.interval:g} s / "
          f"timeout {args.timeout:g} s, 1 engine (the run waits while it is replaced), "
          + ("on Slurm (sync: colocated job; async: het job, engine on its own node)" if args.slurm
             else "local runs"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcrl-fault-") as tmp:
        for mode in args.modes.split(","):
            rows += one_mode(Path(tmp), mode, args)
    print(f"| {'mode':5} | kill | step | found s | serving s | version ok | step cost s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']:5} | {r['kill']:4} | {r['step']:4} | {r['found']:7.2f} | {r['serving']:9.2f} | "
              f"{'yes' if r['version_ok'] else 'NO':10} | {r['step_cost']:11.2f} |")
    for mode in args.modes.split(","):
        s = [r["serving"] for r in rows if r["mode"] == mode]
        if s:
            print(f"{mode}: death -> serving median {statistics.median(s):.2f} s, max {max(s):.2f} s "
                  f"(target < 10 s: {'met' if max(s) < 10 else 'MISSED'})")


if __name__ == "__main__":
    main()
