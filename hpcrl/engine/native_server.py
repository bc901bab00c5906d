"""SGLang's native HTTP endpoints of the engine server: ``/generate`` (generation through
:mod:`hpcrl.engine.generation`, shared with the OpenAI front end :mod:`hpcrl.engine.openai_server`), abort,
pause and continue, flush, health and info, weight updates and memory release / resume, with SGLang's fields
and answers (``/work/shared/reference/cpu-stack.md`` section 3). :mod:`hpcrl.engine.server` assembles
them into the app.

``/get_weight_version`` and ``/get_load`` are hpcrl-specific aliases kept for older clients (SGLang 0.5 has
the weight version in ``/model_info`` and the load in ``/v1/loads``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from hpcrl.engine import protocol, state
from hpcrl.engine.args import EngineArgs
from hpcrl.engine.generation import Generation, read_body
from hpcrl.engine.memory import normalize_tags
from hpcrl.engine.scheduler import EngineUnavailable, Job, Scheduler
from hpcrl.engine.serialize import deserialize_flattened_bucket, deserialize_named_tensors
from hpcrl.engine.weights import overall_checksum
from hpcrl.engine.weights import WeightLoader, WeightUpdateError, WeightUpdateGroups

logger = logging.getLogger("hpcrl.engine")

COMMAND_MARGIN_S = 30.0
"""Seconds a distributed weight-update command may run past ``--dist-timeout`` before it is answered 400."""


def error_response(message: str, status: int = 400) -> web.Response:
    """SGLang's error body ``{"error": {"message": ...}}`` with HTTP ``status``."""
    return web.json_response({"error": {"message": message}}, status=status)


