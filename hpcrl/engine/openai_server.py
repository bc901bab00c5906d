"""The OpenAI-compatible HTTP handlers of the engine server (``/v1/completions``, ``/v1/chat/completions``,
``/tokenize``, ``/detokenize``): request checks and response shapes live in :mod:`hpcrl.engine.openai_api`,
generation in :mod:`hpcrl.engine.generation` (shared with the native ``/generate``). :mod:`hpcrl.engine.openai_api`
(pydantic, ~0.4 CPU-seconds to import) is imported by the first OpenAI request, not by every engine's start: a
training run's engines serve ``/generate`` alone (issue #52, start-up)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from hpcrl.engine import protocol
from hpcrl.engine.generation import Generation, read_body
from hpcrl.engine.scheduler import EngineUnavailable


def routes(generation: Generation) -> dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]:
    """``{path: handler}`` of the POST endpoints, bound to ``generation``."""
    def bind(fn):
        async def handler(request: web.Request) -> web.StreamResponse:
            return await fn(generation, request)
        return handler

    return {"/v1/completions": bind(v1_completions), "/v1/chat/completions": bind(v1_chat_completions),
            "/tokenize": bind(tokenize), "/v1/tokenize": bind(tokenize), "/detokenize": bind(detokenize),
            "/v1/detokenize": bind(detokenize)}


def _spec(generation: Generation, body: dict, chat: bool) -> tuple[Any, protocol.GenerateSpec]:
    """Validate an OpenAI request and turn it into a generate spec. Raises OpenAIError."""
    from hpcrl.engine import openai_api

    tok = generation.tokenizer
    if chat:
        req = openai_api.parse(openai_api.ChatCompletionRequest, body, openai_api.CHAT_UNSUPPORTED)
        if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
            raise openai_api.OpenAIError("tool_choice 'required' or naming a function is not supported by the hpcrl "
                                         "CPU engine (no tool-call parser); use 'auto' or 'none'",
                                         param="tool_choice")
        tools = None if req.tool_choice == "none" else req.tools
        ids = openai_api.render_chat(tok, generation.chat_template, req.messages, tools, True,
                                     req.continue_final_message, req.chat_template_kwargs)
        top = (req.top_logprobs or 0) if req.logprobs else None
        native = openai_api.native_body(req, [ids], req.temperature, req.top_p,
                                        req.max_completion_tokens or req.max_tokens, top,
                                        generation.context_len)
    else:
        req = openai_api.parse(openai_api.CompletionRequest, body, openai_api.COMPLETION_UNSUPPORTED)
        prompts = openai_api.completion_prompts(tok, req.prompt)
        native = openai_api.native_body(req, prompts, req.temperature, req.top_p, req.max_tokens,
                                        req.logprobs, generation.context_len)
    try:
        return req, generation.parse_generate(native)
    except protocol.RequestError as e:
        raise openai_api.OpenAIError(str(e)) from None


async def _completions(generation: Generation, request: web.Request, chat: bool) -> web.StreamResponse:
    from hpcrl.engine import openai_api

    try:
        req, spec = _spec(generation, await read_body(request), chat)
    except protocol.RequestError as e:  # invalid JSON
        return openai_api.OpenAIError(str(e)).response()
    except openai_api.OpenAIError as e:
        return e.response()
    rid = openai_api.new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        return await _stream(generation, request, req, spec, rid, chat)
    try:
        results = await generation.collect(spec)
    except EngineUnavailable as e:
        return openai_api.OpenAIError(str(e), 503, "ServiceUnavailableError").response()
    failed = protocol.engine_failure(results)
    if failed is not None:
        return openai_api.OpenAIError(failed[0], failed[1], "InternalServerError").response()
    build = openai_api.chat_response if chat else openai_api.completion_response
    return web.json_response(build(generation.tokenizer, req, results, rid))


async def _stream(generation: Generation, request: web.Request, req, spec: protocol.GenerateSpec, rid: str,
                  chat: bool) -> web.StreamResponse:
    """OpenAI's server-sent events: one chunk per new text of a choice, then a ``usage`` chunk when asked,
    then ``data: [DONE]``."""
    from hpcrl.engine import openai_api

    try:
        queue = generation.updates(spec)
    except EngineUnavailable as e:
        return openai_api.OpenAIError(str(e), 503, "ServiceUnavailableError").response()
    resp = web.StreamResponse(headers=protocol.SSE_HEADERS)
    await resp.prepare(request)
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    states = [openai_api.StreamState(row.params.stop) for row in spec.rows]
    finals: list[dict | None] = [None] * len(spec.rows)
    want_lp = req.logprobs if chat else req.logprobs is not None

    async def send(payload: dict | str) -> None:
        await resp.write(protocol.sse_event(payload))

    left = len(spec.rows)
    try:
        while left:
            index, response, finished = await queue.get()
            left -= finished
            failed = protocol.engine_failure([response]) if finished else None
            if failed is not None:
                await send({"error": {"message": failed[0], "type": "InternalServerError",
                                      "code": failed[1]}})
                generation.abort_spec(spec, "Abort: another choice failed.")
                break
            state = states[index]
            text = state.delta(response["text"], finished)
            reason, matched = openai_api.finish_reason(response["meta_info"]["finish_reason"])
            ntok = len(response["output_ids"])
            if not text and not finished and state.started:
                continue
            logprobs = None
            if want_lp:
                meta = response["meta_info"]
                tok = generation.tokenizer
                logprobs = (openai_api.chat_logprobs(tok, meta, state.sent_tokens) if chat else
                            openai_api.completion_logprobs(tok, meta, state.sent_tokens,
                                                           len(state.sent_text) - len(text)))
                state.sent_tokens = ntok
            if chat:
                delta: dict[str, Any] = {"content": text}
                if not state.started:
                    delta = {"role": "assistant", "content": text}
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                          "matched_stop": matched}
            else:
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                          "matched_stop": matched}
            state.started = True
            if finished:
                finals[index] = response
            await send({"id": rid, "object": obj, "created": created, "model": req.model,
                        "choices": [choice]})
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                await send({"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
                            "usage": openai_api.usage(finals, req.n)})
        await send("[DONE]")
    except (asyncio.CancelledError, ConnectionResetError):
        generation.abort_spec(spec, "Abort: the client disconnected.")
        raise
    await resp.write_eof()
    return resp


async def v1_completions(generation: Generation, request: web.Request) -> web.StreamResponse:
    """``/v1/completions`` (OpenAI; :mod:`hpcrl.engine.openai_api`)."""
    return await _completions(generation, request, chat=False)


async def v1_chat_completions(generation: Generation, request: web.Request) -> web.StreamResponse:
    """``/v1/chat/completions`` (OpenAI; the chat template renders ``messages``)."""
    return await _completions(generation, request, chat=True)


async def tokenize(generation: Generation, request: web.Request) -> web.Response:
    """``/tokenize`` and ``/v1/tokenize``: ``{"tokens", "count", "max_model_len"}`` (lists for a list of
    prompts)."""
    from hpcrl.engine import openai_api

    tok = generation.tokenizer
    try:
        req = openai_api.parse(openai_api.TokenizeRequest, await read_body(request))
        if (req.prompt is None) == (req.messages is None):
            raise openai_api.OpenAIError("Exactly one of 'prompt' or 'messages' must be provided.")
        if req.messages is not None:
            add_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
            tokens: Any = openai_api.render_chat(tok, generation.chat_template, req.messages, req.tools,
                                                 add_prompt, False, req.chat_template_kwargs)
            count: Any = len(tokens)
        elif isinstance(req.prompt, str):
            tokens = list(tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
            count = len(tokens)
        else:
            tokens = [list(tok(p, add_special_tokens=req.add_special_tokens)["input_ids"])
                      for p in req.prompt]
            count = [len(t) for t in tokens]
    except protocol.RequestError as e:
        return openai_api.OpenAIError(str(e)).response()
    except openai_api.OpenAIError as e:
        return e.response()
    return web.json_response({"tokens": tokens, "count": count, "max_model_len": generation.context_len})


async def detokenize(generation: Generation, request: web.Request) -> web.Response:
    """``/detokenize`` and ``/v1/detokenize``: ``{"text"}`` (a list for lists of ids)."""
    from hpcrl.engine import openai_api

    try:
        req = openai_api.parse(openai_api.DetokenizeRequest, await read_body(request))
    except protocol.RequestError as e:
        return openai_api.OpenAIError(str(e)).response()
    except openai_api.OpenAIError as e:
        return e.response()
    batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    seqs = req.tokens if batch else [req.tokens]
    bad = [t for s in seqs for t in s if not 0 <= t < generation.vocab_size]
    if bad:
        return openai_api.OpenAIError(f"tokens out of range [0, {generation.vocab_size}): {bad[:5]}",
                                      param="tokens").response()
    texts = [generation.tokenizer.decode(s, skip_special_tokens=req.skip_special_tokens) for s in seqs]
    return web.json_response({"text": texts if batch else texts[0]})
