"""The real ``sglang-router`` (Rust "SGLang Model Gateway", 0.3.x) as a subprocess, and its worker API.

``start_router`` runs ``python -m hpcrl.rollout.router [--api-key-stdin] <flags>``, a short wrapper that
hands the flags to ``sglang_router.launch_router.main`` (exactly what ``python -m
sglang_router.launch_router`` does, but without importing its Python MiniLB unless ``--mini-lb`` is given:
:func:`_mini_lb_placeholder`), adding ``--api-key KEY`` in memory from the first line of its stdin, a
pipe that ``start_router`` writes the key into and closes. So the run secret is never on a command line
(``ps``), in an environment (``/proc/PID/environ``) or in a file other than the 0600 run secret. (The router
also overwrites its process title with ``sglang::router``.)

How the router authenticates (measured with sglang-router 0.3.2 against workers that log every request):

- ``--api-key KEY`` is both the router's own data-plane key and the key it sends to workers. Clients must send
  ``Authorization: Bearer KEY`` to ``/generate``, ``/flush_cache`` and the worker API ``/workers`` (401
  otherwise); ``/health``, ``/readiness`` and ``/liveness`` stay open. To workers given with ``--worker-urls``
  it sends ``Bearer KEY`` on every proxied request (``/generate``...), on its metadata probes
  (``/server_info``, ``/model_info``) and on broadcasts (``/flush_cache``).
- A worker added at runtime with ``POST /workers`` gets no key unless the body has ``"api_key"`` (the router
  logs "Adding worker ... without API key while router has API key configured"); the per-worker key then
  replaces the router key for that worker. :meth:`RouterProcess.add_worker` always sends it.
- There is no separate worker-key flag. Without ``--api-key`` the router passes the client's own
  ``Authorization`` header through on ``/generate``, but its probes and broadcasts carry none (metadata is
  missing and ``/flush_cache`` answers 206 with 401 per worker), so the key must be given to the router.
- The router's **first** probe of a new worker (``detect_connection_mode``: ``GET /health``) carries no key;
  its later periodic health checks do. A worker that demands auth on ``/health`` is therefore never registered
  (the log repeats "detect_connection_mode ... 401 Unauthorized"). Real SGLang leaves ``/health*`` and
  ``/metrics`` open, and so does hpcrl's CPU engine; any engine behind the router must do the same.
- With a wrong key the worker still registers (the health probe passes), but every proxied request comes back
  401 from the worker; :class:`~hpcrl.rollout.client.RolloutClient` raises it at once (4xx is not retried).
- When a worker dies with requests in flight, the router itself retries them on another worker (its default
  ``--retry-max-retries 5``; seen in the log as "Failed to send typed request worker_url=<dead>" followed by
  200 for the same request id), so the client sees a normal, if slower, answer.
- The router also starts a Prometheus exporter, by default on 0.0.0.0:29000; :func:`start_router` binds it to
  the router's host and a free port instead, so several routers can share a node and nothing listens on all
  interfaces. A port is free when picked, and the router binds it about a second later; when another process
  took it in between (seen in CI: ``PanicException: failed to install Prometheus metrics exporter:
  FailedToCreateHTTPListener("Address already in use (os error 98)")``), :meth:`RouterProcess.wait_ready`
  starts the router again on a new port, logged, up to :data:`hpcrl.procs.PORT_ATTEMPTS` starts.
 The worker API: ``GET /workers`` lists ``{"id", "url", "is_healthy", ...}``; ``POST /workers {"url",
"api_key"}`` answers 202 and registers in the background; ``DELETE /workers/{id}`` (the UUID, not the URL)
answers 202. The legacy ``/add_worker`` / ``/remove_worker`` are gone (404). The router does not proxy abort,
pause, continue, weight sync or memory endpoints; :class:`hpcrl.rollout.client.RolloutClient` sends those to
each
engine directly.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from hpcrl.procs import (PORT_ATTEMPTS, ManagedProcess, ProcessStartError, child_preexec, find_free_port,
                         log_since, log_size, log_tail, open_log, port_taken, url_for, wait_for_http_ok)

logger = logging.getLogger(__name__)

KEY_STDIN_FLAG = "--api-key-stdin"
"""Wrapper flag: read the router's API key from the first line of stdin."""

ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")
"""Routing policies of sglang-router 0.3.x (``--policy``)."""


WORKER_POLL_S = 0.05
"""Seconds between two reads of the router's worker list while a worker is added or removed (the router
registers one within ~50 ms of ``POST /workers`` on a 2-core machine)."""


class RouterError(RuntimeError):
    """A worker API call on the router failed (HTTP error, or the change did not take effect in time)."""


