"""The RL loop end to end on real processes: `hpcrl run` with a real engine, router, Megatron trainer.

A random tiny Qwen2 cannot add, so these runs use a reward that a random model can improve on (the fraction of
digits in its response, a real learning signal) to make gradients non-zero.
"""

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
from tests.integration.run_utils import engine_log

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

REWARD_MODULE = '''
def digit_fraction(args, sample):
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)
'''


def run_hpcrl(tmp_path: Path, name: str, *overrides: str, timeout: int = 600,
              curves: bool = False, one_thread: bool = True) -> subprocess.CompletedProcess:
    """`hpcrl run` as a user runs it (``curves``: with its curves.png); output to a file (shared-memory helpers
    keep pipes open)."""
    (tmp_path / "loop_rewards.py").write_text(REWARD_MODULE)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent(f"""
        run: {{name: {name}, output_dir: {tmp_path / 'runs'}, num_rollout: 3, seed: 7}}
        model: {{path: {tmp_path / 'tiny'}, create: tiny-qwen2, tiny_hidden_size: 64, tiny_num_layers: 2}}
        data: {{source: addition, num_train: 200, num_eval: 16}}
        rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6,
                  reward_function: loop_rewards.digit_fraction, eval_interval: 0}}
        train: {{lr: 1.0e-3, micro_batch_size: 8}}
        checkpoint: {{save_interval: 2, keep_last: 2}}
    """))
    return run_config(tmp_path, cfg, name, *overrides, timeout=timeout, curves=curves, one_thread=one_thread)


