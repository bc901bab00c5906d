"""Preemption exactness without Slurm (issue #5 points 1-3): a local `hpcrl run` that gets USR2, or is
SIGKILLed, and is run again ends with weights bitwise equal to an uninterrupted run, and every sample was
trained exactly once (from the HDF5 data buffer of the last checkpoint). Deterministic settings
(``run.deterministic``: one request at a time in the engine, deterministic torch).

The run over-samples (12 groups submitted for 4, nonzero-std filter), so the data source holds back finished
and aborted groups between steps: they must survive the restart through ``buffer.h5``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.hpcrl_process import popen_hpcrl

from tests.integration.run_utils import trainer_ranks
from tests.integration.test_loop import REWARD_MODULE

pytestmark = pytest.mark.integration

STEPS = 8


def write_config(tmp_path: Path) -> Path:
    """``tmp_path/run.yaml`` (runs under ``tmp_path/runs``) and the reward module it names."""
    (tmp_path / "loop_rewards.py").write_text(REWARD_MODULE)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
run: {{name: x, output_dir: {tmp_path / 'runs'}, num_rollout: {STEPS}, seed: 7, deterministic: true}}
model: {{path: {tmp_path / 'tiny'}, create: tiny-qwen2, tiny_hidden_size: 64, tiny_num_layers: 2}}
data: {{source: addition, num_train: 200, num_eval: 16}}
rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, over_sampling_batch_size: 12,
          dynamic_filter: nonzero_std, reward_function: loop_rewards.digit_fraction, eval_interval: 0}}
train: {{lr: 1.0e-3, micro_batch_size: 8}}
checkpoint: {{save_interval: 0, keep_last: 2}}
""")
    return cfg


def start(tmp_path: Path, name: str, *overrides: str, threads: int = 1, curves: bool = False,
          fork_engines: bool = True) -> subprocess.Popen:
    """``hpcrl run`` of :func:`write_config`'s run as ``run.name=name`` with ``threads`` torch threads in the
    trainer and the engine (``OMP_NUM_THREADS``; the float result depends on it on some CPUs) and, with
    ``curves``, its curves.png (the suite's runs skip it); ``fork_engines`` False: the engine started with
    ``subprocess`` (``HPCRL_ENGINE_FORK=0``), not forked (:mod:`hpcrl.fork_server`); output in
    ``tmp_path/<name>.log``."""
    cfg = write_config(tmp_path)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS=str(threads), HPCRL_CURVES="1" if curves else "0",
               HPCRL_ENGINE_FORK="1" if fork_engines else "0")
    # a file: torch's shm manager keeps pipes open
    return popen_hpcrl(["run", str(cfg), f"run.name={name}", *overrides], cwd=tmp_path, env=env,
                       log=tmp_path / f"{name}.log")


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _alive(pid: int) -> bool:
    try:  # a zombie has been killed; only its parent's wait() is missing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def full_cmdline(pid: int) -> str:
    """The whole command line of ``pid`` ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """PIDs of every live process below ``pid`` (from /proc)."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p in pids if _ppid(p) in frontier}
        out.extend(frontier)
    return out


