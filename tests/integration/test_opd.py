"""On-policy distillation on real processes (issue #14 point 1): a local ``hpcrl run`` whose teacher is served
by its own CPU engine, started, keyed and health-checked like the student's, never weight-synced.

The teacher here is the student's own starting model (a copy of the folder), so at rollout 0 the teacher's
prefill-only log-probs of the student's samples must equal the rollout engine's decode log-probs: the reverse
KL starts at 0 and grows as the student trains away from its start. The teacher's engine is SIGKILLed
mid-run and must be replaced from its folder. On the local Slurm cluster the teacher's engine runs as its own
rollout job step.
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

from tests.hpcrl_process import popen_hpcrl

from tests.integration.test_loop import REWARD_MODULE
from tests.integration.test_preemption_local import _alive, descendants, full_cmdline, steps_done

pytestmark = pytest.mark.integration


def teacher_engines(proc: subprocess.Popen, teacher: Path) -> list[int]:
    return [p for p in descendants(proc.pid)
            if _alive(p) and "hpcrl.engine.server" in (c := full_cmdline(p)) and str(teacher) in c]


def write_run(tmp_path: Path, tiny_model_dir: Path, steps: int) -> tuple[Path, Path]:
    """``tmp_path/run.yaml``: a short OPD run whose teacher (``tmp_path/teacher``) is a copy of the student's
    starting model (``tmp_path/student``); returns ``(config, teacher folder)``."""
    student = shutil.copytree(tiny_model_dir, tmp_path / "student")
    teacher = shutil.copytree(tiny_model_dir, tmp_path / "teacher")
    (tmp_path / "loop_rewards.py").write_text(REWARD_MODULE)
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
    return cfg, teacher


def assert_teacher_scored(run_dir: Path, steps: int) -> list[dict]:
    """Rollout 0: the teacher is the student, so its prefill log-probs equal the rollout's decode log-probs (and
    the trainer's); the student then trains away from it. Returns the step rows."""
    rows = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["step"] >= 0]
    assert len(rows) == steps
    assert abs(rows[0]["rollout/opd_reverse_kl"]) < 1e-4, rows[0]
    assert abs(rows[0]["train/opd_reverse_kl"]) < 1e-4, rows[0]
    assert rows[-1]["rollout/opd_reverse_kl"] > 1e-3, [r["rollout/opd_reverse_kl"] for r in rows]
    # one reduction on both sides (each sample's token mean, averaged): only the log-probs differ
    assert all(r["train/opd_reverse_kl"] == pytest.approx(r["rollout/opd_reverse_kl"], abs=1e-3) for r in rows), \
        [(r["train/opd_reverse_kl"], r["rollout/opd_reverse_kl"]) for r in rows]
    assert all(r["rollout/opd_teacher_seconds"] > 0 for r in rows)
    return rows


def test_teacher_engine_scores_like_the_rollout_engine_and_is_replaced_when_killed(tmp_path, tiny_model_dir):
    steps = 20
    cfg, teacher = write_run(tmp_path, tiny_model_dir, steps)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    log = tmp_path / "run.log"
    log.write_bytes(b"")
    proc = popen_hpcrl(["run", str(cfg)], cwd=tmp_path, env=env, log=log)
    run_dir = tmp_path / "runs" / "opd"
    deadline = time.monotonic() + 300
    while steps_done(run_dir) < 5 or not teacher_engines(proc, teacher):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.05)
    victim = teacher_engines(proc, teacher)[0]
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, log.read_text(errors="replace")[-3000:]
    assert_teacher_scored(run_dir, steps)
    # the teacher's engine logs in its own folder, and the killed one was replaced from the teacher folder
    attempt = run_dir / "logs" / "attempt-0"
    assert (attempt / "teacher-same" / "engine-0.log").is_file()
    assert len(list((attempt / "teacher-same").glob("engine-0.restart-*.log"))) == 1
    assert not list(attempt.glob("engine-0.restart-*.log"))  # the student's engine was not touched
    assert not _alive(victim)


@pytest.mark.slurm
@pytest.mark.timeout(900)
def submit_and_wait(cwd: Path, *args: str, timeout_s: float = 600) -> tuple[str, Path, str, str]:
    """``hpcrl submit ARGS`` in ``cwd`` on the local cluster, waited for (cancelled whatever happens):
    ``(final state, run folder, tail of the submitit logs, job id)``."""
    from hpcrl.slurm.state import FINAL_STATES, query_states

    out = subprocess.run([str(Path(sys.executable).with_name("hpcrl")), "submit", *args], cwd=cwd,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    job_id, run_dir = words[words.index("job") + 1], Path(words[words.index("job") + 3])
    deadline = time.monotonic() + timeout_s
    try:
        while query_states([job_id])[job_id] not in FINAL_STATES:
            assert time.monotonic() < deadline, f"the job did not finish in {timeout_s:g} s"
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)  # nothing left in the queue, whatever happened
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((run_dir / "submitit").glob("*")))
    return query_states([job_id])[job_id], run_dir, logs, job_id


def test_teacher_engines_run_as_their_own_job_step_on_slurm(tmp_path, tiny_model_dir, slurm_cluster, monkeypatch):
    """``hpcrl submit`` of the same run, colocated on one node: the teacher's engine is a second rollout job
    step (its address file in the teacher's folder of the attempt) and the job completes with the same
    exactness at rollout 0."""
    steps = 8
    write_run(tmp_path, tiny_model_dir, steps)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    state, run_dir, logs, _ = submit_and_wait(tmp_path, "run.yaml", "slurm.cpus_per_task=2", "slurm.time=00:10:00")
    assert state == "COMPLETED", logs
    assert_teacher_scored(run_dir, steps)
    attempt = run_dir / "logs" / "attempt-0"
    teacher = json.loads((attempt / "teacher-same" / "engines" / "engine-0.json").read_text())
    policy = json.loads((attempt / "engines" / "engine-0.json").read_text())
    # the job's one node, whichever Slurm gave it (n2 when n1 was still being released by the test before)
    assert teacher["node"] == policy["node"] and teacher["node"] in slurm_cluster.nodes
