"""The engine's HTTP server: loads the model and assembles the aiohttp app from its two front ends, SGLang's
native endpoints (:mod:`hpcrl.engine.native_server`) and OpenAI's (:mod:`hpcrl.engine.openai_server`), both
generating through :mod:`hpcrl.engine.generation` on the scheduler thread (:mod:`hpcrl.engine.scheduler`).

This is a reference engine for CPUs and tests, not a fast server: the same requests and JSON fields as
SGLang's ``http_server.py`` (``/work/shared/reference/cpu-stack.md`` section 3), served by a KV-cached batched
decode on HF transformers, so hpcrl's rollout client, weight sync and the sglang-router work against it
unchanged.

Authentication follows SGLang: with ``--api-key`` (or ``--api-key-file``) every endpoint needs
``Authorization: Bearer KEY`` and answers 401 with SGLang's body ``{"error": "Unauthorized"}`` otherwise,
except ``/health*``,
``/ready`` and ``/metrics``, which stay open for probes. This exemption is needed by sglang-router 0.3.2,
whose first worker probe (``detect_connection_mode``: ``GET /health``) is sent without the key, so a worker
that demands it on ``/health`` is never registered (its later health checks and info calls do carry the
key). Admin endpoints
(weight updates, memory release/resume, pause/continue, flush, weight version, ``/abort_request``) need
``--admin-api-key`` when one is set, else the API key (SGLang's ``ADMIN_OPTIONAL`` level). Keys are compared
with ``hmac.compare_digest``.

Besides SGLang's native endpoints the server speaks OpenAI's API (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/tokenize``, ``/detokenize``: :mod:`hpcrl.engine.openai_api` and
:mod:`hpcrl.engine.openai_server`). ``/get_weight_version`` and ``/get_load`` are hpcrl-specific aliases kept
for older clients (:mod:`hpcrl.engine.native_server`).

Run: ``python -m hpcrl.engine.server --model-path DIR [--port 30000] [--api-key-file FILE]``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

from hpcrl.engine import openai_server, state
from hpcrl.engine.args import EngineArgs, parse_args
from hpcrl.engine.auth import ADMIN_PATHS, OPEN_PREFIXES, make_auth_middleware  # noqa: F401 - re-exported
from hpcrl.engine.generation import Generation
from hpcrl.engine.httplog import quiet_refused_requests
from hpcrl.engine.lora import EngineAdapters, LoraError, read_adapter_folder
from hpcrl.engine.lora_endpoints import LoraEndpoints
from hpcrl.engine.memory import create_memory_saver
from hpcrl.engine.native_server import NativeServer
from hpcrl.engine.scheduler import Scheduler
from hpcrl.engine.weights import WeightLoader, WeightUpdateGroups
from hpcrl.models.hf import context_length
from hpcrl.procs import release_freed_memory_eagerly, skip_final_collection

logger = logging.getLogger("hpcrl.engine")


def load_fp8_model(path: str, dtype):
    """The model of a block-fp8 HF folder (:mod:`hpcrl.weights.fp8`) built from its config without the
    quantisation (transformers' fp8 quantiser needs a GPU): its weights are loaded by the engine's
    :class:`~hpcrl.engine.weights.WeightLoader`, which dequantises them (``fp8=True``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


class EngineServer:
    """The engine process: loads the model, tokenizer, scheduler thread and weight-update parts, assembles the
    aiohttp app from both front ends (:mod:`hpcrl.engine.native_server`, :mod:`hpcrl.engine.openai_server`,
    both generating through :mod:`hpcrl.engine.generation`) and serves it until stopped.

    Loads the model from ``args.model_path`` at construction (raises OSError/ValueError from transformers on a
    bad folder). All mutable state of the server lives in this object's parts.
    """

    def __init__(self, args: EngineArgs):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.args = args
        if "OMP_NUM_THREADS" not in os.environ and hasattr(os, "sched_getaffinity"):
            # torch defaults to every core of the machine; under Slurm only the allocated ones are ours
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        torch.manual_seed(args.random_seed)
        self.memory = create_memory_saver(args.enable_memory_saver, args.device)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
        from hpcrl.weights.fp8 import is_fp8_folder

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        fp8 = is_fp8_folder(args.model_path)
        with self.memory.region("weights"):
            self.model = (load_fp8_model(args.model_path, dtype) if fp8 else
                          AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype))
        self.model.eval()
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_len = context_length(cfg)
        eos: set[int] = set()
        for src in (self.tokenizer.eos_token_id, getattr(cfg, "eos_token_id", None),
                    getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(x) for x in src)
        pad = self.tokenizer.pad_token_id
        self.adapters = EngineAdapters(self.model, args.lora_options())
        """LoRA adapters (``--enable-lora``; :mod:`hpcrl.engine.lora`), ``--lora-paths`` loaded here."""
        for name, path, pinned in self.adapters.options.paths:
            preload_adapter(self.adapters, name, path, pinned)
        self.scheduler = Scheduler(self.model, self.tokenizer, eos, args.max_running_requests,
                                   args.random_seed, args.weight_version, pad_id=0 if pad is None else pad,
                                   adapters=self.adapters)
        chat_template = (Path(args.chat_template).read_text() if args.chat_template
                         else getattr(self.tokenizer, "chat_template", None))
        self.generation = Generation(self.tokenizer, self.scheduler, self.vocab_size, self.context_len,
                                     chat_template, args.allow_auto_truncate)
        """What both front ends generate with (:mod:`hpcrl.engine.generation`); its ``chat_template`` renders
        ``/v1/chat/completions`` (``--chat-template`` file, else the tokenizer's)."""
        self.loader = WeightLoader(self.model, fp8=fp8)
        if fp8:  # block-fp8 weights, emulated: dequantised at load (hpcrl.weights.fp8)
            self.loader.load_from_disk(args.model_path)
        self.groups = WeightUpdateGroups(args.dist_timeout)
        self.session = state.WeightUpdateSession()
        """The weight-update session (:mod:`hpcrl.engine.state`), read and changed in the scheduler thread."""
        self.started = time.time()
        self.native = NativeServer(args, self.model, self.generation, self.memory, self.loader, self.groups,
                                   self.session, self.started)
        """SGLang's native endpoints over these parts (:mod:`hpcrl.engine.native_server`)."""

    # ------------------------------------------------------------------ app
    def build_app(self) -> web.Application:
        """The aiohttp application: the auth middleware, SGLang's native endpoints
        (:mod:`hpcrl.engine.native_server`), OpenAI's (:mod:`hpcrl.engine.openai_server`, POST) and the LoRA
        ones (:mod:`hpcrl.engine.lora_endpoints`)."""
        app = web.Application(middlewares=[make_auth_middleware(self.args.api_key, self.args.admin_api_key)],
                              client_max_size=1 << 30)
        r = app.router
        for method, path, h in self.native.routes():
            r.add_route(method, path, h)
        for path, h in openai_server.routes(self.generation).items():
            r.add_route("POST", path, h)
        for method, path, h in LoraEndpoints(self.adapters, self.scheduler).routes():
            r.add_route(method, path, h)
        return app

    # ------------------------------------------------------------------ lifecycle
    async def serve(self, stop: asyncio.Event,
                    on_ready: Callable[[], Awaitable[None] | None] | None = None) -> None:
        """Serve until ``stop`` is set, then shut down: the scheduler first, so requests in flight are answered
        with HTTP 503 (a client or router retries them on another engine), then the HTTP server and the
        groups."""
        quiet_refused_requests()
        self.scheduler.start()
        runner = web.AppRunner(self.build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.args.host, self.args.port)
        try:
            await site.start()
            import torch

            logger.info("hpcrl engine (CPU reference engine, not a fast server) ready at "
                        "http://%s:%d, model %s, %d torch thread(s)",
                        self.args.host, self.args.port, self.args.model_path, torch.get_num_threads())
            if on_ready is not None:
                res = on_ready()
                if asyncio.iscoroutine(res):
                    await res
            await stop.wait()
        finally:
            logger.info("shutting down")
            busy = not self.scheduler.is_fully_idle()
            await asyncio.to_thread(self.scheduler.stop)  # in-flight rows finish with 503 ...
            if busy:  # ... and their handlers answer before the server closes (an idle engine: no 0.1 s wait;
                await asyncio.sleep(0.1)  # runner.cleanup still waits for handlers in progress)
            await runner.cleanup()
            logger.debug("http server closed")
            self.groups.destroy_all()
            logger.info("stopped")


def preload_adapter(adapters: EngineAdapters, name: str, path: str, pinned: bool) -> None:
    """Load ``--lora-paths`` entry ``name`` from PEFT folder ``path`` before serving. Raises RuntimeError with
    SGLang's start-up message."""
    try:
        config, tensors = read_adapter_folder(path)
        adapters.load(name, config, path, pinned, lambda: tensors)  # (no eviction: check() bounds --lora-paths)
    except (LoraError, ValueError, OSError, KeyError) as e:
        raise RuntimeError(f"Failed to load LoRA adapter {name}: {e}") from e


def main(argv: list[str] | None = None) -> int:
    """Parse SGLang-style flags, load the model and serve until SIGTERM/SIGINT. Returns the exit code."""
    try:
        args = parse_args(argv)
    except (ValueError, OSError) as e:
        print(f"hpcrl serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    release_freed_memory_eagerly()  # freed KV and weight-update buffers leave the RSS (hpcrl.procs)
    try:
        server = EngineServer(args)
    except Exception as e:  # noqa: BLE001 - report the load failure and exit non-zero
        logger.error("cannot load model from %s: %s", args.model_path, e)
        return 1

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await server.serve(stop)

    try:
        asyncio.run(run())
    except OSError as e:
        logger.error("cannot serve on %s:%d: %s", args.host, args.port, e)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    skip_final_collection()  # stopped: exit without traversing the model's heap once more (~1 s)
    sys.exit(code)
