"""Async HTTP client for the rollout engines: SGLang's native protocol, direct or through the router.

The same code talks to real SGLang servers on GPUs and to hpcrl's CPU engine: it uses only SGLang's documented
endpoints and fields (``/generate`` with ``input_ids``, ``/abort_request``, ``/pause_generation``,
``/continue_generation``, ``/flush_cache``, ``/health``, ``/get_model_info``, and the weight/memory admin
endpoints through :meth:`RolloutClient.post_all`).

Routing. ``generate`` goes to the router when there is one (the router balances and retries between its
workers), else round-robin over ``engine_urls``. Everything that the router does not proxy (abort, pause,
continue, weight sync, memory release/resume; see ``reference/cpu-stack.md`` section 5) goes to every engine
directly, so the client needs the engine URLs even when a router is used.

Retries. Connection errors, timeouts and HTTP 5xx are retried with exponential backoff
(``backoff_s * 2**attempt``, at most ``max_backoff_s``) up to ``max_retries`` times; without a router each
retry moves on to the next engine. HTTP 4xx is never retried. When the attempts are used up a
:class:`RolloutError` names the URL and the last error.

Engines that die. The set of engines (and the router) can change while requests run: the rollout's health
monitor (:mod:`hpcrl.rollout.health`) removes a dead engine with :meth:`RolloutClient.set_engine_urls`, marks
the router down or moved with :meth:`RolloutClient.set_router`, and is told of every failed attempt through
``on_failure(base_url, error)``. A request whose target was taken out of rotation by that call is sent again at
once, to another engine, without using up a retry; when nothing is left to send to, requests wait until an
engine (or the router) is back, or until :meth:`RolloutClient.set_lost` says none will come
(:class:`EnginesLost`). :attr:`RolloutClient.retried_requests` counts requests sent more than once.

Auth. With ``api_key`` set, every request carries ``Authorization: Bearer <api_key>`` (engines started with
the run secret, and a router started with the same key, require it).

Usage::

    async with RolloutClient(router_url, engine_urls, api_key=key) as client:
        await client.wait_healthy(timeout_s=300)
        out = await client.generate([1, 2, 3], {"max_new_tokens": 16})
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Optional, Sequence

import aiohttp

from hpcrl.rollout.token_versions import ChunkLabeller, labels_from_spans

KEEPALIVE_S = 4.0
"""Seconds an idle pooled connection to an engine or router may be reused (aiohttp's default is 15): below the
keep-alive of SGLang's server (uvicorn's ``timeout_keep_alive``, ``SGLANG_TIMEOUT_KEEP_ALIVE``, 5 s), which
closes a connection idle that long. aiohttp hands out the oldest idle connection first, and after a rollout's
hundreds of requests the pool holds many: a weight update sent on one the server was closing failed with
``ClientOSError: Can not write request body`` (the quickstart on SGLang with one trainer thread, at step 2,
twice in two runs; SGLang never saw the request). hpcrl's CPU engine keeps connections 75 s (aiohttp's server
default)."""


class RolloutError(RuntimeError):
    """A request to an engine or the router failed for good.

    ``url`` is the URL of the last attempt, ``status`` its HTTP status (None for connection errors and
    timeouts), ``body`` the response text (truncated) if there was one.
    """

    def __init__(self, message: str, url: str, status: Optional[int] = None, body: Optional[str] = None):
        super().__init__(message)
        self.url = url
        self.status = status
        self.body = body


class EnginesLost(RolloutError):
    """No engine is left to generate and none may be restarted (``rollout.max_engine_restarts`` used up): the
    run checkpoints its last finished step and exits for requeue (:data:`hpcrl.errors.EXIT_RETRY`)."""


class _Retryable(Exception):
    """Internal: an attempt failed in a way worth retrying (connection error, timeout, 5xx)."""

    def __init__(self, description: str, status: Optional[int] = None, body: Optional[str] = None):
        super().__init__(description)
        self.status = status
        self.body = body


_BODY_LIMIT = 2000  # characters of an error body kept in RolloutError


def _decode(text: str) -> Any:
    """JSON if the body parses as JSON, else the text itself (SGLang answers some endpoints in plain text)."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _as_dict(value: Any) -> dict:
    """Normalise a response body to a dict: dicts as-is, empty/null -> {}, text -> {"text": ...},
    other JSON -> {"result": ...}."""
    if isinstance(value, dict):
        return value
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        return {"text": value}
    return {"result": value}


