"""Checkpoints (hpcrl.checkpoint) and HF export (hpcrl.convert) with real megatron-core models on CPU (gloo).

- Bitwise resume, TP=1 in this process (fp32 and bf16): train 3 steps saving before step 1 and after it;
  then, from other RNG seeds, build a fresh model + optimizer, load a checkpoint and train the remaining
  steps: parameters, optimizer state (Adam moments, step, main params) and the next draws of every RNG
  stream equal the uninterrupted run's. The batches come from the global python / numpy / torch RNGs, so
  an unrestored RNG would change them.
- The same in 2 torchrun processes (this file run as a script, see ``worker``): TP=2, and TP=1 x DP=2 with
  the distributed optimizer.
- A checkpoint without marker, with a truncated file or (with checksums) a corrupted one is skipped for the
  previous one; ``.tmp-*`` leftovers are ignored and removed by the next save; ``keep_last`` pruning.
- ``mcore_to_hf``: the folder loads in transformers with logits equal to the Megatron model's (1e-5) and
  weights bitwise equal to the trained ones, also for a checkpoint saved at TP=2 and converted at TP=1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration.engine_utils import run_ranks

from hpcrl.config import TrainSection

VOCAB = 21  # the tiny model's vocab (hpcrl.models.tiny)
SEQ = 10
STEPS, SAVE_AT = 3, 1
TRAIN = TrainSection(lr=1e-2, weight_decay=0.01, clip_grad=1.0)


# --- shared by the in-process tests and the torchrun worker ------------------------------------------------

def seed_everything(seed: int) -> None:
    """Seed python, numpy, torch and megatron's tensor-parallel RNG tracker."""
    from hpcrl.train import parallel

    np.random.seed(seed)
    parallel.model_parallel_cuda_manual_seed(seed)


def draw_batch():
    """A batch drawn from the global RNG streams (the same on every rank: they are seeded alike)."""
    tokens = torch.randint(3, VOCAB, (2, SEQ))
    adv = torch.from_numpy(np.random.standard_normal(2).astype(np.float32))
    total = torch.tensor([SEQ, random.randint(5, SEQ)])
    return tokens, total, torch.tensor([4, 3]), adv


def one_step(ddp_model, optimizer) -> dict:
    from hpcrl.train import logprobs, model as tmodel

    tokens, total, resp, adv = draw_batch()

    def loss_fn(model, _):
        out = logprobs.response_log_probs(model, tokens, total, resp)
        return -(out.log_probs * out.mask * adv[:, None]).sum() / out.mask.sum()

    return tmodel.train_step(ddp_model, optimizer, loss_fn, [None])


def model_tensors(ddp_model) -> dict[str, torch.Tensor]:
    """This rank's parameters (TP shards), copied."""
    from hpcrl.train import bridge

    return {k: v.detach().clone() for k, v in bridge.unwrap_model(ddp_model).named_parameters()}


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Main params and every optimizer state tensor (Adam moments, step) of this rank, copied, in order."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                for k in sorted(inner.state[p]):
                    v = inner.state[p][k]
                    out.append(v.detach().clone() if torch.is_tensor(v) else torch.tensor(v))
    return out


def rng_probe() -> list[float]:
    """The next draw of every RNG stream a checkpoint restores."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(1).item()
    return [random.random(), float(np.random.rand()), torch.rand(1).item(), tracked]


def probe_logits(ddp_model) -> torch.Tensor:
    """Full-vocab logits [2, SEQ, VOCAB] on fixed tokens (gathered over TP)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    with torch.no_grad():
        positions = torch.arange(SEQ).expand(2, -1)
        logits = ddp_model(input_ids=tokens, position_ids=positions, attention_mask=None)
    return gather_from_tensor_model_parallel_region(logits)[..., :VOCAB].clone()


