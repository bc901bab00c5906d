"""Command line flags of the engine server, named as SGLang names them, and the resolved server arguments."""

from __future__ import annotations

import argparse
import dataclasses
import os
import stat
from pathlib import Path

from hpcrl.names import PEFT_TARGETS


@dataclasses.dataclass
class EngineArgs:
    """Resolved server arguments (what ``/get_server_info`` reports, secrets redacted).

    Field names follow SGLang's ``ServerArgs`` where one exists. ``max_running_requests`` is the largest
    number of sequences (rows) decoded together in one batch. ``dist_timeout`` (seconds) bounds weight-update
    group rendezvous and every broadcast on such a group.
    """

    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None
    dtype: str = "float32"
    max_running_requests: int = 64
    enable_memory_saver: bool = False
    random_seed: int = 0
    served_model_name: str | None = None
    weight_version: str = "default"
    log_level: str = "info"
    dist_timeout: int = 300
    health_check_timeout: float = 20.0
    allow_auto_truncate: bool = False
    chat_template: str | None = None
    # Fixed facts of this engine, reported for clients and the router.
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    device: str = "cpu"
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    custom_weight_loader: list[str] = dataclasses.field(default_factory=list)
    """The ``load_format`` values weight updates may name besides SGLang's own (SGLang's
    ``--custom-weight-loader``): this engine knows one, :data:`hpcrl.weights.delta.DELTA_LOADER`."""
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    lora_paths: list[str] | None = None
    """LoRA serving (SGLang's flags; :mod:`hpcrl.engine.lora`): ``NAME=PATH`` entries loaded at start."""

    def lora_options(self):
        """These flags as :class:`hpcrl.engine.lora.LoraOptions`."""
        from hpcrl.engine.lora import LoraOptions, parse_lora_paths

        return LoraOptions(enabled=self.enable_lora, max_rank=self.max_lora_rank,
                           target_modules=frozenset(self.lora_target_modules) if self.lora_target_modules else None,
                           max_loras_per_batch=self.max_loras_per_batch, max_loaded_loras=self.max_loaded_loras,
                           paths=parse_lora_paths(self.lora_paths))

    def public_dict(self) -> dict:
        """The arguments as a JSON-able dict with the API keys replaced by ``"<redacted>"`` (or None if
        unset)."""
        out = dataclasses.asdict(self)
        for key in ("api_key", "admin_api_key"):
            out[key] = "<redacted>" if out[key] else None
        return out


def read_key_file(path: str | os.PathLike) -> str:
    """Read an API key from a file that only its owner can read (mode 0600 or 0400).

    Returns the stripped file content. Raises ValueError if the file is readable or writable by group or
    others, or if it is empty; OSError if it cannot be read.
    """
    path = Path(path)
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"API key file {path} must not be accessible by group or others (chmod 600 {path})")
    key = path.read_text().strip()
    if not key:
        raise ValueError(f"API key file {path} is empty")
    return key


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (flag names as in SGLang's ``launch_server``)."""
    p = argparse.ArgumentParser(
        prog="hpcrl serve",
        description="hpcrl's CPU reference engine: SGLang's HTTP protocol on HF transformers "
                    "(not a fast server).",
    )
    p.add_argument("--model-path", required=True, help="HF model folder (config, safetensors, tokenizer)")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer folder (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (visible in ps; "
                                                   "prefer --api-key-file)")
    p.add_argument("--api-key-file", default=None, help="read the API key from this 0600 file")
    p.add_argument("--admin-api-key", default=None,
                   help="key for admin endpoints (weights, memory, pause...)")
    p.add_argument("--admin-api-key-file", default=None, help="read the admin API key from this 0600 file")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-running-requests", type=int, default=64, help="max sequences decoded in one batch")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant results (SGLang's flag): the CPU engine then decodes one sequence at a "
                        "time, so a request's log-probs and seeded samples never depend on what else is running")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="use torch-memory-saver on GPU (no-op on CPU; release/resume are recorded anyway)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="SGLang's flag for return_routed_experts (routing replay): accepted; this engine "
                        "records the routed experts of a MoE model whether it is given or not")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--dist-timeout", type=int, default=300,
                   help="seconds for weight-update group rendezvous and broadcasts")
    p.add_argument("--allow-auto-truncate", action="store_true",
                   help="shorten a prompt or max_new_tokens that does not fit the context instead of answering "
                        "400 (SGLang's flag)")
    p.add_argument("--chat-template", default=None,
                   help="jinja chat template file for /v1/chat/completions (default: the tokenizer's)")
    p.add_argument("--health-check-timeout", type=float, default=20.0,
                   help="seconds /health_generate waits for its 1-token generation")
    p.add_argument("--custom-weight-loader", nargs="*", default=None,
                   help="load_format values weight updates may name (SGLang's flag); this engine knows "
                        "hpcrl.weights.delta.load_delta (delta weight sync, on every update endpoint)")
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters (SGLang's flag; on with --lora-paths): /load_lora_adapter, "
                        "/load_lora_adapter_from_tensors, /unload_lora_adapter, lora_path per request")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank a load may bring")
    p.add_argument("--lora-target-modules", nargs="*", default=None, choices=[*PEFT_TARGETS, "all"],
                   help="the modules adapters may target (all: every one)")
    p.add_argument("--lora-paths", nargs="*", default=None,
                   help="adapters loaded at start: NAME=PATH, PATH (named by its path) or SGLang's JSON")
    p.add_argument("--max-loras-per-batch", type=int, default=8,
                   help="SGLang's adapter slots per batch: accepted and reported; this engine mixes any number")
    p.add_argument("--max-loaded-loras", type=int, default=None,
                   help="the most adapters loaded at once: a load beyond evicts the least recently used")
    return p


