"""Launch overhead on the local Slurm cluster (tests/cluster/): seconds from ``hpcrl submit`` to the job
running, to the first weight sync and to the first rollout, colocated on one node and as a het job over
n1 + n2 (issue #4 point 10; target: under 20 s to the first rollout).

Each run is the quickstart without SFT and without the dynamic filter (a random model scores 0; the tiny model
is created once beforehand, so model creation is not timed) for 3 rollout steps. Times come from the run
folder: the job's start from ``sacct``, the first ``sync`` and ``generate`` phases from
``logs/attempt-0/phases.jsonl`` (wall clock; the fake nodes share this machine's clock). Prints one row per
placement (median of ``--repeats``).

    python benchmarks/slurm_overhead.py [--repeats 3]

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
PLACEMENTS = {
    "colocate (1 node)": ["slurm.cpus_per_task=2"],
    "het job (n1 + n2)": ["run.placement=disaggregate", "slurm.cpus_per_task=2",
                          "slurm.rollout={nodes: 1, cpus_per_task: 2}"],
}
THREADS = 2  # torch threads of the trainer step (and the engine step): slurm.cpus_per_task above


def _job_start(job_id: str) -> float:
    """Unix seconds the job (its first component) started, from sacct."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,Start", "-j", job_id], capture_output=True,
                         text=True, timeout=30).stdout
    for line in out.splitlines():
        jid, start = line.split("|")
        if jid in (job_id, f"{job_id}+0") and start not in ("Unknown", "None"):
            return time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S"))
    raise RuntimeError(f"sacct has no start time for job {job_id}: {out!r}")


def one_run(work: Path, model: Path, name: str, overrides: list[str]) -> dict[str, float]:
    """Submit, wait for the end, return seconds from submit to job start, first sync and first rollout."""
    from hpcrl.slurm.state import FINAL_STATES, query_states

    shutil.copy(ROOT / "configs" / "quickstart.yaml", work / "quickstart.yaml")
    t0 = time.time()
    out = subprocess.run([str(HPCRL), "submit", "quickstart.yaml", f"run.name={name}", "sft.enabled=false",
                          f"model.path={model}", "run.num_rollout=3", "train.lr_warmup_steps=0",
                          "rollout.eval_interval=0", "rollout.dynamic_filter=null", "slurm.time=00:10:00",
                          "slurm.signal=USR2@60", *overrides],
                         cwd=work, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    words = out.stdout.split()
    job_id, run_dir = words[words.index("job") + 1], Path(words[words.index("job") + 3])
    deadline = time.monotonic() + 600
    while (state := query_states([job_id])[job_id]) not in FINAL_STATES:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} still {state} after 600 s")
        time.sleep(1)
    if state != "COMPLETED":
        raise RuntimeError(f"job {job_id} ended {state}; see {run_dir}")
    phases = [json.loads(line) for line in (run_dir / "logs/attempt-0/phases.jsonl").read_text().splitlines()]
    first = {}
    for p in phases:
        first.setdefault(p["phase"], p["wall"])
    return {"job start": _job_start(job_id) - t0, "first weight sync": first["sync"] - t0,
            "first rollout": first["generate"] - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from hpcrl.models.tiny import create_tiny_qwen2
    from tests.cluster.local_slurm import start_cluster

    start_cluster()
    with tempfile.TemporaryDirectory(prefix="hpcrl-slurm-overhead-") as tmp:
        work = Path(tmp)
        model = create_tiny_qwen2(work / "tiny-qwen2", seed=0)
        rows = {}
        for label, overrides in PLACEMENTS.items():
            runs = [one_run(work, model, f"ovh{len(rows)}-{i}", overrides) for i in range(args.repeats)]
            rows[label] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"[{label}] " + "; ".join(f"{k} " + ", ".join(f"{r[k]:.1f}" for r in runs) for k in runs[0]),
                  flush=True)
    print()
    print(machine_header(threads=THREADS, precision="float32"))
    print(f"seconds from `hpcrl submit` (median of {args.repeats}; local cluster, sched_interval=2, bf_interval=1)")
    print(f"| {'placement':<20} | {'job running':>11} | {'first weight sync':>17} | {'first rollout':>13} |")
    print(f"|{'-' * 22}|{'-' * 13}|{'-' * 19}|{'-' * 15}|")
    for label, r in rows.items():
        print(f"| {label:<20} | {r['job start']:>11.1f} | {r['first weight sync']:>17.1f} | "
              f"{r['first rollout']:>13.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
