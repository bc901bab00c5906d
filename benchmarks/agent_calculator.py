"""The calculator agent's learning curve against its no-tool baseline (issue #17 point 4).

Reads the ``metrics.jsonl`` of two finished runs of ``configs/smollm2-agent.yaml`` - the calculator agent and
the same config with ``rollout.agent.function=examples/agent_calculator/agent.py:answer_directly`` - and
prints, per step, the training reward (the task's scorer on each episode's final answer, mean over the step's
32 episodes), the share of episodes that called the tool and the policy calls per episode; then the first-5 /
last-5 step means.
``--png`` also draws reward and tool-call rate of both runs.

    python benchmarks/agent_calculator.py runs/smollm2-agent runs/smollm2-agent-no-tool [--png FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402


def steps(run_dir: Path) -> list[dict]:
    """The step rows (``step >= 0``) of a run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("step", -1) >= 0]


def mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tool_run", type=Path)
    ap.add_argument("baseline_run", type=Path)
    ap.add_argument("--threads", type=int, default=2, help="torch threads the runs used (for the header)")
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    tool, base = steps(args.tool_run), steps(args.baseline_run)
    print(machine_header(threads=args.threads, precision="float32"))
    print("| step | reward (tool) | tool-call rate | calls/episode | reward (no tool) | step s (tool) |")
    print("|---|---|---|---|---|---|")
    for i in range(max(len(tool), len(base))):
        t = tool[i] if i < len(tool) else {}
        b = base[i] if i < len(base) else {}
        cell = (lambda r, k, f="{:.3f}": f.format(r[k]) if k in r else "")
        print(f"| {i} | {cell(t, 'rollout/reward_mean')} | {cell(t, 'rollout/agent_tool_call_rate')} | "
              f"{cell(t, 'rollout/agent_calls', '{:.2f}')} | {cell(b, 'rollout/reward_mean')} | "
              f"{cell(t, 'timing/step_seconds', '{:.0f}')} |")
    for name, rows in (("tool", tool), ("no tool", base)):
        r = [x["rollout/reward_mean"] for x in rows]
        print(f"{name}: reward first 5 steps {mean(r[:5]):.3f}, last 5 steps {mean(r[-5:]):.3f}")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([x["rollout/reward_mean"] for x in tool], label="reward, calculator agent")
        ax.plot([x["rollout/agent_tool_call_rate"] for x in tool], "--", label="tool-call rate")
        ax.plot([x["rollout/reward_mean"] for x in base], label="reward, no tool")
        ax.set_xlabel("GRPO step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(loc="center right")
        fig.tight_layout()
        fig.savefig(args.png, dpi=100)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
