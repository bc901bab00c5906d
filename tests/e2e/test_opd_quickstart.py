"""On-policy distillation end to end, shortened (issue #14 point 1): ``configs/opd-quickstart.yaml`` as a user
runs it, with both models taken from the session's quickstart instead of two more SFT runs.

The student is the quickstart's SFT warm start (about 40% greedy; the config's own student SFT, stopped at 10%,
is a plain warm start that the quickstart and the SFT tests already cover, and it took 161 of this test's 226 s
on an AVX2 EPYC); the teacher is the quickstart's GRPO-trained model, exported with ``hpcrl convert
mcore-to-hf`` (about 75% greedy). Asserted: the reverse KL to the teacher falls over the run, the trainer's and
the engine's estimates of it agree, and the student's greedy accuracy rises by at least :data:`MIN_GAIN` in
:data:`STEPS` steps. The full curve (a 10% student, a 60% teacher, 500 steps) is in docs/performance.md
("On-policy distillation").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HPCRL = Path(sys.executable).with_name("hpcrl")
STEPS = 60
MIN_GAIN = 0.05
"""Greedy accuracy points the student must gain in :data:`STEPS` steps. Measured 2026-11-29 on an AVX2 EPYC with
this suite's own models (student 0.406, teacher 0.744): 0.406 -> 0.471 at step 29 -> 0.626 at step 59 (+22),
the reverse KL 0.34 -> 0.10 nats (means of the first and last 10 steps); the eval of ~450 problems has about 2
points of noise. The quickstart's own test guarantees a gap of only >= 15 points between the two on any CPU
(its RL ends >= 15 points over its SFT start), so the gate asks a third of that, not the two thirds seen here.
(From the 10% student of the config: 0.210 -> 0.343 at step 59, 2026-11-26.)"""


def run(args: list[str], cwd: Path, log: Path, timeout: int = 1200) -> int:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "wb") as out:
        return subprocess.run([str(HPCRL), *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode


@pytest.mark.slow
def test_opd_quickstart_student_moves_towards_its_teacher(quickstart_run, tmp_path):
    assert quickstart_run.returncode == 0, quickstart_run.output[-3000:]
    student = shutil.copytree(quickstart_run.sft_model, tmp_path / "student")
    teacher = tmp_path / "teacher"
    assert run(["convert", "mcore-to-hf", str(quickstart_run.folder / "runs" / "quickstart"), str(teacher)],
               tmp_path, tmp_path / "convert.log") == 0, (tmp_path / "convert.log").read_text()[-2000:]
    shutil.copy(ROOT / "configs" / "opd-quickstart.yaml", tmp_path / "opd.yaml")
    rc = run(["run", "opd.yaml", f"model.path={student}", "sft.enabled=false", f"run.num_rollout={STEPS}",
              f"rollout.eval_interval={STEPS // 2}", f"algorithm.opd.teachers=[{{name: strong, path: {teacher}}}]"],
             tmp_path, tmp_path / "out.log")
    assert rc == 0, (tmp_path / "out.log").read_text(errors="replace")[-3000:]

    rows = [json.loads(x) for x in (tmp_path / "runs" / "opd-quickstart" / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], round(r["eval/accuracy"], 3)) for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if r["step"] >= 0]
    kl = [r["rollout/opd_reverse_kl"] for r in steps]
    print(f"opd: student eval {curve}; reverse KL first 10 {sum(kl[:10]) / 10:.3f}, last 10 {sum(kl[-10:]) / 10:.3f}")
    assert len(steps) == STEPS
    assert sum(kl[-10:]) / 10 < sum(kl[:10]) / 10, kl
    # the same per-sample token mean on both sides: only the trainer's and the engine's log-probs differ (~1e-6)
    assert all(r["train/opd_reverse_kl"] == pytest.approx(r["rollout/opd_reverse_kl"], abs=1e-3) for r in steps)
    start, end = curve[0][1], curve[-1][1]
    assert end >= start + MIN_GAIN, curve
