"""API keys of the engine server, as SGLang 0.5.23 checks them (``srt/utils/auth.py``).

With an API key every endpoint needs ``Authorization: Bearer KEY`` (nothing else is accepted) and answers 401
with ``{"error": "Unauthorized"}``, except the open probe paths (:data:`OPEN_PREFIXES`). Admin endpoints
(:data:`ADMIN_PATHS`, SGLang's ``ADMIN_OPTIONAL`` level) need the admin key when one is set, else the API key.
"""

from __future__ import annotations

import hmac

from aiohttp import web

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Paths that never need a key (SGLang leaves health, readiness and metrics open for probes)."""

ADMIN_PATHS = frozenset({
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/init_weights_update_group", "/destroy_weights_update_group", "/release_memory_occupation",
    "/resume_memory_occupation", "/pause_generation", "/continue_generation", "/flush_cache",
    "/update_weight_version", "/abort_request", "/begin_weight_update", "/end_weight_update", "/weights_checker",
    "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter",
})
"""Endpoints that need the admin key when ``--admin-api-key`` is set (else the API key)."""


def _token_ok(request: web.Request, expected: str) -> bool:
    """``Authorization: Bearer <expected>`` (SGLang accepts nothing else)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), expected.encode())


def make_auth_middleware(api_key: str | None, admin_api_key: str | None):
    """aiohttp middleware enforcing the keys as described in the module docstring (401 on a missing/wrong
    key)."""

    @web.middleware
    async def auth(request: web.Request, handler):
        path = request.path
        if request.method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
            return await handler(request)
        if path in ADMIN_PATHS and admin_api_key:
            expected = admin_api_key
        else:
            expected = api_key
        if expected and not _token_ok(request, expected):
            return web.json_response({"error": "Unauthorized"}, status=401)  # SGLang's body
        return await handler(request)

    return auth
