"""Where a CI run's time went (issue #52 point 3): reads the per-test records that ``tests/timing.py`` wrote
(``HPCRL_TEST_TIMING=DIR``, one ``<worker>.jsonl`` per pytest process) and prints

* the time per tier: tests, test-seconds (the sum of their wall times over both lanes), CPU seconds of the
  lanes' process trees, and the tier's span (first start to last end) against its budget (``.ci/budgets.json``);
* each lane's total and the machine's busy cores over the run (weighted by wall time: near the core count,
  the suite is bound by CPU work and more lanes cannot help; well under it, the lanes wait);
* the groups that hold the most (a group runs in one lane: ``tests/lanes.py``), with CPU / wall;
* the slowest tests (wall, CPU of the process tree, the machine's busy cores meanwhile, lane);
* one ``OVER BUDGET`` line per tier whose test-seconds exceed its budget.

    python .ci/timing_report.py DIR [--slowest 25] [--budgets .ci/budgets.json]

Exit status 0 even when a tier is over its budget (the line says so; the 90-minute limit is CI's own), 2 when
DIR holds no record. Standard library only: it runs after the tests, with any Python.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_records(directory: Path) -> list[dict]:
    """Every record of every ``*.jsonl`` file in ``directory`` (lines that are not JSON are skipped)."""
    out = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def load_budgets(path: Path) -> dict[str, float]:
    """Tier -> budget in test-seconds, from ``path`` (``{"tiers": {"unit": 150, ...}}``); {} when missing."""
    try:
        return {k: float(v) for k, v in json.loads(path.read_text())["tiers"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def tier_table(records: list[dict], budgets: dict[str, float]) -> tuple[list[str], list[str]]:
    """The per-tier lines and the over-budget lines."""
    by_tier: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_tier[r["tier"]].append(r)
    lines = [f"{'tier':<18} {'tests':>6} {'test-s':>9} {'cpu-s':>9} {'span-s':>8} {'budget-s':>9}"]
    over = []
    for tier in sorted(by_tier, key=lambda t: -sum(r["wall"] for r in by_tier[t])):
        rs = by_tier[tier]
        wall = sum(r["wall"] for r in rs)
        cpu = sum(r["cpu"] for r in rs)
        span = max(r["start"] + r["wall"] for r in rs) - min(r["start"] for r in rs)
        budget = budgets.get(tier)
        lines.append(f"{tier:<18} {len(rs):>6} {wall:>9.0f} {cpu:>9.0f} {span:>8.0f} "
                     f"{budget if budget is not None else '-':>9}")
        if budget is not None and wall > budget:
            over.append(f"OVER BUDGET: tier {tier} took {wall:.0f} test-seconds, its budget is {budget:.0f} "
                        f"(.ci/budgets.json; docs/performance.md 'CI time')")
    return lines, over


def lanes(records: list[dict]) -> list[str]:
    """One line: each lane's (worker's) summed wall seconds, and the machine's busy cores over all tests,
    weighted by their wall time."""
    per: dict[str, float] = defaultdict(float)
    for r in records:
        per[r["worker"]] += r["wall"]
    wall = sum(per.values())
    busy = sum(r["wall"] * r["machine_busy_cores"] for r in records) / wall if wall else 0.0
    return [", ".join(f"lane {w.replace('gw', '')} {s:.0f} s" for w, s in sorted(per.items()))
            + f"; the machine's busy cores {busy:.2f} on average"]


def groups(records: list[dict], n: int) -> list[str]:
    """The ``n`` groups with the most wall time (a record's ``group``, else its module): tests, wall, CPU of
    the tests' process trees and their ratio (a Slurm job's processes are slurmd's, not in it)."""
    by: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in records:
        g = by[r.get("group") or r["nodeid"].split("::")[0]]
        g[0] += 1
        g[1] += r["wall"]
        g[2] += r["cpu"]
    out = [f"{'tests':>6} {'wall-s':>8} {'cpu-s':>8} {'cpu/wall':>8}  group"]
    for name, (k, wall, cpu) in sorted(by.items(), key=lambda kv: -kv[1][1])[:n]:
        out.append(f"{k:>6} {wall:>8.0f} {cpu:>8.0f} {cpu / wall if wall else 0.0:>8.2f}  {name}")
    return out


def slowest(records: list[dict], n: int) -> list[str]:
    """The ``n`` slowest tests, one line each."""
    rows = sorted(records, key=lambda r: -r["wall"])[:n]
    out = [f"{'wall-s':>8} {'cpu-s':>8} {'busy':>5} {'lane':>5}  test"]
    for r in rows:
        mark = "" if r["outcome"] == "passed" else f"  [{r['outcome']}]"
        out.append(f"{r['wall']:>8.1f} {r['cpu']:>8.1f} {r['machine_busy_cores']:>5.2f} "
                   f"{r['worker'].replace('gw', ''):>5}  {r['nodeid']}{mark}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--slowest", type=int, default=25)
    p.add_argument("--budgets", type=Path, default=HERE / "budgets.json")
    a = p.parse_args(argv)
    records = load_records(a.directory)
    if not records:
        print(f"timing_report: no test records in {a.directory}", file=sys.stderr)
        return 2
    tiers, over = tier_table(records, load_budgets(a.budgets))
    span = max(r["start"] + r["wall"] for r in records) - min(r["start"] for r in records)
    print(f"\n== time per tier ({len(records)} tests, {span:.0f} s from the first test's start to the last's end;"
          f" test-s sums both lanes) ==")
    print("\n".join(tiers))
    print("\n".join(lanes(records)))
    print("\n== the groups that hold the most (each runs in one lane) ==")
    print("\n".join(groups(records, 12)))
    print(f"\n== the {a.slowest} slowest tests (busy: the machine's busy cores meanwhile) ==")
    print("\n".join(slowest(records, a.slowest)))
    for line in over:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
