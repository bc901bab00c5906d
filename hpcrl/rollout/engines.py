"""Rollout engines as subprocesses: the command line, start with a health wait, stop (process utilities:
:mod:`hpcrl.procs`).

Two engines speak the same HTTP protocol (SGLang's):

- ``cpu``: hpcrl's reference engine, ``python -m hpcrl.engine.server --model-path P --host H --port N
  --api-key-file F``. The key stays in the 0600 run-secret file; it never appears on a command line.
- ``sglang``: real SGLang, ``python -m sglang.launch_server --model-path P --host H --port N --api-key KEY``
  plus the ``sglang:`` config section as flags (``enable_memory_saver: true`` -> ``--enable-memory-saver``,
  ``moe_a2a_backend: deepep`` -> ``--moe-a2a-backend deepep``, ``false``/``null`` drop the flag, a list gives
  one flag followed by all its values, a dict is passed as JSON). SGLang has no environment variable or
  file flag for its API key, so by default **the key is on SGLang's command line, readable by every user of
  the node through ``ps``/``/proc``**. ``key_via="config"`` avoids that by writing the key into a 0600 YAML
  file next to the secret and passing ``--config FILE`` (SGLang's ``server_args_config_parser``, present in
  the 0.5 series); opt-in.

Without a GPU, ``sglang`` runs SGLang's CPU path: :func:`sglang_cpu_args` and :func:`engine_env` add what it
needs (tests/sglang_cpu installs its runtime and says why each setting is there).

SGLang's API-key middleware leaves ``/health*`` and ``/metrics`` open; every other endpoint needs
``Authorization: Bearer KEY``. The router relies on that (see :mod:`hpcrl.rollout.router`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from hpcrl.procs import (PORT_ATTEMPTS, ManagedProcess, ProcessStartError, child_preexec, find_free_port,
                         log_since, log_size, open_log, port_taken, url_for, wait_for_http_ok)
from hpcrl.rollout.secret import read_secret

if TYPE_CHECKING:
    from hpcrl.fork_server import ForkServer

logger = logging.getLogger(__name__)

CPU_ENGINE_MODULE = "hpcrl.engine.server"
"""The CPU engine's module (``python -m``)."""

ENGINE_KINDS = ("cpu", "sglang")
"""Engines :func:`engine_command` can start."""

RESERVED_SGLANG_KEYS = frozenset({"model_path", "host", "port", "api_key", "config", "api_key_file"})
"""``sglang:`` keys that hpcrl sets itself; giving them in the config is an error."""


def sglang_flags(args: Mapping[str, Any]) -> list[str]:
    """Turn a ``sglang:`` config dict into SGLang command-line flags, in the dict's order.

    ``key: true`` -> ``--key``; ``false``/``None`` -> nothing; a list/tuple -> ``--key v1 v2 ...`` (SGLang's
    list flags are ``nargs='+'``); a dict -> ``--key '<json>'``; anything else -> ``--key str(value)``.
    Underscores in keys become dashes. Raises ValueError for an empty list (SGLang would reject ``--key``).
    """
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"sglang.{key}: an empty list cannot be passed as a flag; remove the key")
            out.append(flag)
            out.extend(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)
        elif isinstance(value, dict):
            out.extend([flag, json.dumps(value)])
        else:
            out.extend([flag, str(value)])
    return out


def _cpu_engine_flags() -> set[str]:
    """Long option names the CPU engine's parser accepts (``--max-running-requests``...)."""
    from hpcrl.engine.args import build_parser

    actions = build_parser()._actions
    return {opt for action in actions for opt in action.option_strings if opt.startswith("--")}


def resolve_engine(kind: str) -> str:
    """``cpu``/``sglang`` unchanged; ``auto`` -> ``sglang`` when torch sees CUDA, else ``cpu`` (without
    importing torch where no GPU device node exists: :func:`hpcrl.procs.cuda_available`).

    Raises ValueError for any other value."""
    if kind == "auto":
        return "sglang" if on_gpu() else "cpu"
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine {kind!r}; expected one of {ENGINE_KINDS} or 'auto'")
    return kind