@dataclass
class RouterProcess(ManagedProcess):
    """A running sglang-router (:class:`hpcrl.procs.ManagedProcess`): ``url`` its base URL, ``log_path`` its
    combined stdout/stderr. ``stop()`` SIGKILLs it after the grace period, which it would otherwise spend
    waiting up to ``--shutdown-grace-period-secs`` for requests in flight."""

    api_key: Optional[str] = field(default=None, repr=False)
    prometheus_port: Optional[int] = None
    spawn_args: dict = field(default_factory=dict, repr=False)
    """:func:`spawn_router`'s arguments, to start it again on another port when its bind fails."""
    port_pinned: bool = False
    """Whether the caller chose ``port`` (then a taken main port is the caller's to handle: not retried)."""
    log_offset: int = 0
    """Where this start's lines begin in ``log_path`` (restarts append to the same log)."""

    # ------------------------------------------------------------------ worker API
    def _call(self, method: str, path: str, payload: Any = None, timeout_s: float = 10.0) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                status, text = int(resp.status), resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            status, text = int(e.code), e.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError) as e:
            raise RouterError(f"{method} {self.url}{path}: router unreachable ({e})") from None
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def list_workers(self) -> list[dict]:
        """The router's workers (``GET /workers``): dicts with ``id``, ``url``, ``is_healthy``, ``load``...

        Raises RouterError on an HTTP error."""
        status, body = self._call("GET", "/workers")
        if status != 200 or not isinstance(body, dict):
            raise RouterError(f"GET {self.url}/workers answered {status}: {body}")
        return list(body.get("workers", []))

    def worker_urls(self, healthy_only: bool = False) -> list[str]:
        """URLs of the registered workers (only the healthy ones with ``healthy_only``)."""
        return [w["url"] for w in self.list_workers() if w.get("is_healthy", True) or not healthy_only]

    def add_worker(self, url: str, api_key: Optional[str] = None, timeout_s: float = 60.0) -> str:
        """Register ``url`` (``POST /workers``) and wait until the router lists it as healthy.

        ``api_key`` is what the router sends to this worker; default: the router's own key.
        ``timeout_s`` bounds the wait (seconds). Returns the worker id.
        Raises RouterError if the router refuses or the worker is not healthy in time (with the log tail).
        """
        url = url.rstrip("/")
        self._post_worker(url, api_key if api_key is not None else self.api_key)
        return self._wait_worker(url, timeout_s)

    def _post_worker(self, url: str, key: Optional[str]) -> None:
        payload: dict[str, Any] = {"url": url}
        if key:
            payload["api_key"] = key
        status, body = self._call("POST", "/workers", payload)
        if status not in (200, 201, 202):
            raise RouterError(f"POST {self.url}/workers {url} answered {status}: {body}")

    def _wait_worker(self, url: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            for w in self.list_workers():
                if w.get("url", "").rstrip("/") == url and w.get("is_healthy", False):
                    return str(w.get("id", ""))
            if not self.alive():
                raise RouterError(f"router {self.url} exited (code {self.process.returncode}) while adding "
                                  f"{url}\n--- log tail ---\n{log_tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise RouterError(f"worker {url} not registered as healthy by {self.url} within "
                                  f"{timeout_s:g} s\n--- log tail ---\n{log_tail(self.log_path)}")
            time.sleep(WORKER_POLL_S)

    def wait_ready(self, worker_urls: Sequence[str] = (), timeout_s: float = 60.0,
                   register: bool = False) -> None:
        """Wait until the router answers ``/health`` and lists each of ``worker_urls`` as healthy: workers
        given at start (``--worker-urls``), or with ``register`` workers this call adds (``POST /workers``
        with the router's key, once it answers). ``timeout_s`` bounds the whole wait (seconds).

        Raises ProcessStartError with the log tail if the router exits, does not answer in time, refuses a
        worker or does not register the workers in time; the router is stopped first."""
        deadline = time.monotonic() + timeout_s
        try:
            self._wait_bound(deadline)
            try:
                for url in worker_urls if register else ():
                    self._post_worker(url.rstrip("/"), self.api_key)
                for url in worker_urls:
                    self._wait_worker(url.rstrip("/"), max(0.0, deadline - time.monotonic()))
            except RouterError as e:
                raise ProcessStartError(str(e).split("\n--- log tail")[0], log_tail(self.log_path)) from None
        except BaseException:
            self.stop(grace_s=5.0)
            raise

    def _wait_bound(self, deadline: float) -> None:
        """Wait until the router answers ``/health``; when it exits because one of its ports was taken between
        the pick and its bind (the log says ``Address already in use``), start it again on a new port - the
        Prometheus port, or the main one unless the caller pinned it - up to :data:`hpcrl.procs.PORT_ATTEMPTS`
        starts, each logged. Raises ProcessStartError (with this start's log) otherwise."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                wait_for_http_ok(self.url + "/health", self.process, max(0.1, deadline - time.monotonic()),
                                 self.log_path, f"sglang-router {self.url}")
                return
            except ProcessStartError:
                text = log_since(self.log_path, self.log_offset)
                # its exporter's bind panics with "failed to install Prometheus metrics exporter"
                taken = "prometheus" if "prometheus metrics exporter" in text.lower() else "main"
                if not port_taken(text) or attempt == PORT_ATTEMPTS or (taken == "main" and self.port_pinned):
                    raise
                old = self.prometheus_port if taken == "prometheus" else self.url
                self._respawn(taken)
                logger.warning("sglang-router: its %s port (%s) was taken before it could bind it; started "
                               "again on %s (attempt %d of %d)", taken, old,
                               self.prometheus_port if taken == "prometheus" else self.url, attempt + 1,
                               PORT_ATTEMPTS)

    def _respawn(self, taken: str) -> None:
        """Start the router again with :attr:`spawn_args` and a new ``taken`` port (``main`` or
        ``prometheus``); this object then stands for the new process."""
        self.stop(grace_s=2.0)
        args = dict(self.spawn_args)
        args["log_path"] = self.log_path
        args["prometheus_port"] = None if taken == "prometheus" else self.prometheus_port
        args["port"] = None if taken == "main" else int(urllib.parse.urlsplit(self.url).port)
        new = spawn_router(**args)
        self.url, self.process, self.prometheus_port = new.url, new.process, new.prometheus_port
        self.log_offset, self._log_file = new.log_offset, new._log_file

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Deregister ``url`` (``DELETE /workers/{id}``) and wait until the router no longer lists it.

        Raises RouterError if the URL is not registered, the router refuses, or it is still listed after
        ``timeout_s`` seconds."""
        url = url.rstrip("/")
        ids = [w["id"] for w in self.list_workers() if w.get("url", "").rstrip("/") == url]
        if not ids:
            raise RouterError(f"worker {url} is not registered with {self.url}")
        for wid in ids:
            status, body = self._call("DELETE", "/workers/" + urllib.parse.quote(str(wid), safe=""))
            if status not in (200, 202, 204):
                raise RouterError(f"DELETE {self.url}/workers/{wid} ({url}) answered {status}: {body}")
        deadline = time.monotonic() + timeout_s
        while any(w.get("url", "").rstrip("/") == url for w in self.list_workers()):
            if time.monotonic() > deadline:
                raise RouterError(f"worker {url} still listed by {self.url} {timeout_s:g} s after removal")
            time.sleep(WORKER_POLL_S)


def router_command(worker_urls: Sequence[str], host: str, port: int, policy: str = "round_robin",
                   prometheus_port: Optional[int] = None, log_level: str = "info",
                   extra_args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The wrapper command line (no key on it; see the module docstring).

    Raises ValueError for an unknown policy, or if ``extra_args`` sets ``--api-key`` (pass ``api_key`` to
    :func:`start_router` instead)."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"unknown router policy {policy!r}; expected one of {ROUTER_POLICIES}")
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra_args):
        raise ValueError("pass the router key as api_key=, not in extra_args (it would show in ps)")
    cmd = [python, "-m", "hpcrl.rollout.router", "--host", host, "--port", str(int(port)), "--policy", policy,
           "--log-level", log_level]
    if prometheus_port is not None:
        cmd += ["--prometheus-host", host, "--prometheus-port", str(int(prometheus_port))]
    if worker_urls:
        cmd += ["--worker-urls", *[u.rstrip("/") for u in worker_urls]]
    return cmd + list(extra_args)


def start_router(worker_urls: Sequence[str], host: str = "127.0.0.1", port: Optional[int] = None,
                 api_key: Optional[str] = None, policy: str = "round_robin",
                 log_path: Optional[str | os.PathLike] = None, extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 60.0, wait_workers: bool = True, log_level: str = "info",
                 prometheus_port: Optional[int] = None, cpus: Optional[Sequence[int]] = None) -> RouterProcess:
    """Start sglang-router in front of ``worker_urls`` and wait until it serves (:func:`spawn_router`, then
    :meth:`RouterProcess.wait_ready`).

    Args:
        worker_urls: engine base URLs registered at start (may be empty; add more with ``add_worker``).
        host, port: where the router listens; ``port`` None picks a free one.
        api_key: the run secret: required from clients and sent to every worker (see the module docstring).
        policy: routing policy (:data:`ROUTER_POLICIES`).
        log_path: file for the router's stdout/stderr (default: a new temporary file).
        extra_args: more ``sglang-router launch`` flags (``--request-timeout-secs 600``...).
        startup_timeout_s: bound on the whole wait, seconds.
        wait_workers: also wait until every worker in ``worker_urls`` is registered and healthy (otherwise
            requests sent right after start are refused with 503 "no available workers").
        log_level: router log level (``debug``, ``info``, ``warn``, ``error``).
        prometheus_port: port of the router's Prometheus exporter (bound to ``host``); default a free port.
        cpus: pin the router to these CPU ids (a disaggregated local run: the rollout's); None: inherit.

    Raises ProcessStartError with the log tail if the router exits, does not answer ``/health``, or does not
    register the workers in time (the router is stopped first); ValueError for bad arguments.
    """
    router = spawn_router(worker_urls, host, port, api_key, policy, log_path, extra_args, log_level,
                          prometheus_port, cpus)
    router.wait_ready(worker_urls if wait_workers else (), startup_timeout_s)
    return router


def spawn_router(worker_urls: Sequence[str], host: str = "127.0.0.1", port: Optional[int] = None,
                 api_key: Optional[str] = None, policy: str = "round_robin",
                 log_path: Optional[str | os.PathLike] = None, extra_args: Sequence[str] = (),
                 log_level: str = "info", prometheus_port: Optional[int] = None,
                 cpus: Optional[Sequence[int]] = None) -> RouterProcess:
    """Start sglang-router (arguments as :func:`start_router`) and return at once, while it starts (~1 s of
    Python imports and its own start-up): a run spawns it beside its loading engines and calls
    :meth:`RouterProcess.wait_ready` later. Raises ValueError for bad arguments."""
    spawn_args = dict(worker_urls=list(worker_urls), host=host, api_key=api_key, policy=policy,
                      extra_args=list(extra_args), log_level=log_level, cpus=cpus)
    port_pinned = port is not None
    bind = host if host not in ("0.0.0.0", "::") else ""
    port = int(port) if port is not None else find_free_port(bind)
    prometheus_port = int(prometheus_port) if prometheus_port is not None else find_free_port(bind)
    if api_key is not None and (not api_key or "\n" in api_key):
        raise ValueError("api_key must be a non-empty single line")
    cmd = router_command(worker_urls, host, port, policy, prometheus_port, log_level, extra_args)
    if api_key:
        cmd.insert(3, KEY_STDIN_FLAG)
    path, log_file = open_log(log_path, "hpcrl-router-")
    offset = log_size(path)
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=child_preexec(cpus),
                               stdin=subprocess.PIPE if api_key else subprocess.DEVNULL)
    if api_key:
        assert process.stdin is not None
        try:
            process.stdin.write(api_key.encode() + b"\n")
            process.stdin.close()
        except BrokenPipeError:
            pass  # the wrapper died at once; the health wait reports it with the log tail
    return RouterProcess(url=url_for(host, port), process=process, log_path=path, api_key=api_key,
                         prometheus_port=prometheus_port, _log_file=log_file, spawn_args=spawn_args,
                         port_pinned=port_pinned, log_offset=offset)


