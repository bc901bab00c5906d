"""Throughput of hpcrl's CPU reference engine at concurrency 1 and 64 (generated tokens per second).

Starts ``python -m hpcrl.engine.server`` on a free loopback port (on the tiny random Qwen2 unless
``--model-path`` is given), sends ``/generate`` requests with ``--prompt-len`` token prompts and
``--new-tokens`` sampled tokens (temperature 1, ``ignore_eos`` so every request generates exactly that many),
``concurrency`` requests in flight at a time, and prints a table: batch (concurrency), requests, generated
tokens, seconds, tokens/s.

    python benchmarks/engine_throughput.py [--model-path DIR] [--threads 1] [--batches 1 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited with code {proc.returncode}")
            try:
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"engine not healthy after {timeout} s")


async def run_level(url: str, concurrency: int, requests: int, prompt_len: int, new_tokens: int,
                    vocab: int, seed: int) -> tuple[int, int, float]:
    """Send ``requests`` requests, ``concurrency`` at a time. Returns (requests, generated tokens,
    seconds)."""
    import aiohttp

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    sem = asyncio.Semaphore(concurrency)
    tokens = 0
    timeout = aiohttp.ClientTimeout(total=600)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(prompt: list[int]) -> None:
            nonlocal tokens
            body = {"input_ids": prompt, "sampling_params": {"temperature": 1.0, "max_new_tokens": new_tokens,
                                                             "ignore_eos": True}}
            async with sem:
                async with session.post(url + "/generate", json=body) as r:
                    r.raise_for_status()
                    out = await r.json()
            tokens += len(out["output_ids"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return requests, tokens, time.perf_counter() - t0


async def main_async(args: argparse.Namespace, model_path: str) -> list[tuple]:
    import json

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "hpcrl.engine.server", "--model-path", model_path, "--port", str(port),
           "--max-running-requests", str(max(args.batches)), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    try:
        await wait_healthy(url, proc, 120)
        vocab = json.loads(Path(model_path, "config.json").read_text())["vocab_size"]
        await run_level(url, 4, 4, args.prompt_len, 2, vocab, seed=0)  # warm-up
        rows = []
        for batch in args.batches:
            n = max(args.min_requests, batch * args.rounds)
            rows.append((batch, *await run_level(url, batch, n, args.prompt_len, args.new_tokens, vocab,
                                                 batch)))
        return rows
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="HF folder (default: a fresh tiny random Qwen2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server (OMP_NUM_THREADS)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="concurrency levels")
    p.add_argument("--rounds", type=int, default=2,
                   help="requests per level = max(min_requests, batch * rounds)")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model_path
        if model_path is None:
            from hpcrl.models.tiny import create_tiny_qwen2

            model_path = str(create_tiny_qwen2(Path(tmp) / "tiny-qwen2"))
        rows = asyncio.run(main_async(args, model_path))
    print(machine_header(threads=args.threads, precision="float32 (the engine's default dtype)"))
    print(f"hpcrl CPU engine, {model_path if args.model_path else 'tiny Qwen2 (~1M params)'}, "
          f"{args.threads} threads, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          "temperature 1")
    print(f"{'batch':>5} {'requests':>8} {'gen tokens':>10} {'seconds':>8} {'tokens/s':>9}")
    for batch, n, tokens, secs in rows:
        print(f"{batch:>5} {n:>8} {tokens:>10} {secs:>8.2f} {tokens / secs:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
