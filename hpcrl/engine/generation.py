"""Generation as both of the engine's front ends use it: the SGLang-native ``/generate``
(:mod:`hpcrl.engine.native_server`) and OpenAI's completions (:mod:`hpcrl.engine.openai_server`).

A request body is read (:func:`read_body`), parsed into the scheduler's form
(:meth:`Generation.parse_generate`, a :class:`hpcrl.engine.protocol.GenerateSpec`), submitted to the scheduler
thread, and its rows' responses are either collected (:meth:`Generation.collect`) or streamed
(:meth:`Generation.updates`); a client that goes away aborts its rows (:meth:`Generation.abort_spec`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hpcrl.engine import protocol
from hpcrl.engine.scheduler import Job, Scheduler


async def read_body(request: web.Request) -> dict:
    """The JSON body as a dict ({} when empty). Raises protocol.RequestError on invalid JSON."""
    return protocol.parse_json_body(await request.read())


@dataclass
class Generation:
    """The served model's facts and its scheduler, as the front ends need them to generate.

    ``tokenizer`` is the HF tokenizer, ``vocab_size`` and ``context_len`` are in tokens, ``chat_template`` is
    the Jinja template for chat requests (None: the model has none), ``allow_auto_truncate`` is the engine
    flag of that name (a prompt over the context is cut instead of refused).
    """

    tokenizer: Any
    scheduler: Scheduler
    vocab_size: int
    context_len: int
    chat_template: str | None
    allow_auto_truncate: bool

    def parse_generate(self, body: dict) -> protocol.GenerateSpec:
        """:func:`hpcrl.engine.protocol.parse_generate` with this engine's model facts and flags, and the LoRA
        adapters it names checked (:meth:`hpcrl.engine.lora.EngineAdapters.check_request`). Raises
        :class:`hpcrl.engine.protocol.RequestError`."""
        spec = protocol.parse_generate(body, self.tokenizer, self.vocab_size, self.context_len,
                                       routed_experts=self.scheduler.routed.layers > 0,
                                       allow_auto_truncate=self.allow_auto_truncate)
        if self.scheduler.adapters is not None:  # the adapters named must be loaded (LoRA)
            self.scheduler.adapters.check_request([row.lora for row in spec.rows])
        return spec

    async def collect(self, spec: protocol.GenerateSpec) -> list[dict]:
        """Run ``spec`` and return every row's finished response (response order). Raises EngineUnavailable
        when generation is refused; aborts the rows if the client goes away (CancelledError)."""
        queue = self.updates(spec)
        results: list[dict | None] = [None] * len(spec.rows)
        left = len(spec.rows)
        try:
            while left:
                index, response, finished = await queue.get()
                if finished:
                    results[index] = response
                    left -= 1
        except asyncio.CancelledError:
            self.abort_spec(spec, "Abort: the client disconnected.")
            raise
        return results  # type: ignore[return-value]

    def updates(self, spec: protocol.GenerateSpec) -> asyncio.Queue:
        """Submit ``spec`` with streaming callbacks: a queue of ``(index, response, finished)``. Raises
        EngineUnavailable."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_update(index: int, response: dict, finished: bool) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, response, finished))

        self.scheduler.submit(Job(spec, on_update))
        return queue

    def abort_spec(self, spec: protocol.GenerateSpec, message: str) -> None:
        """Abort every row of ``spec`` (by its inputs' rids) with ``message``."""
        for base in {row.base_rid for row in spec.rows}:
            self.scheduler.abort(base, message)
