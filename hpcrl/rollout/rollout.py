"""One rollout step: generate groups through the engines, score them, filter them (slime's ``generate_rollout``).

Over-sampling plus a dynamic filter: prompts are submitted ``rollout.over_sampling_batch_size`` groups at a
time; finished groups are taken **in submission order** (so a seeded run is reproducible whatever the timing)
and kept when the dynamic filter accepts them, until ``rollout.batch_size`` groups are kept. The rest are then
aborted on every engine and pushed back to the data source: partial responses are kept for the next step when
``rollout.partial_rollout`` is on, otherwise the groups go back as fresh prompts. So no prompt is ever dropped
by an abort; groups the filter rejects are dropped, as in slime.

``run.deterministic`` with ``rollout.partial_rollout``: how far an aborted group got depends on timing, so
nothing is aborted; the groups still in flight when the batch is full are finished (and scored) and pushed
back whole, to be served first next step (the filter sees them then). Two runs of one seed then train the
same groups; nothing generated is wasted. Without partial rollouts an abort resets the groups to fresh
prompts, which is deterministic already.

A starving filter: after :data:`MAX_OVERSAMPLING_FACTOR` x ``batch_size`` groups without enough kept, the
rollout returns the groups it kept (at least one) with a warning and ``rollout/groups_short`` > 0
(``rollout.on_filter_starved: train``, the default), or raises (``error``).

A custom rollout (slime ``--rollout-function-path``) has the signature of :func:`generate_rollout`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from hpcrl.data.sample import Sample, Status
from hpcrl.rollout.client import RolloutClient, RolloutError

log = logging.getLogger("hpcrl.rollout")

MAX_OVERSAMPLING_FACTOR = 32
"""A rollout stops submitting after this many times ``batch_size`` groups without keeping enough (then
``rollout.on_filter_starved`` decides: train on the kept groups, or raise)."""

RewardFn = Callable[[Sample], Awaitable[Any]]
GroupFilter = Callable[[list[Sample]], bool]


class FilterStarved(RuntimeError):
    """The dynamic filter kept fewer groups than a step needs within its cap on submitted groups, and the run
    may not train on fewer (none kept, or ``rollout.on_filter_starved: error``). A known error: ``hpcrl run``
    prints it as one line and exits 1, after checkpointing the last finished step. ``kept``, ``submitted`` and
    ``needed`` count groups."""

    def __init__(self, rollout_id: int, kept: int, submitted: int, needed: int):
        self.rollout_id, self.kept, self.submitted, self.needed = rollout_id, kept, submitted, needed
        self.summary = (f"rollout {rollout_id}: the dynamic filter kept {kept} of {submitted} groups "
                        f"(needed {needed})")
        """What happened, without the fix (also the start of the warning when the run trains on fewer)."""
        if kept:
            fix = "loosen or unset rollout.dynamic_filter, or set rollout.on_filter_starved=train"
        elif rollout_id == 0:  # the starting policy: no update has happened yet
            fix = ("every group's samples got equal rewards from the starting model (e.g. it solves none: "
                   "warm-start it with SFT), or unset rollout.dynamic_filter")
        else:
            fix = ("every group's samples got equal rewards (a collapsed policy?): lower the learning rate, "
                   "or loosen or unset rollout.dynamic_filter")
        super().__init__(f"{self.summary}; {fix}")


@dataclass
class RolloutContext:
    """What a rollout needs besides the config: the client, tokenizer and the resolved plug-ins
    (:func:`hpcrl.rollout.plugins.resolve_plugins`, built by the rollout manager)."""

    client: RolloutClient
    """The engines' client (:class:`hpcrl.rollout.client.RolloutClient`)."""
    tokenizer: Any
    reward_fn: RewardFn
    """``rollout.reward_function``; by default the task's verifier (``Task.score``, :mod:`hpcrl.data.tasks`)
    for built-in tasks, else the named built-in reward (:mod:`hpcrl.rewards.resolve`) or a plug-in."""
    generate_fn: Callable[[RolloutClient, Sample, dict], Awaitable[Sample]]
    """``rollout.generate_function``; by default :func:`hpcrl.rollout.generate.generate` (one ``/generate``
    call through the client)."""
    dynamic_filter: Optional[GroupFilter] = None
    """``rollout.dynamic_filter`` (:mod:`hpcrl.rollout.filters`), None to keep every group."""
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
    """Fill ``sample.tokens`` with the prompt's token ids (once; partial samples keep their tokens):
    :func:`hpcrl.data.chat.prompt_token_ids`, with the item's tools (``metadata["tools"]``)."""
    from hpcrl.data.chat import TOOLS_KEY, prompt_token_ids

    if sample.tokens:
        return
    sample.tokens = prompt_token_ids(tokenizer, sample.prompt, apply_chat_template,
                                     sample.metadata.get(TOOLS_KEY))