def run_config(tmp_path: Path, cfg: Path, name: str, *overrides: str, timeout: int = 600, curves: bool = False,
               one_thread: bool = True):
    """`hpcrl run CFG OVERRIDES` in ``tmp_path`` (on PYTHONPATH, one thread a process unless ``one_thread`` is
    False: then hpcrl picks each process's threads, as for a user who sets none; ``curves``: drawing
    curves.png, which the suite's runs skip), output appended to ``tmp_path/NAME.log``; the CompletedProcess
    with ``.log`` (the whole log text)."""
    log = tmp_path / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", HPCRL_CURVES="1" if curves else "0")
    if not one_thread:
        del env["OMP_NUM_THREADS"]
    args = ["run", str(cfg), *overrides]
    out = subprocess.CompletedProcess(args, hpcrl_process.run_hpcrl(args, cwd=tmp_path, env=env, log=log,
                                                                     timeout=timeout))
    out.log = log.read_text()
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# deterministic mode turns on slime's CI gates inside the trainer (first-step ppo_kl, rollout-0 ref diff)
DETERMINISTIC = ("run.deterministic=true", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.001")


@pytest.fixture(scope="module")
def gates_run(tmp_path_factory):
    """One deterministic run (CI gates on, with a KL loss): checked by the gates test, and the first of the two
    same-seed runs of the bitwise test (the second runs in the same folder, on the same tiny model)."""
    tmp = tmp_path_factory.mktemp("loop-gates")
    out = run_hpcrl(tmp, "gates", *DETERMINISTIC, curves=True)
    assert out.returncode == 0, out.log[-3000:]
    return tmp


def test_loop_runs_with_gates_phases_and_checkpoints(gates_run):
    run_dir = gates_run / "runs" / "gates"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [-1, 0, 1, 2]
    steps = rows[1:]
    for r in steps:
        assert r["train/first_step_ppo_kl"] < 1e-8
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert r["train/grad_norm"] > 0  # a real learning signal
        assert r["rollout/groups_submitted"] >= 4
    # weight versions bump by one per step: rollout i is generated with the weights after step i-1
    assert [r["rollout/weight_version"] for r in steps] == ["0", "1", "2"]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in steps[-1]
    # colocated phase order, one code path with no-op memory adapters on CPU
    phases = [json.loads(x)["phase"] for x in (run_dir / "logs" / "attempt-0" / "phases.jsonl").read_text()
              .splitlines()]
    start = ["offload_engine", "offload_trainer", "onload_engine_weights", "sync", "onload_engine_kv"]
    step = ["generate", "offload_engine", "onload_trainer", "train",
            "offload_trainer", "onload_engine_weights", "sync", "onload_engine_kv"]
    assert phases == start + step * 3
    # ... and as the engine saw it, under SGLang 0.5.23's state rules (hpcrl.engine.state): memory released
    # only when idle, resumed only once released, every sync inside one weight-update session
    events = [m.group(1) for m in re.finditer(r"hpcrl.engine: (released memory .+|resumed memory .+|"
                                               r"weight-update session \w+)$",
                                               engine_log(run_dir / "logs" / "attempt-0"),
                                               re.MULTILINE)]
    sync = ["released memory ['weights', 'kv_cache', 'cuda_graph']", "resumed memory ['weights']",
            "weight-update session opened", "weight-update session closed",
            "resumed memory ['kv_cache', 'cuda_graph']"]
    assert events == sync * 4, events
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["iter_0000001", "iter_0000002"]
    assert (run_dir / "curves.png").exists() and (run_dir / "config.yaml").exists()
    # curves.png draws every series of CURVE_SERIES from the keys this run logged: the KL panel too, since
    # use_kl_loss is on (no on-policy distillation here, no PPO critic), and the trainer vs engine log-prob gap
    import matplotlib.pyplot as plt

    from hpcrl.metrics import CURVE_SERIES, draw_curves

    fig = draw_curves(rows)
    drawn = sorted(line.get_label() for ax in fig.axes for line in ax.get_lines())
    plt.close(fig)
    assert drawn == sorted(s.label for s in CURVE_SERIES
                           if s.key != "train/opd_reverse_kl" and not s.key.startswith("critic/"))
    status = subprocess.run([sys.executable, "-m", "hpcrl", "status", str(run_dir)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert status.stdout.splitlines()[1].split()[:4] == ["gates", "-", "COMPLETED", "3/3"], status.stdout
    assert oct((run_dir / "secret").stat().st_mode & 0o777) == "0o600"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_continues_after_the_last_checkpoint(tmp_path):
    first = run_hpcrl(tmp_path, "resume", "checkpoint.save_interval=1", "run.num_rollout=2")
    assert first.returncode == 0, first.log[-3000:]
    second = run_hpcrl(tmp_path, "resume", "checkpoint.save_interval=1", "run.num_rollout=4")
    assert second.returncode == 0, second.log[-3000:]
    run_dir = tmp_path / "runs" / "resume"
    assert "resumed from" in second.log and "next rollout 2" in second.log
    assert [r["step"] for r in metrics(run_dir)] == [-1, 0, 1, 2, 3]
    assert (run_dir / "logs" / "attempt-1").is_dir()
    # the data source continued: every sample id appears once across both attempts' steps
    state = json.loads((run_dir / "checkpoints" / "iter_0000003" / "state.json").read_text())
    assert state["rollout_id"] == 3 and state["data_source"]["sample_counter"] == 4 * 4 * 4


def test_same_seed_gives_bitwise_identical_weights(gates_run):
    """The gates run and a second run of the same config and seed (both with OMP_NUM_THREADS=1, run_hpcrl's)
    export bitwise-equal weights."""
    from safetensors.torch import load_file

    tmp_path = gates_run
    out = run_hpcrl(tmp_path, "det-b", *DETERMINISTIC)
    assert out.returncode == 0, out.log[-3000:]
    exported = []
    for name in ("gates", "det-b"):
        hf = tmp_path / f"{name}-hf"
        hpcrl_process.check_hpcrl(["convert", "mcore-to-hf", str(tmp_path / "runs" / name), str(hf)], cwd=tmp_path,
                                  log=tmp_path / f"{name}-convert.log")
        tensors = {}
        for f in sorted(hf.glob("*.safetensors")):
            tensors.update(load_file(f))
        exported.append(tensors)
    a, b = exported
    base = load_file(next((tmp_path / "tiny").glob("*.safetensors")))
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a), "two runs with the same seed diverged"
    assert any(not a[k].equal(base[k]) for k in a), "training did not change the weights"
    # the same checkpoint as the block-fp8 folder fp8-rollout engines serve (hpcrl.weights.fp8)
    import torch

    from hpcrl.weights.fp8 import QUANTIZATION_CONFIG, quantize_stream

    fp8 = tmp_path / "gates-fp8"
    hpcrl_process.check_hpcrl(["convert", "mcore-to-hf", str(tmp_path / "runs" / "gates"), str(fp8), "--fp8"],
                              cwd=tmp_path, log=tmp_path / "gates-fp8-convert.log")
    got, want = load_file(fp8 / "model.safetensors"), dict(quantize_stream(a.items()))
    assert got.keys() == want.keys() and any(k.endswith("_scale_inv") for k in got)
    assert all(got[k].dtype == want[k].dtype and got[k].view(torch.uint8).equal(want[k].view(torch.uint8))
               for k in want)
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG


def test_colocated_phases_split_the_cores_between_their_processes(tmp_path):
    """A colocated local run with two trainer ranks and two CPU engines, and no OMP_NUM_THREADS set (as a user
    runs it): each phase has the machine to itself, so each engine takes its half of this machine's CPUs in
    torch threads, not all of them (two engines on 2 cores with 2 threads each made the quickstart's rollout
    step 5.8x slower), and the run trains with data parallelism over its two ranks."""
    out = run_hpcrl(tmp_path, "split", "train.nprocs=2", "rollout.num_engines=2", "rollout.router=false",
                    "run.num_rollout=2", "checkpoint.save_interval=0", one_thread=False)
    assert out.returncode == 0, out.log[-3000:]
    per_engine = max(1, len(os.sched_getaffinity(0)) // 2)
    attempt = tmp_path / "runs" / "split" / "logs" / "attempt-0"
    for i in range(2):
        # with its port-retry logs: an engine whose port was taken between pick and bind starts again elsewhere
        ready = re.findall(r"ready at .* (\d+) torch thread\(s\)", engine_log(attempt, i))
        assert ready == [str(per_engine)], (i, ready)
    rows = metrics(tmp_path / "runs" / "split")
    assert [r["step"] for r in rows if "train/loss" in r] == [0, 1]
