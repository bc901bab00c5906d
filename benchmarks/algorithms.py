"""The algorithms side by side on the quickstart task: greedy accuracy and seconds per step after a fixed budget.

Every algorithm trains the quickstart's model (``configs/quickstart.yaml``: tiny Qwen2, 3-digit addition) from
the same SFT warm start (made once in the work folder and reused: same base model, seed and recipe) for the
same number of rollout steps, 64 samples per step:

- ``grpo``: the quickstart at 8 prompts x 8 samples (``rollout.batch_size=8``: the quickstart itself takes 16
  since issue #40), group advantage, PPO clip;
- ``gspo``: ``algorithm.advantage_estimator=gspo`` (sequence-level ratio, GSPO's small clip range);
- ``reinforce++``: ``advantage_estimator=reinforce_plus_plus`` (batch-whitened returns);
- ``cispo``: ``algorithm.policy_loss=cispo`` (eps_low 1.0, eps_high 4.0: no lower bound, as in the paper);
- ``rloo``: ``advantage_estimator=rloo`` (leave-one-out group baseline, no std division);
- ``ppo``: ``advantage_estimator=gae``, PPO with a critic started from the same SFT model: 64 prompts x 1
  sample (no group, so no dynamic filter), GAE with ``gamma = lam = 1`` on the outcome reward, advantages
  whitened, critic lr 1e-3 (a fresh value head learns faster than the policy may move), 5 critic-only warm-up
  steps, value clip 0.2;
- ``ppo-own``: ``ppo`` with the critic on a process of its own (``critic.nprocs=1``): the same run, the critic's
  values and steps beside the actor's instead of after them (the machine's CPUs shared by both processes);
- ``opd``: on-policy distillation only: 64 prompts x 1 sample, no dynamic filter, advantage
  ``log pi_teacher - log pi_student`` from a teacher made by the same SFT run on to ``--teacher-accuracy``
  (0.6), with ``configs/opd-quickstart.yaml``'s learning rate (4e-4 cosine to 4e-5, 20 warmup steps).

    python benchmarks/algorithms.py                       # 300 steps each, in a fresh temporary folder
    python benchmarks/algorithms.py --steps 100 --only grpo cispo

Prints the machine header, then one row per algorithm: start and end greedy accuracy (500 held-out problems),
gain, the accuracy after the same training wall time (``acc@T``: ``T`` is the shortest run's training time,
the sum of its steps' ``timing/step_seconds`` less their evals' ``eval/seconds``; each run's last greedy eval
within ``T``, evals every ``--eval-every`` steps), seconds per rollout step (median of the run's
``timing/step_seconds`` or wall time / steps), the peak resident memory of the run's largest process (the
trainer; ``ru_maxrss`` of the run's process tree, MiB) and wall seconds.
Results in docs/performance.md ("Algorithms side by side").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from machine import machine_header  # noqa: E402

TEACHER = ".cache/models/tiny-qwen2-addition-teacher"


BASE = ["rollout.batch_size=8"]
"""Before every algorithm's overrides: 8 prompts of 8 samples, 64 samples a step (the quickstart's own rollout
takes 16 prompts since issue #40; the tables in docs/performance.md were measured at 8)."""
PPO = ["algorithm.advantage_estimator=gae", "rollout.batch_size=64", "rollout.n_samples_per_prompt=1",
       "rollout.dynamic_filter=null", "critic.lr=1e-3", "critic.warmup_steps=5"]


def algorithms(teacher_accuracy: float) -> dict[str, list[str]]:
    """Overrides of ``configs/quickstart.yaml`` per algorithm (see the module doc), each after :data:`BASE`."""
    return {name: [*BASE, *overrides] for name, overrides in {
        "grpo": [],
        "gspo": ["algorithm.advantage_estimator=gspo", "algorithm.eps_clip=0.0003", "algorithm.eps_clip_high=0.0004"],
        "reinforce++": ["algorithm.advantage_estimator=reinforce_plus_plus"],
        "cispo": ["algorithm.policy_loss=cispo", "algorithm.eps_clip=1.0", "algorithm.eps_clip_high=4.0"],
        "rloo": ["algorithm.advantage_estimator=rloo"],
        "ppo": PPO,
        "ppo-own": [*PPO, "critic.nprocs=1"],
        "opd": ["rollout.batch_size=64", "rollout.n_samples_per_prompt=1", "rollout.dynamic_filter=null",
                "train.lr=4e-4", "train.min_lr=4e-5", "train.lr_warmup_steps=20",  # configs/opd-quickstart.yaml's
                f"algorithm.opd.teachers=[{{name: strong, path: {TEACHER}, "
                f"sft_target_accuracy: {teacher_accuracy}}}]"],
    }.items()}


PEAK_RSS = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
            "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
            "sys.exit(rc)")
