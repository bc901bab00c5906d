"""The colocated loop never touches the trainer's tensors while its memory is offloaded.

On GPUs, ``hpcrl.offload.TorchMemorySaverTrainerMemory`` unmaps the trainer's memory between the weight sync and
the next train step: reading a parameter (or allocating on the device) then fails with ``cudaErrorInvalidValue``
(seen on an H200, 2026-11-26: the sync exported the paused parameters; a checkpoint save ran while paused). On
the CPU the same contract is checked with an adapter that makes every parameter and Adam moment read NaN while
offloaded and puts the contents back on onload: a real ``hpcrl run`` (engine, Megatron trainer, checkpoints)
must sync the weights it trained (the engine's log-probs equal the trainer's) and save finite tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DRIVER = '''
import json, math, sys
import torch
import hpcrl.checkpoint.manager as manager
import hpcrl.run_session as session
import hpcrl.offload as offload

held, record = {}, {"offloads": 0, "saves": []}


def tensors():
    actor = held["actor"]
    out = []
    for owner in (actor, getattr(actor, "critic", None)):  # a PPO run's critic shares the trainer's memory
        if owner is None:
            continue
        out += [p.data for p in owner.model.parameters()]
        for state in owner.optimizer.optimizer.state.values():
            out += [t for t in state.values() if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0]
    return out


class PoisonedWhileOffloaded(offload.TrainerMemory):
    """torch-memory-saver's contract on the CPU: offloaded tensors must not be read (they read NaN here)."""

    pauses_device_memory = True

    def offload(self):
        self.saved = [(t, t.clone()) for t in tensors()]
        for t, _ in self.saved:
            t.fill_(math.nan)
        self.offloaded = True
        record["offloads"] += 1

    def onload(self):
        for t, copy in self.saved:
            t.copy_(copy)
        self.offloaded = False


def capture(*a, **k):
    t = build_trainer(*a, **k)
    held["actor"] = t.actor
    return t


def checked_save(self, rollout_id):
    finite = all(bool(torch.isfinite(t).all()) for t in tensors())
    record["saves"].append({"rollout_id": rollout_id, "finite": finite})
    return save(self, rollout_id)


if __name__ == "__main__":  # checkpoint writers are spawned: they import this file
    offload.create_trainer_memory = (lambda colocate: PoisonedWhileOffloaded() if colocate
                                     else offload.TrainerMemory())
    build_trainer, session.build_trainer = session.build_trainer, capture
    save, manager.CheckpointManager._save = manager.CheckpointManager._save, checked_save
    from hpcrl.cli import main

    try:
        rc = main(sys.argv[2:])
    finally:
        with open(sys.argv[1], "w") as f:
            json.dump(record, f)
    sys.exit(rc)
'''


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_colocated_sync_and_saves_never_read_offloaded_trainer_tensors(tmp_path, estimator):
    """``gae``: PPO, whose critic (model and Adam states, poisoned with the actor's) lives in the trainer
    process and takes the actor's turns; its metrics are logged every step."""
    (tmp_path / "driver.py").write_text(DRIVER)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent(f"""
        run: {{name: colo, output_dir: {tmp_path / 'runs'}, num_rollout: 3, seed: 7, placement: colocate}}
        model: {{path: {tmp_path / 'tiny'}, create: tiny-qwen2, tiny_hidden_size: 64, tiny_num_layers: 2}}
        data: {{source: addition, num_train: 200, num_eval: 16}}
        rollout: {{batch_size: 4, n_samples_per_prompt: 4, max_new_tokens: 6, dynamic_filter: null,
                  eval_interval: 0}}
        train: {{lr: 1.0e-3, micro_batch_size: 8}}
        algorithm: {{advantage_estimator: {estimator}}}
        checkpoint: {{save_interval: 1, keep_last: 1}}
    """))
    record = tmp_path / "record.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(tmp_path / "run.log", "wb") as f:
        out = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(record), "run", str(cfg)],
                             cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, timeout=600, env=env)
    log = (tmp_path / "run.log").read_text()
    assert out.returncode == 0, log[-3000:]
    rec = json.loads(record.read_text())
    assert rec["offloads"] >= 4  # the first sync and one per step
    assert [s["rollout_id"] for s in rec["saves"]] == [0, 1, 2] and all(s["finite"] for s in rec["saves"]), rec
    rows = [json.loads(x) for x in (tmp_path / "runs" / "colo" / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows if r.get("step", -1) >= 0]
    assert len(diffs) == 3 and max(diffs) < 1e-4, diffs  # the engine got the trained weights, not NaN
    if estimator == "gae":
        assert all(r["critic/value_loss"] >= 0 for r in rows if r.get("step", -1) >= 0)
    phases = [json.loads(x)["phase"] for x in
              next((tmp_path / "runs" / "colo" / "logs").glob("attempt-0/phases.jsonl")).read_text().splitlines()]
    assert phases[:8] == ["offload_engine", "offload_trainer", "onload_engine_weights", "sync", "onload_engine_kv",
                          "generate", "offload_engine", "onload_trainer"], phases


def test_an_engine_that_joins_while_the_others_are_released_is_not_resumed(tiny_model_dir, tmp_path):
    """The health monitor may put a new engine in rotation between the release of the engines' memory and its
    resume (it replaced a dead one): that engine's memory is held, and SGLang 0.5.23's scheduler dies on a
    resume of a tag that is not released (the CPU engine answers 400). The phases resume only what they
    released, and release the newcomer with the others at the next offload."""
    import asyncio

    from hpcrl.offload import ColocatedMemory, TrainerMemory
    from hpcrl.rollout.client import RolloutClient
    from tests.integration.engine_utils import EngineProcess, http_json

    def released(url: str) -> list[str]:
        return http_json("GET", url + "/get_server_info")[1]["internal_states"][0]["released_tags"]

    with EngineProcess(tiny_model_dir, log_path=tmp_path / "a.log") as a, \
            EngineProcess(tiny_model_dir, log_path=tmp_path / "b.log") as b:
        async def phases() -> None:
            async with RolloutClient(engine_urls=[a.url]) as client:
                memory = ColocatedMemory(TrainerMemory(), client)
                await memory.offload_engine()
                client.set_engine_urls([a.url, b.url])  # b replaced a dead engine meanwhile
                await memory.onload_engine_weights()
                await memory.onload_engine_kv()
                assert released(a.url) == [] and released(b.url) == [] and memory.released == {}
                await memory.offload_engine()  # both now
                assert released(a.url) == released(b.url) == ["cuda_graph", "kv_cache", "weights"]
                await memory.onload_engine_weights()
                await memory.onload_engine_kv()

        asyncio.run(phases())
        assert released(a.url) == released(b.url) == []
        status, body = http_json("POST", b.url + "/resume_memory_occupation", {"tags": ["weights"]})
        assert status == 400 and "not released" in body["error"]["message"]  # what the phases never send
