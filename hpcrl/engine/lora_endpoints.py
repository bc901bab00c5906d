"""SGLang 0.5.23's LoRA endpoints on the CPU engine: ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors``,
``/unload_lora_adapter`` (admin), with SGLang's fields, answers (``{"rid", "http_worker_ipc", "success",
"error_message", "loaded_adapters"}``; 200 on success, 400 with ``success: false`` otherwise) and refusals
(:mod:`hpcrl.engine.lora`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web

from hpcrl.engine import protocol
from hpcrl.engine.generation import read_body
from hpcrl.engine.lora import DISABLED, TENSOR_PATH, EngineAdapters, LoraError, read_adapter_folder
from hpcrl.engine.scheduler import Scheduler
from hpcrl.engine.serialize import deserialize_flattened_bucket, deserialize_tensor_dict

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0
UNLOAD_POLL_S = 0.05


def _answer(success: bool, message: str = "", loaded: dict | None = None) -> web.Response:
    return web.json_response({"rid": None, "http_worker_ipc": None, "success": success, "error_message": message,
                              "loaded_adapters": loaded}, status=200 if success else 400)


def _validation_error(message: str) -> web.Response:
    """SGLang's (FastAPI's) 400 for a body that does not fit the request struct."""
    return web.json_response({"object": "error", "message": message, "type": "Bad Request", "param": None,
                              "code": 400}, status=400)


@dataclass
class LoraEndpoints:
    """The three handlers over ``adapters`` (the registry and PEFT's layers) and ``scheduler`` (loads and
    unloads run there, between forward passes). One load or unload at a time (``lock``, as SGLang's
    ``TokenizerManager`` holds its ``lora_update_lock``): an unload takes the name away at once but drops the layers
    only after the requests on them finish, so a load of the same name meanwhile would pass the duplicate check
    and then lose its layers to that unload."""

    adapters: EngineAdapters
    scheduler: Scheduler
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def routes(self) -> list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]]:
        """``(method, path, handler)`` of each endpoint."""
        return [("POST", "/load_lora_adapter", self.load_lora_adapter),
                ("POST", "/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors),
                ("POST", "/unload_lora_adapter", self.unload_lora_adapter)]

    async def _command(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(self.scheduler.run_command(fn)), LOAD_TIMEOUT_S)

    async def _body(self, request: web.Request, required: dict[str, type]) -> dict:
        body = await read_body(request)
        for key, kind in required.items():
            if key not in body:
                raise protocol.RequestError(f"Field required: {key}")
            if not isinstance(body[key], kind):
                raise protocol.RequestError(f"{key}: expected {getattr(kind, '__name__', kind)}")
        return body

    async def _load(self, name: str, config: dict, path: str, pinned: bool,
                    tensors: Callable[[], dict]) -> web.Response:
        """Load in the scheduler thread (:meth:`EngineAdapters.load`), then evict over ``--max-loaded-loras``."""
        try:
            evict = await self._command(lambda: self.adapters.load(name, config, path, pinned, tensors))
            for old in evict:
                await self._unload(old)
        except (LoraError, ValueError, OSError, KeyError) as e:
            logger.error("LoRA adapter %s not loaded: %s", name, e)
            return _answer(False, str(e))
        logger.info("LoRA adapter %s loaded (rank %s, %s)", name, config.get("r"), path)
        return _answer(True, "", self.adapters.loaded())

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """``/load_lora_adapter``: ``lora_name``, ``lora_path`` (a PEFT adapter folder), ``pinned``."""
        try:
            body = await self._body(request, {"lora_name": str, "lora_path": str})
        except protocol.RequestError as e:
            return _validation_error(str(e))
        if not self.adapters.enabled:
            return _answer(False, DISABLED)
        try:
            config, tensors = read_adapter_folder(body["lora_path"])
        except (OSError, ValueError) as e:
            return _answer(False, str(e))
        async with self.lock:
            return await self._load(body["lora_name"], config, body["lora_path"], bool(body.get("pinned")),
                                    lambda: tensors)

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        """``/load_lora_adapter_from_tensors``: ``lora_name``, ``config_dict`` (``adapter_config.json``),
        ``serialized_named_tensors`` (one per TP rank; this engine reads the first: a ``{name: tensor}`` dict,
        or with ``load_format: flattened_bucket`` one bucket), ``pinned``. ``expected_checksums`` is refused
        (not implemented), ``added_tokens_config`` refused as SGLang refuses added tokens."""
        try:
            body = await self._body(request, {"lora_name": str, "config_dict": dict, "serialized_named_tensors": list})
        except protocol.RequestError as e:
            return _validation_error(str(e))
        payloads = body["serialized_named_tensors"]
        if not payloads or not all(isinstance(p, str) for p in payloads):
            return _validation_error("serialized_named_tensors: Expected base64-encoded bytes, one per TP rank")
        if body.get("expected_checksums"):
            return _answer(False, "expected_checksums is not supported by the hpcrl CPU engine")
        if not self.adapters.enabled:
            return _answer(False, DISABLED)
        config = dict(body["config_dict"])
        if body.get("added_tokens_config"):
            config["added_tokens_config"] = body["added_tokens_config"]
        flattened = body.get("load_format") == "flattened_bucket"

        def tensors() -> dict:
            if flattened:
                return dict(deserialize_flattened_bucket(payloads[0]))
            return deserialize_tensor_dict(payloads[0])

        async with self.lock:
            return await self._load(body["lora_name"], config, TENSOR_PATH, bool(body.get("pinned")), tensors)

    async def _unload(self, name: str) -> None:
        """Take ``name`` away now, drop its layers once no unfinished row uses it (SGLang waits for the
        in-flight requests too)."""
        self.adapters.remove(name)
        while name in await self._command(self.scheduler.adapters_in_use):
            await asyncio.sleep(UNLOAD_POLL_S)
        await self._command(lambda: self.adapters.delete(name))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """``/unload_lora_adapter``: ``lora_name``. Answers once the requests running on it have finished."""
        try:
            body = await self._body(request, {"lora_name": str})
        except protocol.RequestError as e:
            return _validation_error(str(e))
        try:
            async with self.lock:
                await self._unload(body["lora_name"])
        except LoraError as e:
            return _answer(False, str(e))
        logger.info("LoRA adapter %s unloaded", body["lora_name"])
        return _answer(True, "", self.adapters.loaded())