def reset_sample(sample: Sample) -> None:
    """Drop a sample's response so it goes back to the data source as a fresh prompt."""
    del sample.tokens[sample.prompt_length:]
    sample.response, sample.response_length = "", 0
    sample.loss_mask.clear()
    sample.rollout_log_probs.clear()
    sample.rollout_token_versions.clear()
    sample.teacher_log_probs.clear()
    sample.rollout_routed_experts = ""
    sample.segments.clear()
    sample.weight_versions.clear()
    sample.reward, sample.status = None, Status.PENDING


class _GroupBatcher:
    """Stands in for the client of one group's default ``generate`` calls and sends them as one batch
    ``/generate`` (:meth:`RolloutClient.generate_batch`): one HTTP request per group instead of one per sample,
    and the engine prefills the group's shared prompt once.

    The calls that arrive in the same event-loop turn (the group's ``asyncio.gather``) form a batch; a lone
    call, or one with other arguments, goes out as a plain :meth:`RolloutClient.generate`. When the batch is
    refused with an HTTP 4xx, each call is sent on its own, so each gets its own answer or error. A batch whose
    callers were all cancelled is cancelled too.
    """

    def __init__(self, client: RolloutClient) -> None:
        self._client = client
        self._pending: list[tuple[list[int], dict, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()

    @property
    def router_url(self):
        return self._client.router_url

    @property
    def generate_fields(self) -> dict:
        """The wrapped client's extra ``/generate`` fields (sent with the batch too)."""
        return self._client.generate_fields

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, **extra) -> dict:
        if rid is not None or extra or not return_logprob:
            return await self._client.generate(input_ids, sampling_params, return_logprob, rid, **extra)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._pending:
            loop.call_soon(self._start_flush)
        self._pending.append((list(input_ids), dict(sampling_params), fut))
        return await fut

    def _start_flush(self) -> None:
        items, self._pending = self._pending, []
        task = asyncio.ensure_future(self._flush(items))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

        def cancel_if_abandoned(_fut: asyncio.Future) -> None:
            if all(f.cancelled() for _, _, f in items) and not task.done():
                task.cancel()

        for _, _, f in items:
            f.add_done_callback(cancel_if_abandoned)

    @staticmethod
    def _settle(fut: asyncio.Future, result: Any = None, error: Optional[BaseException] = None) -> None:
        if fut.done():
            return
        if isinstance(error, asyncio.CancelledError):
            fut.cancel()
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    async def _flush(self, items: list[tuple[list[int], dict, asyncio.Future]]) -> None:
        items = [it for it in items if not it[2].done()]
        if len(items) == 1:
            await self._one(*items[0])
            return
        if not items:
            return
        try:
            outs = await self._client.generate_batch([i for i, _, _ in items], [p for _, p, _ in items])
        except RolloutError as e:
            if e.status is not None and 400 <= e.status < 500:
                await asyncio.gather(*(self._one(*it) for it in items))
            else:
                for _, _, f in items:
                    self._settle(f, error=e)
            return
        except BaseException as e:
            for _, _, f in items:
                self._settle(f, error=e)
            raise
        for (_, _, f), out in zip(items, outs):
            self._settle(f, out)

    async def _one(self, input_ids, sampling_params, fut) -> None:
        try:
            out = await self._client.generate(input_ids, sampling_params, return_logprob=True)
        except Exception as e:  # noqa: BLE001 - handed to the waiting call
            self._settle(fut, error=e)
        except BaseException as e:
            self._settle(fut, error=e)
            raise
        else:
            self._settle(fut, out)


async def generate_group(cfg, ctx: RolloutContext, group: list[Sample], params: dict, evaluation: bool):
    """Generate and score one group in place (``[n_samples_per_prompt]`` samples): tokenise the prompts
    (:func:`tokenize_prompt`), call ``ctx.generate_fn`` for each unfinished sample with ``params`` (and a
    per-sample ``sampling_seed``, except in a greedy ``evaluation``), then, unless a sample was aborted, score
    with ``ctx.reward_fn`` every sample whose reward the generate function did not fix. The one path of the
    rollout and of the evaluation (:mod:`hpcrl.rollout.evaluate`). Returns ``group``; raises what the generate
    and reward functions raise."""
    from hpcrl.rollout.generate import generate as default_generate

    for s in group:
        tokenize_prompt(ctx.tokenizer, s, cfg.data.apply_chat_template)
    todo = [s for s in group if s.status in (Status.PENDING, Status.ABORTED)]  # others finished earlier
    # Without a router, the default generate's calls of a group go out as one batch request (same samples),
    # unless they stream to keep partial responses (rollout.partial_rollout).
    client = ctx.client
    if (ctx.generate_fn is default_generate and len(todo) > 1 and client.router_url is None
            and hasattr(client, "generate_batch") and not getattr(client, "keep_partial", False)):
        client = _GroupBatcher(ctx.client)
    calls = []
    for s in todo:
        p = dict(params)
        if not evaluation or p.get("temperature", 0) > 0:  # greedy evaluation needs no seed
            p["sampling_seed"] = sample_seed(ctx.seed, s.index)
        calls.append(ctx.generate_fn(client, s, p))
    await asyncio.gather(*calls)
    if all(s.status != Status.ABORTED for s in group):
        # a reward the generate function fixed (an agent's posted one, a failed episode's) is kept; every other
        # sample is scored, also again when a finished group is served a second time (held back)
        unscored = [s for s in group if "reward_source" not in s.metadata]
        rewards = await asyncio.gather(*(ctx.reward_fn(s) for s in unscored))
        for s, r in zip(unscored, rewards):
            s.reward = r
    return group


async def generate_rollout(cfg, rollout_id: int, data_source, ctx: RolloutContext) -> RolloutOutput:
    """Generate ``cfg.rollout.batch_size`` accepted groups for rollout step ``rollout_id``.

    Returns the kept groups in submission order with ``sample.rollout_id`` set (fewer than ``batch_size``, at
    least one, when the filter starves and ``rollout.on_filter_starved`` is ``train``), and metrics:
    ``rollout/seconds``, ``rollout/groups_submitted``, ``rollout/groups_filtered``,
    ``rollout/groups_aborted`` (pushed back as partial or fresh prompts), ``rollout/groups_held`` (finished
    in-flight groups pushed back whole, deterministic partial rollouts only), ``rollout/groups_short``
    (``batch_size`` minus the kept groups). Raises ``hpcrl.rollout.client.RolloutError`` when generation
    fails for good (after the client's retries); RuntimeError when the filter keeps no group within
    :data:`MAX_OVERSAMPLING_FACTOR` x ``batch_size`` submitted groups, or fewer than ``batch_size`` with
    ``rollout.on_filter_starved: error``.
    """
    rc = cfg.rollout
    target = rc.batch_size
    chunk = rc.over_sampling_batch_size or target
    params = sampling_params(rc)
    finish_in_flight = bool(cfg.run.deterministic and rc.partial_rollout)  # no timing-dependent cut
    t0 = time.perf_counter()
    kept: list[list[Sample]] = []
    pending: list[tuple[asyncio.Task, list[Sample]]] = []
    submitted = filtered = aborted = held = 0
    max_submitted = MAX_OVERSAMPLING_FACTOR * target
    done = False
    try:
        while len(kept) < target:
            if not pending and submitted >= max_submitted:
                starved = FilterStarved(rollout_id, len(kept), submitted, target)
                if not kept or rc.on_filter_starved == "error":
                    raise starved
                log.warning("%s: training on the %d kept groups (rollout.on_filter_starved: train)",
                            starved.summary, len(kept))
                break
            if not pending:
                groups = data_source.get_samples(chunk)
                for g in groups:
                    for s in g:
                        s.rollout_id = rollout_id
                pending = [(asyncio.create_task(generate_group(cfg, ctx, g, params, evaluation=False)), g)
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
        done = True
    finally:
        if done and finish_in_flight:
            held = await _hold_rest(pending, data_source)
        else:
            aborted = await _abort_rest(ctx, pending, data_source, rc.partial_rollout)
    return RolloutOutput(kept, {
        "rollout/seconds": time.perf_counter() - t0,
        "rollout/groups_submitted": submitted,
        "rollout/groups_filtered": filtered,
        "rollout/groups_aborted": aborted,
        "rollout/groups_held": held,
        "rollout/groups_short": target - len(kept),
    })


async def _hold_rest(pending: list[tuple[asyncio.Task, list[Sample]]], data_source) -> int:
    """Let the in-flight groups finish (no abort: the cut does not depend on timing), then push them back to
    the data source whole, in submission order. Raises the first generation error of a group."""
    if not pending:
        return 0
    results = await asyncio.gather(*(t for t, _ in pending), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    data_source.add_samples([g for _, g in pending])
    return len(pending)


def split_trainable(groups: list[list[Sample]], multiple: int) -> tuple[list[list[Sample]], list[list[Sample]]]:
    """Split kept groups into the largest leading count that is a multiple of ``multiple`` (what the trainer
    can split over data-parallel ranks x optimizer steps) and the rest, which the caller holds back for the
    next step. ``multiple``: groups, >= 1 (:func:`group_multiple`). Raises ValueError for ``multiple < 1``."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    n = len(groups) - len(groups) % multiple
    return groups[:n], groups[n:]


def group_multiple(n_samples_per_prompt: int, dp_size: int, num_steps_per_rollout: int) -> int:
    """The smallest number of whole groups whose samples split evenly over ``dp_size`` data-parallel ranks x
    ``num_steps_per_rollout`` optimizer steps (1 for the usual layouts)."""
    parts = dp_size * num_steps_per_rollout
    return parts // math.gcd(n_samples_per_prompt, parts)


async def _abort_rest(ctx: RolloutContext, pending: list[tuple[asyncio.Task, list[Sample]]], data_source,
                     partial: bool) -> int:
    """Abort in-flight groups on every engine, wait for them, and push them back to the data source.

    When the abort itself fails (an engine is gone), the in-flight groups are cancelled and awaited before the
    error propagates, so no task is left with an exception nobody retrieves (asyncio would print one traceback
    per group at exit, burying the run's own error line)."""
    if not pending:
        return 0
    try:
        await ctx.client.abort_all()
    except BaseException:
        for task, _ in pending:
            task.cancel()
        await asyncio.gather(*(t for t, _ in pending), return_exceptions=True)
        raise
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