def resume_experiment(hf_dir, run_dir, train=TRAIN, lora=None) -> dict:
    """An uninterrupted run (A) saving before the first step and after step SAVE_AT, and runs resumed from
    those two checkpoints (C from step 0, B from SAVE_AT) by a fresh model + optimizer; their states. With
    ``lora`` (a LoraSpec) the model trains adapters (drawn from seed 1 in A, seed 2 in the fresh models, so a
    resume that did not load them differs)."""
    from hpcrl import checkpoint
    from hpcrl.train import bridge, model as tmodel

    seed_everything(1234)
    model, opt = tmodel.setup_model_and_optimizer(hf_dir, train, lora=lora, lora_seed=1)
    res: dict = {"A": {}, "B": {}, "C": {}, "path": {}}
    for step in range(STEPS + 1):
        if step:
            res["A"].setdefault("loss", []).append(one_step(model, opt)["loss"])
        if step in (0, SAVE_AT):
            extra = {"rollout_id": step, "data": {"epoch": 0, "offset": 7}, "metrics": [{"x": 0.5}]}
            res["path"][step] = str(checkpoint.save_checkpoint(run_dir, step, model, opt, extra))
        if step == SAVE_AT:
            res["A"]["saved_model"], res["A"]["saved_optim"] = model_tensors(model), optimizer_tensors(opt)
            res["A"]["saved_hf"] = dict(bridge.export_hf_weights(model))
            res["A"]["saved_logits"] = probe_logits(model)
    res["A"].update(model=model_tensors(model), optim=optimizer_tensors(opt), rng=rng_probe())
    del model, opt

    for run, start in (("B", SAVE_AT), ("C", 0)):
        seed_everything(999)  # a fresh start: other RNG states, the base weights, a new optimizer
        model, opt = tmodel.setup_model_and_optimizer(hf_dir, train, lora=lora, lora_seed=2)
        res[run]["extra"] = checkpoint.load_checkpoint(res["path"][start], model, opt)
        res[run]["loaded_model"], res[run]["loaded_optim"] = model_tensors(model), optimizer_tensors(opt)
        for _ in range(start + 1, STEPS + 1):
            res[run].setdefault("loss", []).append(one_step(model, opt)["loss"])
        res[run].update(model=model_tensors(model), optim=optimizer_tensors(opt), rng=rng_probe())
        del model, opt
    return res


def assert_bitwise_resume(res: dict) -> None:
    a, b, c = res["A"], res["B"], res["C"]
    assert b["extra"] == {"rollout_id": 1, "data": {"epoch": 0, "offset": 7}, "metrics": [{"x": 0.5}]}
    assert c["extra"]["rollout_id"] == 0
    assert sorted(b["loaded_model"]) == sorted(a["saved_model"])
    for k, v in a["saved_model"].items():
        assert torch.equal(b["loaded_model"][k], v), k
    assert len(b["loaded_optim"]) == len(a["saved_optim"]) > 0
    assert all(torch.equal(x, y) for x, y in zip(b["loaded_optim"], a["saved_optim"]))
    assert any(not torch.equal(a["model"][k], a["saved_model"][k]) for k in a["model"])  # it did train on
    assert b["loss"] == a["loss"][SAVE_AT:] and c["loss"] == a["loss"]
    for run in (b, c):
        for k, v in a["model"].items():
            assert torch.equal(run["model"][k], v), k
        assert len(run["optim"]) == len(a["optim"])
        assert all(torch.equal(x, y) for x, y in zip(run["optim"], a["optim"]))
        assert run["rng"] == a["rng"]


# --- the distributed side: `torchrun --nproc_per_node=2 test_checkpoint.py --hf DIR --out DIR` -------------


