"""A reward model behind HTTP (slime ``--rm-type remote_rm --rm-url URL``).

The request is ``POST URL`` with JSON ``{"prompt": ..., "response": ..., "label": ...}``. The reply is JSON:
a number, ``{"reward": number, ...}`` (the number is used), or another object of numbers (returned as a dict
reward, like slime's dict rewards). Connection errors, timeouts, HTTP 429 and 5xx are retried with
exponential backoff (``backoff_s * 2**attempt``, capped at ``max_backoff_s``); other HTTP errors and
malformed replies fail at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, Union


class RemoteRewardError(RuntimeError):
    """The reward server could not give a reward (after retries, or a non-retryable reply)."""


async def remote_rm(url: str, prompt: Any, response: str, label: Any, *, timeout_s: float = 60.0,
                    max_retries: int = 10, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                    session: Any = None) -> Union[float, dict[str, float]]:
    """POST one sample to a reward server and return its reward.

    ``timeout_s`` bounds each attempt (seconds); there are at most ``1 + max_retries`` attempts (slime retries
    10 times). ``session``: an ``aiohttp.ClientSession`` to reuse; by default one is opened per call.
    Raises :class:`RemoteRewardError` naming the URL, the attempts and the last error.
    """
    import aiohttp

    payload = {"prompt": prompt, "response": response, "label": label}
    own = session is None
    if own:
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
    last = ""
    try:
        for attempt in range(max_retries + 1):
            if attempt:
                await asyncio.sleep(min(backoff_s * 2 ** (attempt - 1), max_backoff_s))
            try:
                async with session.post(url, json=payload,
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    if resp.status == 429 or resp.status >= 500:
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        continue
                    if resp.status >= 400:
                        raise RemoteRewardError(
                            f"reward server {url} answered HTTP {resp.status}: {(await resp.text())[:200]}")
                    body = await resp.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            return _parse_reward(url, body)
    finally:
        if own:
            await session.close()
    raise RemoteRewardError(f"reward server {url} failed after {max_retries + 1} attempts; "
                            f"last error: {last}")


def _parse_reward(url: str, body: Any) -> Union[float, dict[str, float]]:
    """A reply body as a float or a dict of floats; raises RemoteRewardError otherwise."""
    if isinstance(body, (int, float)) and not isinstance(body, bool):
        return float(body)
    if isinstance(body, dict):
        if "reward" in body and isinstance(body["reward"], (int, float)):
            return float(body["reward"])
        if body and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in body.values()):
            return {str(k): float(v) for k, v in body.items()}
    raise RemoteRewardError(f"reward server {url} replied {str(body)[:200]!r}; expected a number, "
                            f"{{'reward': number}} or an object of numbers")

