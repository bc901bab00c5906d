"""aiohttp's log of the requests it refuses before any handler runs: one line, not an error with a traceback.

sglang-router probes a new worker with an HTTP/2 preface (:data:`HTTP2_PREFACE`), which this HTTP/1.1 server
answers 400, and aiohttp would log each as a server fault. Installed by
:meth:`hpcrl.engine.server.EngineServer.serve`.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("hpcrl.engine")

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What an HTTP/2 client sends first (RFC 9113 3.4). sglang-router probes workers with it at start; this
HTTP/1.1 server answers it 400."""


class RefusedRequestFilter(logging.Filter):
    """Turns aiohttp's ``ERROR`` + traceback for a request it could not parse into one line without traceback.

    aiohttp answers a request that is not valid HTTP/1.x (the HTTP/2 preface sglang-router sends at start,
    garbage, an oversized header) with 400 and logs it on ``aiohttp.server`` like a server fault. Those are
    the client's errors, rightly refused: the preface is logged at DEBUG, anything else malformed as one
    WARNING line naming the peer and aiohttp's reason. Every other record (a handler that raised: a real
    server error) passes unchanged, with its traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        reason = " ".join(str(getattr(exc, "message", "") or exc).split())[:200]
        if "PRI" in reason:  # aiohttp: "Pause on PRI/Upgrade"
            logger.debug("refused an HTTP/2 preface from %s with 400 (this server speaks HTTP/1.1)", peer)
        else:
            logger.warning("refused a malformed request from %s with 400: %s", peer, reason)
        return False


def quiet_refused_requests() -> None:
    """Install :class:`RefusedRequestFilter` on the ``aiohttp.server`` logger (once per process)."""
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, RefusedRequestFilter) for f in server_log.filters):
        server_log.addFilter(RefusedRequestFilter())