def worker(hf_dir: str, out: Path) -> None:
    """Run on each of 2 ranks: the resume experiment at TP=2 and at TP=1 x DP=2 (distributed optimizer)."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from hpcrl.train import parallel

    env = parallel.init_distributed()
    results = {}
    from hpcrl.train.lora import LoraSpec

    distopt = dataclasses.replace(TRAIN, use_distributed_optimizer=True)
    for name, tp, train, lora in (("tp2", 2, TRAIN, None), ("dp2_distopt", 1, distopt, None),
                                  ("tp2_lora", 2, TRAIN, LoraSpec(rank=4, alpha=8.0))):
        parallel.initialize_model_parallel(tp=tp)
        results[name] = resume_experiment(hf_dir, out / f"run-{name}", train, lora)
        results[name]["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
        results[name]["dp"] = parallel_state.get_data_parallel_world_size()
        parallel_state.destroy_model_parallel()
    torch.save(results, out / f"rank{env.rank}.pt")
    parallel.destroy()


# --- the test side ------------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def tp1():
    """gloo world of 1 with megatron-core model parallelism (TP=1), torn down after the module."""
    pytest.importorskip("megatron.core")
    from hpcrl.train import parallel

    torch.set_num_threads(1)
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    yield
    parallel.destroy()


@pytest.fixture(scope="module")
def tp1_resume(tp1, tiny_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run-tp1")
    return resume_experiment(tiny_model_dir, run_dir) | {"run_dir": run_dir}


@pytest.fixture(scope="module")
def ranks(tiny_model_dir, tmp_path_factory):
    """Run the 2-rank job once (engine_utils.run_ranks); the per-rank results (rank 0 first) and its output folder."""
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("ckpt-tp2")
    run_ranks(__file__, ["--hf", str(tiny_model_dir)], out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], out


@pytest.fixture(scope="module")
def small_model(tp1, tiny_model_dir):
    """A model and its (never stepped) optimizer, for the quick model-only checkpoints below."""
    from hpcrl.train import model as tmodel

    return tmodel.setup_model_and_optimizer(tiny_model_dir, TRAIN)


def _save(model_and_opt, run_dir, rollout_id, keep_last=2):
    """Save a model-only checkpoint (no optimizer) with extra state ``{"id": rollout_id}``."""
    from hpcrl import checkpoint

    return checkpoint.save_checkpoint(run_dir, rollout_id, model_and_opt[0], None, {"id": rollout_id},
                                      keep_last=keep_last)


# (a) bitwise resume at TP=1 --------------------------------------------------------------------------------

def test_resume_tp1_is_bitwise_identical(tp1_resume):
    assert_bitwise_resume(tp1_resume)


def test_resume_with_lora_is_bitwise_identical(tp1, tiny_model_dir, tmp_path):
    """LoRA (issue #56 point 4): the checkpoint holds the adapters and their optimizer state alone (the frozen
    base is the HF folder the model is built from, loaded before the checkpoint), a fraction of a full
    checkpoint's bytes; a fresh model with other adapters resumes bitwise."""
    from megatron.core import dist_checkpointing

    from hpcrl.checkpoint.layout import DIST_DIR
    from hpcrl.train.lora import LoraSpec

    res = resume_experiment(tiny_model_dir, tmp_path, lora=LoraSpec(rank=4, alpha=8.0))
    assert_bitwise_resume(res)
    adapters = [k for k in res["A"]["model"] if ".lora.lora_" in k]
    assert len(adapters) == 4 * 7 * 2
    # main params + 2 Adam moments + step per adapter: nothing of the base
    assert len(res["A"]["optim"]) == 4 * len(adapters)
    saved = Path(res["path"][SAVE_AT])
    keys = dist_checkpointing.load_tensors_metadata(str(saved / DIST_DIR)).keys()
    model_keys = [k for k in keys if not k.startswith("optimizer")]
    assert model_keys and all(".lora.lora_" in k for k in model_keys), sorted(model_keys)[:5]
    size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    base = sum(f.stat().st_size for f in Path(tiny_model_dir).glob("*.safetensors"))
    assert size < base, (size, base)  # adapters + their Adam: less than the base model's weights alone


def test_resume_tp1_bf16_is_bitwise_identical(tp1, tiny_model_dir, tmp_path):
    """bf16 parameters with fp32 main parameters in the optimizer (Float16OptimizerWithFloat16Params)."""
    res = resume_experiment(tiny_model_dir, tmp_path, dataclasses.replace(TRAIN, bf16=True))
    assert res["A"]["saved_model"]["decoder.final_layernorm.weight"].dtype == torch.bfloat16
    assert_bitwise_resume(res)
    assert json.loads((Path(res["path"][1]) / "COMPLETE").read_text())["params_dtype"] == "bfloat16"


def test_checkpoint_layout_and_marker(tp1_resume):
    from hpcrl import checkpoint

    path = Path(tp1_resume["path"][1])
    assert path == checkpoint.checkpoint_path(tp1_resume["run_dir"], 1)
    assert path.name == "iter_0000001"
    assert sorted(p.name for p in path.parent.iterdir()) == ["iter_0000000", "iter_0000001"]  # no temp folder
    marker = checkpoint.validate_checkpoint(path, verify_checksums=True)
    assert marker["rollout_id"] == 1 and marker["world_size"] == 1 and marker["tp_size"] == 1
    assert marker["params_dtype"] == "float32" and marker["padded_vocab_size"] == 128
    files = set(marker["files"])
    assert {"dist/.metadata", "dist/metadata.json", "dist/common.pt", "state.json",
            "rng/rank_00000.pt"} <= files
    assert marker["optimizer"] == "saved"
    assert checkpoint.read_marker(path.parent / "iter_0000000")["optimizer"] == "initial"  # before step 1
    assert any(f.endswith(".distcp") for f in files)
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert on_disk == files | {"COMPLETE"}
    assert json.loads((path / "state.json").read_text())["rollout_id"] == 1


