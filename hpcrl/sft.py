"""Supervised warm start (``hpcrl sft``): teach the base model the task's answer format before RL.

RL from a random-init model gets no reward signal, so the CI model (and any model that does not yet answer in
the task's format) first learns from demonstrations: each train item becomes ``prompt + label + eos``, with the
loss on the label and eos tokens only. This is a *warm start* trained with plain PyTorch AdamW on the HF model
in this process (no parallelism, no Megatron); the Megatron trainer (``hpcrl/train/``) is for RL and comes in a
later issue. The result is an ordinary HF folder at ``sft.output`` that RL then starts from, and it is a cache:
when the folder exists and was made from the same inputs (its ``sft_key.json``: the base model's files, the data,
the seed and the recipe, see :func:`cache_key`), :func:`run_sft` returns it without training; otherwise it trains
again and replaces it.

The warm start ends on accuracy, not on a step count: learning 3-digit addition from scratch is a sharp phase
transition (greedy accuracy goes from ~1% to ~40% within 50-100 steps) whose step moves with the seed *and*
with the CPU's rounding (seed 1234 gave 39.4% at step 600 on one machine and 12.3% on an AVX2-only EPYC).
With ``sft.target_accuracy`` the eval runs every ``sft.eval_interval`` steps and training stops at the first
eval at or above the target; ``sft.steps`` is only a cap, and the lr (warmup, then cosine over the cap) is still
near its peak when the target is reached. The rise near the target is steep (seed 1 on an Intel Xeon: 6.5%,
14.9%, 31.4%, 50.6% at steps 270-300), so every 10 steps can overshoot a 35% target by 15 points; with
``sft.eval_interval_near_target`` the eval runs that often once it has reached a quarter of the target
(:data:`NEAR_TARGET_FRACTION`).

Measured (AMD EPYC, AVX2 only, 1 thread, 3-digit addition, the tiny Qwen2 (hidden 128, 4 layers, tied
embeddings), lr 3e-3, batch 256, eval every 20 steps): seed 1 went 0.067, 0.134, 0.340 at steps 180-220 and then
hovered at 0.33-0.43; seed 2 went 0.143, 0.338, 0.444 at steps 360-400. The recipe below (AdamW betas 0.9/0.999, no weight decay, clip 1.0, warmup then cosine to 10%) beat betas
0.9/0.95 (27%), weight decay 0.1 (5%) and a constant lr (40%) at seed 1234.

What RL can do from the warm start depends on more than its greedy accuracy: GRPO only sharpens answers the
model already samples (a group whose samples are all wrong carries no signal), so the fraction of problems with
at least one right answer in 8 samples bounds where RL ends. At lr 3e-3 some seeds stop SFT with a model that
never samples the answer to ~45% of the problems (seed 1: 0.383 greedy, 55% of problems covered; GRPO then
stalled at 0.50); at lr 1e-3 the same seeds cross the target as a more complete model (seed 1: 0.388 greedy, 68%
covered; GRPO reached 0.75), after about as many steps. The quickstart uses 1e-3 (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from hpcrl.config import Config

log = logging.getLogger(__name__)

METRICS_FILENAME = "sft_metrics.jsonl"
"""Per-step metrics, written inside the ``sft.output`` folder (so they are cached with the model)."""
KEY_FILENAME = "sft_key.json"
"""The cache key (:func:`cache_key`) of the model in ``sft.output``."""
LOG_INTERVAL = 10
"""A training-metrics line every this many steps."""
NEAR_TARGET_FRACTION = 0.25
"""Once an eval reaches this fraction of ``sft.target_accuracy``, evals run every
``sft.eval_interval_near_target`` steps (3-digit addition: 10% of a 40% target, ~15 steps before it)."""
WARMUP_FRACTION = 0.05
MAX_WARMUP_STEPS = 50
MIN_LR_RATIO = 0.1
"""Cosine decay from ``sft.lr`` to ``MIN_LR_RATIO * sft.lr`` at ``sft.steps``."""
GRAD_CLIP = 1.0
ADAM_BETAS = (0.9, 0.999)
WEIGHT_DECAY = 0.0
IGNORE_INDEX = -100


def lr_at(step: int, total_steps: int, lr: float) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``: linear warmup over
    ``min(MAX_WARMUP_STEPS, WARMUP_FRACTION * total_steps)`` steps (at least 1), then cosine to
    ``MIN_LR_RATIO * lr``."""
    warmup = max(1, min(MAX_WARMUP_STEPS, int(WARMUP_FRACTION * total_steps)))
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Demonstrations:
    """Tokenized SFT examples, right-padded to a common width.

    ``input_ids``: [N, L] int64 (pad id after the sequence); ``labels``: [N, L] int64, the token ids of the
    label + eos positions and :data:`IGNORE_INDEX` elsewhere (prompt and padding); ``attention_mask``: [N, L].
    """

    input_ids: Any
    labels: Any
    attention_mask: Any

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def prompt_text(tokenizer: Any, prompt: Any, apply_chat_template: bool = False) -> str:
    """The text the model sees for an item's ``prompt``: the string itself, or the chat template applied to a
    message list (or to a string when ``apply_chat_template``), with the generation prompt added."""
    if isinstance(prompt, str) and not apply_chat_template:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def build_demonstrations(tokenizer: Any, items: Sequence[dict[str, Any]],
                         apply_chat_template: bool = False) -> Demonstrations:
    """Tokenize ``items`` (``{"prompt", "label"}``) as ``prompt + str(label) + eos`` demonstrations.

    The prompt is tokenized with the tokenizer's defaults (as in :mod:`hpcrl.eval`), the label separately
    without special tokens, so the label tokens are exactly what the model would generate after the prompt.
    Raises ValueError when an item has no label or the tokenizer has no eos token.
    """
    import torch

    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token; SFT demonstrations end with eos")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    rows = []
    for i, it in enumerate(items):
        if it.get("label") is None:
            raise ValueError(f"SFT needs labels: train item {i} (prompt {str(it.get('prompt'))[:60]!r}) has none")
        p = tokenizer(prompt_text(tokenizer, it["prompt"], apply_chat_template))["input_ids"]
        a = tokenizer(str(it["label"]), add_special_tokens=False)["input_ids"] + [eos]
        rows.append((p, a))
    width = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (p, a) in enumerate(rows):
        seq = torch.tensor(p + a, dtype=torch.long)
        input_ids[r, :len(seq)] = seq
        labels[r, len(p):len(seq)] = seq[len(p):]
        mask[r, :len(seq)] = 1
    return Demonstrations(input_ids=input_ids, labels=labels, attention_mask=mask)


