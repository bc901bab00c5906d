"""A LoRA RL run end to end (issue #56 points 2-4): ``hpcrl run`` with ``model.lora`` and a KL loss, on the
deterministic run of ``test_preemption_local``.

- The KL reference is the base model with the adapters off (no copy of the weights): at step 0, before any
  update, the reference and the policy are the same model (``train/ref_logprob_diff`` 0), and the KL grows as
  the adapters train.
- The engine gets the adapters alone (``model.lora.sync: adapter``, the default: a new LoRA adapter each sync,
  which the requests name) or merged into the base (``merged``, a full weight sync): either way the trainer's
  log-probs of the engine's tokens equal the engine's to 1e-5 at every step (a sync that missed the adapters,
  or merged them wrongly, differs by ~1e-1 once they train); the adapter sync sends a fraction of the bytes.
- Only the adapters train: the exported model (``hpcrl convert mcore-to-hf``'s, adapters merged) differs from
  the base in the adapted linears alone; ``hpcrl convert mcore-to-peft`` writes the adapters as a PEFT folder
  (a fraction of the model's bytes) that PEFT merges into the same weights.
- USR2 then a rerun, and SIGKILL inside a step then a rerun, end bitwise equal to the uninterrupted LoRA run.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch

from tests.hpcrl_process import check_hpcrl
from tests.integration.test_preemption_local import (STEPS, finish, start, steps_done, trained, wait_steps,
                                                     weights)

pytestmark = pytest.mark.integration

LORA = ("model.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj, gate_proj, down_proj]}",
        "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.05", "train.lr=0.01")


def rows(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def test_a_lora_run_trains_adapters_against_the_base_and_resumes_exactly(tmp_path):
    proc = start(tmp_path, "ref", *LORA)
    assert finish(proc) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    steps = [r for r in rows(tmp_path, "ref") if "train/loss" in r]
    assert len(steps) == STEPS
    assert steps[0]["train/ref_logprob_diff"] == 0.0  # the reference is the policy before its first update
    assert steps[0]["train/kl_loss"] == 0.0 and steps[-1]["train/kl_loss"] > 1e-4  # and the adapters move it
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in steps) < 1e-5  # the engine serves the adapters
    engine_log = "".join(p.read_text() for p in (tmp_path / "runs" / "ref").rglob("engine*.log"))
    assert engine_log.count("LoRA adapter hpcrl-policy-") >= STEPS and "unloaded" in engine_log, engine_log[-2000:]
    ref = weights(tmp_path, "ref")
    base = weights_of_folder(tmp_path / "tiny")
    changed = [k for k in base if k in ref and not torch.equal(ref[k], base[k])]
    # the targets' weights moved (merged adapters), nothing else did
    assert changed and all(any(t in k for t in ("q_proj", "v_proj", "gate_proj", "down_proj")) for k in changed)
    # hpcrl convert mcore-to-peft: the adapters as a PEFT folder, which PEFT merges into the same model
    peft_dir = tmp_path / "ref-peft"
    check_hpcrl(["convert", "mcore-to-peft", str(tmp_path / "runs" / "ref"), str(peft_dir)], cwd=tmp_path,
                log=tmp_path / "ref-peft.log")
    merged = peft_merged(tmp_path / "tiny", peft_dir)
    assert max((merged[k] - ref[k]).abs().max().item() for k in ref) < 1e-5
    adapter_bytes = (peft_dir / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < sum(t.numel() * t.element_size() for t in ref.values()) / 4

    # the adapters merged into a full sync: the same agreement, the whole model's bytes per sync
    proc = start(tmp_path, "merged", *LORA, "model.lora.sync=merged", "run.num_rollout=3")
    assert finish(proc) == 0, (tmp_path / "merged.log").read_text()[-3000:]
    merged_steps = [r for r in rows(tmp_path, "merged") if "train/loss" in r]
    assert max(r["train/train_rollout_logprob_abs_diff"] for r in merged_steps) < 1e-5
    model_bytes = sum(t.numel() * t.element_size() for t in ref.values())
    assert all(r["sync/bytes"] >= model_bytes * 0.9 for r in merged_steps)
    assert all(0 < r["sync/bytes"] < model_bytes / 4 for r in steps)

    proc = start(tmp_path, "usr2", *LORA)
    run_dir = tmp_path / "runs" / "usr2"
    wait_steps(proc, run_dir, 3)
    os.kill(proc.pid, signal.SIGUSR2)
    assert finish(proc) == 75, (tmp_path / "usr2.log").read_text()[-3000:]
    assert 3 <= steps_done(run_dir) < STEPS
    proc = start(tmp_path, "usr2", *LORA)
    assert finish(proc) == 0, (tmp_path / "usr2.log").read_text()[-3000:]
    np.testing.assert_array_equal(trained(tmp_path, "usr2"), trained(tmp_path, "ref"))
    got = weights(tmp_path, "usr2")
    assert all(got[k].equal(ref[k]) for k in ref), "the resumed LoRA run diverged"

    # SIGKILL inside a later step: the rerun loads the adapters and their Adam state, syncs the adapters to a new
    # engine, redoes the lost step and ends bitwise equal
    proc = start(tmp_path, "kill", *LORA, "checkpoint.save_interval=1")
    wait_steps(proc, tmp_path / "runs" / "kill", 2)
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    proc = start(tmp_path, "kill", *LORA, "checkpoint.save_interval=1")
    assert finish(proc) == 0, (tmp_path / "kill.log").read_text()[-3000:]
    np.testing.assert_array_equal(trained(tmp_path, "kill"), trained(tmp_path, "ref"))
    got = weights(tmp_path, "kill")
    assert all(got[k].equal(ref[k]) for k in ref), "the LoRA run rerun after SIGKILL diverged"


def peft_merged(base, peft_dir) -> dict:
    """The base HF model with the PEFT folder's adapters merged by PEFT (``merge_and_unload``)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                           str(peft_dir))
    return {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}


