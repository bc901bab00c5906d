"""Rollout routing replay's gate (issue #15 point 3): routing and log-prob mismatch with and without replay.

The rollout engine serves a tiny Qwen3-MoE in bf16 while the trainer (megatron-core, fp32) computes the same
samples' log-probs: bf16 rounding flips some tokens' top-k expert choice. For every sampled token this prints

- the fraction of fed tokens whose experts (in any MoE layer) differ between the trainer's forward and the
  engine's ``return_routed_experts``, measured from the experts the trainer's routers actually used (their
  ``routing_map`` output), not assumed;
- the train/rollout log-prob difference of the response tokens (mean and max of ``|trainer - engine|``),

once with the trainer routing on its own and once replaying the engine's routing
(:mod:`hpcrl.train.routing_replay`, megatron-core's ``RouterReplay``). Replay must make the routing difference
0 and the log-prob difference smaller (``tests/integration/test_routing_replay.py`` runs :func:`measure` and
asserts both). Results in docs/performance.md.

    python benchmarks/routing_replay.py [--family qwen3_moe|glm4_moe] [--prompts 16] [--samples 4]
        [--max-new-tokens 24]

``--family glm4_moe`` measures the tiny GLM-4.5-style model instead (:data:`GLM_MODEL`: sigmoid router with
expert bias, 2 groups, the first layer dense, a shared expert).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
from machine import machine_header  # noqa: E402
from weight_sync import start_engine, stop_engine  # noqa: E402

MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8, top_k=2,
             moe_intermediate_size=128, seed=3)
"""The tiny Qwen3-MoE measured (random weights: many near-ties between experts, where precision decides)."""
GLM_MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8,
                 top_k=2, moe_intermediate_size=128, intermediate_size=256, seed=3)
"""The tiny GLM-4.5-style model measured with ``--family glm4_moe`` (4 layers: 1 dense, 3 MoE)."""
DEEPSEEK_MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, head_dim=32, num_experts=8, top_k=2,
                      moe_intermediate_size=128, intermediate_size=256, seed=3)
"""The tiny DeepSeek-V3-style model measured with ``--family deepseek_v3`` (MLA; 4 layers: 1 dense, 3 MoE)."""
FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3")


def sample_from_engine(url: str, prompts: list[list[int]], samples: int, max_new_tokens: int, seed: int) -> list:
    """``[(tokens, response_length, engine log-probs [R], routed experts [n - 1, layers, top_k])]`` of
    ``samples`` sampled responses per prompt (temperature 1)."""
    out = []
    for i, prompt in enumerate(prompts):
        body = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                "sampling_params": {"n": samples, "max_new_tokens": max_new_tokens, "temperature": 1.0,
                                    "ignore_eos": True, "sampling_seed": seed + i}}
        req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answers = json.loads(r.read())
        for a in answers if isinstance(answers, list) else [answers]:
            out.append((prompt + a["output_ids"], len(a["output_ids"]),
                        [t[0] for t in a["meta_info"]["output_token_logprobs"]], a["meta_info"]["routed_experts"]))
    return out


def measure(model_dir: Path, engine_url: str, prompts: list[list[int]], samples: int, max_new_tokens: int,
            seed: int = 0) -> list[dict]:
    """One row per mode (``no replay``, ``replay``): ``tokens`` fed, ``routing_differs`` (fraction of fed
    tokens), ``logprob_mean`` / ``logprob_max`` (``|trainer - engine|`` over response tokens). Needs
    megatron-core's parallel state (world of 1) to be initialised."""
    import torch
    from transformers import AutoConfig

    from hpcrl.engine.routing import decode
    from hpcrl.train import bridge, routing_replay
    from hpcrl.train.logprobs import response_log_probs

    hf_config = AutoConfig.from_pretrained(str(model_dir))
    model = bridge.build_gpt_model(hf_config, moe_enable_routing_replay=True)
    bridge.load_hf_weights(model, model_dir)
    model.eval()
    layers, top_k = routing_replay.moe_layer_count(model.config), hf_config.num_experts_per_tok
    used: list = []
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
    for r in routers:
        r.register_forward_hook(lambda mod, args, out: used.append(out[1].detach()))  # routing_map [tokens, E]
    data = sample_from_engine(engine_url, prompts, samples, max_new_tokens, seed)
    rows = []
    for mode in ("no replay", "replay"):
        fed = differs = 0
        diffs: list[float] = []
        for tokens, resp, engine_lp, routed_text in data:
            n = len(tokens)
            routed = torch.from_numpy(decode(routed_text, n, layers, top_k).copy())
            indices = routing_replay.padded_indices([routed], [n], n, layers, top_k) if mode == "replay" else None
            used.clear()
            with torch.no_grad(), routing_replay.replaying(indices):
                out = response_log_probs(model, torch.tensor([tokens]), [n], [resp])
            diffs += (out.log_probs[0] - torch.tensor(engine_lp)).abs().tolist()
            trainer_sets = torch.stack(used, dim=1)[: n - 1]  # [n - 1, layers, experts] bool, tokens 0..n-2
            engine_sets = torch.zeros_like(trainer_sets).scatter_(2, routed.long(), True)
            differs += int((trainer_sets != engine_sets).any(dim=2).any(dim=1).sum())
            fed += n - 1
        rows.append(dict(mode=mode, tokens=fed, routing_differs=differs / fed,
                         logprob_mean=sum(diffs) / len(diffs), logprob_max=max(diffs)))
    return rows


