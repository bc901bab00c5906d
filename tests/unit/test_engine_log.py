"""The engine server's log: requests it rightly refuses (not HTTP/1.x) are one quiet line, real server errors
keep their traceback. A real aiohttp server on a loopback port with :func:`quiet_refused_requests` installed,
driven over raw sockets (issue #9 point 11; the engine itself behind the router: test_rollout_client.py)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from hpcrl.engine.httplog import HTTP2_PREFACE, quiet_refused_requests


async def _boom(request: web.Request) -> web.Response:
    raise RuntimeError("a real server fault")


async def _exchange(payloads: list[bytes]) -> list[bytes]:
    """Serve an app with a raising handler; send each payload on its own connection; the status lines."""
    app = web.Application()
    app.router.add_get("/boom", _boom)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    replies = []
    try:
        for payload in payloads:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(payload)
            await writer.drain()
            replies.append((await asyncio.wait_for(reader.read(4096), 10)).split(b"\r\n", 1)[0])
            writer.close()
    finally:
        await runner.cleanup()
    return replies


def test_refused_requests_are_one_line_and_server_errors_keep_their_traceback(caplog):
    quiet_refused_requests()
    quiet_refused_requests()  # idempotent: one filter
    assert len(logging.getLogger("aiohttp.server").filters) == 1
    caplog.set_level(logging.DEBUG)
    replies = asyncio.run(_exchange([
        HTTP2_PREFACE,
        b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",  # malformed header line
        b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n",
    ]))
    assert [r.split(b" ")[1] for r in replies] == [b"400", b"400", b"500"]
    records = [r for r in caplog.records if r.name in ("aiohttp.server", "hpcrl.engine")]
    refused = [r for r in records if "refused" in r.getMessage()]
    assert [(r.levelname, r.exc_info) for r in refused] == [("DEBUG", None), ("WARNING", None)]
    assert "HTTP/2 preface from 127.0.0.1" in refused[0].getMessage()
    # the only record with a traceback is the handler's real fault, at ERROR
    with_tb = [r for r in records if r.exc_info]
    assert len(with_tb) == 1 and with_tb[0].levelname == "ERROR"
    assert isinstance(with_tb[0].exc_info[1], RuntimeError)
