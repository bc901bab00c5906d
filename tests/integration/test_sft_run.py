"""SFT on the Megatron trainer as a run (issue #40 points 1-3, 5): ``run.mode: sft`` through ``hpcrl run`` and
the warm start of an RL run, with the real CPU engine serving the evals.

- An SFT run logs its steps and evals, checkpoints with the demonstrations' position and converts with
  ``hpcrl convert``; stopped by USR2, run again, SIGKILLed inside a later step and run again, it ends with
  weights and every step's loss bitwise equal to the uninterrupted run's.
- The warm start's cache is content-addressed: another seed trains a folder of its own beside the first
  (``sft.output`` links to the newest), once for two runs with its key started together (the other waits for
  the lock), the first seed again is a cache hit; an RL run preempted inside its warm start resumes the SFT
  run and ends with the warm start an uninterrupted one makes, bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.hpcrl_process import popen_hpcrl

from tests.integration.test_preemption_local import finish, steps_done, wait_steps, weights

pytestmark = pytest.mark.integration

STEPS = 8
CONFIG = """\
run: {{name: x, output_dir: {out}, num_rollout: 2, seed: 7, deterministic: true, mode: sft}}
model: {{path: {base}, create: tiny-qwen2, tiny_hidden_size: 64, tiny_num_layers: 2}}
data: {{source: addition, num_train: 400, num_eval: 16}}
sft: {{output: {sft}, steps: {steps}, batch_size: 32, lr: 3.0e-3, eval_interval: 4}}
rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, eval_interval: 0, dynamic_filter: null,
          router: false}}