def test_resume_with_a_second_model_is_bitwise_identical(tp1, tiny_model_dir, tmp_path):
    """A further named model + optimizer (PPO's critic) in the same checkpoint (``dist_critic/``, in the
    marker's ``models``): a fresh pair of each loaded from it trains on bitwise like the saving run; a load
    naming other models than the checkpoint's is one CheckpointError line naming it and the fix, and
    ``models=None`` (hpcrl convert) loads the main model alone."""
    from hpcrl import checkpoint
    from hpcrl.train import model as tmodel

    def build():
        return [tmodel.setup_model_and_optimizer(tiny_model_dir, TRAIN) for _ in range(2)]

    def step(pairs):
        return [one_step(m, o)["loss"] for m, o in pairs]

    def state(pairs):
        return [(model_tensors(m), optimizer_tensors(o)) for m, o in pairs]

    seed_everything(1234)
    pairs = build()
    step(pairs)
    path = checkpoint.save_checkpoint(tmp_path, 1, *pairs[0], {"rollout_id": 1}, models={"critic": pairs[1]})
    losses = step(pairs)
    want = state(pairs)
    assert any(not torch.equal(v, want[1][0][k]) for k, v in want[0][0].items())  # two different models
    marker = checkpoint.validate_checkpoint(path, verify_checksums=True)
    assert marker["models"]["critic"]["optimizer"] == "saved" and marker["optimizer"] == "saved"
    assert {"dist_critic/.metadata", "dist_critic/metadata.json"} <= set(marker["files"])
    assert any(f.startswith("dist_critic/") and f.endswith(".distcp") for f in marker["files"])

    seed_everything(999)
    fresh = build()
    assert checkpoint.load_checkpoint(path, *fresh[0], models={"critic": fresh[1]}) == {"rollout_id": 1}
    assert step(fresh) == losses
    for (model, optim), (want_model, want_optim) in zip(state(fresh), want):
        assert all(torch.equal(v, model[k]) for k, v in want_model.items())
        assert len(optim) == len(want_optim) and all(torch.equal(a, b) for a, b in zip(optim, want_optim))

    with pytest.raises(checkpoint.CheckpointError,
                       match=r"iter_0000001 holds a critic model, which this run does not have.*new run"):
        checkpoint.load_checkpoint(path, *fresh[0], models={})
    checkpoint.load_checkpoint(path, *fresh[0])  # models=None: the main model only
    without = checkpoint.save_checkpoint(tmp_path, 2, *fresh[0], {"rollout_id": 2})
    assert checkpoint.read_marker(without)["models"] == {}
    with pytest.raises(checkpoint.CheckpointError, match=r"iter_0000002 has no critic model, which this run has"):
        checkpoint.load_checkpoint(without, *fresh[0], models={"critic": fresh[1]})


# (b) bitwise resume at TP=2 and TP=1 x DP=2 (distributed optimizer) in 2 processes -------------------------

@pytest.mark.integration
@pytest.mark.parametrize("name", ("tp2", "dp2_distopt", "tp2_lora"))
def test_resume_two_processes_is_bitwise_identical(ranks, name):
    results, _ = ranks
    if name.startswith("tp2"):
        assert [r[name]["tp_rank"] for r in results] == [0, 1]
    else:
        assert [r[name]["dp"] for r in results] == [2, 2]
    for res in results:
        assert_bitwise_resume(res[name])
    if name == "tp2_lora":  # the split adapters are each rank's own part (a replicated save gave both rank 0's)
        split = "decoder.layers.0.self_attention.linear_qkv.lora.lora_B.q_proj"
        assert not torch.equal(results[0][name]["A"]["model"][split], results[1][name]["A"]["model"][split])
    marker = json.loads((Path(results[0][name]["path"][1]) / "COMPLETE").read_text())
    assert marker["world_size"] == 2 and marker["tp_size"] == (2 if name.startswith("tp2") else 1)
    assert {"rng/rank_00000.pt", "rng/rank_00001.pt"} <= set(marker["files"])


# (c) truncated and leftover checkpoints ---------------------------------------------------------------------

