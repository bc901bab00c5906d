"""On-policy distillation end to end, shortened (issue #14 point 1): ``configs/opd-quickstart.yaml`` as a user
runs it, for :data:`STEPS` steps, with its two models taken from the shipped warm starts (``tests/warm_starts``)
instead of two more SFT runs: the student is the quickstart's SFT (about 40% greedy), the teacher the same SFT
recipe run on to 60%. (The config's own pair - a student stopped at 10%, a teacher at 60%, both by its own
recipe - are plain warm starts that the SFT tests cover.) Asserted: the reverse KL to the teacher falls over the
run, the trainer's and the engine's estimates of it agree, and the student's greedy accuracy rises by at least
:data:`MIN_GAIN`. The full curve (500 steps) is in docs/performance.md ("On-policy distillation").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.warm_starts import WARM_STARTS

ROOT = Path(__file__).resolve().parents[2]
HPCRL = Path(sys.executable).with_name("hpcrl")
STEPS = 60
MIN_GAIN = 0.05
"""Greedy accuracy points the student must gain in :data:`STEPS` steps. Measured 2026-12-06 on an AVX2 EPYC in the
CI's lanes (one thread a process), student 0.406, teacher 0.601: 0.406 -> 0.446 at step 29 -> 0.517 at step 59
(+11.1), the reverse KL 0.236 -> 0.045 nats (means of the first and last 10 steps); the eval of ~450 problems
has about 2 points of noise, so the gate asks under half of the gain seen. (With the quickstart's GRPO model,
0.744, as the teacher: +22, 2026-11-29.)"""


def run(args: list[str], cwd: Path, log: Path, timeout: int = 1200) -> int:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "wb") as out:
        return subprocess.run([str(HPCRL), *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode


@pytest.mark.slow
def test_opd_quickstart_student_moves_towards_its_teacher(tmp_path):
    student = shutil.copytree(WARM_STARTS["quickstart"].folder / "tiny-qwen2-addition-sft", tmp_path / "student")
    teacher = shutil.copytree(WARM_STARTS["quickstart-teacher"].folder / "tiny-qwen2-addition-teacher",
                              tmp_path / "teacher")
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
