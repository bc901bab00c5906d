"""One rollout step: generate groups through the engines, score them, filter them (slime's ``generate_rollout``).

Over-sampling plus a dynamic filter: prompts are submitted ``rollout.over_sampling_batch_size`` groups at a
time; finished groups are taken **in submission order** (so a seeded run is reproducible whatever the timing)
and kept when the dynamic filter accepts them, until ``rollout.batch_size`` groups are kept. The rest are then
aborted on every engine and pushed back to the data source: partial responses are kept for the next step when
``rollout.partial_rollout`` is on, otherwise the groups go back as fresh prompts. So no prompt is ever dropped
by an abort; groups the filter rejects are dropped, as in slime.

A custom rollout (slime ``--rollout-function-path``) has the signature of :func:`generate_rollout`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from hpcrl.data.sample import Sample, Status
from hpcrl.rollout.client import RolloutClient

MAX_OVERSAMPLING_FACTOR = 32
"""A rollout gives up after submitting this many times ``batch_size`` groups without keeping enough."""

RewardFn = Callable[[Sample], Awaitable[Any]]
GroupFilter = Callable[[list[Sample]], bool]


@dataclass
class RolloutContext:
    """What a rollout needs besides the config: the client, tokenizer and the resolved plug-ins."""

    client: RolloutClient
    tokenizer: Any
    reward_fn: RewardFn
    generate_fn: Callable[[RolloutClient, Sample, dict], Awaitable[Sample]]
    dynamic_filter: Optional[GroupFilter] = None
    seed: int = 0


@dataclass
class RolloutOutput:
    """Kept groups (``[batch_size][n_samples_per_prompt]`` samples) and rollout metrics (seconds, counts)."""

    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)


def sampling_params(rollout_cfg, evaluation: bool = False) -> dict[str, Any]:
    """SGLang ``sampling_params`` from the ``rollout`` config section; greedy (temperature 0) for evaluation."""
    params: dict[str, Any] = {
        "max_new_tokens": rollout_cfg.max_new_tokens,
        "temperature": 0.0 if evaluation else rollout_cfg.temperature,
        "top_p": 1.0 if evaluation else rollout_cfg.top_p,
        "top_k": -1 if evaluation else rollout_cfg.top_k,
        "no_stop_trim": True,
    }
    if rollout_cfg.stop:
        params["stop"] = list(rollout_cfg.stop)
    if rollout_cfg.stop_token_ids:
        params["stop_token_ids"] = list(rollout_cfg.stop_token_ids)
    return params


def sample_seed(run_seed: int, sample_index: int) -> int:
    """Per-sample ``sampling_seed`` (< 2**31), a hash of the run seed and the global sample index."""
    digest = hashlib.sha256(f"{run_seed}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def tokenize_prompt(tokenizer, sample: Sample, apply_chat_template: bool = False) -> None:
    """Fill ``sample.tokens`` with the prompt's token ids (once; partial samples keep their tokens)."""
    if sample.tokens:
        return
    if apply_chat_template and isinstance(sample.prompt, list):
        ids = tokenizer.apply_chat_template(sample.prompt, add_generation_prompt=True, tokenize=True)
    else:
        ids = tokenizer(sample.prompt, add_special_tokens=True)["input_ids"]
    sample.tokens = list(ids)


def reset_sample(sample: Sample) -> None:
    """Drop a sample's response so it goes back to the data source as a fresh prompt."""
    del sample.tokens[sample.prompt_length:]
    sample.response, sample.response_length = "", 0
    sample.loss_mask.clear()
    sample.rollout_log_probs.clear()
    sample.weight_versions.clear()
    sample.reward, sample.status = None, Status.PENDING