def engine_sglang_args(cfg: Any) -> dict:
    """The engine flags of a run: the ``sglang:`` section plus ``enable_memory_saver`` when colocated,
    ``enable_deterministic_inference`` with ``run.deterministic``, ``enable_return_routed_experts`` with
    ``algorithm.routing_replay`` (SGLang returns no experts without it), ``custom_weight_loader`` with
    :data:`hpcrl.weights.delta.DELTA_LOADER` when ``weights.delta``, ``enable_lora`` with the adapters' rank and
    modules when ``model.lora.sync`` is ``adapter``, and ``dtype`` when ``model.dtype`` is not float32 (the CPU
    engine's default; SGLang's is the checkpoint's) (keys as SGLang's flags with ``_``; every one parses with
    SGLang 0.5.23's own parser: ``tests/unit/test_sglang_conformance.py``)."""
    args = dict(cfg.sglang)
    if cfg.model.dtype != "float32":
        args.setdefault("dtype", cfg.model.dtype)
    if cfg.run.placement == "colocate":
        args.setdefault("enable_memory_saver", True)
    if cfg.run.deterministic:
        args.setdefault("enable_deterministic_inference", True)
    if cfg.algorithm.routing_replay:
        args.setdefault("enable_return_routed_experts", True)
    lora = cfg.model.lora
    if lora is not None and lora.sync == "adapter":  # the engines serve the actor's adapters (hpcrl.weights.adapter)
        args.setdefault("enable_lora", True)
        args.setdefault("max_lora_rank", lora.rank)
        args.setdefault("lora_target_modules", sorted(lora.target_modules))
    if cfg.weights.delta:  # the engines must accept the delta's load_format (hpcrl.weights.delta)
        from hpcrl.weights.delta import DELTA_LOADER

        loaders = list(args.get("custom_weight_loader") or [])
        args["custom_weight_loader"] = loaders + [DELTA_LOADER] * (DELTA_LOADER not in loaders)
    return args


def sglang_engines(cfg: Any) -> bool:
    """Whether the run's engines are real SGLang: by the config (:func:`hpcrl.config.rollout.
    sglang_engines_by_config`), or ``auto`` resolved here (:func:`resolve_engine`: this machine's CUDA)."""
    from hpcrl.config.rollout import sglang_engines_by_config

    return sglang_engines_by_config(cfg) or resolve_engine(cfg.rollout.engine) == "sglang"


def engine_dtype(cfg: Any) -> str:
    """The dtype the engines hold their parameters in: ``sglang.dtype`` or ``model.dtype``
    (:func:`engine_sglang_args`'s ``dtype``; the CPU engine's default is float32)."""
    return str(engine_sglang_args(cfg).get("dtype") or "float32")


def engine_command(cfg_rollout: Any, sglang_args: Optional[Mapping[str, Any]], model_path: str | os.PathLike,
                   host: str, port: int, api_key_file: Optional[str | os.PathLike],
                   engine: Optional[str] = None, python: str = sys.executable,
                   key_via: str = "argv") -> list[str]:
    """The command line of one engine server.

    Args:
        cfg_rollout: the ``rollout`` config section; its ``engine`` is used when ``engine`` is None.
        sglang_args: the ``sglang:`` config section. For ``sglang`` every key becomes a flag
            (:func:`sglang_flags`); for ``cpu`` only the keys the CPU engine also has
            (``max_running_requests``, ``enable_memory_saver``, ``random_seed``, ``dtype``...) are passed, the
            rest are dropped with a log line (they tune GPU serving).
        model_path: HF model folder.
        host, port: where the server listens.
        api_key_file: the run secret (0600), or None for an engine without auth.
        engine: ``cpu``, ``sglang`` or ``auto`` (see :func:`resolve_engine`).
        python: interpreter for the server.
        key_via: ``sglang`` only: ``argv`` (``--api-key KEY``, visible in ``ps``) or ``config`` (the key in a
            0600 ``<api_key_file>.sglang.yaml`` passed as ``--config``, which this function writes).

    Raises ValueError for an unknown engine/key_via or a reserved key in ``sglang_args``
    (``model_path``, ``host``, ``port``, ``api_key``, ``config``), SecretError for an unsafe key file.
    """
    kind = resolve_engine(engine if engine is not None else getattr(cfg_rollout, "engine", "auto"))
    args = dict(sglang_args or {})
    reserved = sorted(RESERVED_SGLANG_KEYS & {str(k).replace("-", "_") for k in args})
    if reserved:
        raise ValueError(f"sglang: {', '.join(reserved)} are set by hpcrl (model.path, the run secret, "
                         "free ports); remove them from the sglang section")
    base = ["--model-path", str(model_path), "--host", str(host), "--port", str(int(port))]
    if kind == "cpu":
        accepted = _cpu_engine_flags()
        passed = {k: v for k, v in args.items() if "--" + str(k).replace("_", "-") in accepted}
        dropped = sorted(set(args) - set(passed))
        if dropped:
            logger.info("cpu engine: ignoring sglang keys it does not have: %s", ", ".join(map(str, dropped)))
        cmd = [python, "-m", CPU_ENGINE_MODULE, *base]
        if api_key_file is not None:
            read_secret(api_key_file)  # fail here, not in the child, if the file is unsafe
            cmd += ["--api-key-file", str(api_key_file)]
        return cmd + sglang_flags(passed)
    if not on_gpu():
        args = sglang_cpu_args(args)
    cmd = [python, "-m", "sglang.launch_server", *base]
    if api_key_file is not None:
        key = read_secret(api_key_file)
        if key_via == "argv":
            cmd += [f"--api-key={key}"]  # one token: a key may start with "-" (token_urlsafe)
        elif key_via == "config":
            cfg_path = Path(f"{api_key_file}.sglang.yaml")
            _write_private(cfg_path, f"api-key: {json.dumps(key)}\n")
            cmd += ["--config", str(cfg_path)]
        else:
            raise ValueError(f"key_via must be 'argv' or 'config', got {key_via!r}")
    return cmd + sglang_flags(args)


