"""Preemption cost on the local Slurm cluster (tests/cluster/), issue #5 point 6: seconds from the preemption
signal (USR2) to the checkpoint being complete on disk, and from the requeue to the first training step of the
new attempt. Targets: the checkpoint within the signal's lead time (``slurm.signal=USR2@LEAD``); back to
training within 30 s of the requeue.

Two triggers, each on a fresh colocated run of the quickstart without SFT (tiny model; ``--model smollm2`` runs
SmolLM2-135M-Instruct from configs/smollm2-arith.yaml instead, whose checkpoint with optimizer state is
~1.6 GB):

* ``scancel --signal=USR2 JOB`` (what a site or user sends by hand; hpcrl runs ``scontrol requeue`` itself);
* a job in the ``urgent`` partition that preempts it (``preempt_send_user_signal``: Slurm sends USR2 and
  requeues the job after the partition's GraceTime).

Times (wall clock; the fake nodes share this machine's clock): signal sent; checkpoint complete (mtime of the
new checkpoint's ``COMPLETE`` marker); requeue (the job seen PENDING again, polled every 0.1 s); job RUNNING
again; the first training step of the new attempt done (its ``metrics.jsonl`` row). The columns:

* ``signal -> ckpt``: the step in flight finishes, all ranks agree, the rollout step stops, the save runs;
* ``requeue -> running``: Slurm's part (here ``cred_expire=5``, ``sched_interval=2``: ~7 s);
* ``requeue -> 1st step``: Slurm's part plus the new attempt's start-up (imports, engine step, resume, the step).

    python benchmarks/preemption.py [--repeats 2] [--model tiny|smollm2]

Needs root on Debian (the cluster is started if it is not up).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HPCRL = Path(sys.executable).with_name("hpcrl")
LEAD_S = 60
THREADS = 2  # torch threads of the trainer step: slurm.cpus_per_task, 2 in both configs (the default)


def _state(job_id: str) -> str:
    from hpcrl.slurm.state import query_states

    return query_states([job_id])[job_id]


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if r["step"] >= 0]


def _wait(what: str, cond, timeout: float, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
    return value


def _complete_checkpoints(run_dir: Path) -> dict[str, float]:
    """{checkpoint folder name: mtime of its COMPLETE marker}."""
    from hpcrl.checkpoint import MARKER_FILE

    return {p.parent.name: p.stat().st_mtime for p in (run_dir / "checkpoints").glob(f"iter_*/{MARKER_FILE}")}


def one_run(work: Path, base: list[str], name: str, trigger: str) -> dict[str, float]:
    out = subprocess.run([str(HPCRL), "submit", *base, f"run.name={name}", "run.num_rollout=100000",
                          "rollout.eval_interval=0", "checkpoint.save_interval=0", "slurm.cpus_per_task=2",
                          "slurm.time=00:30:00", f"slurm.signal=USR2@{LEAD_S}", "slurm.requeue=true"],
                         cwd=work, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    words = out.stdout.split()
    job_id, run_dir = words[words.index("job") + 1], Path(words[words.index("job") + 3])
    try:
        _wait("3 training steps", lambda: len(_steps(run_dir)) >= 3, 900, poll=0.5)
        before = _complete_checkpoints(run_dir)
        node = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
        t_signal = time.time()
        if trigger == "scancel --signal=USR2":
            subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        else:
            subprocess.run(["sbatch", "-p", "urgent", "-w", node, "-c", "2", "-t", "1", "-o", "/dev/null",
                            "--wrap", "sleep 1"], check=True, capture_output=True, timeout=30)
        new = _wait("the checkpoint", lambda: set(_complete_checkpoints(run_dir)) - set(before), 600)
        t_ckpt = _complete_checkpoints(run_dir)[sorted(new)[-1]]
        last_step = _steps(run_dir)[-1]["step"]
        t_requeue = _wait("the requeue", lambda: _state(job_id) in ("PENDING", "REQUEUED") and time.time(), 300)
        t_running = _wait("the job running again", lambda: _state(job_id) == "RUNNING" and time.time(), 300)
        first = _wait("the first step of the new attempt",
                      lambda: [r for r in _steps(run_dir) if r["time"] > t_requeue], 600, poll=0.2)[0]
        if first["step"] != last_step + 1:
            raise RuntimeError(f"resumed at step {first['step']}, expected {last_step + 1}")
        return {"signal -> ckpt": t_ckpt - t_signal, "requeue -> running": t_running - t_requeue,
                "requeue -> 1st step": first["time"] - t_requeue, "step": first.get("timing/step_seconds", 0.0)}
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.cluster.local_slurm import start_cluster

    start_cluster()
    with tempfile.TemporaryDirectory(prefix="hpcrl-preemption-") as tmp:
        work = Path(tmp)
        if args.model == "tiny":
            from hpcrl.models.tiny import create_tiny_qwen2

            model = create_tiny_qwen2(work / "tiny-qwen2", seed=0)
            shutil.copy(ROOT / "configs" / "quickstart.yaml", work / "run.yaml")
            base = ["run.yaml", "sft.enabled=false", f"model.path={model}", "train.lr_warmup_steps=0",
                    "rollout.dynamic_filter=null"]  # a random model scores 0: the filter would drop all
        else:
            shutil.copy(ROOT / "configs" / "smollm2-arith.yaml", work / "run.yaml")
            base = ["run.yaml", "train.lr_warmup_steps=0", "rollout.dynamic_filter=null"]
        rows = {}
        for trigger in ("scancel --signal=USR2", "preempted by urgent"):
            runs = [one_run(work, base, f"pre{len(rows)}-{i}", trigger) for i in range(args.repeats)]
            rows[trigger] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"[{trigger}] " + "; ".join(f"{k} " + ", ".join(f"{r[k]:.1f}" for r in runs) for k in runs[0]),
                  flush=True)
    print()
    print(machine_header(threads=THREADS, precision="float32"))
    print(f"{args.model}: seconds (median of {args.repeats}; local cluster, signal lead {LEAD_S} s, urgent "
          "GraceTime 30 s, cred_expire=5)")
    print(f"| {'trigger':<22} | {'signal -> ckpt':>14} | {'requeue -> running':>18} | {'requeue -> 1st step':>19} |"
          f" {'step':>5} |")
    print(f"|{'-' * 24}|{'-' * 16}|{'-' * 20}|{'-' * 21}|{'-' * 7}|")
    for trigger, r in rows.items():
        print(f"| {trigger:<22} | {r['signal -> ckpt']:>14.1f} | {r['requeue -> running']:>18.1f} | "
              f"{r['requeue -> 1st step']:>19.1f} | {r['step']:>5.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
