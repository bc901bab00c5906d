"""`hpcrl run` stopping on an error it knows prints one line naming the cause and the attempt log that holds the
traceback, and exits non-zero; an unexpected error keeps its traceback (hpcrl.errors). Real runs of the tiny
model: the engine, the router and the Megatron trainer are the real ones."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import hpcrl_process
from tests.integration.run_utils import trainer_ranks

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

PLUGINS = '''
def broken_reward(args, sample):
    return 1 / 0

def zero_reward(args, sample):
    return 0.0

def stall_from_step_1(args, sample):
    import time
    if sample.rollout_id >= 1:  # the controller stalls in its reward: the other rank waits in the broadcast
        time.sleep(300)
    return 0.0
'''


def hpcrl_run(tmp_path: Path, name: str, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`hpcrl run` of a tiny config (forked from this test process's fork server: the same command line and exit
    as a new interpreter's, without ~4 CPU-seconds of imports, :mod:`tests.hpcrl_process`); stdout+stderr in
    `.log` (a file: helpers keep pipes open)."""
    args, env, log = run_command(tmp_path, name, *overrides)
    out = subprocess.CompletedProcess(args, hpcrl_process.run_hpcrl(args, cwd=tmp_path, env=env, log=log,
                                                                    timeout=timeout))
    out.log = log.read_text()
    return out


def run_command(tmp_path: Path, name: str, *overrides: str) -> tuple[list[str], dict, Path]:
    """The arguments of ``hpcrl``, environment and log file of :func:`hpcrl_run` (its config and plug-ins
    written)."""
    (tmp_path / "err_plugins.py").write_text(PLUGINS)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent(f"""
        run: {{name: {name}, output_dir: {tmp_path / 'runs'}, num_rollout: 1, seed: 3}}
        model: {{path: {tmp_path / 'tiny'}, create: tiny-qwen2, tiny_hidden_size: 32, tiny_num_layers: 1,
                tiny_intermediate_size: 64}}
        data: {{source: addition, num_train: 50, num_eval: 4}}
        sft: {{enabled: false}}
        rollout: {{batch_size: 2, n_samples_per_prompt: 2, max_new_tokens: 3, eval_interval: 0}}
        train: {{micro_batch_size: 4}}
    """))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")
    return ["run", str(cfg), *overrides], env, tmp_path / f"{name}.log"


def one_error_line(out, tmp_path: Path, name: str, cause: str) -> Path:
    """The run's output has exactly one `hpcrl run: error: <cause>...; traceback in <log>` line and no traceback;
    returns the log, which holds the traceback."""
    assert out.returncode != 0, out.log[-3000:]
    assert "Traceback" not in out.log and "[rank" not in out.log, out.log[-3000:]
    lines = [x for x in out.log.splitlines() if x.startswith("hpcrl run: error: ")]
    assert len(lines) == 1, out.log[-3000:]
    m = re.fullmatch(r"hpcrl run: error: (.+); traceback in (\S+)", lines[0])
    assert m and m.group(1).startswith(cause), lines[0]
    log = tmp_path / m.group(2)
    assert re.fullmatch(rf"runs/{name}/logs/attempt-\d+/trainer\.log", m.group(2)), m.group(2)
    assert "Traceback (most recent call last)" in log.read_text()
    return log


