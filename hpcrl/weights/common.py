"""The error type of weight sync and the HTTP calls every transport shares (bounded, failing loudly).

Every call goes to each engine directly (the router does not proxy admin endpoints), concurrently, without
retries (weight updates are collective operations that must not run twice), and is bounded by ``timeout_s``.
A transport error, an HTTP error status, or a body with ``"success": false`` raises :class:`WeightSyncError`
naming the engine URL, the endpoint and the engine's message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcrl.engine.state import NESTED_BEGIN

logger = logging.getLogger(__name__)

BEGIN = "/begin_weight_update"
END = "/end_weight_update"


class WeightSyncError(RuntimeError):
    """A weight sync failed: an engine refused or did not answer in time, or the transfer itself failed.

    ``url``: the first failing engine's base URL (or the sender's group address for local failures);
    ``endpoint``: the endpoint (or step) that failed; ``message``: the engine's or the transport's message;
    ``failures``: ``[(url, message), ...]`` for every engine that failed in the same call.
    """

    def __init__(self, url: str, endpoint: str, message: str,
                 failures: Sequence[tuple[str, str]] | None = None):
        self.url = url
        self.endpoint = endpoint
        self.message = " ".join(str(message).split())  # one line, whatever the engine's text
        self.failures = ([(u, " ".join(str(m).split())) for u, m in failures] if failures
                         else [(url, self.message)])
        text = f"weight sync: {endpoint} on {url} failed: {self.message}"
        if len(self.failures) > 1:
            text += f" (and {len(self.failures) - 1} more engine(s) failed: " + "; ".join(
                f"{u}: {m}" for u, m in self.failures[1:]) + ")"
        super().__init__(text)

    def with_note(self, note: str) -> "WeightSyncError":
        """The same failure with ``note`` appended to its message (what happened after it, e.g. whether the
        weight-update session could be closed)."""
        return WeightSyncError(self.url, self.endpoint, f"{self.message}; {note}", [
            (u, f"{m}; {note}" if i == 0 else m) for i, (u, m) in enumerate(self.failures)])


def _engine_message(err: Exception) -> str:
    """The human part of a RolloutError: the engine's ``message`` if its body is SGLang's error JSON."""
    body = getattr(err, "body", None)
    if body:
        try:
            value = json.loads(body)
        except ValueError:
            return str(body).strip()[:2000]
        if isinstance(value, dict):
            inner = value.get("error", value)
            if isinstance(inner, dict) and "message" in inner:
                return str(inner["message"])
            if "message" in value:
                return str(value["message"])
        return str(value)[:2000]
    return str(err)


@dataclass
class EngineCalls:
    """The admin calls of a sync on every engine of ``client`` (a ``hpcrl.rollout.client.RolloutClient``).

    ``timeout_s``: the bound on each call, seconds.
    """

    client: Any
    timeout_s: float
    urls: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.urls = self.client.engine_urls
        if not self.urls:
            raise ValueError("weight sync needs the engine URLs (RolloutClient(engine_urls=...))")

    async def _one(self, method: str, url: str, endpoint: str, payload: Any,
                   timeout_s: float | None) -> dict:
        from hpcrl.rollout.client import RolloutError

        try:
            body = await self.client.request(method, endpoint, payload, base_url=url, retry=False,
                                             timeout_s=timeout_s or self.timeout_s)
        except RolloutError as e:
            raise WeightSyncError(url, endpoint, _engine_message(e)) from e
        if not isinstance(body, dict):
            body = {} if body in (None, "") else {"text": body}
        if body.get("success") is False:
            raise WeightSyncError(url, endpoint, str(body.get("message", body)))
        return body

    async def each(self, endpoint: str, payloads: Any, *, method: str = "POST",
                   timeout_s: float | None = None, per_engine: bool = False) -> list[dict]:
        """Send ``payloads`` (the same to all, or with ``per_engine`` a list in engine order) to every engine.

        Waits for all calls; returns the bodies in engine order. Raises WeightSyncError listing every engine
        that failed (HTTP error, ``success: false``, connection error, or no answer within ``timeout_s``).
        """
        if per_engine and len(payloads) != len(self.urls):
            raise ValueError(f"{len(payloads)} payloads for {len(self.urls)} engines")
        items = payloads if per_engine else [payloads] * len(self.urls)
        results = await asyncio.gather(*(self._one(method, u, endpoint, p, timeout_s)
                                          for u, p in zip(self.urls, items, strict=True)),
                                       return_exceptions=True)
        raise_failures(results, endpoint)
        return results  # type: ignore[return-value]

    async def pause(self, mode: str) -> None:
        """``/pause_generation {"mode": mode}`` on every engine."""
        await self.each("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """``/continue_generation`` on every engine."""
        await self.each("/continue_generation", {})

    async def flush_cache(self, poll_s: float = 0.2) -> None:
        """``/flush_cache`` on every engine, asking again while it answers 400 (requests still running; SGLang
        refuses then, slime retries), for at most ``timeout_s`` in all. Raises WeightSyncError."""
        async def one(url: str) -> None:
            deadline = time.monotonic() + self.timeout_s
            while True:
                left = deadline - time.monotonic()
                try:
                    await self._one("POST", url, "/flush_cache", None, max(0.1, left))
                    return
                except WeightSyncError as e:
                    status = getattr(e.__cause__, "status", None)
                    if status != 400 or time.monotonic() + poll_s > deadline:
                        raise
                await asyncio.sleep(poll_s)

        results = await asyncio.gather(*(one(u) for u in self.urls), return_exceptions=True)
        raise_failures(results, "/flush_cache")

    async def begin_sessions(self) -> None:
        """``/begin_weight_update`` on every engine (SGLang's weight-update session, which its tensor and
        distributed updates need: :mod:`hpcrl.engine.state`). An engine that still has a session open (a
        sync whose close could not reach it) has it closed and opened again, with a warning. If any engine
        fails, the sessions opened here are closed again and WeightSyncError names the failing engine(s)."""
        async def one(url: str) -> None:
            try:
                await self._one("POST", url, BEGIN, {}, None)
            except WeightSyncError as e:
                if e.message != NESTED_BEGIN:
                    raise
                logger.warning("weight sync: %s still had a weight-update session open; closing it first",
                               url)
                await self._one("POST", url, END, {}, None)
                await self._one("POST", url, BEGIN, {}, None)

        results = await asyncio.gather(*(one(u) for u in self.urls), return_exceptions=True)
        opened = [u for u, r in zip(self.urls, results, strict=True) if r is None]
        if len(opened) == len(self.urls):
            return
        try:
            raise_failures(results, BEGIN)
        except WeightSyncError as e:
            raise e.with_note(await self.close_sessions_after(opened)) from e.__cause__

    async def end_sessions(self) -> None:
        """``/end_weight_update`` on every engine. Raises WeightSyncError naming every engine that refused."""
        await self.each(END, {})

    async def close_sessions_after(self, urls: Sequence[str] | None = None) -> str:
        """After a failure inside the session: ``/end_weight_update`` on ``urls`` (default: every engine),
        best effort, each bounded by ``timeout_s``. Returns what happened, for the error's one line: the
        session closed on every engine, or which engines it could not be closed on and why (the next sync
        closes it there before it opens a new one)."""
        urls = list(self.urls if urls is None else urls)
        results = await asyncio.gather(*(self._one("POST", u, END, {}, None) for u in urls),
                                       return_exceptions=True)
        stuck = [(u, r) for u, r in zip(urls, results, strict=True) if isinstance(r, BaseException)]
        if not stuck:
            return f"the weight-update session was closed on {len(urls)} engine(s)"
        return "the weight-update session could not be closed on " + ", ".join(
            f"{u} ({getattr(r, 'message', None) or type(r).__name__})" for u, r in stuck)

    async def server_infos(self) -> list[dict]:
        """``GET /get_server_info`` of every engine."""
        return await self.each("/get_server_info", None, method="GET")

    async def check_versions(self, expected: str) -> None:
        """Raise WeightSyncError naming every engine whose ``/get_model_info`` ``weight_version`` is not
        ``expected`` (slime's CI check after a sync)."""
        infos = await self.each("/get_model_info", None, method="GET")
        versions = [str(i.get("weight_version")) for i in infos]
        wrong = [(u, f"weight_version is {v!r}, expected {expected!r}")
                 for u, v in zip(self.urls, versions, strict=True) if v != str(expected)]
        if wrong:
            raise WeightSyncError(wrong[0][0], "/get_model_info", wrong[0][1], wrong)


def raise_failures(results: Sequence[Any], endpoint: str) -> None:
    """Raise one WeightSyncError for all WeightSyncErrors in ``results`` (other exceptions: the first one)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    if not errors:
        return
    others = [e for e in errors if not isinstance(e, WeightSyncError)]
    if others:
        raise others[0]
    failures = [f for e in errors for f in e.failures]
    first = errors[0]
    raise WeightSyncError(first.url, first.endpoint or endpoint, first.message, failures) from first