train: {{lr: 1.0e-4, lr_warmup_steps: 0, micro_batch_size: 8}}
checkpoint: {{save_interval: 0, keep_last: 2}}
"""


def write_config(folder: Path, steps: int = STEPS) -> Path:
    """``folder/run.yaml``: an SFT run of the tiny Qwen2 (hidden 64, 2 layers) on 3-digit addition, batch 32
    in micro-batches of 8, evals every 4 steps; the base model in ``folder/base``, the warm-start cache at
    ``folder/sft`` (for RL runs of the same file with ``run.mode=sync sft.enabled=true``)."""
    cfg = folder / "run.yaml"
    cfg.write_text(CONFIG.format(out=folder / "runs", base=folder / "base", sft=folder / "sft", steps=steps))
    return cfg


def start(folder: Path, command: str, name: str, *overrides: str, curves: bool = False) -> subprocess.Popen:
    """``hpcrl COMMAND run.yaml run.name=NAME OVERRIDES`` in ``folder`` with one torch thread (``curves``: and
    its curves.png, which the suite's runs skip); output appended to ``folder/<name>.log``."""
    cfg = write_config(folder)
    env = dict(os.environ, OMP_NUM_THREADS="1", HPCRL_CURVES="1" if curves else "0")
    return popen_hpcrl([command, str(cfg), f"run.name={name}", *overrides], cwd=folder, env=env,
                       log=folder / f"{name}.log")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in rows(run_dir) if "train/loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted SFT run: its folder, exported weights and metric rows."""
    tmp = tmp_path_factory.mktemp("sft-ref")
    proc = start(tmp, "run", "ref", curves=True)
    assert finish(proc) == 0, (tmp / "ref.log").read_text()[-3000:]
    return tmp, weights(tmp, "ref"), rows(tmp / "runs" / "ref")


def test_sft_run_logs_evaluates_checkpoints_and_converts(reference):
    tmp, ref_weights, ref_rows = reference
    run_dir = tmp / "runs" / "ref"
    train = [r for r in ref_rows if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(STEPS))
    assert train[-1]["train/loss"] < 0.8 * train[0]["train/loss"], [r["train/loss"] for r in train]
    assert all(r["train/tokens"] > 32 and r["train/grad_norm"] > 0 for r in train)
    # evals through the engine: before the first step, every 4 steps and at the last, each after a sync
    assert [r["step"] for r in ref_rows if "eval/accuracy" in r] == [-1, 3, 7]
    assert all("sync/bytes" in r for r in ref_rows if "eval/accuracy" in r and r["step"] >= 0)
    assert (run_dir / "curves.png").stat().st_size > 0
    from hpcrl.checkpoint import find_latest_checkpoint

    ckpt = find_latest_checkpoint(run_dir)
    assert ckpt.name == f"iter_{STEPS - 1:07d}"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["demonstrations"]["offset"] == (STEPS * 32) % 400  # the data position, for the resume
    assert state["demonstrations"]["epoch"] == (STEPS * 32) // 400
    # hpcrl convert's export (weights()) loads in transformers and differs from the base model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp / "ref-hf"))
    base = AutoModelForCausalLM.from_pretrained(str(tmp / "base"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert model.state_dict()[name].equal(ref_weights[name])
    assert not model.state_dict()[name].equal(base.state_dict()[name])


def test_sft_with_lora_trains_the_adapters_alone(tmp_path):
    """``run.mode: sft`` with ``model.lora`` (issue #56 point 2): the loss falls with only the adapters
    training; the export (the adapters merged) differs from the base in the adapted linears and nowhere else."""
    proc = start(tmp_path, "run", "lora", "model.lora={rank: 8, alpha: 16, target_modules: [q_proj, o_proj, "
                 "up_proj, down_proj]}", "sft.lr=1.0e-2")
    assert finish(proc) == 0, (tmp_path / "lora.log").read_text()[-3000:]
    train = losses(tmp_path / "runs" / "lora")
    assert len(train) == STEPS and train[-1][1] < 0.9 * train[0][1], train
    got = weights(tmp_path, "lora")
    from safetensors.torch import load_file

    base = load_file(tmp_path / "base" / "model.safetensors")
    changed = {k for k in got if not got[k].equal(base[k])}
    assert changed and {k.rsplit(".", 2)[-2] for k in changed} <= {"q_proj", "o_proj", "up_proj", "down_proj"}, \
        sorted(changed)


def test_sft_usr2_then_sigkill_resume_bitwise(tmp_path, reference):
    """USR2 after 2 steps (exit 75, a checkpoint at the step boundary), the same command again, SIGKILL
    after its next step's row (checkpoints every step: the rerun redoes what was lost), the same command
    again: the weights and every step's loss equal the uninterrupted run's."""
    _, ref_weights, ref_rows = reference
    run_dir = tmp_path / "runs" / "sft"
    proc = start(tmp_path, "run", "sft", "checkpoint.save_interval=1")
    wait_steps(proc, run_dir, 2)
    os.kill(proc.pid, signal.SIGUSR2)
    assert finish(proc) == 75, (tmp_path / "sft.log").read_text()[-3000:]
    done = steps_done(run_dir)
    assert 2 <= done < STEPS
    proc = start(tmp_path, "run", "sft", "checkpoint.save_interval=1")
    wait_steps(proc, run_dir, done + 1)
    time.sleep(0.1)
    proc.kill()
    proc.wait()
    proc = start(tmp_path, "run", "sft", "checkpoint.save_interval=1")
    assert finish(proc) == 0, (tmp_path / "sft.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "sft.log").read_text()
    assert losses(run_dir) == [(r["step"], r["train/loss"]) for r in ref_rows if "train/loss" in r]
    got = weights(tmp_path, "sft")
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "the resumed SFT run diverged"


# --- the warm start ---------------------------------------------------------------------------------------

WARM = ("run.mode=sync", "sft.enabled=true")


def sft_folder(folder: Path, name: str) -> Path:
    """The folder ``hpcrl sft`` printed last in ``<name>.log``."""
    lines = [x for x in (folder / f"{name}.log").read_text().splitlines() if x.startswith(str(folder))]
    return Path(lines[-1])


def key_of(folder: Path) -> dict:
    return json.loads((folder / "sft_key.json").read_text())


def hf_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """``hpcrl sft`` of seed 7 (the reference warm start) in a folder of its own: the folder and the path
    it printed."""
    tmp = tmp_path_factory.mktemp("warm")
    proc = start(tmp, "sft", "a", *WARM)
    assert finish(proc) == 0, (tmp / "a.log").read_text()[-3000:]
    return tmp, sft_folder(tmp, "a")


def test_warm_start_cache_is_content_addressed(warm):
    """Another seed trains a folder of its own beside the first, once for two runs started together (the
    other waits for the key's lock and uses what it made, as a sweep's array tasks of one seed do); the first
    seed again is a cache hit; ``sft.output`` links to the newest each time."""
    tmp, first = warm
    store = tmp / "sft.d"
    assert first.parent == store and key_of(first)["seed"] == 7 and key_of(first)["trainer"] == "megatron"
    assert os.readlink(tmp / "sft") == f"sft.d/{first.name}"  # sft.output: a relative link to the newest
    curve = [json.loads(x) for x in (first / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve if "eval_accuracy" in r] == [0, 4, 8]
    assert [r["step"] for r in curve if "loss" in r] == list(range(1, STEPS + 1))
    # another seed, two runs at once: one folder of its own, trained once; the first one stays
    procs = [start(tmp, "sft", n, *WARM, "run.seed=8") for n in ("p", "q")]
    assert [finish(p) for p in procs] == [0, 0], (tmp / "q.log").read_text()[-3000:]
    second = sft_folder(tmp, "p")
    assert sft_folder(tmp, "q") == second != first and second.parent == store and key_of(second)["seed"] == 8
    logs = [(tmp / f"{n}.log").read_text() for n in ("p", "q")]
    assert sum("sft: training the warm start" in x for x in logs) == 1, logs
    assert sum("waiting for it" in x for x in logs) == 1
    assert os.readlink(tmp / "sft") == f"sft.d/{second.name}"
    assert not hf_weights(first)["model.norm.weight"].equal(hf_weights(second)["model.norm.weight"])
    # the first seed again: a cache hit (no new attempt of its SFT run), the link back on it
    proc = start(tmp, "sft", "c", *WARM)
    assert finish(proc) == 0, (tmp / "c.log").read_text()[-3000:]
    assert sft_folder(tmp, "c") == first and "using it" in (tmp / "c.log").read_text()
    assert sorted(p.name for p in (store / f"{first.name}.run" / "logs").iterdir()) == ["attempt-0"]
    assert sorted(p.name for p in store.iterdir() if p.suffix == ".run") == sorted(
        [f"{first.name}.run", f"{second.name}.run"])
    assert os.readlink(tmp / "sft") == f"sft.d/{first.name}"


def test_rl_run_preempted_in_its_warm_start_resumes_it(tmp_path, warm):
    """USR2 while the RL run's warm start trains (exit 75, the SFT run checkpointed), the same command again:
    the SFT run resumes, then RL runs from its result; the warm start equals the uninterrupted ``hpcrl sft``
    of the same key (another folder) bitwise."""
    _, ref = warm
    proc = start(tmp_path, "run", "rl", *WARM, "checkpoint.save_interval=1")
    sft_runs = tmp_path / "sft.d"
    deadline = time.monotonic() + 300
    while not (found := list(sft_runs.glob("*.run"))) or steps_done(found[0]) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "rl.log").read_text()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGUSR2)
    assert finish(proc) == 75, (tmp_path / "rl.log").read_text()[-3000:]
    assert not (tmp_path / "runs" / "rl" / "metrics.jsonl").exists()  # RL never started
    proc = start(tmp_path, "run", "rl", *WARM, "checkpoint.save_interval=1")
    assert finish(proc) == 0, (tmp_path / "rl.log").read_text()[-3000:]
    made = Path(json.loads((tmp_path / "runs" / "rl" / "warm_start.json").read_text())["model"])
    assert made.name == ref.name  # the same key in another folder
    assert "resumed from" in (tmp_path / "rl.log").read_text()
    got, want = hf_weights(made), hf_weights(ref)
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    assert steps_done(tmp_path / "runs" / "rl") == 2


def test_warm_start_on_two_trainer_ranks_then_rl(tmp_path):
    """The warm start on every rank of a 2-process trainer (the lock taken by rank 0 for both, the default
    process group formed before it and kept for RL, the eval schedule agreed by all ranks from the
    controller's accuracy; the Slurm job's multi-rank path), then RL on the same
    ranks: its key holds the layout (DP=2 splits each batch), RL starts from what it made. The weights go by
    ``distributed`` (a gloo weight-update group with the engine), as in the Slurm quickstart's het job: each
    stage creates its group, so the warm start must release its own (before, RL's group of the same name
    could not be created and the engine waited for it until ``weights.timeout_s``; seen in CI)."""
    proc = start(tmp_path, "run", "dp2", *WARM, "train.nprocs=2", "weights.method=distributed",
                 "weights.timeout_s=60")
    assert finish(proc) == 0, (tmp_path / "dp2.log").read_text()[-3000:]
    made = Path(json.loads((tmp_path / "runs" / "dp2" / "warm_start.json").read_text())["model"])
    assert key_of(made)["train"]["nprocs"] == 2 and (made / "config.json").is_file()
    curve = [json.loads(x) for x in (made / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve if "loss" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in curve if "eval_accuracy" in r] == [0, 4, 8]  # every rank evaluates together
    assert steps_done(tmp_path / "runs" / "dp2") == 2