def weights_of_folder(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


LOOPS = {
    "ppo": ("algorithm.advantage_estimator=gae",),
    "async": ("run.mode=async", "run.placement=disaggregate"),
    "fully_async": ("run.mode=fully_async", "run.placement=disaggregate", "run.deterministic=false",
                    "algorithm.use_tis=true", "rollout.max_new_tokens=24"),
}


@pytest.mark.parametrize("mode", sorted(LOOPS))
def test_lora_in_the_other_loops(tmp_path, mode):
    """The adapters trained and synced alone with PPO (``gae``: the critic is a full model of its own, only the
    actor has adapters), and in the one-step-off (``async``) and fully asynchronous loops, the engine on its own
    cores (``disaggregate``: each sync a PEFT folder and ``/load_lora_adapter``). In the fully
    asynchronous loop the engine is paused in place: requests started on one adapter finish on it after the
    next sync while new ones take the new one (each sync's adapter has a name of its own, the one before the
    previous unloaded), so no request is refused for an adapter it names."""
    steps = 6
    proc = start(tmp_path, mode, *LORA, *LOOPS[mode], f"run.num_rollout={steps}")
    assert finish(proc) == 0, (tmp_path / f"{mode}.log").read_text()[-3000:]
    trained_steps = [r for r in rows(tmp_path, mode) if "train/loss" in r]
    assert len(trained_steps) == steps and trained_steps[-1]["train/kl_loss"] != 0  # the adapters moved
    engine_log = "".join(p.read_text() for p in (tmp_path / "runs" / mode).rglob("engine*.log"))
    loaded = engine_log.count(" loaded (rank 4")
    assert loaded >= steps and "never been loaded" not in engine_log, engine_log[-2000:]
    assert all(0 < r["sync/bytes"] < 100_000 for r in trained_steps)  # 44 KB of adapters, not the 4 MB model


def test_lora_student_distils_from_its_base_as_teacher(tmp_path, tiny_model_dir):
    """On-policy distillation with LoRA (issue #56 point 2): the student trains adapters, its teacher is the base
    model it starts from (test_opd's run): at rollout 0 the adapters are zero, so the teacher scores the
    student's tokens as the student's engine did (reverse KL ~0); the adapters then move the student away (the
    KL grows) and the trainer's KL equals the rollout's. The teacher's engine, served beside an engine that runs
    the student's adapter, names none."""
    import os

    from tests.hpcrl_process import popen_hpcrl
    from tests.integration.test_opd import assert_teacher_scored, write_run

    steps = 8
    cfg, _ = write_run(tmp_path, tiny_model_dir, steps)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    proc = popen_hpcrl(["run", str(cfg), "model.lora={rank: 4, alpha: 8}", "train.lr=0.02"], cwd=tmp_path, env=env,
                       log=tmp_path / "opd.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "opd.log").read_text(errors="replace")[-3000:]
    run_dir = tmp_path / "runs" / "opd"
    rows = assert_teacher_scored(run_dir, steps)
    model_bytes = sum(f.stat().st_size for f in (tmp_path / "student").glob("*.safetensors"))
    assert all(0 < r["sync/bytes"] < model_bytes / 4 for r in rows)  # the adapters alone