SGLANG_CPU_KV_TOKENS = 4096
"""``--max-total-tokens`` of an SGLang server on a CPU when ``sglang.max_total_tokens`` is not set: without a
bound SGLang's KV pool takes ~0.72 of the machine's free memory (~15 GB on a 24 GB machine)."""
SGLANG_CPU_DROPPED = ("enable_memory_saver",)
"""``sglang:`` keys an SGLang server on a CPU cannot take: ``--enable-memory-saver`` needs ``libcuda.so.1``
(the server exits with status 127); without it ``/release_memory_occupation`` answers 200 and frees nothing."""


def amx_tile_supported() -> bool:
    """Whether this CPU has AMX tiles (torch's own probe), which SGLang's CPU fp8 method requires."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def on_gpu() -> bool:
    """Whether the engines started here get a GPU (torch sees CUDA; :func:`hpcrl.procs.cuda_available`)."""
    from hpcrl.procs import cuda_available

    return cuda_available()


def sglang_cpu_args(args: Mapping[str, Any]) -> dict:
    """SGLang's flags for its CPU path (``--device cpu``), given the run's: ``device: cpu``; ``dtype`` float32
    unless set (SGLang's ``auto`` loads an fp32 checkpoint as fp16: log-probs 1.5e-4 off the trainer's);
    ``max_total_tokens`` :data:`SGLANG_CPU_KV_TOKENS` unless set; ``sleep_on_idle`` unless set (without it
    SGLang's scheduler polls its sockets in a busy loop: measured at 90% of a core for 48 idle minutes, a core
    taken from the trainer between rollouts; with it, no CPU while idle); :data:`SGLANG_CPU_DROPPED` left out
    with a log line; with ``enable_lora`` the ``torch_native`` LoRA backend unless set. The environment it needs
    is :func:`engine_env`'s."""
    out = {k: v for k, v in args.items() if k not in SGLANG_CPU_DROPPED}
    dropped = sorted(k for k in args if k in SGLANG_CPU_DROPPED and args[k])
    if dropped:
        logger.info("sglang on a CPU: leaving out %s (needs a GPU)", ", ".join(dropped))
    out.setdefault("device", "cpu")
    out.setdefault("dtype", "float32")
    out.setdefault("max_total_tokens", SGLANG_CPU_KV_TOKENS)
    out.setdefault("sleep_on_idle", True)
    if out.get("enable_lora"):  # (its default, csgmv, and the others but torch_native are Triton kernels)
        out.setdefault("lora_backend", "torch_native")
    return out