def _error_message(value: Any) -> str:
    """The human part of an SGLang error body (``{"error": {"message": ...}}`` or ``{"message": ...}``)."""
    if isinstance(value, dict):
        err = value.get("error", value)
        if isinstance(err, dict):
            return str(err.get("message", err))
        if "message" in value:
            return str(value["message"])
        return str(err)
    return str(value)[:_BODY_LIMIT]


class RolloutClient:
    """One aiohttp session to a set of engines and an optional router.

    Args:
        router_url: base URL of the router (``http://host:port``), or None to balance over ``engine_urls``.
        engine_urls: base URLs of every engine; needed for the endpoints the router does not proxy.
        api_key: sent as ``Authorization: Bearer <api_key>`` on every request when set.
        timeout_s: total time for one attempt of one request, seconds (a long generation must fit).
        max_retries: retries after the first attempt (connection errors, timeouts, 5xx only).
        backoff_s: first retry delay, seconds; doubles per retry up to ``max_backoff_s``.
        max_backoff_s: cap on one retry delay, seconds.
        max_connections: cap on open connections of the session (0: unlimited; aiohttp's default is 100,
            too few for a rollout with hundreds of requests in flight).
        connect_timeout_s: bound on opening one connection, seconds (a dead node that does not refuse
            connections costs this much per attempt, not ``timeout_s``).
        on_failure: called as ``on_failure(base_url, error_text)`` after each failed attempt on an engine or
            the router (connection error, timeout, 5xx), before the retry; the health monitor's hook.
        keep_partial: stream single-sequence :meth:`generate` calls and, when the engine dies mid-generation,
            keep the tokens it sent and continue from them elsewhere (``rollout.partial_rollout``).
        generate_fields: fields added to every ``/generate`` payload of :meth:`generate` and
            :meth:`generate_batch` (``{"return_routed_experts": True}`` for routing replay).
        span_lag: tokens at the start of each later ``weight_versions`` span of an answer that the previous
            version sampled (:func:`hpcrl.rollout.token_versions.span_lag`: 1 for SGLang paused ``in_place``
            under its overlap scheduler).

    Use as ``async with RolloutClient(...) as client`` (or call :meth:`open` / :meth:`close`).
    Raises ValueError if neither a router nor any engine is given.
    """

    def __init__(self, router_url: Optional[str] = None, engine_urls: Sequence[str] = (),
                 api_key: Optional[str] = None, timeout_s: float = 600.0, max_retries: int = 3,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0, max_connections: int = 0,
                 connect_timeout_s: float = 10.0, on_failure=None, keep_partial: bool = False,
                 generate_fields: Optional[dict[str, Any]] = None, span_lag: int = 0):
        if not router_url and not engine_urls:
            raise ValueError("RolloutClient needs a router_url or at least one engine URL")
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("max_retries must be >= 0, timeout_s > 0 and backoff_s >= 0")
        self.router_url = router_url.rstrip("/") if router_url else None
        self._engine_urls = [u.rstrip("/") for u in engine_urls]
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_connections = int(max_connections)
        self.connect_timeout_s = float(connect_timeout_s)
        self._session: Optional[aiohttp.ClientSession] = None
        self._rr = 0
        self._weight_version: Optional[str] = None
        self.on_failure = on_failure
        self._uses_router = self.router_url is not None
        self._knows_engines = bool(self._engine_urls)
        self._changed: Optional[asyncio.Event] = None  # set (and replaced) when engines or router change
        self._lost: Optional[str] = None
        self.retried_requests = 0
        """Requests that needed more than one attempt (a metric of engine failures)."""
        self.keep_partial = bool(keep_partial)
        self.generate_fields: dict[str, Any] = dict(generate_fields or {})
        self.kept_partial_tokens = 0
        """Tokens received from an engine that then died, kept and continued from on another one."""
        self.span_lag = int(span_lag)

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> "RolloutClient":
        """Create the aiohttp session (idempotent). Returns self."""
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                headers=headers, timeout=self._timeout(self.timeout_s),
                connector=aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=KEEPALIVE_S))
        return self

    async def close(self) -> None:
        """Close the session (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "RolloutClient":
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ state
    @property
    def engine_urls(self) -> list[str]:
        """A copy of the engine URLs the client talks to directly."""
        return list(self._engine_urls)

    def set_engine_urls(self, urls: Sequence[str]) -> None:
        """Replace the engine URLs (after an engine was restarted on a new port or removed); requests waiting
        for an engine go on. Call on the client's event loop."""
        self._engine_urls = [u.rstrip("/") for u in urls]
        self._notify()

    def set_router(self, url: Optional[str]) -> None:
        """The router's new base URL after a restart, or None while it is down (requests wait for it).
        Only for a client made with a router. Call on the client's event loop."""
        self.router_url = url.rstrip("/") if url else None
        self._notify()

    def set_lost(self, reason: str) -> None:
        """No engine will come back: requests waiting for one, and every later one, raise
        :class:`EnginesLost` with ``reason``. Call on the client's event loop."""
        self._lost = reason
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _target(self) -> str:
        """Where the next generation attempt goes: the router, else the next engine (round robin); waits
        while there is none (at most ``timeout_s``). Raises EnginesLost, or RolloutError after the wait."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._lost is not None:
                raise EnginesLost(f"no engine left: {self._lost}", self.router_url or "engines")
            if self._uses_router and self.router_url and (self._engine_urls or not self._knows_engines):
                return self.router_url  # (given the engines too: only while one of them serves)
            if not self._uses_router and self._engine_urls:
                return self._next_engine()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutError(f"no {'router' if self._uses_router else 'engine'} to send to for "
                                   f"{self.timeout_s:g} s", "engines")
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def out_of_rotation(self, engine_url: str) -> bool:
        """Whether ``engine_url`` was one of this client's engines and the health monitor took it out."""
        return (self.on_failure is not None and self._knows_engines
                and engine_url.rstrip("/") not in self._engine_urls and engine_url.rstrip("/") != self.router_url)

    def _in_rotation(self, base: str) -> bool:
        return base == self.router_url if self._uses_router else base in self._engine_urls

    @property
    def weight_version(self) -> Optional[str]:
        """The newest ``meta_info.weight_version`` seen in any generate response (None before the first)."""
        return self._weight_version

    # ------------------------------------------------------------------ low level
    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, sock_connect=min(total_s, self.connect_timeout_s))

    def _next_engine(self) -> str:
        if not self._engine_urls:
            raise ValueError("no engine URLs to send the request to")
        url = self._engine_urls[self._rr % len(self._engine_urls)]
        self._rr += 1
        return url

    def _need_engines(self) -> list[str]:
        if not self._engine_urls:
            raise ValueError("this call goes to every engine directly, but the client has no engine URLs")
        return list(self._engine_urls)

    async def _attempt(self, method: str, url: str, payload: Any, params: Optional[dict],
                       timeout_s: Optional[float]) -> Any:
        """One HTTP request. Returns the decoded body on 2xx; raises _Retryable or RolloutError (4xx)."""
        if self._session is None:
            await self.open()
        assert self._session is not None
        timeout = self._timeout(timeout_s) if timeout_s is not None else None
        try:
            async with self._session.request(method, url, json=payload, params=params,
                                             timeout=timeout) as resp:
                text = await resp.text()
                status = resp.status
        except asyncio.TimeoutError:
            raise _Retryable(f"timed out after {timeout_s or self.timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        body = _decode(text)
        if 200 <= status < 300:
            return body
        message = f"HTTP {status}: {_error_message(body)}"
        if status >= 500:
            raise _Retryable(message, status, text[:_BODY_LIMIT])
        raise RolloutError(f"{method} {url} failed: {message}", url, status, text[:_BODY_LIMIT])

    async def request(self, method: str, path: str, payload: Any = None, *, base_url: Optional[str] = None,
                      params: Optional[dict] = None, retry: bool = True,
                      timeout_s: Optional[float] = None) -> Any:
        """Send one request with the retry policy; return the decoded body (JSON, text, or None if empty).

        ``base_url`` fixes the target; otherwise the router, or round-robin over the engines (moving to the
        next engine on each retry). ``timeout_s`` overrides the client's per-attempt timeout (seconds).
        Raises RolloutError (naming the URL and the last error) after a 4xx, or when the retries are used up.
        """
        return await self._with_retries(
            lambda base: self._attempt(method, base + path, payload, params, timeout_s),
            method, path, base_url=base_url, retry=retry)

    async def _with_retries(self, send, method: str, path: str, *, base_url: Optional[str],
                            retry: bool) -> Any:
        """The retry policy of :meth:`request` around ``await send(base_url_of_this_attempt)``."""
        attempts = 1 + (self.max_retries if retry else 0)
        url = ""
        last: Optional[_Retryable] = None
        attempt = sent = 0
        while attempt < attempts:
            base = base_url or await self._target()
            url = base + path
            sent += 1
            if sent == 2:
                self.retried_requests += 1
            try:
                return await send(base)
            except _Retryable as e:
                last = e
                if self.on_failure is not None:
                    self.on_failure(base, str(e))
                if base_url is None and retry and not self._in_rotation(base):
                    continue  # the monitor took it out of rotation: try elsewhere, this attempt is free
                if base_url is not None and self.out_of_rotation(base_url):
                    break  # an engine the monitor took out: it is being replaced, no use retrying it
                attempt += 1
                if attempt < attempts:
                    await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
        assert last is not None
        raise RolloutError(f"{method} {url} failed after {attempts} attempt(s): {last}", url, last.status,
                           last.body)

    async def _stream_attempt(self, url: str, payload: dict, on_chunk) -> dict:
        """One streamed ``/generate`` (SSE ``data: {json}`` ... ``data: [DONE]``): ``on_chunk(chunk)`` for
        every chunk as it comes; returns the last one. A stream cut before ``[DONE]`` (the engine died), a
        connection error, a timeout or a 5xx raise _Retryable; a 4xx raises RolloutError."""
        if self._session is None:
            await self.open()
        assert self._session is not None
        last: Optional[dict] = None
        try:
            async with self._session.post(url, json=payload) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    message = f"HTTP {resp.status}: {_error_message(_decode(text))}"
                    if resp.status >= 500:
                        raise _Retryable(message, resp.status, text[:_BODY_LIMIT])
                    raise RolloutError(f"POST {url} failed: {message}", url, resp.status, text[:_BODY_LIMIT])
                async for raw in resp.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        if last is None:
                            raise _Retryable("stream ended without a chunk")
                        return last
                    chunk = _decode(data)
                    if not isinstance(chunk, dict) or "error" in chunk:  # e.g. a router whose worker died
                        raise _Retryable(f"stream error: {_error_message(chunk)}")
                    last = chunk
                    on_chunk(chunk)
        except asyncio.TimeoutError:
            raise _Retryable(f"timed out after {self.timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        raise _Retryable("stream ended before [DONE]")

    async def _to_engines(self, method: str, path: str, payload: Any, *, retry: bool,
                          params: Optional[dict] = None, timeout_s: Optional[float] = None,
                          skip_lost: bool = False, only: Optional[Sequence[str]] = None) -> list[dict]:
        """Send the same request to every engine concurrently; results in engine order.

        Every request runs to completion; then the first failure (in engine order) is raised as RolloutError,
        its message also counting how many engines failed. ``skip_lost``: an engine that failed and that the
        health monitor took out of rotation meanwhile (it is being replaced) answers ``{"skipped": reason}``
        instead of failing the call. ``only``: just the engines in rotation that are among these URLs.
        """
        if skip_lost and not self._engine_urls and self.on_failure is not None:
            return []  # every engine is being replaced; they start in the state they are wanted in
        urls = self._need_engines()
        if only is not None:
            wanted = {u.rstrip("/") for u in only}
            urls = [u for u in urls if u in wanted]
        results = await asyncio.gather(
            *(self.request(method, path, payload, base_url=u, params=params, retry=retry, timeout_s=timeout_s)
              for u in urls), return_exceptions=True)
        if skip_lost:
            results = [{"skipped": str(r)} if isinstance(r, RolloutError) and self.out_of_rotation(u) else r
                       for u, r in zip(urls, results)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            first = errors[0]
            if isinstance(first, RolloutError):
                if len(errors) > 1:
                    raise RolloutError(f"{first} ({len(errors)} of {len(urls)} engines failed)",
                                       first.url, first.status, first.body) from first
                raise first
            raise first
        return [_as_dict(r) for r in results]

    # ------------------------------------------------------------------ generation
    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True,
                       rid: Optional[str] = None, **extra: Any) -> dict:
        """POST SGLang's native ``/generate`` with ``input_ids`` (token ids) and return the response dict.

        The response has ``text``, ``output_ids`` and ``meta_info`` (``finish_reason``, ``weight_version``,
        and with ``return_logprob`` ``output_token_logprobs`` as ``[logprob, token_id, text]`` triples).
        ``rid`` names the request (for targeted aborts); ``extra`` adds other documented ``/generate`` fields
        (``logprob_start_len``, ``return_routed_experts``...). Updates :attr:`weight_version`.

        Per-token versions: ``meta_info`` gains ``output_token_weight_versions``, one engine version per
        output token, when the client can tell (:mod:`hpcrl.rollout.token_versions`): from the answer's
        ``weight_versions`` spans (SGLang 0.5.23, the CPU engine), else, streamed (``keep_partial``), from the
        chunks that brought the tokens (kept tokens of a dead engine keep theirs). Without either (an older
        SGLang, not streamed) it is absent: the one ``weight_version`` cannot say where an in-place (or
        retract) update landed inside the response. The log-prob of each token is the engine's sampled one,
        i.e. the distribution the token was drawn from: one version's policy given the prefix under ``abort``
        (one call per version) and ``retract`` (the prefix is re-prefilled with the new weights), but after an
        ``in_place`` update the new weights over the KV cache the old ones computed (neither version's
        policy).
        Raises RolloutError (see :meth:`request`).
        """
        payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                                   "return_logprob": bool(return_logprob), **self.generate_fields}
        if rid is not None:
            payload["rid"] = rid
        payload.update(extra)
        if self.keep_partial and not payload.get("stream"):
            out = await self._generate_keeping_partial(payload)
        else:
            out = await self.request("POST", "/generate", payload)
        if not isinstance(out, dict):
            raise RolloutError(f"/generate returned {type(out).__name__}, expected a JSON object",
                               self.router_url or "engines")
        _label_tokens(out, self.span_lag)
        version = (out.get("meta_info") or {}).get("weight_version")
        if version is not None:
            self._weight_version = str(version)
        return out

    async def _generate_keeping_partial(self, payload: dict) -> dict:
        """:meth:`generate` streamed, so that an engine dying mid-generation costs only what it had not sent:
        the tokens received so far (cumulative in each SSE chunk, SGLang's default) are kept, and the retry
        continues from ``prompt + kept`` with ``max_new_tokens`` reduced by their number, on another engine
        (as slime's ``sglang_streaming_rollout`` keeps an aborted sample's partial state). Returns one
        response as a non-streamed call would (``output_ids``, ``text`` and ``output_token_logprobs`` joined,
        ``completion_tokens`` counted over all attempts). :attr:`kept_partial_tokens` counts kept tokens.
        ``meta_info["output_token_weight_versions"]``: each output token's version
        (:class:`~hpcrl.rollout.token_versions.ChunkLabeller`)."""
        prompt = list(payload["input_ids"])
        params = dict(payload["sampling_params"])
        limit = params.get("max_new_tokens")
        kept_ids: list[int] = []
        kept_lp: list = []
        kept_versions: list = []
        kept_text = ""
        current: dict = {}

        def on_chunk(chunk: dict) -> None:
            current["chunk"] = chunk
            current["labels"].add(split(chunk)[0], (chunk.get("meta_info") or {}).get("weight_version"))

        def split(chunk: dict) -> tuple[list[int], list, str]:
            triples = (chunk.get("meta_info") or {}).get("output_token_logprobs")
            ids = [int(t[1]) for t in triples] if triples is not None else list(chunk.get("output_ids") or [])
            return ids, list(triples or []), str(chunk.get("text") or "")

        async def send(base: str) -> dict:
            nonlocal kept_ids, kept_lp, kept_versions, kept_text
            body = dict(payload, stream=True, input_ids=prompt + kept_ids, sampling_params=dict(params))
            if kept_ids and limit is not None:
                body["sampling_params"]["max_new_tokens"] = max(int(limit) - len(kept_ids), 0)
            current.clear()
            current["labels"] = ChunkLabeller(kept_versions[-1] if kept_versions else None)
            try:
                return await self._stream_attempt(base + "/generate", body, on_chunk)
            except _Retryable:
                chunk = current.get("chunk")
                if chunk is not None:  # the engine died mid-stream: keep what it sent
                    ids, lp, text = split(chunk)
                    kept_ids, kept_lp, kept_text = kept_ids + ids, kept_lp + lp, kept_text + text
                    kept_versions = kept_versions + current["labels"].labels
                    self.kept_partial_tokens += len(ids)
                raise

        if limit is not None and int(limit) <= 0:
            return await self.request("POST", "/generate", payload)
        final = await self._with_retries(send, "POST", "/generate", base_url=None, retry=True)
        ids, lp, text = split(final)
        meta = dict(final.get("meta_info") or {})
        exact = labels_from_spans(meta.get("weight_versions"), len(ids), self.span_lag)
        meta["output_token_weight_versions"] = kept_versions + (current["labels"].labels if exact is None
                                                                else exact)
        if not kept_ids:
            return {**final, "meta_info": meta}
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = kept_lp + lp
        meta["completion_tokens"] = len(kept_ids) + len(ids)
        meta["prompt_tokens"] = len(prompt)
        return {**final, "text": kept_text + text, "output_ids": kept_ids + ids, "meta_info": meta}

    async def generate_batch(self, input_ids: Sequence[list[int]], sampling_params: Sequence[dict],
                             return_logprob: bool = True) -> list[dict]:
        """POST one ``/generate`` for several sequences (SGLang's batch form: ``input_ids`` a list of token-id
        lists, ``sampling_params`` one dict per input) and return one response dict per input, in order.

        Same routing, retries and errors as :meth:`generate` (a retry resends the whole batch); updates
        :attr:`weight_version`. The engine decodes the inputs together and answers when all are done.
        sglang-router 0.3 rejects per-input ``sampling_params`` (HTTP 422), so use this without a router.
        Raises ValueError when the two lists differ in length or are empty, RolloutError (see
        :meth:`request`, and when the answer is not a list of one object per input).
        """
        if len(input_ids) != len(sampling_params) or not input_ids:
            raise ValueError(f"generate_batch needs as many sampling_params ({len(sampling_params)}) as "
                             f"inputs ({len(input_ids)}), and at least one")
        payload = {"input_ids": [list(ids) for ids in input_ids],
                   "sampling_params": [dict(p) for p in sampling_params], "return_logprob": bool(return_logprob),
                   **self.generate_fields}
        out = await self.request("POST", "/generate", payload)
        if not isinstance(out, list) or len(out) != len(input_ids) or not all(isinstance(o, dict) for o in out):
            raise RolloutError(f"batch /generate of {len(input_ids)} inputs returned "
                               f"{type(out).__name__} {len(out) if isinstance(out, list) else ''}, expected a "
                               f"list of {len(input_ids)} JSON objects", self.router_url or "engines")
        for o in out:
            _label_tokens(o, self.span_lag)
            version = (o.get("meta_info") or {}).get("weight_version")
            if version is not None:
                self._weight_version = str(version)
        return out

    # ------------------------------------------------------------------ control (every engine, directly)
    async def abort_all(self) -> list[dict]:
        """POST ``/abort_request {"abort_all": true}`` to every engine: running requests return early with
        ``finish_reason.type == "abort"`` and the tokens generated so far. Raises RolloutError."""
        return await self._to_engines("POST", "/abort_request", {"abort_all": True}, retry=True, skip_lost=True)

    async def abort(self, rid: str) -> list[dict]:
        """Abort the request ``rid`` wherever it runs (``/abort_request {"rid": rid}`` to every engine)."""
        return await self._to_engines("POST", "/abort_request", {"rid": rid}, retry=True, skip_lost=True)

    async def pause(self, mode: str = "abort") -> list[dict]:
        """POST ``/pause_generation {"mode": mode}`` to every engine (``abort``: running requests are aborted;
        ``retract`` / ``in_place``: kept and resumed by :meth:`resume`). Raises RolloutError."""
        return await self._to_engines("POST", "/pause_generation", {"mode": mode}, retry=True, skip_lost=True)

    async def resume(self) -> list[dict]:
        """POST ``/continue_generation`` to every engine. Raises RolloutError."""
        return await self._to_engines("POST", "/continue_generation", {}, retry=True, skip_lost=True)

    async def flush_cache(self, wait_s: float = 60.0, poll_s: float = 1.0) -> list[dict]:
        """POST ``/flush_cache`` to every engine.

        SGLang refuses (HTTP 400) while requests are running; each engine is asked again every ``poll_s``
        seconds until it agrees or ``wait_s`` seconds have passed (slime retries 60 x 1 s).
        Raises RolloutError naming the engine that still refused.
        """
        async def one(url: str) -> dict:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    return _as_dict(await self.request("POST", "/flush_cache", None, base_url=url))
                except RolloutError as e:
                    if self.out_of_rotation(url):
                        return {"skipped": str(e)}
                    if e.status != 400 or time.monotonic() + poll_s > deadline:
                        raise
                await asyncio.sleep(poll_s)

        if not self._engine_urls and self.on_failure is not None:
            return []  # every engine is being replaced (they start with an empty cache)
        results = await asyncio.gather(*(one(u) for u in self._need_engines()), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)  # type: ignore[arg-type]

    async def post_all(self, endpoint: str, payload: Any = None, retry: bool = False,
                       timeout_s: Optional[float] = None, skip_lost: bool = False,
                       only: Optional[Sequence[str]] = None) -> list[dict]:
        """POST ``payload`` to ``endpoint`` on every engine concurrently (weight sync, memory occupation...).

        Returns one dict per engine, in :attr:`engine_urls` order (a ``null``/empty body becomes ``{}``, a
        text body ``{"text": ...}``). No retries by default: weight-update endpoints are collective operations
        that must not run twice. ``timeout_s`` overrides the per-attempt timeout (seconds). ``only``: just the
        engines in rotation among these URLs (the others are not asked). ``skip_lost``: see
        :meth:`_to_engines`. Raises RolloutError for the first engine that failed (4xx, 5xx, connection
        error).
        """
        path = endpoint if endpoint.startswith("/") else "/" + endpoint
        return await self._to_engines("POST", path, payload, retry=retry, timeout_s=timeout_s,
                                      skip_lost=skip_lost, only=only)

    async def get_weight_versions(self) -> dict[str, Optional[str]]:
        """``{engine_url: weight_version}`` from each engine's ``/get_model_info``. Raises RolloutError."""
        urls = self._need_engines()
        infos = await asyncio.gather(*(self.request("GET", "/get_model_info", base_url=u) for u in urls))
        return {u: (_as_dict(i).get("weight_version")) for u, i in zip(urls, infos)}

    async def wait_healthy(self, timeout_s: float = 600.0, poll_s: float = 0.05) -> None:
        """Poll ``GET /health`` on every engine and on the router until each answers 200 (every ``poll_s``
        seconds).

        ``timeout_s`` bounds the whole wait (seconds); each probe waits at most 5 s. Raises RolloutError
        naming every URL that never answered 200 and its last error.
        """
        targets = list(self._engine_urls) + ([self.router_url] if self.router_url else [])
        pending = {u: "no answer yet" for u in targets}
        deadline = time.monotonic() + timeout_s

        async def probe(base: str) -> None:
            try:
                await self._attempt("GET", base + "/health", None, None,
                                    max(0.1, min(5.0, deadline - time.monotonic())))
                pending.pop(base, None)
            except (RolloutError, _Retryable) as e:
                pending[base] = str(e)

        while True:
            await asyncio.gather(*(probe(u) for u in list(pending)))
            if not pending:
                return
            if time.monotonic() + poll_s > deadline:
                detail = "; ".join(f"{u}/health ({err})" for u, err in pending.items())
                first = next(iter(pending))
                raise RolloutError(f"not healthy after {timeout_s:g} s: {detail}", first + "/health")
            await asyncio.sleep(poll_s)


def _label_tokens(out: dict, lag: int = 0) -> None:
    """Add ``meta_info["output_token_weight_versions"]`` to a ``/generate`` answer from its
    ``weight_versions`` spans (``lag``: :func:`hpcrl.rollout.token_versions.labels_from_spans`) when it has
    none yet and the spans cover its output tokens."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict) or "output_token_weight_versions" in meta:
        return
    tokens = meta.get("output_token_logprobs") or out.get("output_ids") or []
    labels = labels_from_spans(meta.get("weight_versions"), len(tokens), lag)
    if labels is not None:
        meta["output_token_weight_versions"] = labels
