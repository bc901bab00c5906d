"""Trainer memory around a colocated offload with torch-memory-saver (issue #3 point 10), on one GPU.

For each model shape a megatron-core :class:`hpcrl.train.actor.Actor` (TP=1, Adam) trains one GRPO step of
8 prompts x 8 samples on the GPU; then :class:`hpcrl.offload.TorchMemorySaverTrainerMemory` - what the
colocated loop calls between training and generation - pauses the trainer's memory and resumes it, and the
actor trains a second step. The table gives, per model: parameters; device memory in use
(``cudaMemGetInfo``: the whole device, what an engine beside the trainer would see) after the first step, while
offloaded and after onload; torch's own count of allocated bytes (unchanged by a pause: the virtual addresses
are kept); the seconds of offload and onload; whether every parameter and optimizer tensor is bitwise equal
after the round trip; and the second step's loss and gradient norm (finite: it trains on).

Model shapes (random init, hpcrl's character tokenizer, so the embeddings are small beside the real models'):
``50m`` (hidden 768, 6 layers, as ``benchmarks/weight_sync.py``), ``smollm2-135m`` (SmolLM2-135M's body: hidden
576, 30 layers, 9 / 3 heads, MLP 1536) and ``qwen2-0.5b`` (Qwen2-0.5B's body: hidden 896, 24 layers, 14 / 2
heads, MLP 4864).

torch-memory-saver pauses only memory allocated under its hook: the script re-executes itself with the hook's
``LD_PRELOAD`` and ``TMS_INIT_ENABLE=1``, ``TMS_INIT_ENABLE_CPU_BACKUP=1``, as hpcrl sets them for a colocated
trainer (``hpcrl.offload.trainer_hook_env``). Needs CUDA and the gpu extra; ``--cpu-smoke`` runs the same steps on the
CPU with the no-op adapter (nothing is freed there) to check the script itself.

    python benchmarks/trainer_offload.py [--models 50m smollm2-135m qwen2-0.5b] [--bf16]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402

MODELS = {
    "50m": dict(hidden_size=768, num_layers=6, num_heads=12, num_kv_heads=6, intermediate_size=3072),
    "smollm2-135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536),
    "qwen2-0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864),
}
GiB = 2**30
PROMPTS, SAMPLES = 8, 8


def grpo_samples(tokenizer, seed: int) -> list:
    """:data:`PROMPTS` x :data:`SAMPLES` addition samples: random digit responses, the first of each group the
    right sum (reward 1, else 0), so every group has advantages. No rollout log-probs (not needed to train)."""
    from hpcrl.data.sample import Sample

    rng = random.Random(seed)
    out = []
    for g in range(PROMPTS):
        a, b = rng.randrange(100, 999), rng.randrange(100, 999)
        prompt = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
        for k in range(SAMPLES):
            text = str(a + b) if k == 0 else "".join(rng.choice("0123456789") for _ in range(rng.randrange(2, 9)))
            response = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            out.append(Sample(group_index=g, index=len(out), prompt=f"{a}+{b}=", label=str(a + b),
                              tokens=prompt + response, response_length=len(response),
                              loss_mask=[1] * len(response), reward=float(k == 0)))
    return out


def state_digest(actor) -> str:
    """sha256 over every parameter and every tensor of the optimizer's state dict, bytes as stored."""
    import torch

    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            h.update(x.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for name, p in actor.model.named_parameters():
        h.update(name.encode())
        walk(p)
    walk(actor.optimizer.state_dict())
    return h.hexdigest()


def device_used() -> int:
    """Bytes in use on the current device, all processes (``total - free`` of ``cudaMemGetInfo``); 0 on CPU."""
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def allocated() -> int:
    """Bytes torch's allocator holds for tensors on the current device; 0 on CPU."""
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def memory_estimate(cfg, path: Path) -> int:
    """``hpcrl validate``'s trainer estimate for this model and config
    (:func:`hpcrl.config.memory.trainer_memory`: weights + gradients + Adam states, bytes), from the model
    folder's ``config.json``."""
    from hpcrl.config.memory import trainer_memory
    from hpcrl.models.params import count_parameters

    hf = json.loads((path / "config.json").read_text())
    return int(trainer_memory(cfg, count_parameters(hf)).total)


def worker(name: str, bf16: bool, cpu_smoke: bool, no_offload: bool = False) -> dict:
    """One model: build, train, offload, onload, train; returns the row. ``no_offload``: the no-op adapter on
    CUDA too (no torch-memory-saver needed; the offload columns then show nothing freed)."""
    import torch
    from transformers import AutoTokenizer

    from hpcrl.config import Config
    from hpcrl.models.tiny import create_tiny_qwen2
    from hpcrl.offload import TorchMemorySaverTrainerMemory, TrainerMemory
    from hpcrl.train import parallel
    from hpcrl.train.actor import Actor

    if not cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("trainer_offload: no CUDA device here (use --cpu-smoke to check the script on a CPU)")
    memory = TrainerMemory() if cpu_smoke or no_offload else TorchMemorySaverTrainerMemory()
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(1234)
    with tempfile.TemporaryDirectory() as tmp:
        path = create_tiny_qwen2(Path(tmp) / name, **MODELS[name])
        tok = AutoTokenizer.from_pretrained(str(path))
        cfg = Config()
        cfg.rollout.n_samples_per_prompt = SAMPLES
        cfg.train.micro_batch_size = 16
        cfg.train.lr = 1e-5
        cfg.train.bf16 = bf16
        actor = Actor(cfg, path)
        estimate = memory_estimate(cfg, path)
    params = sum(p.numel() for p in actor.model.parameters())
    samples = grpo_samples(tok, seed=0)
    first = actor.train(0, samples)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    before, allocated_before = device_used(), allocated()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    digest = state_digest(actor)
    t = time.perf_counter()
    memory.offload()
    sync()
    offload_s = time.perf_counter() - t
    offloaded, allocated_off = device_used(), allocated()
    t = time.perf_counter()
    memory.onload()
    sync()
    onload_s = time.perf_counter() - t
    onloaded = device_used()
    equal = state_digest(actor) == digest
    second = actor.train(1, grpo_samples(tok, seed=1))
    parallel.destroy()
    return {"model": name, "params": params, "before": before, "offloaded": offloaded, "onloaded": onloaded,
            "allocated": allocated_before, "allocated_offloaded": allocated_off, "offload_s": offload_s,
            "onload_s": onload_s, "bitwise_equal": equal, "loss_1": first["train/loss"],
            "loss_2": second["train/loss"], "grad_norm_2": second["train/grad_norm"],
            "adapter": type(memory).__name__, "estimate": estimate, "peak_allocated": peak}


def preload_env() -> dict[str, str]:
    """The environment of a colocated GPU trainer, as ``hpcrl run`` restarts itself with:
    :func:`hpcrl.offload.trainer_hook_env` (the hook preloaded, every allocation in its region, CPU backup on)."""
    from hpcrl.offload import trainer_hook_env

    return trainer_hook_env(os.environ) or dict(os.environ)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--bf16", action="store_true", help="bf16 parameters (train.bf16), else fp32")
    p.add_argument("--cpu-smoke", action="store_true", help="run on the CPU with the no-op adapter")
    p.add_argument("--no-offload", action="store_true",
                   help="no torch-memory-saver: only the memory columns (estimate against torch's peak)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        row = worker(args.worker, args.bf16, args.cpu_smoke, args.no_offload)
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    env = dict(os.environ) if args.cpu_smoke or args.no_offload else preload_env()
    env.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for name in args.models:  # one process per model: a fresh device and a fresh torch-memory-saver
        cmd = ([sys.executable, __file__, "--worker", name] + ["--bf16"] * args.bf16
               + ["--cpu-smoke"] * args.cpu_smoke + ["--no-offload"] * args.no_offload)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        result = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not result:
            print(f"[{name}] failed with exit code {out.returncode}:\n{out.stderr[-4000:]}", file=sys.stderr)
            rows.append({"model": name, "failed": out.returncode})
            continue
        rows.append(json.loads(result[0][len("RESULT "):]))
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(machine_header(threads=torch.get_num_threads(), precision="bf16" if args.bf16 else "fp32"))
    print(f"# trainer offload with torch-memory-saver on {gpu}, torch {torch.__version__}; one GRPO step of "
          f"{PROMPTS} x {SAMPLES} samples before and after; device GiB in use (cudaMemGetInfo), "
          f"torch-allocated GiB; {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"{'model':<13} {'params M':>8} {'step GiB':>8} {'offload GiB':>11} {'onload GiB':>10} "
          f"{'alloc GiB':>9} {'offload s':>9} {'onload s':>8} {'bitwise':>7} {'loss 2':>8} {'gnorm 2':>8}")
    ok = True
    for r in rows:
        if "failed" in r:
            print(f"{r['model']:<13} failed (exit {r['failed']})")
            ok = False
            continue
        finite = math.isfinite(r["loss_2"]) and math.isfinite(r["grad_norm_2"])
        ok &= r["bitwise_equal"] and finite
        print(f"{r['model']:<13} {r['params'] / 1e6:>8.1f} {r['before'] / GiB:>8.2f} {r['offloaded'] / GiB:>11.2f} "
              f"{r['onloaded'] / GiB:>10.2f} {r['allocated'] / GiB:>9.2f} {r['offload_s']:>9.3f} "
              f"{r['onload_s']:>8.3f} {str(r['bitwise_equal']):>7} {r['loss_2']:>8.4f} {r['grad_norm_2']:>8.3f} "
              f"{r['estimate'] / GiB:>7.2f} {r['peak_allocated'] / GiB:>8.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
