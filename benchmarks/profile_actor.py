"""Profile one ``Actor.train`` call (the trainer's part of a GRPO step) on the quickstart's shape and print the
median seconds per call and cProfile's top entries by cumulative time.

64 samples (8 prompts x 8 responses of 2-7 tokens, the test suite's ``make_samples``), TP=1, gloo, fp32,
``--threads`` torch threads (default 1, as in ``benchmarks/vs_trl.py``).

    python benchmarks/profile_actor.py [--model DIR] [--calls 20] [--top 30] [--max-tokens 512] [--sort tottime]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / ".cache/models/tiny-qwen2-addition-sft"),
                   help="HF folder (default: the quickstart's SFT model; run the quickstart once first)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="packed micro-batches of at most this many tokens (train.max_tokens_per_microbatch)")
    p.add_argument("--no-share", action="store_true", help="with --max-tokens: train.share_group_prompt off")
    p.add_argument("--sort", default="cumulative", help="cProfile sort key (cumulative, tottime)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(args.threads)
    from hpcrl.train import parallel
    from hpcrl.train.actor import Actor
    from tests.unit import test_actor as helpers

    helpers.N = 8
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(1234)
    samples = helpers.make_samples(args.model, num_groups=8, seed=0, correct_first=True)
    cfg = helpers.make_config(**{"train.micro_batch_size": 64, "train.max_tokens_per_microbatch": args.max_tokens,
                                 "train.share_group_prompt": not args.no_share})
    cfg.rollout.n_samples_per_prompt = 8
    actor = Actor(cfg, args.model)
    for i in range(3):
        actor.train(i, samples)
    times = []
    for i in range(args.calls):
        t0 = time.perf_counter()
        actor.train(i, samples)
        times.append(time.perf_counter() - t0)
    print(machine_header(threads=args.threads, precision="float32"))
    layout = (f"packed <= {args.max_tokens} tokens{'' if args.no_share else ', shared prompts'}"
              if args.max_tokens else "padded")
    print(f"Actor.train on 64 samples ({layout}): median {statistics.median(times):.4f} s over {args.calls} calls "
          f"({args.threads} thread(s))")
    prof = cProfile.Profile()
    prof.enable()
    for i in range(args.calls):
        actor.train(i, samples)
    prof.disable()
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