def _mini_lb_placeholder() -> Any:
    """A stand-in for ``sglang_router.mini_lb``, the Python debugging load balancer that
    ``sglang_router.launch_router`` imports at module level but runs only with ``--mini-lb``: importing it
    (FastAPI, uvicorn, sglang) took 0.44 s of CPU at every router start, beside the loading engines and
    trainer. Its ``MiniLoadBalancer`` raises RuntimeError if ever called."""
    import types

    def unavailable(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("hpcrl.rollout.router: sglang_router.mini_lb was not imported (no --mini-lb flag)")

    module = types.ModuleType("sglang_router.mini_lb")
    module.MiniLoadBalancer = unavailable  # type: ignore[attr-defined]
    return module


def _main(argv: Sequence[str]) -> None:
    """Entry of the wrapper: run sglang-router's own launcher; with ``--api-key-stdin`` first, add
    ``--api-key`` read from the first line of stdin. Raises SystemExit if that line is empty."""
    args = list(argv)
    if args[:1] == [KEY_STDIN_FLAG]:
        key = sys.stdin.readline().strip()
        if not key:
            raise SystemExit("hpcrl.rollout.router: --api-key-stdin given but stdin had no key")
        args = args[1:] + [f"--api-key={key}"]  # "=": a key may start with "-" (token_urlsafe)
    if not any(a.startswith(("--mini-lb", "--router-mini-lb")) for a in args):
        sys.modules.setdefault("sglang_router.mini_lb", _mini_lb_placeholder())
    from sglang_router.launch_router import main

    sys.argv = ["sglang-router"] + args
    main()


if __name__ == "__main__":
    _main(sys.argv[1:])