def parse_args(argv: list[str] | None = None) -> EngineArgs:
    """Parse ``argv`` into :class:`EngineArgs`.

    Raises SystemExit (argparse) on bad flags, ValueError on a bad key file or inconsistent values.
    """
    ns = build_parser().parse_args(argv)
    if ns.api_key and ns.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if ns.admin_api_key and ns.admin_api_key_file:
        raise ValueError("give --admin-api-key or --admin-api-key-file, not both")
    api_key = read_key_file(ns.api_key_file) if ns.api_key_file else ns.api_key
    admin_key = read_key_file(ns.admin_api_key_file) if ns.admin_api_key_file else ns.admin_api_key
    if ns.max_running_requests < 1:
        raise ValueError("--max-running-requests must be >= 1")
    model_path = str(ns.model_path)
    if ns.chat_template and not Path(ns.chat_template).is_file():
        raise ValueError(f"--chat-template {ns.chat_template}: no such file (give a jinja template file)")
    from hpcrl.weights.delta import DELTA_LOADER

    loaders = list(ns.custom_weight_loader or [])
    unknown = [name for name in loaders if name != DELTA_LOADER]
    if unknown:
        raise ValueError(f"--custom-weight-loader {' '.join(unknown)}: this engine has only {DELTA_LOADER}")
    targets = ns.lora_target_modules
    if targets and "all" in targets and len(targets) > 1:
        raise ValueError("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
    lora = dict(enable_lora=bool(ns.enable_lora or (ns.enable_lora is None and ns.lora_paths)),
                max_lora_rank=ns.max_lora_rank, lora_target_modules=targets,
                max_loras_per_batch=ns.max_loras_per_batch, max_loaded_loras=ns.max_loaded_loras,
                lora_paths=ns.lora_paths)
    args = EngineArgs(
        model_path=model_path, tokenizer_path=ns.tokenizer_path or model_path, host=ns.host, port=ns.port,
        api_key=api_key or None, admin_api_key=admin_key or None, dtype=ns.dtype,
        max_running_requests=1 if ns.enable_deterministic_inference else ns.max_running_requests,
        enable_memory_saver=ns.enable_memory_saver,
        random_seed=ns.random_seed, served_model_name=ns.served_model_name or model_path,
        weight_version=ns.weight_version, log_level=ns.log_level, dist_timeout=ns.dist_timeout,
        health_check_timeout=ns.health_check_timeout, allow_auto_truncate=ns.allow_auto_truncate,
        chat_template=ns.chat_template, custom_weight_loader=loaders, **lora,
    )
    args.lora_options().check()
    return args