def engine_env(cfg_rollout: Any, engine: Optional[str] = None) -> dict[str, str]:
    """Environment variables an engine process gets on top of this process's: ``rollout.engine_env``, and for
    SGLang without a GPU ``SGLANG_USE_CPU_ENGINE=1`` (its ``--device cpu`` fails with ``No module named
    'vllm'`` otherwise) and ``OMP_NUM_THREADS=1`` unless set (two torch threads on shared cores served
    10-35x fewer tokens/s); for every SGLang engine ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` unless set.

    Why the last: SGLang 0.5.23's ``/health`` runs a one-token generation by default, like
    ``/health_generate``. hpcrl's health monitor probes ``/health`` while it has the engines paused or
    released (:mod:`hpcrl.rollout.health`): such a probe waits for the pause, SGLang marks itself unhealthy
    after 20 s, and in the quickstart on SGLang on a CPU a probe interleaved with a weight sync's
    ``/pause_generation`` left the sync's ``/flush_cache`` unanswered (four times in ~200 steps, issue #53).
    With it ``/health`` answers whether the server is up, and ``/health_generate`` stays the generating probe.
    Raises ValueError for an unknown engine."""
    kind = resolve_engine(engine if engine is not None else getattr(cfg_rollout, "engine", "auto"))
    env = {str(k): str(v) for k, v in (getattr(cfg_rollout, "engine_env", None) or {}).items()}
    if kind == "sglang":
        env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    if kind == "sglang" and not on_gpu():
        env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        if "OMP_NUM_THREADS" not in os.environ:
            env.setdefault("OMP_NUM_THREADS", "1")
    return env


SGLANG_SERVER_MODULES = ("sglang", "sglang.srt.entrypoints.http_server", "pybase64", "zmq", "uvloop", "triton",
                         "sgl_kernel")
"""Modules SGLang's server imports first (the package and its HTTP server, its first pure-Python dependency,
ZeroMQ between its processes, its event loop, Triton and its kernels, which it imports at module level also on
a CPU): what :func:`sglang_missing` looks for."""


