"""On-policy distillation on real processes (issue #14 point 1): a local ``hpcrl run`` whose teacher is served
by its own CPU engine, started, keyed and health-checked like the student's, never weight-synced.

The teacher here is the student's own starting model (a copy of the folder), so at rollout 0 the teacher's
prefill-only log-probs of the student's samples must equal the rollout engine's decode log-probs: the reverse
KL starts at 0 and grows as the student trains away from its start. The teacher's engine is SIGKILLed
mid-run and must be replaced from its folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_loop import REWARD_MODULE
from tests.integration.test_preemption_local import _alive, descendants, steps_done

pytestmark = pytest.mark.integration


def full_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def teacher_engines(proc: subprocess.Popen, teacher: Path) -> list[int]:
    return [p for p in descendants(proc.pid)
            if _alive(p) and "hpcrl.engine.server" in (c := full_cmdline(p)) and str(teacher) in c]


def test_teacher_engine_scores_like_the_rollout_engine_and_is_replaced_when_killed(tmp_path, tiny_model_dir):
    student = shutil.copytree(tiny_model_dir, tmp_path / "student")
    teacher = shutil.copytree(tiny_model_dir, tmp_path / "teacher")
    (tmp_path / "loop_rewards.py").write_text(REWARD_MODULE)
    steps = 20
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
run: {{name: opd, output_dir: {tmp_path / 'runs'}, num_rollout: {steps}, seed: 3}}
model: {{path: {student}}}
data: {{source: addition, num_train: 500, num_eval: 16}}
rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, eval_interval: 0, router: false,
          reward_function: loop_rewards.digit_fraction,
          heartbeat_interval_s: 1, heartbeat_timeout_s: 3, max_engine_restarts: 3}}
train: {{lr: 3.0e-3, micro_batch_size: 16}}
algorithm: {{opd: {{coef: 1.0, teachers: [{{name: same, path: {teacher}}}]}}}}
checkpoint: {{save_interval: 0, keep_last: 1}}
""")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hpcrl", "run", str(cfg)], cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    run_dir = tmp_path / "runs" / "opd"
    deadline = time.monotonic() + 300
    while steps_done(run_dir) < 5 or not teacher_engines(proc, teacher):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.05)
    victim = teacher_engines(proc, teacher)[0]
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, log.read_text(errors="replace")[-3000:]

    rows = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["step"] >= 0]
    assert len(rows) == steps
    # rollout 0: the teacher is the student, so its prefill log-probs equal the rollout's decode log-probs
    assert abs(rows[0]["rollout/opd_reverse_kl"]) < 1e-4, rows[0]
    assert abs(rows[0]["train/opd_reverse_kl"]) < 1e-4, rows[0]
    # the student trains away from the teacher (lr 3e-3 on a digit-fraction reward)
    assert rows[-1]["rollout/opd_reverse_kl"] > 1e-3, [r["rollout/opd_reverse_kl"] for r in rows]
    assert all(r["rollout/opd_teacher_seconds"] > 0 for r in rows)
    # the teacher's engine logs in its own folder, and the killed one was replaced from the teacher folder
    attempt = run_dir / "logs" / "attempt-0"
    assert (attempt / "teacher-same" / "engine-0.log").is_file()
    assert len(list((attempt / "teacher-same").glob("engine-0.restart-*.log"))) == 1
    assert not list(attempt.glob("engine-0.restart-*.log"))  # the student's engine was not touched
    assert not _alive(victim)