def test_a_stalled_controller_stops_the_run_in_one_line_naming_rank_step_and_phase(tmp_path):
    """Issue #54 point 1, no silent hang: two trainer ranks, the controller stalls in its reward at step 1
    (300 s), so rank 1 waits in the hand-off group for the step's samples. After
    ``train.rollout_wait_timeout_s`` (60 s here: more than rank 1 waits for the controller's engine start and
    step 0 on a loaded 2-core machine, ~20 s; 3 hours by default) rank 1 stops with one line naming itself, the
    step and the phase, and the run ends with it, the finished step 0 checkpointed. The trainer's own bound,
    ``train.collective_timeout_s``, stays the default 600 s: the wait for the controller is not under it. The
    bound: the run ends well before the stall would (300 s) and before the subprocess timeout."""
    import time

    t0 = time.monotonic()
    out = hpcrl_run(tmp_path, "stall", "rollout.reward_function=err_plugins.stall_from_step_1", "run.num_rollout=3",
                    "train.nprocs=2", "train.micro_batch_size=2", "train.rollout_wait_timeout_s=60",
                    "checkpoint.save_interval=1", timeout=300)
    took = time.monotonic() - t0
    one_error_line(out, tmp_path, "stall", "CollectiveTimeout: trainer rank 1 waited more than 60 s "
                   "(train.rollout_wait_timeout_s) for the controller (rank 0) in a collective of step 1 (the "
                   "rollout's samples sent to every rank)")
    assert out.returncode == 1 and "last checkpoint (iter_0000000)" in out.log, out.log[-2000:]
    assert took < 250, took  # not the stall's 300 s


def test_a_stalled_trainer_rank_stops_the_controller_after_the_collective_timeout(tmp_path):
    """Issue #54 point 1 from the other side: trainer rank 1 stalls (SIGSTOP, as a hung process) once step 0
    is logged, and the controller waits for it in a trainer collective (the training step's gradient
    reduction, the hand-off of the next step's samples or the step's end, depending on where rank 1 stopped).
    After ``train.collective_timeout_s`` (20 s here) the controller stops with one line naming itself and the
    step, while ``train.rollout_wait_timeout_s`` stays its 3-hour default: the controller's side of the hand-off
    waits only the trainer's bound. Rank 1 is let go (SIGCONT) once the controller has exited, so that the
    launcher's SIGTERM ends it. Bound: the run ends within the subprocess timeout (300 s), far under the
    hand-off's 3 hours."""
    import signal
    import time

    import psutil

    cmd, env, log = run_command(tmp_path, "hung", "run.num_rollout=50", "train.nprocs=2", "train.micro_batch_size=2",
                                "train.collective_timeout_s=20", "checkpoint.save_interval=0")
    metrics = tmp_path / "runs" / "hung" / "metrics.jsonl"
    proc = hpcrl_process.popen_hpcrl(cmd, cwd=tmp_path, env=env, log=log)
    try:
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and any(json.loads(x)["step"] >= 0 for x in metrics.read_text().split(
                "\n") if x.strip())):  # step 0 logged: both ranks are in the loop
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        workers = trainer_ranks(proc.pid)
        assert len(workers) == 2, workers  # trainer ranks 0 and 1, started in rank order
        rank0, rank1 = workers
        rank1.send_signal(signal.SIGSTOP)
        while rank0.is_running() and rank0.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline + 60, log.read_text()[-3000:]
            time.sleep(0.5)
        rank1.send_signal(signal.SIGCONT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            for c in psutil.Process(proc.pid).children(recursive=True):
                c.send_signal(signal.SIGCONT)
                c.kill()
            proc.kill()
    out = subprocess.CompletedProcess(cmd, proc.returncode)
    out.log = log.read_text()
    one_error_line(out, tmp_path, "hung", "CollectiveTimeout: trainer rank 0 waited more than 20 s "
                   "(train.collective_timeout_s) for the other ranks in a collective of step ")
    assert out.returncode == 1, out.log[-2000:]


def bad_data(tmp_path: Path) -> Path:
    f = tmp_path / "bad.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8))
                 + "{not json\n")
    return f


def test_data_error_in_process_and_in_local_workers(tmp_path):
    f = bad_data(tmp_path)
    out = hpcrl_run(tmp_path, "data1", f"data.source={f}")
    one_error_line(out, tmp_path, "data1", f"DataError: {f}:9: bad JSON")
    assert out.returncode == 2
    # two local trainer processes: no worker traceback, no [rank0] noise, the same one line
    out = hpcrl_run(tmp_path, "data2", f"data.source={f}", "train.nprocs=2", "train.micro_batch_size=2")
    log = one_error_line(out, tmp_path, "data2", f"DataError: {f}:9: bad JSON")
    assert out.returncode == 2 and "train_main" in log.read_text()
    assert not list((tmp_path / "runs" / "data2" / "logs").glob(".worker-*"))