def sglang_missing(env: Optional[Mapping[str, str]] = None, python: str = sys.executable) -> list[str]:
    """Which of :data:`SGLANG_SERVER_MODULES` an engine process started with ``env`` (default this
    process's) could not import: found in a child interpreter by ``importlib.util.find_spec`` of the top-level
    package and a dotted name's file in that package's folders, so no package's ``__init__`` runs (~0.1 s;
    importing ``sglang`` alone takes ~9 s, its server 9-20 s). Empty when SGLang looks servable. Raises nothing
    (an interpreter that cannot start reports every module missing)."""
    code = ("import importlib.util, os, sys\n"
            "def found(m):\n"
            "    head, *rest = m.split('.')\n"
            "    try:\n"
            "        spec = importlib.util.find_spec(head)\n"
            "    except (ImportError, ValueError):\n"
            "        return False\n"
            "    if spec is None or not rest:\n"
            "        return spec is not None\n"
            "    sub = os.path.join(*rest)\n"
            "    return any(os.path.isfile(os.path.join(d, sub + '.py')) or os.path.isdir(os.path.join(d, sub))\n"
            "               for d in spec.submodule_search_locations or [])\n"
            "print(' '.join(m for m in sys.argv[1:] if not found(m)))")
    try:
        out = subprocess.run([python, "-c", code, *SGLANG_SERVER_MODULES], capture_output=True, text=True,
                             timeout=60, env=dict(env) if env is not None else None)
    except (OSError, subprocess.SubprocessError):
        return list(SGLANG_SERVER_MODULES)
    return out.stdout.split() if out.returncode == 0 else list(SGLANG_SERVER_MODULES)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (a temporary file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def redact(cmd: Sequence[str]) -> list[str]:
    """``cmd`` with the value of ``--api-key``/``--admin-api-key`` (``--flag KEY`` or ``--flag=KEY``) replaced by
    ``<redacted>`` (for logs)."""
    out = list(cmd)
    for i, part in enumerate(out):
        flag = part.split("=", 1)[0]
        if flag in ("--api-key", "--admin-api-key"):
            if "=" in part:
                out[i] = f"{flag}=<redacted>"
            elif i + 1 < len(out):
                out[i + 1] = "<redacted>"
    return out


# ---------------------------------------------------------------------------------------------- processes
@dataclass
class EngineProcess(ManagedProcess):
    """A running engine server (:class:`hpcrl.procs.ManagedProcess`): ``url`` its base URL, ``log_path`` its
    combined stdout/stderr."""

    command: list[str] = field(default_factory=list)
    """The command line, API key redacted."""


def shared_engine_env(cfg_rollout: Any, num_engines: int, engine: Optional[str] = None,
                      available: Optional[int] = None) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``num_engines`` CPU engines that share this machine's CPUs unpinned
    (a colocated local run: the engines generate while the trainer waits, so they split the machine between
    them): ``available // num_engines`` threads, at least 1 (``available``: this process's CPUs). Empty when
    ``OMP_NUM_THREADS`` is already set here or in ``rollout.engine_env`` (the user's choice, or the test
    suite's) or the engine is SGLang (its CPU path gets 1 thread: :func:`engine_env`).

    Why: the CPU engine takes one torch thread per CPU it may run on, so two engines on 2 CPUs ran 4 threads on
    2 cores and thrashed (the quickstart's rollout step at ``train.nprocs=2 rollout.num_engines=2``: 1.56 s,
    against 0.27 s with one thread each; docs/performance.md, "Both cores in each phase")."""
    user = getattr(cfg_rollout, "engine_env", None) or {}
    if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in user or resolve_engine(
            engine if engine is not None else getattr(cfg_rollout, "engine", "auto")) != "cpu":
        return {}
    if available is None:
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, available // max(1, num_engines)))}


def spawn_engine(cfg_rollout: Any, sglang_args: Optional[Mapping[str, Any]], model_path: str | os.PathLike,
                 host: str = "127.0.0.1", port: Optional[int] = None,
                 api_key_file: Optional[str | os.PathLike] = None, engine: Optional[str] = None,
                 log_path: Optional[str | os.PathLike] = None, env: Optional[Mapping[str, str]] = None,
                 key_via: str = "argv", cpus: Optional[Sequence[int]] = None,
                 forks: Optional["ForkServer"] = None) -> EngineProcess:
    """Start one engine (:func:`engine_command`) without waiting for it: :func:`wait_engine` does that, so a
    caller can load the model in the engine while it does other work (the trainer builds its model).
    ``cpus``: pin it to these CPUs, one torch thread each (``OMP_NUM_THREADS``); None: inherit.

    ``port`` None picks a free one. stdout/stderr go to ``log_path`` (default: a new temporary file). ``env``
    entries are added to this process's environment. ``forks``: a CPU engine is forked from this fork server
    (:mod:`hpcrl.fork_server`: ~0.2 s to ready instead of ~4 s of imports) when its environment allows it
    (:meth:`~hpcrl.fork_server.ForkServer.can_run`), else started with ``subprocess``. Raises what
    :func:`engine_command` raises, and OSError when the fork server cannot fork.
    """
    port = int(port) if port is not None else find_free_port(host if host not in ("0.0.0.0", "::") else "")
    cmd = engine_command(cfg_rollout, sglang_args, model_path, host, port, api_key_file, engine=engine,
                         key_via=key_via)
    path, log_file = open_log(log_path, "hpcrl-engine-")
    child_env = dict(os.environ)
    child_env.update(engine_env(cfg_rollout, engine))
    if cpus is not None:
        child_env["OMP_NUM_THREADS"] = str(len(cpus))
    child_env.update(env or {})
    if forks is not None and cmd[:3] == [sys.executable, "-m", CPU_ENGINE_MODULE] and forks.can_run(child_env):
        process = forks.spawn(CPU_ENGINE_MODULE, cmd[3:], child_env, path, cpus, title=redact(cmd))
    else:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   preexec_fn=child_preexec(cpus), env=child_env)
    return EngineProcess(url=url_for(host, port), process=process, log_path=path, command=redact(cmd),
                         _log_file=log_file)


def wait_engine(eng: EngineProcess, api_key_file: Optional[str | os.PathLike] = None,
                startup_timeout_s: float = 600.0) -> EngineProcess:
    """Wait until ``eng`` answers ``GET /health`` with 200 (``startup_timeout_s`` seconds, model loading
    included); returns it. Raises :class:`hpcrl.procs.ProcessStartError` with the log tail if the server exits
    or is not healthy in time (the process is stopped first)."""
    key = read_secret(api_key_file) if api_key_file is not None else None
    try:
        wait_for_http_ok(eng.url + "/health", eng.process, startup_timeout_s, eng.log_path, f"engine {eng.url}",
                         key)
    except BaseException:
        eng.stop(grace_s=5.0)
        raise
    return eng


def start_engine(cfg_rollout: Any, sglang_args: Optional[Mapping[str, Any]], model_path: str | os.PathLike,
                 host: str = "127.0.0.1", port: Optional[int] = None,
                 api_key_file: Optional[str | os.PathLike] = None, engine: Optional[str] = None,
                 log_path: Optional[str | os.PathLike] = None, startup_timeout_s: float = 600.0,
                 env: Optional[Mapping[str, str]] = None, key_via: str = "argv") -> EngineProcess:
    """Start one engine and wait until ``GET /health`` answers 200: :func:`spawn_engine` then
    :func:`wait_engine` (arguments and errors as theirs). With ``port`` None the port is picked free, but the
    engine binds it only once its model is loaded and another process may take it in between: an engine whose
    own lines say ``address already in use`` is started again on a new port (its log
    ``<stem>.port-retry-<k><suffix>`` beside ``log_path``, as :class:`LocalEngineLaunch` names a run's), up to
    :data:`hpcrl.procs.PORT_ATTEMPTS` starts; ``startup_timeout_s`` is each start's."""
    first = Path(log_path) if log_path is not None else None
    for attempt in range(1, PORT_ATTEMPTS + 1):
        log = (first if attempt == 1 or first is None else
               first.with_name(f"{first.stem}.port-retry-{attempt - 1}{first.suffix}"))
        offset = log_size(log)  # a log appended to by an earlier start: only this start's lines count
        eng = spawn_engine(cfg_rollout, sglang_args, model_path, host, port, api_key_file, engine, log, env,
                           key_via)
        try:
            return wait_engine(eng, api_key_file, startup_timeout_s)
        except ProcessStartError:
            if port is not None or not port_taken(log_since(log, offset)) or attempt == PORT_ATTEMPTS:
                raise
            logger.warning("engine: the port of %s was taken before it could bind it; starting it again on "
                           "another (attempt %d of %d, log %s)", eng.url, attempt + 1, PORT_ATTEMPTS, log)
    raise AssertionError("unreachable")


@dataclass
class LocalEngineLaunch:
    """Engines started on this machine and still loading (:data:`hpcrl.rollout.fleet.EngineLauncher`'s
    result for local runs): ``wait()`` returns ``(engines, None)`` once all answer ``/health``; ``stop()``
    stops them (also those not up yet)."""

    engines: list[EngineProcess]
    secret_path: Path
    cfg: Any = None
    attempt_dir: Optional[Path] = None
    model_path: Optional[str | os.PathLike] = None
    """The folder the engines load (to start one again when its port was taken before it bound it)."""
    forks: Optional["ForkServer"] = None
    """The fork server engines started again are forked from (:func:`spawn_engine`), if any."""

    def wait(self) -> tuple[list[EngineProcess], None]:
        """Wait for every engine (they load in parallel); one whose port was taken before it could bind it is
        started again on another (:meth:`_wait_bound`). Raises :class:`hpcrl.procs.ProcessStartError` for the
        first that fails, after stopping all of them."""
        try:
            for i, e in enumerate(list(self.engines)):
                self.engines[i] = self._wait_bound(i, e, engine_sglang_args(self.cfg), self.model_path)
        except BaseException:
            self.stop()
            raise
        return self.engines, None

    def _wait_bound(self, index: int, eng: EngineProcess, args: dict,
                    model_path: Optional[str | os.PathLike]) -> EngineProcess:
        """Wait for engine ``index`` (:func:`wait_engine`). Its port was free when picked, but the engine
        binds it only once its model is loaded, and another process may take it in between (the OS hands
        released ports out again as ephemeral ones; a second run on the node picks it too): when it exits
        saying ``address already in use``, it is started again on a new port, logged, in
        ``engine-<index>.port-retry-<k>.log``, up to :data:`hpcrl.procs.PORT_ATTEMPTS` starts. Raises
        ProcessStartError otherwise."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return wait_engine(eng, self.secret_path)
            except ProcessStartError as err:  # each start has a log of its own: its tail says why
                if not port_taken(err.log_tail) or model_path is None or attempt == PORT_ATTEMPTS:
                    raise
                old = eng.url
                eng = self._spawn(index, args, model_path,
                                  Path(self.attempt_dir) / f"engine-{index}.port-retry-{attempt}.log")
                logger.warning("engine %d: port of %s taken before it could bind it; started again at %s "
                               "(attempt %d of %d)", index, old, eng.url, attempt + 1, PORT_ATTEMPTS)
        raise AssertionError("unreachable")

    def _spawn(self, index: int, args: dict, model_path: str | os.PathLike, log_path: Path) -> EngineProcess:
        """:func:`spawn_engine` of engine ``index`` on a new port, pinned as the launch pins it."""
        from hpcrl.placement import CpuSets, parse_cpu_list

        cfg = self.cfg
        sets = None
        if cfg.run.placement == "disaggregate" and cfg.rollout.cpus is not None:
            sets = CpuSets(tuple(parse_cpu_list(cfg.train.cpus or [])), tuple(parse_cpu_list(cfg.rollout.cpus)))
        n = cfg.rollout.num_engines
        return spawn_engine(cfg.rollout, args, model_path, api_key_file=self.secret_path, log_path=log_path,
                            cpus=sets.engine(index, n) if sets is not None else None,
                            env=shared_engine_env(cfg.rollout, n) if sets is None else None, forks=self.forks)

    def stop(self) -> None:
        """Stop every engine of this launch. Idempotent."""
        for e in self.engines:
            e.stop()

    def restart(self, index: int, model_path: str | os.PathLike, weight_version: Optional[str],
                attempt: int) -> EngineProcess:
        """Start engine ``index`` again (after it died), from the HF folder ``model_path`` serving
        ``weight_version`` (None: the engine's default), on a new port, pinned as before; its log is
        ``engine-<index>.restart-<attempt>.log``. Waits until it answers ``/health``
        (:data:`hpcrl.rollout.health.RestartEngine`). Raises ProcessStartError with its log tail."""
        args = engine_sglang_args(self.cfg)
        if weight_version is not None:
            args["weight_version"] = weight_version
        eng = self._spawn(index, args, model_path, Path(self.attempt_dir) / f"engine-{index}.restart-{attempt}.log")
        eng = self._wait_bound(index, eng, args, model_path)
        self.engines.append(eng)  # stopped with the others at the end
        return eng


def launch_local_engines(cfg: Any, run_dir: Path, attempt_dir: Path, model_path: str | os.PathLike,
                         secret_path: Path, forks: Optional["ForkServer"] = None) -> LocalEngineLaunch:
    """The engine launcher of a run on this machine (:data:`hpcrl.rollout.fleet.EngineLauncher`):
    starts ``rollout.num_engines`` local engine processes, logs in ``attempt_dir/engine-<i>.log``, and returns
    at once (disaggregated: each pinned to its share of ``rollout.cpus``, :mod:`hpcrl.placement`); :meth:`LocalEngineLaunch.wait` waits until they are healthy. If one cannot be started, the ones
    already started are stopped and the error propagates. ``forks``: CPU engines are forked from it
    (:func:`spawn_engine`)."""
    from hpcrl.placement import CpuSets, parse_cpu_list

    args = engine_sglang_args(cfg)
    n = cfg.rollout.num_engines
    sets = None
    if cfg.run.placement == "disaggregate" and cfg.rollout.cpus is not None:  # resolved by hpcrl run
        sets = CpuSets(tuple(parse_cpu_list(cfg.train.cpus or [])), tuple(parse_cpu_list(cfg.rollout.cpus)))
    engines: list[EngineProcess] = []
    try:
        for i in range(n):
            engines.append(spawn_engine(cfg.rollout, args, model_path, api_key_file=secret_path,
                                        log_path=Path(attempt_dir) / f"engine-{i}.log",
                                        cpus=sets.engine(i, n) if sets is not None else None,
                                        env=shared_engine_env(cfg.rollout, n) if sets is None else None,
                                        forks=forks))
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return LocalEngineLaunch(engines, Path(secret_path), cfg, Path(attempt_dir), model_path, forks)
