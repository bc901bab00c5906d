"""The error type of weight sync and the HTTP calls every transport shares (bounded, failing loudly).

Every call goes to each engine directly (the router does not proxy admin endpoints), concurrently, without
retries (weight updates are collective operations that must not run twice), and is bounded by ``timeout_s``.
A transport error, an HTTP error status, or a body with ``"success": false`` raises :class:`WeightSyncError`
naming the engine URL, the endpoint and the engine's message.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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
        self.message = message
        self.failures = list(failures) if failures else [(url, message)]
        text = f"weight sync: {endpoint} on {url} failed: {message}"
        if len(self.failures) > 1:
            text += f" (and {len(self.failures) - 1} more engine(s) failed: " + "; ".join(
                f"{u}: {m}" for u, m in self.failures[1:]) + ")"
        super().__init__(text)


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