async def _generate_group(cfg, ctx: RolloutContext, group: list[Sample], params: dict, evaluation: bool):
    for s in group:
        tokenize_prompt(ctx.tokenizer, s, cfg.data.apply_chat_template)
    calls = []
    for s in group:
        if s.status not in (Status.PENDING, Status.ABORTED):
            continue  # finished in an earlier, aborted rollout (partial rollout)
        p = dict(params)
        if not evaluation:
            p["sampling_seed"] = sample_seed(ctx.seed, s.index)
        calls.append(ctx.generate_fn(ctx.client, s, p))
    await asyncio.gather(*calls)
    if all(s.status != Status.ABORTED for s in group):
        rewards = await asyncio.gather(*(ctx.reward_fn(s) for s in group))
        for s, r in zip(group, rewards):
            s.reward = r
    return group


def reward_value(sample: Sample) -> float:
    """The scalar reward of a sample (``reward["reward"]`` for dict rewards)."""
    r = sample.reward
    return float(r["reward"] if isinstance(r, dict) else r)


async def generate_rollout(cfg, rollout_id: int, data_source, ctx: RolloutContext,
                           evaluation: bool = False) -> RolloutOutput:
    """Generate ``cfg.rollout.batch_size`` accepted groups for rollout step ``rollout_id``.

    Returns the kept groups in submission order with ``sample.rollout_id`` set, and metrics: ``rollout/seconds``,
    ``rollout/groups_submitted``, ``rollout/groups_filtered``, ``rollout/groups_aborted``. Raises
    ``hpcrl.rollout.client.RolloutError`` when generation fails for good (after the client's retries).
    """
    rc = cfg.rollout
    target = rc.batch_size
    chunk = rc.over_sampling_batch_size or target
    params = sampling_params(rc, evaluation)
    t0 = time.perf_counter()
    kept: list[list[Sample]] = []
    pending: list[tuple[asyncio.Task, list[Sample]]] = []
    submitted = filtered = 0
    max_submitted = MAX_OVERSAMPLING_FACTOR * target
    try:
        while len(kept) < target:
            if not pending and submitted >= max_submitted:
                raise RuntimeError(
                    f"rollout {rollout_id}: the dynamic filter kept {len(kept)} of {submitted} groups "
                    f"(needed {target}); loosen or unset rollout.dynamic_filter")
            if not pending:
                groups = data_source.get_samples(chunk)
                for g in groups:
                    for s in g:
                        s.rollout_id = rollout_id
                pending = [(asyncio.create_task(_generate_group(cfg, ctx, g, params, evaluation)), g)
                           for g in groups]
                submitted += len(groups)
            task, group = pending[0]
            await task
            pending.pop(0)
            if any(s.status == Status.ABORTED for s in group):
                raise RuntimeError(f"group {group[0].group_index} was aborted while the rollout still needed it")
            if ctx.dynamic_filter is not None and not ctx.dynamic_filter(group):
                filtered += 1
                continue
            kept.append(group)
    finally:
        aborted = await _abort_rest(ctx, pending, data_source, rc.partial_rollout)
    return RolloutOutput(kept, {
        "rollout/seconds": time.perf_counter() - t0,
        "rollout/groups_submitted": submitted,
        "rollout/groups_filtered": filtered,
        "rollout/groups_aborted": aborted,
    })


async def _abort_rest(ctx: RolloutContext, pending: list[tuple[asyncio.Task, list[Sample]]], data_source,
                     partial: bool) -> int:
    """Abort in-flight groups on every engine, wait for them, and push them back to the data source."""
    if not pending:
        return 0
    await ctx.client.abort_all()
    results = await asyncio.gather(*(t for t, _ in pending), return_exceptions=True)
    back = []
    for result, (_, group) in zip(results, pending):
        failed = isinstance(result, BaseException)
        for s in group:
            if not partial or failed or s.status == Status.FAILED:
                reset_sample(s)
            elif s.status == Status.ABORTED:
                s.status = Status.PENDING  # keeps its partial response; generate() continues it
        back.append(group)
    if back:
        data_source.add_samples(back)
    return len(back)