def measure_family(family: str, folder: Path, prompts: int, samples: int, max_new_tokens: int,
                   threads: int = 1) -> list[dict]:
    """Create the tiny ``family`` model (``qwen3_moe``: :data:`MODEL`, ``glm4_moe``: :data:`GLM_MODEL`,
    ``deepseek_v3``: :data:`DEEPSEEK_MODEL`) in
    ``folder``, serve it with a bf16 engine (``threads`` threads), build the fp32 megatron-core trainer at
    TP=1 in this process and :func:`measure` ``prompts`` addition prompts (``"137+263="``-style, character
    tokenizer) x ``samples`` samples x ``max_new_tokens`` tokens, without and with replay; the engine and the
    model-parallel state are torn down afterwards. Returns :func:`measure`'s rows. Raises ValueError for
    another family."""
    from hpcrl.models import tiny
    from hpcrl.train import parallel

    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not measured here ({', '.join(FAMILIES)})")
    tok = tiny.build_char_tokenizer()
    ids = [tok(f"{100 + 37 * i}+{250 + 13 * i}=")["input_ids"] for i in range(prompts)]
    create, sizes = {"qwen3_moe": (tiny.create_tiny_qwen3_moe, MODEL),
                     "glm4_moe": (tiny.create_tiny_glm4_moe, GLM_MODEL),
                     "deepseek_v3": (tiny.create_tiny_deepseek_v3, DEEPSEEK_MODEL)}[family]
    model_dir = create(Path(folder) / "moe", **sizes)
    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(0)
    try:
        proc, url = start_engine(str(model_dir), threads, Path(folder) / "engine.log",
                                 ("--dtype", "bfloat16"))
        try:
            return measure(model_dir, url, ids, samples, max_new_tokens)
        finally:
            stop_engine(proc)
    finally:
        parallel.destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure_family(args.family, Path(tmp), args.prompts, args.samples, args.max_new_tokens,
                              args.threads)
    print(machine_header(threads=args.threads, precision="engine bfloat16, trainer float32"))
    grouped = "8 experts + 1 shared, top-2 in 1 of 2 groups, sigmoid + expert bias, 4 layers of which 1 dense"
    name = {"glm4_moe": f"tiny GLM-4.5-style ({grouped}",
            "deepseek_v3": f"tiny DeepSeek-V3-style (MLA with YaRN; {grouped}",
            "qwen3_moe": "tiny Qwen3-MoE (8 experts, top-2, 4 layers"}[args.family]
    print(f"{name}, random weights), {args.prompts} prompts x {args.samples} "
          f"samples x {args.max_new_tokens} tokens; {time.perf_counter() - start:.0f} s")
    print("| trainer routing | fed tokens | tokens routed differently | |logprob diff| mean | max |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['tokens']} | {100 * r['routing_differs']:.2f}% | {r['logprob_mean']:.5f} "
              f"| {r['logprob_max']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