def test_missing_model_folder(tmp_path):
    out = hpcrl_run(tmp_path, "nomodel", f"model.path={tmp_path / 'absent'}", "model.create=")
    assert out.returncode == 2 and "Traceback" not in out.log
    assert out.log.strip().splitlines() == [f"config error: model.path={str(tmp_path / 'absent')!r}: no such "
                                            "model folder; fix the path, or set model.create=tiny-qwen2 / "
                                            "tiny-qwen3-moe / tiny-glm4-moe / tiny-deepseek-v3 / gguf to create "
                                            "it"]


def test_engine_that_cannot_start(tmp_path):
    out = hpcrl_run(tmp_path, "noengine", "sglang.max_running_requests=0")
    log = one_error_line(out, tmp_path, "noengine", "ProcessStartError: engine")
    assert out.returncode == 1
    assert (log.parent / "engine-0.log").is_file()


def test_filter_that_keeps_no_group(tmp_path):
    """A starting model whose every sample gets the same reward (a random model, reward 0 everywhere): the
    dynamic filter keeps no group, so there is nothing to train on; one line saying why and what to do."""
    out = hpcrl_run(tmp_path, "starved", "rollout.reward_function=err_plugins.zero_reward",
                    "rollout.dynamic_filter=nonzero_std")
    one_error_line(out, tmp_path, "starved",
                   "FilterStarved: rollout 0: the dynamic filter kept 0 of 64 groups (needed 2); every "
                   "group's samples got equal rewards from the starting model (e.g. it solves none: "
                   "warm-start it with SFT)")
    assert out.returncode == 1


def test_unreadable_checkpoint_then_unexpected_error(tmp_path):
    out = hpcrl_run(tmp_path, "ckpt")
    assert out.returncode == 0, out.log[-3000:]
    state = next((tmp_path / "runs" / "ckpt" / "checkpoints").glob("iter_*")) / "state.json"
    state.write_bytes(b"\0" * state.stat().st_size)  # same size: passes the listing check, cannot be parsed
    out = hpcrl_run(tmp_path, "ckpt", "run.num_rollout=2")
    one_error_line(out, tmp_path, "ckpt", f"CheckpointError: {state.parent}: unreadable state.json (")
    assert out.returncode == 1

    # an unexpected error (a reward plug-in that divides by zero) keeps its traceback on the terminal
    out = hpcrl_run(tmp_path, "zero", "rollout.reward_function=err_plugins.broken_reward")
    assert out.returncode != 0
    assert "Traceback (most recent call last)" in out.log and "ZeroDivisionError" in out.log
    assert "hpcrl run: error:" not in out.log


def test_slurm_entry_prints_one_line(tmp_path):
    """The job's entry (what `hpcrl run-slurm` and submitit's SlurmEntry run in the allocation), outside Slurm:
    one trainer task. A bad data row: one line on stderr (the job's .err log), the traceback in the attempt."""
    from hpcrl.config import load_config
    from hpcrl.validate import save_resolved

    f = bad_data(tmp_path)
    run_dir = tmp_path / "runs" / "job"
    cfg = load_config(None, [f"run.name=job", f"run.output_dir={tmp_path / 'runs'}", f"data.source={f}",
                             f"model.path={tmp_path / 'tiny'}", "model.create=tiny-qwen2", "model.tiny_hidden_size=32",
                             "model.tiny_num_layers=1", "sft.enabled=false", "data.num_eval=2"])
    save_resolved(cfg, run_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "hpcrl", "run-slurm", str(run_dir / "config.yaml")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600,
                         env=dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = [x for x in out.stderr.splitlines() if x.startswith("hpcrl job: error: ")]
    assert lines == [f"hpcrl job: error: DataError: {f}:9: bad JSON (Expecting property name enclosed in double "
                     "quotes at column 2); each line must be one JSON object (or set data.on_bad_row: skip); "
                     "traceback in runs/job/logs/attempt-0/trainer.log"], out.stderr[-3000:]
    assert "DataError" in (run_dir / "logs" / "attempt-0" / "trainer.log").read_text()