def test_incomplete_checkpoints_are_skipped(small_model, tmp_path, caplog):
    from hpcrl import checkpoint

    for i in (1, 2, 3, 4):
        _save(small_model, tmp_path, i, keep_last=0)
    root = checkpoint.checkpoint_root(tmp_path)
    (root / "iter_0000004" / "COMPLETE").unlink()  # no marker (a save never renames such a folder in)
    distcp = sorted((root / "iter_0000003" / "dist").glob("*.distcp"))[0]
    os.truncate(distcp, distcp.stat().st_size // 2)  # a short file
    (root / "iter_0000002" / "rng" / "rank_00000.pt").unlink()  # a missing file
    leftover = root / "iter_0000005.tmp-deadbeef"  # a save killed half-way
    (leftover / "dist").mkdir(parents=True)
    (leftover / "dist" / "__0_0.distcp").write_bytes(b"x" * 10)

    with caplog.at_level(logging.WARNING, logger="hpcrl.checkpoint"):
        latest = checkpoint.find_latest_checkpoint(tmp_path)
    assert latest == root / "iter_0000001"
    text = caplog.text
    assert "iter_0000004: no COMPLETE marker" in text and "rank_00000.pt is missing" in text
    assert "iter_0000003: dist/__0_0.distcp has" in text and "truncated" in text
    model, opt = small_model
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.load_checkpoint(root / "iter_0000003", model)
    with pytest.raises(checkpoint.CheckpointError, match="without optimizer state"):
        checkpoint.load_checkpoint(latest, model, opt)
    assert checkpoint.load_checkpoint(latest, model)["id"] == 1

    # A flipped byte keeps the size: only the CRC check sees it.
    good = sorted((root / "iter_0000001" / "dist").glob("*.distcp"))[0]
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF
    good.write_bytes(bytes(data))
    assert checkpoint.find_latest_checkpoint(tmp_path) == root / "iter_0000001"
    assert checkpoint.find_latest_checkpoint(tmp_path, verify_checksums=True) is None

    # The next save removes the leftover and the invalid folders older than what it keeps.
    _save(small_model, tmp_path, 6, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000006"]
    assert checkpoint.find_latest_checkpoint(tmp_path) == root / "iter_0000006"


def test_find_latest_in_empty_run_dir(tmp_path):
    from hpcrl import checkpoint

    assert checkpoint.find_latest_checkpoint(tmp_path) is None
    assert checkpoint.list_checkpoints(tmp_path) == []


# (d) pruning ------------------------------------------------------------------------------------------------

def test_keep_last_pruning_and_replacement(small_model, tmp_path):
    from hpcrl import checkpoint

    def names():
        return sorted(p.name for p in checkpoint.checkpoint_root(tmp_path).iterdir())

    for i in (1, 2, 3, 4):
        _save(small_model, tmp_path, i, keep_last=2)
        assert names() == [f"iter_{j:07d}" for j in range(max(1, i - 1), i + 1)]
    # Saving an older id again (a resumed run) replaces it and keeps it, even though it is not the newest.
    path = _save(small_model, tmp_path, 3, keep_last=1)
    assert names() == ["iter_0000003", "iter_0000004"]
    assert json.loads((path / "state.json").read_text()) == {"id": 3}
    _save(small_model, tmp_path, 5, keep_last=0)  # 0 keeps all
    assert names() == ["iter_0000003", "iter_0000004", "iter_0000005"]


def test_a_save_leaves_no_helper_process(small_model, tmp_path):
    """megatron-core's writer kept its results in a spawned multiprocessing manager started by the first save
    (~1.7 s: it imported torch to unpickle them) and kept for the life of the trainer; hpcrl saves
    synchronously and keeps them in-process. The forked writer workers are gone once the save returns."""
    _save(small_model, tmp_path, 1)
    _save(small_model, tmp_path, 2)
    from tests.integration.test_preemption_local import descendants, full_cmdline

    cmdlines = [full_cmdline(pid) for pid in descendants(os.getpid())]
    # (the test process's own fork server, which the multi-rank tests' ranks are forked from, and its resource
    # tracker stay: they are not the writer's; a manager left by the writer runs spawn_main)
    left = [c for c in cmdlines if ("multiprocessing" in c or "spawn_main" in c)
            and "multiprocessing.forkserver" not in c and "multiprocessing.resource_tracker" not in c]
    assert not left, left


def test_bad_extra_state_writes_nothing(small_model, tmp_path):
    from hpcrl import checkpoint

    with pytest.raises(TypeError, match="not plain JSON"):
        checkpoint.save_checkpoint(tmp_path, 1, small_model[0], None, {"x": object()})
    assert not checkpoint.checkpoint_root(tmp_path).exists()


# (e) HF export ----------------------------------------------------------------------------------------------

def _hf_logits(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokens = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    with torch.no_grad():
        return model(tokens).logits


def _assert_export(out, saved_hf, saved_logits, base):
    from transformers import AutoTokenizer

    from hpcrl.train import bridge

    exported = bridge.read_hf_state_dict(out)
    assert sorted(exported) == sorted(saved_hf)
    for k, v in saved_hf.items():
        assert torch.equal(exported[k], v), k
    assert (_hf_logits(out) - saved_logits).abs().max() < 1e-5
    assert AutoTokenizer.from_pretrained(str(out))("1+2=3")["input_ids"] == \
        AutoTokenizer.from_pretrained(str(base))("1+2=3")["input_ids"]
    assert not list(out.parent.glob("*.tmp-*"))


def test_mcore_to_hf_tp1(tp1_resume, tiny_model_dir, tmp_path):
    from hpcrl import convert
    from hpcrl.train import bridge

    out = convert.mcore_to_hf(tp1_resume["path"][1], tiny_model_dir, tmp_path / "hf")
    a = tp1_resume["A"]
    base = bridge.read_hf_state_dict(tiny_model_dir)
    assert not torch.equal(a["saved_hf"]["model.norm.weight"], base["model.norm.weight"])  # trained
    _assert_export(out, a["saved_hf"], a["saved_logits"], tiny_model_dir)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    with pytest.raises(FileExistsError):
        convert.mcore_to_hf(tp1_resume["path"][1], tiny_model_dir, out)
    # The command line, as a single process of its own, resolves a run folder to its newest checkpoint.
    cmd = [sys.executable, "-m", "hpcrl.convert", str(tp1_resume["run_dir"]), str(tiny_model_dir),
           str(tmp_path / "hf-bf16"), "--dtype", "bfloat16"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("hf-bf16")
    bf16 = bridge.read_hf_state_dict(tmp_path / "hf-bf16")
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(t, a["saved_hf"][k].to(torch.bfloat16)) for k, t in bf16.items())
    assert json.loads((tmp_path / "hf-bf16" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.integration
def test_mcore_to_hf_converts_tp2_checkpoint_at_tp1(tp1, ranks, tiny_model_dir, tmp_path, caplog):
    from hpcrl import checkpoint, convert
    from hpcrl.train import bridge, model as tmodel

    results, _ = ranks
    res = results[0]["tp2"]
    assert torch.equal(results[1]["tp2"]["A"]["saved_logits"], res["A"]["saved_logits"])
    # Several safetensors files + index (1 MB each at most): transformers reads them as one model.
    out = convert.mcore_to_hf(res["path"][1], tiny_model_dir, tmp_path / "hf", max_shard_bytes=1_000_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert (out / "model.safetensors.index.json").exists()
    _assert_export(out, res["A"]["saved_hf"], res["A"]["saved_logits"], tiny_model_dir)
    assert json.loads((out / "hpcrl_export.json").read_text())["saved_tp_size"] == 2

    # The whole training state (model + optimizer) of the TP=2 checkpoint also loads at TP=1 (with the
    # saved padded vocab, 256); the RNG states are not restored, and a warning says so.
    model, opt = tmodel.setup_model_and_optimizer(tiny_model_dir, TRAIN,
                                                    {"make_vocab_size_divisible_by": 256})
    with caplog.at_level(logging.WARNING, logger="hpcrl.checkpoint"):
        extra = checkpoint.load_checkpoint(res["path"][1], model, opt)
    assert extra["rollout_id"] == 1 and "RNG states not restored" in caplog.text
    assert all(torch.equal(v, res["A"]["saved_hf"][k]) for k, v in bridge.export_hf_weights(model))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=worker.__doc__)
    parser.add_argument("--hf", required=True, help="tiny HF model folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    worker(args.hf, args.out)


def test_checkpoint_manager_saves_its_states_when_due_and_restores_them(small_model, tmp_path):
    """The run's CheckpointManager with the loop's four stateful objects: it saves at the interval and the
    last step (not between), on a stop signal at any step, and a fresh set of objects loaded from it equals
    the saved ones (held-back groups through the HDF5 columns, trained rows, metrics truncated to the step)."""
    import json
    import signal

    from hpcrl.checkpoint import CheckpointManager, RolloutCounter, list_checkpoints
    from hpcrl.data.buffer import TrainedRows
    from hpcrl.data.sample import Sample, Status
    from hpcrl.data.source import DataSource
    from hpcrl.metrics import MetricsPosition
    from hpcrl.preempt import PreemptionWatch

    items = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(10)]

    def states():
        return {"progress": RolloutCounter(), "data_source": DataSource(items, 2, seed=3),
                "trained": TrainedRows(), "metrics": MetricsPosition(tmp_path, controller=True)}

    def manager(st, watch):
        return CheckpointManager(tmp_path, small_model[0], None, st, interval=3, num_rollout=8, keep_last=0,
                                 resume=True, watch=watch)

    st, watch = states(), PreemptionWatch(signal.SIGUSR2)
    ckpt = manager(st, watch)
    assert ckpt.load() == 0
    saved_at = []
    for step in range(5):
        groups = st["data_source"].get_samples(2)
        st["trained"].extend(step, groups[0])
        (tmp_path / "metrics.jsonl").open("a").write(json.dumps({"step": step}) + "\n")
        if step == 4:  # a preemption signal after step 4 (not due): the manager saves it and says stop
            watch.requested = True
            held = groups[1]
            held[0].append_response_tokens([7, 8], [-0.25, -0.5])
            held[0].status = Status.ABORTED
            st["data_source"].add_samples([held])
        stopped = ckpt.end_step(step)
        saved_at = [int(p.name[5:]) for p in list_checkpoints(tmp_path)]
        assert stopped == ("signal" if step == 4 else None)
    assert saved_at == [2, 4] and watch.max_save_s > 0
    (tmp_path / "metrics.jsonl").open("a").write(json.dumps({"step": 5}) + "\n")  # logged after the save

    back = states()
    assert manager(back, PreemptionWatch(signal.SIGUSR2)).load() == 5
    assert back["progress"].rollout_id == 4 and back["trained"].rows == st["trained"].rows
    assert back["data_source"].state_dict() == st["data_source"].state_dict()
    assert isinstance(back["data_source"].buffer[0][0], Sample) and back["data_source"].buffer[0][0].tokens[-2:] == [7, 8]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3, 4]
    state = json.loads((tmp_path / "checkpoints" / "iter_0000004" / "state.json").read_text())
    assert state["rollout_id"] == 4 and "buffer" not in state["data_source"] and len(state["metrics"]) == 5


def test_optimizer_classes_in_param_groups_load_back(tp1, tiny_model_dir, tmp_path):
    """megatron's CPU optimizer offload (``megatron.optimizer_cpu_offload``: HybridDeviceOptimizer) keeps its
    sub-optimizer classes (``cpu_optimizer_cls``, ``gpu_optimizer_cls``) in the param groups, which megatron
    pickles into the checkpoint's common state. On an H200 (2026-11-27) such a checkpoint could not be loaded
    (resume and convert failed: torch.load's weights_only refused ``torch.optim.adamw.AdamW``). The same param
    groups on CPU: saved, then loaded into a fresh optimizer, classes and all."""
    from megatron.core import optimizer as megatron_optimizer

    from hpcrl import checkpoint
    from hpcrl.train import model as tmodel

    seed_everything(1234)
    model, opt = tmodel.setup_model_and_optimizer(tiny_model_dir, TRAIN)
    one_step(model, opt)
    classes = {"cpu_optimizer_cls": megatron_optimizer.CPUAdam, "gpu_optimizer_cls": megatron_optimizer.Adam}
    for group in opt.param_groups:
        group.update(classes)
    path = checkpoint.save_checkpoint(tmp_path, 0, model, opt, {"rollout_id": 0})
    model2, opt2 = tmodel.setup_model_and_optimizer(tiny_model_dir, TRAIN)
    checkpoint.load_checkpoint(path, model2, opt2)
    assert all(g["cpu_optimizer_cls"] is megatron_optimizer.CPUAdam for g in opt2.param_groups)
    assert model_tensors(model2).keys() == model_tensors(model).keys()
    assert all(torch.equal(a, model_tensors(model2)[k]) for k, a in model_tensors(model).items())
