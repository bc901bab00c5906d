"""Weight sync time from a megatron-core trainer (this process, TP=1) to hpcrl's CPU engine, per method.

For each model (the tiny random Qwen2, ~1M parameters, and a randomly initialised ~53M-parameter Qwen2:
hidden 768, 6 layers, 12 heads / 6 KV heads, MLP 3072), builds the trainer's GPTModel from the HF folder,
starts ``python -m hpcrl.engine.server`` on it, and runs ``WeightSyncer.sync(iterate_for_sync(model))`` with
each method: ``tensor`` (flattened buckets in shared memory), ``distributed`` (gloo broadcast on loopback) and
``disk`` (safetensors folder in a temporary directory), at each ``--bucket-mb``. One warm-up sync (which
also creates the distributed group), then ``--repeats`` timed syncs; the table shows the median.

Columns: method, bucket (MiB), MB (1e6 bytes synced), buckets, sync s (the whole sync: pause, flush,
transfer, version check, continue), transfer s, GB/s (bytes / transfer seconds / 1e9). CPU, fp32; numbers
are for this machine only (on GPUs the tensor path sends CUDA-IPC handles, not copies).

    python benchmarks/weight_sync.py [--threads 1] [--repeats 3] [--bucket-mb 512 32] [--models tiny 50m]
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

MODELS = {
    "tiny": {},
    "50m": dict(hidden_size=768, num_layers=6, num_heads=12, num_kv_heads=6, intermediate_size=3072),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model_path: str, threads: int, log: Path, extra_args: tuple[str, ...] = ()
                 ) -> tuple[subprocess.Popen, str]:
    """Start the engine (``extra_args``: more server flags) and wait (at most 180 s) for ``/health``.
    Returns (process, base URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "hpcrl.engine.server", "--model-path", model_path, "--port", str(port),
           "--log-level", "warning", *extra_args]
    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
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
    raise TimeoutError(f"engine not healthy after 180 s; see {log}")


def stop_engine(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(15)


async def bench_method(url: str, model, method: str, bucket_bytes: int, repeats: int, disk_dir: str) -> dict:
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer, iterate_for_sync

    async with RolloutClient(engine_urls=[url]) as client:
        syncer = WeightSyncer(client, method, bucket_bytes=bucket_bytes, timeout_s=300, disk_dir=disk_dir)
        try:
            runs = []
            for i in range(repeats + 1):  # the first is a warm-up
                m = await syncer.sync(iterate_for_sync(model), str(i + 1))
                if i:
                    runs.append(m)
        finally:
            await syncer.close()
    return {"method": method, "bucket_mib": bucket_bytes / 2**20, "mb": runs[0]["bytes"] / 1e6,
            "buckets": runs[0]["buckets"], "seconds": statistics.median(r["seconds"] for r in runs),
            "transfer": statistics.median(r["transfer_seconds"] for r in runs),
            "gbps": statistics.median(r["gb_per_s"] for r in runs)}


def bench_model(name: str, model_path: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    from hpcrl.config import TrainSection
    from hpcrl.train import model as tmodel

    t0 = time.perf_counter()
    model, _ = tmodel.setup_model_and_optimizer(model_path, TrainSection())
    params = sum(p.numel() for p in model.parameters())
    print(f"[{name}] trainer model: {params / 1e6:.1f}M parameters, "
          f"built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    proc, url = start_engine(model_path, args.threads, tmp / f"engine-{name}.log")
    rows = []
    try:
        for bucket_mb in args.bucket_mb:
            for method in args.methods:
                if method != "tensor" and bucket_mb != args.bucket_mb[0]:
                    continue  # bucket size matters most for the tensor path; others at the first size only
                row = asyncio.run(bench_method(url, model, method, int(bucket_mb * 2**20), args.repeats,
                                               str(tmp / f"disk-{name}")))
                rows.append({"model": name, **row})
                print(f"[{name}] {method} bucket {bucket_mb} MiB: {row['seconds']:.3f} s", file=sys.stderr)
    finally:
        stop_engine(proc)
        del model
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine and of this process")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per row (after one warm-up)")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[512, 32], help="bucket sizes, MiB")
    p.add_argument("--methods", nargs="+", default=["tensor", "distributed", "disk"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args(argv)

    import torch

    from hpcrl.models.tiny import create_tiny_qwen2
    from hpcrl.train import parallel

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(0)
    rows = []
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models:
                path = create_tiny_qwen2(Path(tmp) / f"qwen2-{name}", **MODELS[name])
                rows += bench_model(name, str(path), args, Path(tmp))
    finally:
        parallel.destroy()
    print(machine_header(threads=args.threads, precision="float32"))
    print(f"weight sync, megatron-core trainer (TP=1) -> hpcrl CPU engine, fp32, {args.threads} thread(s), "
          f"median of {args.repeats}; total {time.perf_counter() - start:.0f} s")
    print(f"{'model':<6} {'method':<12} {'bucket MiB':>10} {'MB':>8} {'buckets':>7} {'sync s':>8} "
          f"{'transfer s':>10} {'GB/s':>7}")
    for r in rows:
        print(f"{r['model']:<6} {r['method']:<12} {r['bucket_mib']:>10.0f} {r['mb']:>8.1f} {r['buckets']:>7} "
              f"{r['seconds']:>8.3f} {r['transfer']:>10.3f} {r['gbps']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