def kill_and_expect_gone(proc: subprocess.Popen, children: list[int], within_s: float) -> None:
    """SIGKILL ``proc`` (the ``hpcrl run`` launcher) and assert that none of ``children`` (its descendants)
    is alive ``within_s`` seconds later."""
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + within_s
    while (left := [p for p in children if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the killed run outlived it: {[full_cmdline(p) for p in left]}"


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"step": -1' not in line)


def wait_steps(proc: subprocess.Popen, run_dir: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(run_dir) < n:
        assert proc.poll() is None, f"run ended early with {proc.returncode}"
        assert time.monotonic() < deadline, f"no {n} steps in {timeout} s"
        time.sleep(0.05)


def finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    return proc.wait(timeout=timeout)


def run_state(run_dir: Path) -> str:
    """The run's STATE as ``hpcrl status`` shows it (no Slurm job: from ``local_run.json``)."""
    from hpcrl.slurm.state import collect_status

    return collect_status([run_dir], lambda argv: None)[0].state


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def weights(tmp_path: Path, name: str) -> dict:
    """The weights of run ``name``'s newest checkpoint, exported to HF by what ``hpcrl convert mcore-to-hf RUN
    DIR`` runs (``convert_run_checkpoint``), in this process: a subprocess per export paid the imports of torch,
    megatron-core and transformers each time (the command line itself is tested in tests/integration/test_loop.py
    and test_checkpoint.py). Exporting copies tensors, no arithmetic: thread counts do not matter here."""
    from safetensors.torch import load_file

    from hpcrl.convert import convert_run_checkpoint

    hf = tmp_path / f"{name}-hf"
    saved = {k: os.environ.pop(k) for k in DIST_VARS if k in os.environ}  # a world of 1 on a free port
    try:
        convert_run_checkpoint(tmp_path / "runs" / name, hf)
    finally:
        os.environ.update(saved)
    out = {}
    for f in sorted(hf.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def trained(tmp_path: Path, name: str, steps: int = STEPS) -> np.ndarray:
    """The trained-sample rows ``[n, 3]`` (rollout id, group index, sample index) of the finished run ``name``,
    from its last checkpoint's ``buffer.h5`` (asserted to be that of step ``steps - 1``)."""
    from hpcrl.checkpoint import find_latest_checkpoint
    from hpcrl.data.buffer import BUFFER_FILE, read_buffer

    ckpt = find_latest_checkpoint(tmp_path / "runs" / name)
    assert ckpt is not None and ckpt.name == f"iter_{steps - 1:07d}"
    return read_buffer(ckpt / BUFFER_FILE)[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its exported weights and trained-sample rows."""
    tmp = tmp_path_factory.mktemp("preempt-ref")
    proc = start(tmp, "ref")
    assert finish(proc) == 0, (tmp / "ref.log").read_text()[-3000:]
    rows = trained(tmp, "ref")
    assert rows.shape == (STEPS * 16, 3) and sorted(rows[:, 0].tolist()) == sorted(list(range(STEPS)) * 16)
    assert len(set(rows[:, 2].tolist())) == len(rows)  # each sample once
    groups = {}
    for _, g, _ in rows.tolist():
        groups[g] = groups.get(g, 0) + 1
    assert set(groups.values()) == {4}  # whole groups, each trained once
    return tmp, weights(tmp, "ref"), rows


def engine_parent(proc: subprocess.Popen) -> str:
    """The command line of the parent of the run's engine (the one live ``hpcrl.engine.server``)."""
    engines = [p for p in descendants(proc.pid) if _alive(p) and "hpcrl.engine.server" in full_cmdline(p)]
    assert len(engines) == 1, [full_cmdline(p) for p in descendants(proc.pid)]
    return full_cmdline(_ppid(engines[0]))


def test_usr2_checkpoints_at_the_step_boundary_and_resumes_exactly(tmp_path, reference):
    """The first part runs its engine as a ``subprocess`` (``HPCRL_ENGINE_FORK=0``), the rerun and the reference
    fork theirs (:mod:`hpcrl.fork_server`): the two ways generate the same tokens and log-probs, or the
    resumed weights would differ from the reference's."""
    ref_dir, ref_weights, ref_rows = reference
    proc = start(tmp_path, "usr2", fork_engines=False)
    run_dir = tmp_path / "runs" / "usr2"
    wait_steps(proc, run_dir, 3)
    assert "hpcrl engine fork server" not in engine_parent(proc)
    assert run_state(run_dir) == "RUNNING"  # hpcrl status of a live local run
    os.kill(proc.pid, signal.SIGUSR2)
    assert finish(proc) == 75, (tmp_path / "usr2.log").read_text()[-3000:]  # stopped early, resumable
    assert run_state(run_dir) == "STOPPED"
    log = (tmp_path / "usr2.log").read_text()
    assert "stopping after rollout" in log and "(signal)" in log
    done = steps_done(run_dir)
    assert 3 <= done < STEPS
    from hpcrl.checkpoint import find_latest_checkpoint

    assert find_latest_checkpoint(run_dir).name == f"iter_{done - 1:07d}"  # saved at the step it stopped
    assert all(p.poll() is not None for p in [proc])
    proc = start(tmp_path, "usr2")  # the same command again: it resumes, no flag needed
    assert finish(proc) == 0, (tmp_path / "usr2.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "usr2.log").read_text()
    assert steps_done(run_dir) == STEPS  # metrics: one line per step, none repeated
    assert run_state(run_dir) == "COMPLETED"
    np.testing.assert_array_equal(trained(tmp_path, "usr2"), ref_rows)
    got = weights(tmp_path, "usr2")
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "resumed run diverged"


def test_sigkill_then_rerun_resumes_exactly(tmp_path, reference):
    """SIGKILL loses the steps since the last checkpoint (save_interval 1 here); the rerun redoes them exactly.
    No process of the killed run outlives it (engine, megatron-core's forked checkpoint writers)."""
    _, ref_weights, ref_rows = reference
    run_dir = tmp_path / "runs" / "kill"
    proc = start(tmp_path, "kill", "checkpoint.save_interval=1")
    wait_steps(proc, run_dir, 2)
    time.sleep(random.Random(0).uniform(0.0, 0.5))  # somewhere inside a later step
    children = descendants(proc.pid)
    assert children, "the run has no child processes (engine)?"
    assert engine_parent(proc).startswith("hpcrl engine fork server")  # a run forks its CPU engine
    kill_and_expect_gone(proc, children, 15)  # the fork server and its engine too
    assert run_state(run_dir) == "FAILED"  # died without recording an outcome
    proc = start(tmp_path, "kill", "checkpoint.save_interval=1")
    assert finish(proc) == 0, (tmp_path / "kill.log").read_text()[-3000:]
    np.testing.assert_array_equal(trained(tmp_path, "kill"), ref_rows)
    got = weights(tmp_path, "kill")
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "resumed run diverged"


def test_resume_at_an_epoch_boundary_neither_skips_nor_repeats(tmp_path):
    """8 prompts, 4 per step, no over-sampling: every even checkpoint ends an epoch exactly (offset == number
    of items). A run killed after such a checkpoint and rerun trains every prompt exactly once per epoch, the
    epochs in order (veRL #7401 skipped the tail of an epoch on resume)."""
    args = ("data.num_train=8", "rollout.over_sampling_batch_size=4", "rollout.dynamic_filter=null",
            "checkpoint.save_interval=2")
    run_dir = tmp_path / "runs" / "epochs"
    proc = start(tmp_path, "epochs", *args)
    wait_steps(proc, run_dir, 3)
    proc.kill()
    proc.wait()
    from hpcrl.checkpoint import find_latest_checkpoint

    ckpt = find_latest_checkpoint(run_dir)
    assert ckpt is not None and int(ckpt.name[5:]) % 2 == 1  # after step 1 or 3: the end of epoch 0 or 1
    proc = start(tmp_path, "epochs", *args)
    assert finish(proc) == 0, (tmp_path / "epochs.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "epochs.log").read_text()
    rows = trained(tmp_path, "epochs")
    by_step: dict[int, set] = {}
    for step, group, _ in rows.tolist():
        by_step.setdefault(step, set()).add(group)
    for epoch in range(STEPS // 2):
        groups = by_step[2 * epoch] | by_step[2 * epoch + 1]
        assert sorted(groups) == list(range(8 * epoch, 8 * epoch + 8)), (epoch, sorted(groups))


def test_a_killed_launcher_takes_its_trainer_ranks_and_engine_with_it(tmp_path):
    """Two trainer ranks (``train.nprocs=2``, data parallel): their processes are the launcher's (forked by its
    fork server), and rank 0's engine is theirs. SIGKILL of the launcher (as ``kill -9``, or an OOM kill) leaves none of them:
    the fork server dies with the launcher and the ranks with it (``PR_SET_PDEATHSIG``), the engine with rank 0. Before, the ranks ran on
    as orphans, holding the cores, the engine's port and the run folder."""
    run_dir = tmp_path / "runs" / "orphans"
    # steps enough that the run cannot end by itself while the test waits (a 50-step run once ended within the
    # 30 s and hid that the ranks outlived their launcher)
    proc = start(tmp_path, "orphans", "train.nprocs=2", "run.num_rollout=100000")
    wait_steps(proc, run_dir, 1)
    children = descendants(proc.pid)
    ranks = trainer_ranks(proc.pid)
    assert len(ranks) == 2 and {r.pid for r in ranks} <= set(children) and any("hpcrl.engine.server" in full_cmdline(p) for p in children), \
        [full_cmdline(p) for p in children]
    kill_and_expect_gone(proc, children, 30)
    assert "hpcrl.loop INFO done" not in (tmp_path / "orphans.log").read_text()
