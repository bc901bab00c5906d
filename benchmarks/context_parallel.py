"""Peak memory per rank of one long packed sample at context parallel size 1 and 2 (issue #55 point 2).

A sample of ``--tokens`` tokens (prompt, then a ``--response``-token response) as one packed micro-batch of the
actor's (``train.max_tokens_per_microbatch``), through the trainer's forward (``hpcrl.train.forward``) and a
backward of its log-probs, on a tiny Qwen2 (hidden 128, 4 layers, 4 heads; positions up to the sample's length)
in fp32, one torch thread per rank. Each layout runs under ``torchrun`` with ``CP`` processes; every rank reads
its resident-memory high-water mark (``VmHWM``) after resetting it just before the pass
(``/proc/self/clear_refs``), so the figure is the most memory the rank held during the forward and backward,
minus what it held before (the model, the optimizer, the imports). The context-parallel rank holds ``T / CP``
rows of every activation and the attention scores of its queries against all keys: its peak is about half of
CP=1's; the whole-pack keys and values it gathers are the part that does not shrink.

    python benchmarks/context_parallel.py [--tokens 4096] [--response 256] [--cps "1 2"]

Prints the machine header and a table; results in docs/performance.md ("Context parallelism").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import machine_header  # noqa: E402

MiB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worker(model_dir: str, tokens: int, response: int, out: str) -> None:
    """One rank: the model at this CP size, one forward + backward of the long sample, its peak."""
    import torch

    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from hpcrl.config import TrainSection
    from hpcrl.data.sample import Sample
    from hpcrl.train import model as tmodel
    from hpcrl.train import parallel
    from hpcrl.train.actor import build_micro_batch, sequence_multiple
    from hpcrl.train.bridge import unwrap_model
    from hpcrl.train.context_parallel import context_parallel
    from hpcrl.train.forward import staged_log_probs

    env = parallel.init_distributed()
    parallel.initialize_model_parallel(cp=env.world_size)
    parallel.model_parallel_cuda_manual_seed(1234)
    ddp, _ = tmodel.setup_model_and_optimizer(model_dir, TrainSection())
    bare = unwrap_model(ddp)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, bare.hf_config.vocab_size, (tokens,), generator=g).tolist()
    sample = Sample(index=0, tokens=ids, response_length=response, loss_mask=[1] * response,
                    rollout_log_probs=[0.0] * response, reward=1.0)
    mb = build_micro_batch([sample], [0], [torch.zeros(response)], packed=True,
                           pad_to_multiple=sequence_multiple(bare.config))
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    staged = staged_log_probs(ddp, bare, mb, 1.0, False, bare.hf_config.vocab_size)
    loss = -staged.finish(staged.output).log_probs.sum()
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    cp, rank, _ = context_parallel()
    row = {"cp": cp, "rank": rank, "rows": int(mb.pack.tokens.shape[1]) // cp, "before_mib": before / 1024,
           "peak_mib": peak / 1024, "pass_mib": (peak - before) / 1024, "seconds": seconds,
           "loss": float(loss)}
    Path(out).with_suffix(f".{env.rank}.json").write_text(json.dumps(row))
    parallel_state.destroy_model_parallel()
    parallel.destroy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--cps", default="1 2")
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "TOKENS", "RESPONSE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        model, tokens, response, out = args.worker
        worker(model, int(tokens), int(response), out)
        return
    from hpcrl.models.tiny import create_tiny_qwen2

    print(machine_header(threads=1, precision="float32"))
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_qwen2(Path(tmp) / "tiny", seed=0, max_position_embeddings=args.tokens)
        rows = []
        for cp in (int(c) for c in args.cps.split()):
            out = Path(tmp) / f"cp{cp}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={cp}",
                   "--master_addr=127.0.0.1", f"--master_port={29500 + cp}", __file__, "--worker", str(model),
                   str(args.tokens), str(args.response), str(out)]
            subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                           stdout=subprocess.DEVNULL)
            rows += [json.loads(out.with_suffix(f".{r}.json").read_text()) for r in range(cp)]
        hf = json.loads((Path(model) / "config.json").read_text())
    print(f"one packed sample of {args.tokens} tokens ({args.response} response), tiny Qwen2 (hidden 128, "
          f"4 layers, 4 heads), forward + backward of its log-probs; 'estimate': hpcrl validate's activation "
          f"term for this micro-batch (hpcrl.config.memory.activation_bytes: no attention scores, which a fused "
          f"GPU kernel does not store and this CPU path does)")
    print("| CP | rank | rows | RSS before (MiB) | peak during the pass (MiB) | pass (MiB above before) | "
          "estimate (MiB) | s | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cp']} | {r['rank']} | {r['rows']} | {r['before_mib']:.0f} | {r['peak_mib']:.0f} | "
              f"{r['pass_mib']:.0f} | {estimate(hf, args.tokens, r['cp']) / MiB:.0f} | {r['seconds']:.1f} | "
              f"{r['loss']:.4f} |")


def estimate(hf: dict, tokens: int, cp: int) -> float:
    """The activation bytes ``hpcrl validate`` estimates for one micro-batch of ``tokens`` on a CP rank (fp32,
    no recompute, one stage)."""
    from hpcrl.config import Config
    from hpcrl.config.memory import activation_bytes

    cfg = Config()
    cfg.train.max_tokens_per_microbatch, cfg.train.context_parallel_size, cfg.train.bf16 = tokens, cp, False
    return activation_bytes(cfg, hf, int(hf["num_hidden_layers"]), 0, 1)


if __name__ == "__main__":
    main()