def sft_loss(model: Any, input_ids: Any, attention_mask: Any, labels: Any):
    """Mean next-token cross entropy over the label positions (``labels != IGNORE_INDEX``) of a batch.

    Shapes: all [B, L]. Returns a scalar tensor (nats per label token).
    """
    import torch.nn.functional as F

    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX)


def _batches(n: int, batch_size: int, generator: Any):
    """Endless index batches: a fresh seeded permutation each epoch, batches may span epochs."""
    import torch

    buf = torch.empty(0, dtype=torch.long)
    while True:
        while len(buf) < batch_size:
            buf = torch.cat([buf, torch.randperm(n, generator=generator)])
        yield buf[:batch_size]
        buf = buf[batch_size:]


def _sha256_files(paths: Sequence[Path], root: Optional[Path] = None) -> str:
    """sha256 over the relative names and the bytes of ``paths`` (in the given order)."""
    h = hashlib.sha256()
    for f in paths:
        h.update((f.relative_to(root) if root else f).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def cache_key(cfg: "Config", base: Path) -> dict[str, Any]:
    """What determines the SFT result, as a JSON-able dict: the sha256 of the base model folder's files, the
    data (source, sizes, task arguments, and the sha256 of file sources), ``run.seed``, the recipe
    (``sft.*`` but ``enabled``/``output``), the eval's response limits (they decide where a target stops
    training) and ``model.dtype``. Two configs with equal keys train bitwise-equal models on one machine."""
    d = cfg.data
    files = [Path(p) for p in (d.source, d.eval_source or "") if p and Path(p).is_file()]
    return {
        "base_model_sha256": _sha256_files(sorted(f for f in base.rglob("*") if f.is_file()), root=base),
        "data": {"source": d.source, "eval_source": d.eval_source, "num_train": d.num_train,
                 "num_eval": d.num_eval, "task_kwargs": d.task_kwargs, "prompt_key": d.prompt_key,
                 "label_key": d.label_key, "apply_chat_template": d.apply_chat_template,
                 "files_sha256": _sha256_files(files) if files else None},
        "seed": cfg.run.seed,
        "sft": {k: getattr(cfg.sft, k) for k in ("steps", "batch_size", "lr", "target_accuracy",
                                                  "eval_interval", "eval_interval_near_target")},
        "eval": {"max_new_tokens": cfg.rollout.max_new_tokens, "stop": list(cfg.rollout.stop)},
        "dtype": cfg.model.dtype,
    }


def _cached(out: Path, key: dict[str, Any]) -> bool:
    """True when ``out`` holds a finished SFT model made with ``key``."""
    try:
        return json.loads((out / KEY_FILENAME).read_text()) == json.loads(json.dumps(key))
    except (OSError, ValueError):
        return False


def run_sft(cfg: "Config") -> Path:
    """Supervised warm start of ``cfg.model`` on the task's demonstrations; returns the ``cfg.sft.output`` folder.

    :func:`~hpcrl.models.hf.ensure_model` creates the base model if needed. The demonstrations are
    ``sft.data`` when set (a data section of their own: an agent run warm-starts on tool-use demonstrations,
    then trains on the task's prompts), else the run's ``data``; everything below that says ``data`` means
    that section. When ``sft.output`` exists with the same :func:`cache_key` it is returned at once (the
    cache). Otherwise: train/eval items come from :func:`hpcrl.data.datasets.load_datasets`; the model is
    trained in float32 with AdamW (betas :data:`ADAM_BETAS`, weight decay :data:`WEIGHT_DECAY`, grad-norm clip
    :data:`GRAD_CLIP`, linear warmup then cosine decay, see :func:`lr_at`) for at most ``sft.steps`` optimizer
    steps of ``sft.batch_size`` demonstrations at peak lr ``sft.lr``. Greedy accuracy on the eval items
    (responses of at most ``rollout.max_new_tokens`` tokens, cut at eos and ``rollout.stop``) is measured
    before the first step, every ``sft.eval_interval`` steps (every ``sft.eval_interval_near_target`` steps
    once an eval reached :data:`NEAR_TARGET_FRACTION` of the target) and after the last; training stops at the
    first eval that reaches ``sft.target_accuracy``. The model (in ``model.dtype``), tokenizer and
    ``sft_metrics.jsonl`` (one JSON object per line: ``step``, ``loss`` in nats per label token, ``lr``,
    ``grad_norm``, ``elapsed_s`` in seconds since the start; eval lines have ``eval_accuracy`` instead) are
    written to a temp folder and renamed to ``sft.output`` (atomic), so the metrics are cached with the model;
    ``sft_key.json`` holds the key. A cached folder with another key is replaced (the old one is moved aside,
    the new one renamed into place, the old one deleted).

    Deterministic given ``run.seed`` (bitwise-equal weights across runs; measured equal with 1 and 2 torch
    threads). Uses the threads torch is set to (``torch.set_num_threads``).

    Raises ValueError when ``sft.output`` is empty, ``sft.steps``/``sft.batch_size`` < 1 or an item has no
    label; the errors of ``ensure_model`` and ``load_datasets``.
    """
    import torch

    from hpcrl.data.datasets import load_datasets
    from hpcrl.eval import greedy_accuracy
    from hpcrl.models.hf import ensure_model, load_hf_model

    sft = cfg.sft
    if sft.data is not None:
        cfg = dataclasses.replace(cfg, data=sft.data)
    if not sft.output:
        raise ValueError("sft.output is empty; set it to the folder the SFT model is saved to")
    out = Path(sft.output)
    if sft.steps < 1 or sft.batch_size < 1:
        raise ValueError(f"sft.steps ({sft.steps}) and sft.batch_size ({sft.batch_size}) must be >= 1")

    t_start = time.perf_counter()
    base = ensure_model(cfg.model, seed=cfg.run.seed)
    key = cache_key(cfg, Path(base))
    if _cached(out, key):
        log.info("sft: %s was made from the same base model, data, seed and recipe: using it", out)
        return out
    if out.exists():
        log.info("sft: %s was made from other inputs (%s differs from this run's): training again", out,
                 KEY_FILENAME)
    data = load_datasets(cfg)
    model, tokenizer = load_hf_model(base, dtype="float32")
    demos = build_demonstrations(tokenizer, data.train, cfg.data.apply_chat_template)
    eval_items = [dict(it, prompt=prompt_text(tokenizer, it["prompt"], cfg.data.apply_chat_template))
                  for it in data.eval]
    stop = list(cfg.rollout.stop) or None

    def evaluate() -> float:
        return greedy_accuracy(model, tokenizer, eval_items, data.task.score, cfg.rollout.max_new_tokens,
                               stop=stop)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        with open(tmp / METRICS_FILENAME, "w", encoding="utf-8") as metrics:
            def record(row: dict[str, Any]) -> None:
                row["elapsed_s"] = round(time.perf_counter() - t_start, 3)
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()

            with torch.random.fork_rng():
                torch.manual_seed(cfg.run.seed)
                _train(model, demos, sft, evaluate, record, seed=cfg.run.seed)
        if cfg.model.dtype != "float32":
            model.to(getattr(torch, cfg.model.dtype))
        model.eval()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / KEY_FILENAME).write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
        if out.exists():
            os.replace(out, old)  # a stale cache (another key) goes aside, then the new one takes its name
        try:
            os.replace(tmp, out)
        except OSError:
            if not out.exists():
                raise
            log.warning("sft: %s appeared while training (another run?); keeping it, discarding this one", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    log.info("sft: saved %s (%.1f s)", out, time.perf_counter() - t_start)
    return out


def _train(model: Any, demos: Demonstrations, sft: Any, evaluate: Any, record: Any, seed: int) -> None:
    """The SFT loop: AdamW steps over seeded batches, metrics via ``record``, evals via ``evaluate`` (every
    ``sft.eval_interval`` steps, every ``sft.eval_interval_near_target`` once near the target)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    batches = _batches(len(demos), sft.batch_size, generator)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=sft.lr, betas=ADAM_BETAS, weight_decay=WEIGHT_DECAY)
    target = sft.target_accuracy
    near = sft.eval_interval_near_target if target is not None else None
    interval, last_eval = sft.eval_interval, 0

    def eval_and_record(step: int) -> bool:
        nonlocal interval, last_eval
        acc = evaluate()
        record({"step": step, "eval_accuracy": acc})
        log.info("sft: step %d eval accuracy %.3f", step, acc)
        last_eval = step
        if near and interval != near and acc >= NEAR_TARGET_FRACTION * target:
            interval = near
            log.info("sft: near the target: eval every %d steps", interval)
        return target is not None and acc >= target

    if eval_and_record(0):
        return
    model.train()
    for step in range(1, sft.steps + 1):
        idx = next(batches)
        mask = demos.attention_mask[idx]
        width = int(mask.sum(1).max())
        lr = lr_at(step - 1, sft.steps, sft.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = sft_loss(model, demos.input_ids[idx, :width], mask[:, :width], demos.labels[idx, :width])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        if step % LOG_INTERVAL == 0 or step == 1:
            record({"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item()})
        if step - last_eval >= interval or step == sft.steps:
            model.eval()
            done = eval_and_record(step)
            model.train()
            if done:
                log.info("sft: target accuracy %.3f reached at step %d", target, step)
                return