"""Runs a command and writes the peak RSS (KiB, Linux) of the largest process of its tree to a file: a fresh
process per run, so one run's peak does not carry into the next."""


def run_one(folder: Path, name: str, overrides: list[str], steps: int, config: str = "quickstart.yaml",
            eval_every: Optional[int] = None) -> dict:
    """``hpcrl run <config>`` (a file in ``folder``) in ``folder`` as run ``name``, ``steps`` rollout steps, greedy
    eval at the start, every ``eval_every`` steps (default: only the end) and the end; returns the row
    (accuracies in [0, 1]; ``evals``: ``(training seconds so far, accuracy)`` per eval; ``peak_mib``: the
    largest process's peak RSS; ``rc``, ``wall_s``, and the log's tail when it failed).
    benchmarks/async_modes.py runs its modes through it too."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    hpcrl = Path(sys.executable).with_name("hpcrl")
    peak = folder / f"{name}.peak_kib"
    cmd = [sys.executable, "-c", PEAK_RSS, str(peak), str(hpcrl), "run", config, f"run.name={name}",
           f"run.num_rollout={steps}", f"rollout.eval_interval={eval_every or steps}", *overrides]
    t0 = time.perf_counter()
    with open(folder / f"{name}.log", "wb") as log:
        rc = subprocess.run(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    row = {"name": name, "rc": rc, "wall_s": time.perf_counter() - t0}
    if peak.exists():
        row["peak_mib"] = int(peak.read_text()) / 1024
    metrics = folder / "runs" / name / "metrics.jsonl"
    if rc == 0 and metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
        step_s = [r["timing/step_seconds"] for r in rows if r["step"] >= 1 and "timing/step_seconds" in r]
        trained, timeline = 0.0, []
        for r in rows:
            trained += r.get("timing/step_seconds", 0.0) - (r.get("eval/seconds", 0.0) if r["step"] >= 0 else 0)
            if "eval/accuracy" in r:
                timeline.append((trained, r["eval/accuracy"]))
        row.update(start=evals[0], end=evals[-1], evals=timeline, train_s=trained,
                   step_s=statistics.median(step_s) if step_s else row["wall_s"] / steps,
                   kl=[r.get("rollout/opd_reverse_kl") for r in rows if r["step"] >= 0])
    else:
        row["tail"] = (folder / f"{name}.log").read_text(errors="replace")[-2000:]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="rollout steps per algorithm (default 300)")
    p.add_argument("--only", nargs="+", default=None, help="a subset of: grpo gspo reinforce++ cispo rloo ppo ppo-own opd")
    p.add_argument("--eval-every", type=int, default=25, help="greedy eval every this many steps (25): acc@T's grain")
    p.add_argument("--teacher-accuracy", type=float, default=0.6, help="OPD teacher's SFT target (0.6)")
    p.add_argument("--folder", default=None, help="work folder (default: a new temporary one, deleted after)")
    args = p.parse_args(argv)
    import torch

    algos = algorithms(args.teacher_accuracy)
    names = args.only or list(algos)
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="hpcrl-algorithms-"))
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "configs" / "quickstart.yaml", folder / "quickstart.yaml")
    rows = []
    for name in names:
        row = run_one(folder, name, algos[name], args.steps, eval_every=args.eval_every)
        rows.append(row)
        print(f"[{name}] rc {row['rc']} {row.get('start')} -> {row.get('end')} in {row['wall_s']:.0f} s",
              file=sys.stderr, flush=True)
        if row["rc"] != 0:
            print(row.get("tail", ""), file=sys.stderr)
    print(machine_header(threads=torch.get_num_threads(), precision="fp32"))
    print(f"# configs/quickstart.yaml from one SFT warm start, {args.steps} rollout steps of 64 samples each, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}")
    done = [r for r in rows if "start" in r]
    budget = min((r["train_s"] for r in done), default=0.0)
    print(f"# acc@T: the last greedy eval within T = {budget:.0f} s of training (the shortest run's), evals every "
          f"{args.eval_every} steps; peak MiB: the largest process of the run (the trainer)")
    print("| algorithm | start | end | gain | acc@T | s/step | peak MiB | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "start" not in r:
            print(f"| {r['name']} | failed (exit {r['rc']}, folder {folder}) |")
            continue
        at_budget = [acc for t, acc in r["evals"] if t <= budget + 1e-6][-1]
        print(f"| {r['name']} | {r['start']:.3f} | {r['end']:.3f} | {100 * (r['end'] - r['start']):+.1f} | "
              f"{at_budget:.3f} | {r['step_s']:.3f} | {r.get('peak_mib', float('nan')):.0f} | {r['wall_s']:.0f} |")
    if not args.folder and all(r["rc"] == 0 for r in rows):
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