def request_error_response(e: protocol.RequestError) -> web.Response:
    """A refused ``/generate``: 400 with SGLang's contract-error body ``{"error": "<text>"}`` for a
    :class:`~hpcrl.engine.protocol.ContractError`, else ``{"error": {"message": ...}}``."""
    if isinstance(e, protocol.ContractError):
        return web.json_response({"error": str(e)}, status=400)
    return error_response(str(e), 400)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class NativeServer:
    """SGLang's native endpoints of one engine, over its loaded parts (built by
    :class:`hpcrl.engine.server.EngineServer`).

    ``args`` are the resolved server arguments (``update_weights_from_disk`` sets their ``model_path``),
    ``model`` the HF model, ``generation`` its model facts and scheduler, ``memory`` the memory saver
    (:mod:`hpcrl.engine.memory`), ``loader`` and ``groups`` the weight loader and the torch.distributed
    weight-update groups (:mod:`hpcrl.engine.weights`), ``session`` the weight-update session
    (:mod:`hpcrl.engine.state`, read and changed in the scheduler thread), ``started`` the load time (s since
    the epoch).
    """

    args: EngineArgs
    model: Any
    generation: Generation
    memory: Any
    loader: WeightLoader
    groups: WeightUpdateGroups
    session: state.WeightUpdateSession
    started: float

    @property
    def scheduler(self) -> Scheduler:
        """The batching thread that owns the model (the generation's)."""
        return self.generation.scheduler

    def routes(self) -> list[tuple[str, str, Handler]]:
        """``(method, path, handler)`` of every native endpoint, in the order they are added to the app."""
        out: list[tuple[str, str, Handler]] = [("POST", "/generate", self.generate),
                                                 ("PUT", "/generate", self.generate)]
        for path, h in [("/health", self.health), ("/health_generate", self.health_generate),
                        ("/ping", self.ping), ("/ready", self.ready), ("/get_model_info", self.model_info),
                        ("/model_info", self.model_info), ("/get_server_info", self.server_info),
                        ("/server_info", self.server_info), ("/get_weight_version", self.get_weight_version),
                        ("/v1/models", self.v1_models), ("/get_load", self.get_load),
                        ("/v1/loads", self.v1_loads)]:
            out.append(("GET", path, h))
        for path, h in [("/flush_cache", self.flush_cache),
                        ("/release_memory_occupation", self.release_memory),
                        ("/resume_memory_occupation", self.resume_memory),
                        ("/weights_checker", self.weights_checker)]:
            out.append(("GET", path, h))
            out.append(("POST", path, h))
        for path, h in [("/abort_request", self.abort_request), ("/pause_generation", self.pause_generation),
                        ("/continue_generation", self.continue_generation),
                        ("/update_weight_version", self.update_weight_version),
                        ("/update_weights_from_disk", self.update_weights_from_disk),
                        ("/update_weights_from_tensor", self.update_weights_from_tensor),
                        ("/init_weights_update_group", self.init_weights_update_group),
                        ("/update_weights_from_distributed", self.update_weights_from_distributed),
                        ("/destroy_weights_update_group", self.destroy_weights_update_group),
                        ("/begin_weight_update", self.begin_weight_update),
                        ("/end_weight_update", self.end_weight_update)]:
            out.append(("POST", path, h))
        return out

    async def _command(self, fn: Callable[[], Any], timeout: float) -> Any:
        """Run ``fn`` in the scheduler thread (between forward passes) and await it for up to ``timeout``
        s."""
        fut = self.scheduler.run_command(fn)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)

    # ------------------------------------------------------------------ generation
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``/generate``: SGLang's native generation (see :func:`hpcrl.engine.protocol.parse_generate`)."""
        try:
            spec = self.generation.parse_generate(await read_body(request))
        except protocol.RequestError as e:
            return request_error_response(e)
        if spec.options.stream:
            return await self._generate_stream(request, spec)
        try:
            results = await self.generation.collect(spec)
        except EngineUnavailable as e:
            return error_response(str(e), 503)
        failed = protocol.engine_failure(results)
        if failed is not None:  # an internal failure is an HTTP error, not a 200 with an abort reason
            return error_response(*failed)
        return web.json_response(results[0] if spec.is_single else results)

    async def _generate_stream(self, request: web.Request, spec: protocol.GenerateSpec) -> web.StreamResponse:
        try:
            queue = self.generation.updates(spec)
        except EngineUnavailable as e:
            return error_response(str(e), 503)
        resp = web.StreamResponse(headers=protocol.SSE_HEADERS)
        await resp.prepare(request)
        left = len(spec.rows)
        try:
            while left:
                index, response, finished = await queue.get()
                if not spec.is_single:
                    response = {**response, "index": index}
                await resp.write(protocol.sse_event(response))
                left -= finished
            await resp.write(protocol.sse_event("[DONE]"))
        except (asyncio.CancelledError, ConnectionResetError):
            self.generation.abort_spec(spec, "Abort: the client disconnected.")
            raise
        await resp.write_eof()
        return resp

    async def abort_request(self, request: web.Request) -> web.Response:
        """``/abort_request``: ``rid`` or ``abort_all: true``; the rows finish with an abort reason. Empty
        200."""
        try:
            body = await read_body(request)
        except protocol.RequestError as e:
            return error_response(str(e))
        message = body.get("abort_message") or "Abort by /abort_request."
        if body.get("abort_all"):
            self.scheduler.abort(None, message)
        elif body.get("rid"):
            rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
            for rid in rids:
                self.scheduler.abort(str(rid), message)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``/pause_generation``: ``mode`` abort (default), retract or in_place; new requests wait until
        continue."""
        try:
            body = await read_body(request)
            mode = body.get("mode") or "abort"
            if mode not in ("abort", "retract", "in_place"):
                raise protocol.RequestError(f"unknown mode {mode!r}; use abort, retract or in_place")
            await self._command(lambda: self.scheduler.pause_now(mode), 60.0)
        except (protocol.RequestError, ValueError) as e:
            return error_response(str(e))
        except asyncio.TimeoutError:
            return error_response("pause timed out", 503)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``/continue_generation``: resume after a pause."""
        self.scheduler.continue_generation()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache``: 200 when the engine is fully idle (no row running; none waiting unless paused),
        else 400 with SGLang's text; with ``?timeout=`` s it first waits that long for full idleness
        (:mod:`hpcrl.engine.state`, rule 3)."""
        try:
            timeout = float(request.query.get("timeout", 0) or 0)
        except ValueError:
            return error_response("timeout must be a number of seconds")
        if timeout > 0:
            deadline = time.monotonic() + min(timeout, 3600.0)
            while not self.scheduler.is_fully_idle() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if not self.scheduler.is_fully_idle():
                return web.Response(status=400, text=state.FLUSH_TIMED_OUT)
        if not await self._command(self.scheduler.flush_now, 60.0):
            return web.Response(status=400, text=state.FLUSH_FAILED)
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. "
                                             "(When there are running or waiting requests, the operation "
                                             "will not be performed.)\n")

    # ------------------------------------------------------------------ health and info
    async def health(self, request: web.Request) -> web.Response:
        """``/health``: 200 while the scheduler thread runs, else 503 (cheap; see ``/health_generate``)."""
        return web.Response(status=200 if self.scheduler.is_alive() else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """``/health_generate``: 200 if a 1-token greedy generation answers in time, or at once while the engine
        is generating anyway; 503 otherwise, and while it is paused (``/pause_generation``) or its memory is
        released, as SGLang answers then (its probe request waits, unanswered, for 20 s): a health monitor must
        know those states from what it asked the engine to do (:mod:`hpcrl.rollout.health`)."""
        if not self.scheduler.is_alive() or self.scheduler.paused or self.scheduler.released_tags:
            return web.Response(status=503)
        if self.scheduler.has_kv():
            return web.Response(status=200)
        gen = self.generation
        spec = protocol.parse_generate(
            {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
             "rid": f"HEALTH_CHECK_{time.time()}"}, gen.tokenizer, gen.vocab_size, gen.context_len)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_update(index: int, response: dict, finished: bool) -> None:
            if finished:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(response))

        try:
            self.scheduler.submit(Job(spec, on_update))
            await asyncio.wait_for(done, self.args.health_check_timeout)
        except (EngineUnavailable, asyncio.TimeoutError):
            self.scheduler.abort(spec.rows[0].rid, "health check timed out")
            return web.Response(status=503)
        return web.Response(status=200)

    async def ping(self, request: web.Request) -> web.Response:
        """``/ping``: 200."""
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        """``/ready``: 200 once the model is loaded and the scheduler runs, else 503."""
        return web.Response(status=200 if self.scheduler.is_alive() else 503)

    def _model_info(self) -> dict:
        cfg = self.model.config
        return {
            "model_path": self.args.model_path,
            "served_model_name": self.args.served_model_name,
            "tokenizer_path": self.args.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "load_format": self.args.load_format,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": list(getattr(cfg, "architectures", None) or []),
        }

    async def model_info(self, request: web.Request) -> web.Response:
        """``/get_model_info`` and ``/model_info``."""
        return web.json_response(self._model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        """``/get_server_info`` and ``/server_info``: resolved args (keys redacted), counters, version."""
        import dataclasses

        import torch

        import hpcrl

        internal = {**dataclasses.asdict(self.scheduler.stats), **self.scheduler.load(),
                    **self.session.state(), "continuous_batching": self.scheduler.continuous_batching,
                    "cpu_threads": torch.get_num_threads()}
        info = self.args.public_dict()
        info.update({
            "weight_version": self.scheduler.weight_version,
            "context_length": self.generation.context_len,
            "max_total_num_tokens": self.generation.context_len * self.args.max_running_requests,
            "internal_states": [internal],
            "version": hpcrl.__version__,
            "engine": "hpcrl-cpu-reference",
            "uptime_s": time.time() - self.started,
        })
        return web.json_response(info)

    async def get_load(self, request: web.Request) -> web.Response:
        """``/get_load``: running and waiting rows (hpcrl's older form; SGLang now serves ``/v1/loads``)."""
        return web.json_response([self.scheduler.load()])

    async def v1_loads(self, request: web.Request) -> web.Response:
        """``/v1/loads`` as SGLang 0.5 serves it: ``{"timestamp", "version", "accelerator", "num_accelerators",
        "loads": [{"dp_rank": 0, "num_running_reqs", "num_waiting_reqs", "max_running_requests", ...}]}``
        (rows, not tokens; one data-parallel rank). ``include`` is accepted (``core`` or ``all``; other
        sections do not exist here and are answered with the core fields)."""
        import datetime

        import hpcrl

        load = self.scheduler.load()
        core = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": load["num_running_reqs"],
                "num_waiting_reqs": load["num_waiting_reqs"],
                "max_running_requests": self.args.max_running_requests,
                "max_total_num_tokens": self.generation.context_len * self.args.max_running_requests}
        return web.json_response({"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                  "version": hpcrl.__version__, "accelerator": None, "num_accelerators": 0,
                                  "loads": [core]})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        """``/get_weight_version``."""
        return web.json_response({"weight_version": self.scheduler.weight_version})

    async def v1_models(self, request: web.Request) -> web.Response:
        """``/v1/models`` (OpenAI model list): the served model, then with ``--enable-lora`` each loaded adapter
        (``root`` its folder, ``__tensor__`` when loaded from tensors; least recently used first), as SGLang."""
        name = self.args.served_model_name
        cards = [{"id": name, "object": "model", "created": int(self.started), "owned_by": "sglang", "root": name,
                  "parent": None, "max_model_len": self.generation.context_len}]
        adapters = self.scheduler.adapters
        if adapters is not None and adapters.enabled:
            cards += [{"id": lora, "object": "model", "created": int(self.started), "owned_by": "sglang",
                       "root": path, "parent": name, "max_model_len": None}
                      for lora, path in adapters.loaded().items()]
        return web.json_response({"object": "list", "data": cards})

    # ------------------------------------------------------------------ weights and memory
    async def _weight_update(self, request: web.Request, required: tuple[str, ...],
                             work: Callable[[dict], str], timeout: float,
                             extra: dict | None = None, flushes: bool = True) -> web.Response:
        """Common body of the update endpoints: parse, optionally abort all, run ``work`` in the scheduler
        thread, then, with ``flushes`` and the body's ``flush_cache`` (default true), the flush that ends an
        update, and the weight version if given, set in the same command (so no token of the new weights is
        sampled under the old version, :meth:`Scheduler.set_weight_version`). ``work`` returns a message or
        raises (any error is a 400 failure). A gated endpoint (:data:`hpcrl.engine.state.SESSION_GATED`)
        outside a weight-update session is refused before ``work`` runs; a flush refused after it (requests
        hold KV cache) is a 400 failure although the weights were loaded, and the version stays
        (:mod:`hpcrl.engine.state`). ``extra`` fields are added to the response body."""
        extra = extra or {}
        endpoint = request.path.lstrip("/")

        def fail(message: str) -> web.Response:
            logger.error("/%s refused: %s", endpoint, message)
            return web.json_response({"success": False, "message": message, **extra}, status=400)

        try:
            body = await read_body(request)
        except protocol.RequestError as e:
            return fail(str(e))
        missing = [k for k in required if body.get(k) is None]
        if missing:
            return fail(f"missing required fields {missing}")
        if body.get("abort_all_requests"):
            self.scheduler.abort(None, "Abort: weight update with abort_all_requests.")
        flush = flushes and body.get("flush_cache", True) is not False
        version = body.get("weight_version")

        def command() -> tuple[bool, str]:
            self.session.require(endpoint)
            message = work(body)
            if flush and not self.scheduler.flush_now():
                return False, state.UPDATE_NOT_FLUSHED
            if version is not None:  # with the weights, before any token of theirs (SGLang's scheduler too)
                self.scheduler.set_weight_version(str(version))
            return True, message

        try:
            flushed, message = await self._command(command, timeout)
        except asyncio.TimeoutError:
            return fail(f"timed out after {timeout:.0f} s")
        except Exception as e:  # noqa: BLE001 - every failure is a 400 with success false
            if not isinstance(e, (WeightUpdateError, ValueError, TypeError, KeyError)):
                logger.exception("weight update failed")
            known = isinstance(e, (WeightUpdateError, state.SessionError))
            return fail(str(e) if known else f"{type(e).__name__}: {e}")
        if not flushed:
            return fail(message)
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, **extra})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """``/update_weights_from_disk``: load safetensors from ``model_path`` (same architecture)."""
        def work(body: dict) -> str:
            delta = self._delta_format(body.get("load_format"), allow=(None, "auto", "safetensors"))
            n = self.loader.load_from_disk(body["model_path"], delta=delta)
            if not delta:  # (a delta folder is no model folder to restart from)
                self.args.model_path = str(body["model_path"])
            return f"Succeeded to update model weights from {body['model_path']} ({n} tensors)."

        return await self._weight_update(request, ("model_path",), work, 600.0,
                                         extra={"num_paused_requests": 0})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """``/update_weights_from_tensor``: ``serialized_named_tensors`` (one per TP rank; this engine has
        one)."""
        def work(body: dict) -> str:
            payloads = body["serialized_named_tensors"]
            if not isinstance(payloads, list) or not payloads or not isinstance(payloads[0], str):
                raise WeightUpdateError("serialized_named_tensors must be a non-empty list of base64 strings")
            fmt = body.get("load_format")
            delta = self._delta_format(fmt, allow=(None, "auto", "direct", "flattened_bucket"))
            if fmt == "flattened_bucket":
                named = deserialize_flattened_bucket(payloads[0])
            else:
                named = deserialize_named_tensors(payloads[0])
            n = self.loader.load_delta(named) if delta else self.loader.load(named)
            del named
            return f"Succeeded to update {n} tensors from serialized tensors."

        return await self._weight_update(request, ("serialized_named_tensors",), work, 600.0)

    def _delta_format(self, fmt: Optional[str], allow: tuple) -> bool:
        """Whether an update's ``load_format`` is the delta loader (:data:`hpcrl.weights.delta.DELTA_LOADER`,
        accepted only when the engine was started with it in ``--custom-weight-loader``, as SGLang accepts
        custom loaders; hpcrl's extension: on every update endpoint, SGLang's tensor one only). Raises
        WeightUpdateError for a format that is neither one of ``allow`` nor a registered loader."""
        from hpcrl.weights.delta import DELTA_LOADER

        if fmt in allow:
            return False
        if fmt == DELTA_LOADER and fmt in self.args.custom_weight_loader:
            return True
        raise WeightUpdateError(f"Unknown load_format={fmt} (this engine takes {[a for a in allow if a]} and the "
                                f"custom weight loaders it was started with: {self.args.custom_weight_loader})")

    async def weights_checker(self, request: web.Request) -> web.Response:
        """``/weights_checker`` (SGLang's, GET or POST ``{"action": "checksum", "skip_tensor_list": [...]}``):
        a hash of every parameter and buffer (:meth:`hpcrl.engine.weights.WeightLoader.checksums`), their
        ``per_engine_checksum`` (SGLang's ``overall_checksum``: SHA-256 over sorted names and hashes) and one
        rank's ``ChecksumInfo``; two engines hold bitwise the same weights exactly when those agree. The other
        actions (snapshot, compare, reset_tensors) are SGLang's debugging aids: 400."""
        try:
            body = await read_body(request)
            action = body.get("action", "checksum")
            if action != "checksum":
                raise protocol.RequestError(f"Unsupported action={action!r} (this engine computes checksums "
                                            "only)")
            skip = list(body.get("skip_tensor_list") or [])
            checksums = await self._command(lambda: self.loader.checksums(skip), 120.0)
        except (protocol.RequestError, ValueError) as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        overall = overall_checksum(checksums)
        info = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                "pp_size": 1, "rank": 0, "size": 1}
        return web.json_response({"success": True, "message": f"checksum of {len(checksums)} tensors",
                                  "ranks": [{"checksums": checksums, "per_gpu_checksum": overall,
                                             "parallelism_info": [info]}],
                                  "per_engine_checksum": overall})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """``/init_weights_update_group``: join a torch.distributed group as rank ``rank_offset``."""
        def work(body: dict) -> str:
            used = self.groups.init(str(body["master_address"]), int(body["master_port"]),
                                    int(body["rank_offset"]), int(body["world_size"]),
                                    body.get("group_name") or "weight_update_group",
                                    body.get("backend") or "nccl")
            return f"Succeeded to initialize the weight update group ({used})."

        return await self._weight_update(request, ("master_address", "master_port", "rank_offset",
                                                   "world_size"),
                                         work, self.args.dist_timeout + COMMAND_MARGIN_S, flushes=False)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """``/update_weights_from_distributed``: receive ``names/dtypes/shapes`` by broadcast from rank 0."""
        def work(body: dict) -> str:
            delta = self._delta_format(body.get("load_format"), allow=(None, "direct"))
            n = self.groups.receive(list(body["names"]), list(body["dtypes"]),
                                    [list(s) for s in body["shapes"]],
                                    body.get("group_name") or "weight_update_group", self.loader, delta=delta)
            return f"Succeeded to update {n} tensors from distributed."

        return await self._weight_update(request, ("names", "dtypes", "shapes"), work,
                                         self.args.dist_timeout + COMMAND_MARGIN_S)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        """``/destroy_weights_update_group``: leave and destroy group ``group_name``."""
        def work(body: dict) -> str:
            self.groups.destroy(body.get("group_name") or "weight_update_group")
            return "Succeeded to destroy the weight update group."

        return await self._weight_update(request, (), work, 60.0, flushes=False)

    async def _session_call(self, request: web.Request, step: Callable[[dict], None]) -> web.Response:
        """Body of ``/begin_weight_update`` / ``/end_weight_update``: ``step`` runs in the scheduler thread;
        200 ``{"success": true, "message": "Success"}``, or 400 with ``success: false`` and SGLang's
        message."""
        try:
            body = await read_body(request)
            await self._command(lambda: step(body), 60.0)
        except (protocol.RequestError, ValueError) as e:
            logger.error("%s refused: %s", request.path, e)
            return web.json_response({"success": False, "message": str(e)}, status=400)
        except asyncio.TimeoutError:
            return web.json_response({"success": False, "message": "timed out after 60 s"}, status=400)
        logger.info("weight-update session %s", "opened" if self.session.is_open else "closed")
        return web.json_response({"success": True, "message": "Success"})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """``/begin_weight_update``: open the weight-update session (``selector``: ``target``, ``draft`` or
        ``all``, the default); refused while one is open (:mod:`hpcrl.engine.state`)."""
        return await self._session_call(request,
                                        lambda body: self.session.begin(body.get("selector") or "all"))

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """``/end_weight_update``: close the weight-update session; refused when none is open (SGLang
        finalises in-place-packed quantised weights here; this engine has none)."""
        return await self._session_call(request, lambda body: self.session.end())

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """``/update_weight_version``: set ``new_version`` (aborting all requests unless told not to)."""
        try:
            body = await read_body(request)
        except protocol.RequestError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        version = body.get("new_version")
        if version is None:
            return web.json_response({"success": False, "message": "missing required field new_version"},
                                     status=400)
        if body.get("abort_all_requests", True):
            self.scheduler.abort(None, "Abort: weight version update.")
        await self._command(lambda: self.scheduler.set_weight_version(str(version)), 60.0)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": str(version)})

    async def _memory(self, request: web.Request, release: bool) -> web.Response:
        try:
            body = await read_body(request)
            tags = normalize_tags(body.get("tags"))
        except (protocol.RequestError, ValueError) as e:
            return error_response(str(e))

        def work() -> None:
            if release:
                self.scheduler.release_now(tags)
                for tag in tags:
                    self.memory.pause(tag)
            else:
                # refuses a tag that is not released, before anything is mapped
                self.scheduler.resume_now(tags)
                for tag in tags:
                    self.memory.resume(tag)

        try:
            await self._command(work, 120.0)
        except (RuntimeError, ValueError) as e:
            logger.error("%s memory %s refused: %s", "release" if release else "resume", tags, e)
            return error_response(str(e))
        except asyncio.TimeoutError:
            return error_response("memory operation timed out", 503)
        logger.info("%s memory %s", "released" if release else "resumed", tags)
        return web.json_response(None)

    async def release_memory(self, request: web.Request) -> web.Response:
        """``/release_memory_occupation``: ``tags`` (null or empty = all); generation is refused (503) until
        resumed. Refused (400, SGLang's assertion text) unless the engine is fully idle
        (:mod:`hpcrl.engine.state`)."""
        return await self._memory(request, release=True)

    async def resume_memory(self, request: web.Request) -> web.Response:
        """``/resume_memory_occupation``: ``tags`` (null or empty = all), each of which must be released."""
        return await self._memory(request, release=False)
