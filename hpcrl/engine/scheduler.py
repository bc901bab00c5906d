"""The batching thread that owns the model: continuous batching over one KV cache.

One background thread runs every forward pass, so the HTTP event loop stays responsive. Each iteration it

1. runs queued *commands* (weight updates, pause, memory release: anything that must not overlap a
   forward pass),
2. applies pending aborts (waiting and running sequences finish with ``finish_reason.type == "abort"`` and
   the output they have so far),
3. admits waiting sequences up to ``max_running_requests`` rows: one left-padded prefill (attention mask plus
   explicit position ids) whose KV cache is left-padded to the running batch's length and concatenated to it,
4. decodes one token for every running row (rows that finish leave the batch; all-padding columns are
   trimmed).

Sequences (*rows*) come from jobs (one ``/generate`` call: batch inputs times ``n``). Output is pushed to the
job's callback from this thread. This is a reference implementation for CPUs and tests, not a fast server.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
import traceback
from typing import Any, Callable

import torch

from hpcrl.engine import kvcache, protocol, routing, sampling, state
from hpcrl.engine.memory import TAG_KV_CACHE, TAG_WEIGHTS

logger = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """Generation is refused right now (memory released, or the engine stopped): HTTP 503."""


@dataclasses.dataclass(eq=False)
class Row:
    """One sequence being generated (state owned by the scheduler thread once admitted)."""

    spec: protocol.RowSpec
    job: "Job"
    seq: int
    generator: torch.Generator
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top: list[tuple[list[float], list[int]]] = dataclasses.field(default_factory=list)
    input_logprobs: list | None = None
    input_top: list | None = None
    routed_experts: list | None = None
    """int32 ``[layers, top_k]`` per fed token (prompt, then outputs), with ``return_routed_experts``."""
    finish_reason: dict | None = None
    next_pos: int = 0
    version_events: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    """``(old weight version, output tokens then)`` at each version change while the row had output."""

    @property
    def params(self) -> protocol.SamplingParams:
        return self.spec.params

    def needs_input_logprobs(self) -> bool:
        return self.spec.return_logprob and self.input_logprobs is None


class Job:
    """One ``/generate`` call: its rows and a callback for results.

    ``on_update(index, response, finished)`` is called from the scheduler thread with the SGLang-shaped
    response dict of row ``index`` (response order) when it finishes, and after every token when
    ``options.stream`` is set.
    """

    def __init__(self, spec: protocol.GenerateSpec, on_update: Callable[[int, dict, bool], None]):
        self.spec = spec
        self.options = spec.options
        self.on_update = on_update
        self.created = time.monotonic()


@dataclasses.dataclass
class Stats:
    """Counters exposed in ``/get_server_info`` ``internal_states`` (tokens, rows, batches, seconds)."""

    requests_served: int = 0
    rows_served: int = 0
    prefill_batches: int = 0
    decode_steps: int = 0
    batches_run: int = 0
    max_batch_rows: int = 0
    max_prefill_rows: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    aborted_rows: int = 0
    retracted_rows: int = 0
    last_gen_throughput: float = 0.0
    busy_seconds: float = 0.0
    """Wall seconds of the steps that prefilled or decoded at least one row (forward passes and their
    bookkeeping); time idle, paused (rows held in place included) or running commands is not counted."""


class Scheduler:
    """Owns the model in one thread; see the module docstring for the loop.

    ``model``: an HF causal LM in eval mode. ``tokenizer``: its HF tokenizer. ``eos_ids``: token ids that stop
    a sequence unless ``ignore_eos``. ``max_rows``: the most rows decoded together. ``seed``: seeds the
    generators of rows without ``sampling_seed``. ``adapters``: the engine's LoRA adapters
    (:class:`hpcrl.engine.lora.EngineAdapters`; None: none), each row run through its ``lora_path``'s.
    """

    def __init__(self, model, tokenizer, eos_ids: set[int], max_rows: int, seed: int, weight_version: str,
                 pad_id: int = 0, adapters=None):
        self.model = model
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_rows = max_rows
        self.pad_id = pad_id
        self.weight_version = weight_version
        self.routed = routing.RoutedExperts(model)
        self.stats = Stats()
        self._master_gen = torch.Generator().manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Row] = collections.deque()
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]]
        self._commands = collections.deque()
        self._aborts: list[tuple[str | None, int, str]] = []
        self._jobs_left: dict[int, int] = {}
        self._seq = 0
        self._paused = False
        self._released: set[str] = set()
        self._stop = False
        # Batch state (scheduler thread only): rows in batch order, their KV cache and its [rows, len] mask.
        self._running: list[Row] = []
        self._cache = None
        self._mask: torch.Tensor | None = None
        self._num_running = 0
        self._deferred: list[tuple[Row, dict]] | None = None
        self._continuous = True
        self._thread = threading.Thread(target=self._loop, name="hpcrl-engine-scheduler", daemon=True)

    # ------------------------------------------------------------------ public API (any thread)
    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; waits up to ``timeout`` seconds."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        """Whether the scheduler thread runs."""
        return self._thread.is_alive() and not self._stop

    def submit(self, job: Job) -> None:
        """Queue all rows of ``job``. Raises :class:`EngineUnavailable` while weights or KV cache are
        released."""
        with self._cond:
            if self._stop:
                raise EngineUnavailable("the engine is shutting down")
            blocked = sorted(self._released & {TAG_WEIGHTS, TAG_KV_CACHE})
            if blocked:
                raise EngineUnavailable(f"memory released for {blocked}; "
                                        "call /resume_memory_occupation first")
            self._jobs_left[id(job)] = len(job.spec.rows)
            for spec in job.spec.rows:
                seed = spec.params.sampling_seed
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._master_gen).item())
                gen = torch.Generator().manual_seed(seed % 2**64)
                row = Row(spec=spec, job=job, seq=self._seq, generator=gen)
                self._seq += 1
                self._waiting.append(row)
            self._cond.notify_all()

    def abort(self, rid: str | None = None, message: str = "Abort by the user.") -> None:
        """Abort the rows submitted so far whose rid (or the rid of their input) is ``rid``; all rows if None.

        They finish at the scheduler's next iteration with ``finish_reason.type == "abort"``.
        """
        with self._cond:
            self._aborts.append((rid, self._seq, message))
            self._cond.notify_all()

    def run_command(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` in the scheduler thread between forward passes; the future holds its result or
        exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stop:
                fut.set_exception(EngineUnavailable("the engine is shutting down"))
                return fut
            self._commands.append((fn, fut))
            self._cond.notify_all()
        return fut

    def continue_generation(self) -> None:
        """Leave the paused state; waiting and in-place paused rows go on."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        """Whether generation is paused (``/pause_generation`` until ``/continue_generation``)."""
        return self._paused

    @property
    def continuous_batching(self) -> bool:
        """Whether new rows join a running batch (False: wave batching, for caches that cannot be merged)."""
        return self._continuous

    @property
    def released_tags(self) -> list[str]:
        """Memory tags released by ``/release_memory_occupation`` and not resumed yet."""
        with self._cond:
            return sorted(self._released)

    def load(self) -> dict:
        """Queue and batch sizes: running rows (holding KV cache), waiting rows, paused flag."""
        with self._cond:
            return {"num_running_reqs": self._num_running, "num_waiting_reqs": len(self._waiting),
                    "paused": self._paused, "released_tags": sorted(self._released)}

    def has_kv(self) -> bool:
        """Whether any row holds KV cache (running, or paused in place)."""
        return self._num_running > 0

    def is_fully_idle(self, ignore_waiting: bool = False) -> bool:
        """SGLang's ``is_fully_idle``: no row holds KV cache and, unless ``ignore_waiting``, none waits
        (:mod:`hpcrl.engine.state`, rule 2)."""
        with self._cond:
            return self._num_running == 0 and (ignore_waiting or not self._waiting)

    def flush_now(self) -> bool:
        """SGLang's ``flush_cache``: whether the cache could be flushed, i.e. the engine is fully idle,
        waiting rows ignored while paused (this engine keeps no cache between requests, so there is nothing
        else to drop). Call from the scheduler thread (a command) so no step runs meanwhile."""
        return self.is_fully_idle(ignore_waiting=self._paused)

    # ------------------------------------------------------------------ commands (scheduler thread)
    def adapters_in_use(self) -> set[str]:
        """The LoRA adapters named by rows not finished yet (waiting, running or paused); a command."""
        with self._cond:
            rows = [*self._waiting, *self._running]
        return {row.spec.lora for row in rows if row.spec.lora}

    def set_weight_version(self, version: str) -> None:
        """Serve ``version`` from now on (a command: no step runs meanwhile, as SGLang's scheduler records
        it). Rows with output (running, paused in place or retracted) record the change, so that their
        finished answers say which version sampled which tokens (``meta_info.weight_versions`` spans)."""
        if version != self.weight_version:
            with self._cond:
                rows = [*self._waiting, *self._running]
            for row in rows:
                if row.output_ids:
                    row.version_events.append((self.weight_version, len(row.output_ids)))
            self.weight_version = version

    def pause_now(self, mode: str) -> None:
        """Command body of ``/pause_generation``: pause, then abort, retract or keep the running rows.

        ``abort``: running and waiting rows finish with an abort reason. ``retract``: running rows drop their
        KV cache and go back to the front of the queue with their output so far. ``in_place``: running rows
        keep their cache and resume on continue. Raises ValueError on another mode.
        """
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}; use abort, retract or in_place")
        with self._cond:
            self._paused = True
        if mode == "abort":
            self._abort_rows(lambda row: True, "Abort by pause_generation(mode=abort).")
        elif mode == "retract":
            rows = self._running
            self._clear_batch()
            with self._cond:
                for row in reversed(rows):
                    self._waiting.appendleft(row)
            self.stats.retracted_rows += len(rows)

    def release_now(self, tags: list[str]) -> None:
        """Command body of ``/release_memory_occupation``: record ``tags`` as released.

        Raises RuntimeError with SGLang's assertion text unless the engine is fully idle (waiting rows ignored
        while paused): abort the running rows, or pause with ``abort``/``retract``, first.
        """
        if not self.is_fully_idle(ignore_waiting=self._paused):
            raise RuntimeError(state.RELEASE_NOT_IDLE)
        with self._cond:
            self._released.update(tags)

    def resume_now(self, tags: list[str]) -> None:
        """Command body of ``/resume_memory_occupation``: forget ``tags`` as released. Raises RuntimeError
        (nothing changed) for a tag that is not released (SGLang's scheduler dies of a KeyError there)."""
        with self._cond:
            missing = [t for t in tags if t not in self._released]
            if missing:
                raise RuntimeError(state.resume_not_released(missing))
            self._released.difference_update(tags)
            self._cond.notify_all()

    # ------------------------------------------------------------------ the loop
    def _has_work_locked(self) -> bool:
        if self._commands or self._aborts:
            return True
        if self._paused or self._released & {TAG_WEIGHTS, TAG_KV_CACHE}:
            return False
        if self._running:
            return True
        return bool(self._waiting)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._has_work_locked():
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    break
                commands = list(self._commands)
                self._commands.clear()
                aborts, self._aborts = self._aborts, []
            for fn, fut in commands:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - the caller gets it
                    fut.set_exception(e)
            if aborts:
                self._apply_aborts(aborts)
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - keep serving; fail the rows of this step
                logger.error("engine step failed:\n%s", traceback.format_exc())
                rows = self._running
                self._clear_batch()
                for row in rows:
                    self._finish(row, protocol.finish_abort(f"engine error: {e}", status_code=500))
        self._fail_all("the engine stopped")

    def _apply_aborts(self, aborts: list[tuple[str | None, int, str]]) -> None:
        def match(row: Row):
            for rid, limit, msg in aborts:
                if row.seq < limit and (rid is None or rid in (row.spec.rid, row.spec.base_rid)):
                    return msg
            return None
        self._abort_rows(match, None)

    def _abort_rows(self, match: Callable[[Row], Any], message: str | None) -> None:
        with self._cond:
            keep, dropped = collections.deque(), []
            for row in self._waiting:
                m = match(row)
                (dropped.append((row, m)) if m else keep.append(row))
            self._waiting = keep
        for row, m in dropped:
            self._finish(row, protocol.finish_abort(message or m))
        hit = [(i, match(row)) for i, row in enumerate(self._running)]
        hit = [(i, m) for i, m in hit if m]
        if hit:
            rows = [self._running[i] for i, _ in hit]
            self._remove_rows({i for i, _ in hit})
            for row, (_, m) in zip(rows, hit):
                self._finish(row, protocol.finish_abort(message or m))
        self.stats.aborted_rows += len(dropped) + len(hit)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            rows = list(self._waiting)
            self._waiting.clear()
            commands = list(self._commands)
            self._commands.clear()
        for row in rows + self._running:
            self._finish(row, protocol.finish_abort(message, status_code=503))
        self._clear_batch()
        for _, fut in commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineUnavailable(message))

    def _step(self) -> None:
        with self._cond:
            if self._paused or self._released & {TAG_WEIGHTS, TAG_KV_CACHE}:
                return
            new_rows: list[Row] = []
            if self._continuous or not self._running:
                while self._waiting and len(self._running) + len(new_rows) < self.max_rows:
                    new_rows.append(self._waiting.popleft())
        t0 = time.monotonic()
        tokens_before = self.stats.tokens_generated
        if new_rows:
            try:
                self._prefill(new_rows)
            except Exception as e:  # noqa: BLE001 - the new rows fail; the running batch goes on
                logger.error("prefill failed:\n%s", traceback.format_exc())
                for row in new_rows:
                    if row.finish_reason is None and row not in self._running:
                        self._finish(row, protocol.finish_abort(f"engine error: {e}", status_code=500))
        if self._running:
            self._decode()
        dt = time.monotonic() - t0
        if new_rows or self._running:  # (a prefill whose rows all finished at once ran too)
            self.stats.busy_seconds += dt
        if dt > 0 and self.stats.tokens_generated > tokens_before:
            self.stats.last_gen_throughput = (self.stats.tokens_generated - tokens_before) / dt

    # ------------------------------------------------------------------ model passes
    def _adapters(self, names: list):
        """Row ``i`` of the next forward pass through LoRA adapter ``names[i]`` (None: the base model)."""
        if self.adapters is None:  # (with adapters loaded, the base model's rows too: PEFT's layers would
            return contextlib.nullcontext()  # apply the adapter loaded first to a batch without names)
        return self.adapters.applied(names)

    @torch.no_grad()
    def _prefill(self, rows: list[Row]) -> None:
        seqs = [row.spec.prompt_ids + row.output_ids for row in rows]
        k, width = len(seqs), max(len(s) for s in seqs)
        # Rows with identical tokens (the samples of one GRPO group) share one forward pass, as SGLang's
        # prefix cache shares their prompt: only the distinct sequences are prefilled, and their KV cache and
        # logits are then copied to every row that has them (``owner[i]``: row i's distinct sequence).
        # (a row's LoRA adapter is part of what it shares)
        distinct: dict[tuple, int] = {}
        owner = [distinct.setdefault((row.spec.lora, tuple(s)), len(distinct)) for row, s in zip(rows, seqs)]
        unique = [s for _, s in distinct]
        adapters = [lora for lora, _ in distinct]
        ku = len(unique)
        ids = torch.full((ku, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((ku, width), dtype=torch.long)
        for i, s in enumerate(unique):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        # Logits only for the trailing positions that someone needs: the last one (sampling) and, for input
        # log-probs, the prompt from logprob_start_len on (prompts end at the right edge: left padding).
        keep = max([1] + [len(row.spec.prompt_ids) + len(row.output_ids) - self._logprob_start(row)
                          for row in rows if row.needs_input_logprobs()])
        cache = kvcache.new_cache(self.model.config)
        with self.routed.recording(any(row.job.options.return_routed_experts for row in rows)), \
                self._adapters(adapters):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                             use_cache=True, logits_to_keep=keep)
        experts = self.routed.take(ku, width)  # [distinct, width, layers, top_k] or None
        self.stats.prefill_batches += 1
        self.stats.batches_run += 1
        self.stats.max_prefill_rows = max(self.stats.max_prefill_rows, k)
        self.stats.prompt_tokens += sum(len(s) for s in seqs)
        logits = out.logits
        cache = out.past_key_values
        self._check_cache_layers(cache)
        if ku < k:
            sel = torch.tensor(owner, dtype=torch.long)
            cache.batch_select_indices(sel)
            logits = logits.index_select(0, sel)
            mask = mask.index_select(0, sel)
        for i, row in enumerate(rows):
            row.next_pos = len(seqs[i])
            if experts is not None and row.job.options.return_routed_experts:  # every token fed so far
                row.routed_experts = list(experts[owner[i], width - len(seqs[i]):])
            if row.needs_input_logprobs():
                self._input_logprobs(row, logits[i], keep)
        live = [i for i, row in enumerate(rows) if len(row.output_ids) < row.params.max_new_tokens]
        for i, row in enumerate(rows):
            if i not in live:  # max_new_tokens == 0: a prefill-only request
                self._finish(row, protocol.finish_length(row.params.max_new_tokens))
        survivors = []
        if live:
            last = logits[torch.tensor(live, dtype=torch.long), -1, :]
            sampled = self._sample([rows[i] for i in live], last)
            survivors = [i for i, tok in zip(live, sampled) if self._append(rows[i], tok)]
        if not survivors:
            return
        if len(survivors) < k:
            sel = torch.tensor(survivors, dtype=torch.long)
            cache.batch_select_indices(sel)
            mask = mask.index_select(0, sel)
        self._merge(cache, mask, [rows[i] for i in survivors])

    @torch.no_grad()
    def _decode(self) -> None:
        rows = self._running
        b = len(rows)
        ids = torch.tensor([[row.output_ids[-1]] for row in rows], dtype=torch.long)
        mask = torch.cat([self._mask, torch.ones((b, 1), dtype=self._mask.dtype)], dim=1)
        pos = torch.tensor([[row.next_pos] for row in rows], dtype=torch.long)
        with self.routed.recording(any(row.job.options.return_routed_experts for row in rows)), \
                self._adapters([row.spec.lora for row in rows]):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=self._cache,
                             use_cache=True)
        experts = self.routed.take(b, 1)
        if experts is not None:
            for i, row in enumerate(rows):
                if row.routed_experts is not None:
                    row.routed_experts.append(experts[i, 0])
        self._cache = out.past_key_values
        self._mask = mask
        self.stats.decode_steps += 1
        self.stats.batches_run += 1
        self.stats.max_batch_rows = max(self.stats.max_batch_rows, b)
        for row in rows:
            row.next_pos += 1
        sampled = self._sample(rows, out.logits[:, -1, :])
        # Rows that finish leave the batch before their results go out, so a client that has every answer
        # finds no KV cache held for them (``/flush_cache`` right after a rollout succeeds at once).
        self._deferred = []
        try:
            finished = {i for i, row in enumerate(rows) if not self._append(row, sampled[i])}
            if finished:
                self._remove_rows(finished)
        finally:
            deferred, self._deferred = self._deferred, None
            for row, reason in deferred:
                self._finish(row, reason)

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> list[int]:
        """Process ``[rows, vocab]`` logits into log-probs, record them and return one sampled id per row."""
        logits = logits.float()
        for i, row in enumerate(rows):
            if len(row.output_ids) < row.params.min_new_tokens:
                banned = (set() if row.params.ignore_eos else self.eos_ids) | set(row.params.stop_token_ids)
                if banned:
                    logits[i, list(banned)] = float("-inf")
        temps = torch.tensor([sampling.effective_temperature(row.params.temperature) for row in rows])
        logprobs = sampling.compute_logprobs(logits, temps)
        greedy = [row.params.temperature < sampling.GREEDY_EPS for row in rows]
        tokens = sampling.sample_tokens(
            logprobs, greedy, [row.params.top_k for row in rows], [row.params.top_p for row in rows],
            [row.params.min_p for row in rows], [row.generator for row in rows])
        chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
        top_k = max((row.spec.top_logprobs_num for row in rows if row.spec.return_logprob), default=0)
        top_vals, top_ids = sampling.top_logprobs(logprobs, top_k)
        for i, row in enumerate(rows):
            if row.spec.return_logprob:
                row.output_logprobs.append(chosen[i])
                n = row.spec.top_logprobs_num
                if n > 0:
                    row.output_top.append((top_vals[i][:n], top_ids[i][:n]))
        return tokens

    def _logprob_start(self, row: Row) -> int:
        start = row.spec.logprob_start_len
        return len(row.spec.prompt_ids) - 1 if start == -1 else start

    def _input_logprobs(self, row: Row, logits: torch.Tensor, kept: int) -> None:
        """SGLang's ``input_token_logprobs`` for prompt tokens from ``logprob_start_len``: first entry
        null."""
        prompt = row.spec.prompt_ids
        start = self._logprob_start(row)
        n = row.spec.top_logprobs_num
        values: list = [None]
        tops: list = [None]
        if start < len(prompt) - 1:
            # ``logits`` [kept, vocab]: the last ``kept`` positions of the row (its sequence ends there);
            # the logits at ``offset + j - 1`` predict prompt token j, for j in (start, len(prompt)).
            offset = kept - (len(prompt) + len(row.output_ids))
            sel = logits[offset + start: offset + len(prompt) - 1].float()
            temp = sampling.effective_temperature(row.params.temperature)
            lp = sampling.compute_logprobs(sel, torch.full((sel.shape[0],), temp))
            targets = torch.tensor(prompt[start + 1:], dtype=torch.long)
            values += lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            if n > 0:
                tv, ti = sampling.top_logprobs(lp, n)
                tops += list(zip(tv, ti))
        row.input_logprobs = values
        row.input_top = tops if n > 0 else None

    # ------------------------------------------------------------------ row bookkeeping
    def _append(self, row: Row, token: int) -> bool:
        """Append a sampled token; finish the row if a stop condition holds. Returns whether it goes on."""
        row.output_ids.append(token)
        self.stats.tokens_generated += 1
        p = row.params
        reason = None
        if len(row.output_ids) >= p.max_new_tokens:
            reason = protocol.finish_length(p.max_new_tokens)
        elif len(row.output_ids) >= p.min_new_tokens and (
                (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids):
            reason = protocol.finish_stop(token)
        elif p.stop and len(row.output_ids) >= p.min_new_tokens:
            tail_len = max(len(s) for s in p.stop) + 1
            tail = self.tokenizer.decode(row.output_ids[-tail_len:],
                                         skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in tail:
                    reason = protocol.finish_stop(s)
                    break
        if reason is not None:
            self._finish(row, reason)
            return False
        if row.job.options.stream:
            try:
                row.job.on_update(row.spec.index, self.response(row), False)
            except Exception:  # noqa: BLE001 - a broken client callback must not stop the engine
                logger.exception("stream callback failed for rid %s", row.spec.rid)
        return True

    def _finish(self, row: Row, reason: dict) -> None:
        if self._deferred is not None:  # inside a decode step: delivered once the batch has dropped the row
            row.finish_reason = reason
            self._deferred.append((row, reason))
            return
        row.finish_reason = reason
        self.stats.rows_served += 1
        try:
            row.job.on_update(row.spec.index, self.response(row), True)
        except Exception:  # noqa: BLE001 - a broken client callback must not stop the engine
            logger.exception("result callback failed for rid %s", row.spec.rid)
        with self._cond:
            key = id(row.job)
            left = self._jobs_left.get(key, 1) - 1
            if left <= 0:
                self._jobs_left.pop(key, None)
                self.stats.requests_served += 1
            else:
                self._jobs_left[key] = left

    def response(self, row: Row) -> dict:
        """The SGLang-shaped response of ``row`` as it stands (``finish_reason`` null while running)."""
        opts = row.job.options
        tok = self.tokenizer
        meta: dict[str, Any] = {
            "id": row.spec.rid,
            "finish_reason": row.finish_reason,
            "prompt_tokens": len(row.spec.prompt_ids),
            "completion_tokens": len(row.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - row.job.created,
        }
        if row.finish_reason is not None:
            meta["weight_versions"] = protocol.weight_version_spans(row.version_events, self.weight_version,
                                                                    len(row.output_ids))
        if row.spec.return_logprob:
            start = self._logprob_start(row)
            in_ids = row.spec.prompt_ids[start:]
            meta["input_token_logprobs"] = protocol.logprob_triples(
                tok, row.input_logprobs or [], in_ids, opts.return_text_in_logprobs)
            meta["output_token_logprobs"] = protocol.logprob_triples(
                tok, row.output_logprobs, row.output_ids, opts.return_text_in_logprobs)
            meta["output_token_logprobs_length"] = len(row.output_logprobs)
            if row.spec.top_logprobs_num > 0:
                in_top = row.input_top or []
                meta["input_top_logprobs"] = protocol.top_logprob_triples(
                    tok, [None if t is None else t[0] for t in in_top],
                    [None if t is None else t[1] for t in in_top], opts.return_text_in_logprobs)
                meta["output_top_logprobs"] = protocol.top_logprob_triples(
                    tok, [t[0] for t in row.output_top], [t[1] for t in row.output_top],
                    opts.return_text_in_logprobs)
        if opts.return_routed_experts:
            fed = len(row.spec.prompt_ids) + len(row.output_ids) - 1  # SGLang's rows: the last token is not fed
            start = opts.routed_experts_start_len
            meta["routed_experts"] = routing.encode((row.routed_experts or [])[start:], fed - start)
        out = {
            "text": protocol.output_text(tok, row.output_ids, row.finish_reason, row.params),
            "output_ids": list(row.output_ids),
            "meta_info": meta,
        }
        if opts.return_prompt_token_ids:
            out["prompt_token_ids"] = list(row.spec.prompt_ids)
        return out

    # ------------------------------------------------------------------ KV cache surgery
    def _check_cache_layers(self, cache) -> None:
        ok = all(hasattr(layer, "keys") and not getattr(layer, "is_sliding", False)
                 for layer in getattr(cache, "layers", []))
        if not ok and self._continuous:
            logger.warning("cache layers are not plain DynamicLayers: falling back to wave batching")
            self._continuous = False

    def _merge(self, cache, mask: torch.Tensor, rows: list[Row]) -> None:
        """Append ``rows`` with their ``cache`` / ``[rows, len]`` mask to the running batch (left-padding the
        shorter)."""
        if not self._running:
            self._cache, self._mask, self._running = cache, mask, list(rows)
        else:
            self._mask = kvcache.append_rows(self._cache, self._mask, cache, mask)
            self._running = self._running + list(rows)
        with self._cond:
            self._num_running = len(self._running)

    def _remove_rows(self, drop: set[int]) -> None:
        keep = [i for i in range(len(self._running)) if i not in drop]
        if not keep:
            self._clear_batch()
            return
        self._mask = kvcache.keep_rows(self._cache, self._mask, keep, trim=self._continuous)
        self._running = [self._running[i] for i in keep]
        with self._cond:
            self._num_running = len(self._running)

    def _clear_batch(self) -> None:
        self._running, self._cache, self._mask = [], None, None
        with self._cond:
            self._num_running = 0

