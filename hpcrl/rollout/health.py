"""Engines and router that die or hang are replaced, not fatal: the controller's health monitor.

:class:`HealthMonitor` runs on the rollout's event loop (started by
:class:`hpcrl.rollout.fleet.RolloutFleet`), one watcher task per engine and one for the router (slime's
``RolloutHealthMonitor``, ``--use-fault-tolerance``; GLM-5 report section 3.6). Every
``rollout.heartbeat_interval_s`` seconds each engine is probed:

- ``GET /health_generate`` while the engines generate (a one-token generation, answered at once by a busy
  engine), ``GET /health`` while the manager has them paused, updating weights or with their memory released:
  SGLang answers 503 on ``/health_generate`` then, and a paused engine is not a dead one;
- an engine whose process exited, or which refuses connections, is dead at once; one whose probes have not
  succeeded for ``rollout.heartbeat_timeout_s`` is hung (e.g. SIGSTOPped, a stuck collective);
- a failed request (the client's ``on_failure`` hook) takes the engine out of rotation at once when it could
  not be reached, and wakes its watcher: a request never waits for the next heartbeat to be sent elsewhere.

A dead engine is replaced (:meth:`HealthMonitor.replace`): taken out of the client's rotation and the router
(``DELETE /workers/{id}``; the real router keeps a SIGKILLed worker listed as healthy), stopped (SIGKILL after a
short grace: a hung one does not answer SIGTERM), and started again through the launcher from the current
weights (:class:`hpcrl.weights.snapshot.WeightSnapshot`: the weight version the others serve), then added back
to the router and the client. Requests that were in flight on it fail with a connection error and are sent
again to the other engines, or wait until one is back (:class:`hpcrl.rollout.client.RolloutClient`); with
``rollout.partial_rollout`` the client streams each generation and continues from the tokens the dead engine
had sent. ``rollout.max_engine_restarts`` bounds restarts per engine;
a new engine that dies soon after starting raises a backoff of 1, 2, 4 ... 30 s. When no engine is left and
none may restart, the client raises :class:`hpcrl.rollout.client.EnginesLost` to the rollout: the loop
checkpoints its last finished step and the run exits for requeue. The router is watched the same way
(``GET /health``) and restarted with the engines in rotation.

Metrics (:meth:`HealthMonitor.take_metrics`, per rollout step): ``rollout/engine_restarts``,
``rollout/router_restarts``, ``rollout/retried_requests``, ``rollout/seconds_without_engine`` and
``rollout/engine_recovery_seconds`` (the longest death-to-serving time of the step) and
``rollout/kept_partial_tokens`` (tokens from engines that died mid-generation, kept and continued from).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

log = logging.getLogger("hpcrl.health")

SERVING, SUSPECT, RESTARTING, LOST = "serving", "suspect", "restarting", "lost"
"""Engine slot states: in rotation; out of rotation until its watcher has probed it; being replaced; gone."""

MAX_BACKOFF_S = 30.0
"""Cap of the wait before restarting an engine whose last restart died soon after it started, seconds."""


@dataclass
class EngineSlot:
    """One engine position of the run (``index`` as in ``engine-<index>.log``) and its current server."""

    index: int
    engine: Any
    """The server: ``.url``, ``.stop()``, and ``.alive()`` when it is a local process."""
    state: str = SERVING
    restarts: int = 0
    crashes_in_a_row: int = 0
    """Engines of this slot in a row that died within ``heartbeat_timeout_s`` of starting, with no rollout
    step finished since (the backoff's exponent)."""
    started: float = field(default_factory=time.monotonic)
    last_ok: float = field(default_factory=time.monotonic)
    wake: Optional[asyncio.Event] = None


RestartEngine = Callable[[int, Any, Optional[str], int], Any]
"""``restart(index, model_path, weight_version, attempt) -> engine``: start engine ``index`` again from the HF
folder ``model_path`` serving ``weight_version`` (None: the engine's default) and wait until it answers
``/health``; blocking (run in a thread). Raises when it cannot (a crash loop is bounded by the monitor)."""


class HealthMonitor:
    """Watches the engines and the router of one run and replaces the dead ones (see the module doc).

    Args:
        client: the run's :class:`hpcrl.rollout.client.RolloutClient` (its rotation is kept to the serving
            engines; its ``on_failure`` hook is :meth:`report`).
        engines: the started engines, in index order.
        restart: how an engine starts again (:data:`RestartEngine`), or None where the launcher cannot
            restart one (then a dead engine is only taken out of rotation).
        snapshot: the current weights (:class:`hpcrl.weights.snapshot.WeightSnapshot`).
        interval_s, timeout_s: ``rollout.heartbeat_interval_s`` / ``heartbeat_timeout_s`` (seconds).
        max_restarts: ``rollout.max_engine_restarts`` (per engine).
        api_key: the run secret (probes of ``/health_generate`` carry it).
        router: the router process (:class:`hpcrl.rollout.router.RouterProcess`) or None.
        restart_router: ``restart_router(engine_urls, port) -> RouterProcess`` (blocking), or None.
        job_ending: ``job_ending() -> bool``, true once Slurm is ending the job
            (:meth:`hpcrl.preempt.PreemptionWatch.job_ending`): then no engine is restarted, and with none in
            rotation the client is told none will come (the run checkpoints and stops).
    """

    def __init__(self, client, engines: list, restart: Optional[RestartEngine], snapshot, interval_s: float,
                 timeout_s: float, max_restarts: int, api_key: Optional[str] = None, router=None,
                 restart_router: Optional[Callable[[list[str], Optional[int]], Any]] = None,
                 job_ending: Callable[[], bool] = lambda: False) -> None:
        self.client, self.restart_engine, self.snapshot = client, restart, snapshot
        self.job_ending = job_ending
        self.interval_s, self.timeout_s, self.max_restarts = float(interval_s), float(timeout_s), int(max_restarts)
        self.api_key, self.router, self.restart_router = api_key, router, restart_router
        self.slots = [EngineSlot(i, e) for i, e in enumerate(engines)]
        self.generating = False
        """True while the engines generate (probe ``/health_generate``); False while they are paused, updating
        weights or released (probe ``/health``). Set by the manager's verbs."""
        self.sync_lock = asyncio.Lock()
        """Held by a weight sync; a restarted engine joins the rotation only outside one."""
        self._generate_probes = 0
        """``/health_generate`` probes in flight (:meth:`quiesce` waits for them)."""
        self._no_generate_probe = asyncio.Event()
        """Set while no ``/health_generate`` probe is in flight."""
        self._no_generate_probe.set()
        self._tasks: list[asyncio.Task] = []
        self._session = None
        self._router_wake: Optional[asyncio.Event] = None
        self._none_since: Optional[float] = None
        self._m = {"engine_restarts": 0, "router_restarts": 0, "seconds_without_engine": 0.0,
                   "engine_recovery_seconds": 0.0}
        self._retried_seen = 0
        self._kept_seen = 0

    # ------------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the watchers (call on the rollout's event loop) and hook into the client."""
        import aiohttp

        from hpcrl.rollout.client import KEEPALIVE_S

        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else {},
            connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S))  # below SGLang's 5 s keep-alive
        self.client.on_failure = self.report
        for slot in self.slots:
            slot.wake = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._watch(slot), name=f"hpcrl-health-engine-{slot.index}"))
        if self.router is not None:
            self._router_wake = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._watch_router(), name="hpcrl-health-router"))

    async def stop(self) -> None:
        """Stop the watchers (a replacement under way is cancelled; its new engine, if up, is in the slot)."""
        self.client.on_failure = None
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def engines(self) -> list:
        """The current engine of every slot (for stopping them)."""
        return [s.engine for s in self.slots]

    # ------------------------------------------------------------------------------------------ reports
    def report(self, base_url: str, error: str) -> None:
        """The client's ``on_failure`` hook: an attempt on ``base_url`` failed with ``error``. An engine that
        could not be reached is taken out of rotation until its watcher has probed it; every failure wakes
        the watcher."""
        if self.router is not None and base_url == self.client.router_url:
            if self._router_wake is not None:
                self._router_wake.set()
            return
        for slot in self.slots:
            if slot.engine.url.rstrip("/") == base_url.rstrip("/") and slot.state == SERVING:
                if not error.startswith("HTTP "):  # no answer at all: connection refused/reset, timeout
                    slot.state = SUSPECT
                    self._publish()
                if slot.wake is not None:
                    slot.wake.set()

    async def settle(self) -> bool:
        """Probe every engine in rotation now (after a call to them failed); the dead ones go out of rotation
        and their watchers replace them. Returns whether any engine is out of rotation (dead, being replaced,
        or lost)."""
        for slot in self.slots:
            if slot.state in (SERVING, SUSPECT) and await self._check(slot) is not None:
                slot.state = SUSPECT
                self._publish()
                if slot.wake is not None:
                    slot.wake.set()
        return any(slot.state != SERVING for slot in self.slots)

    def served(self) -> None:
        """A rollout step finished on the engines in rotation: none of them is in a crash loop."""
        for slot in self.slots:
            if slot.state == SERVING:
                slot.crashes_in_a_row = 0

    def take_metrics(self) -> dict[str, float]:
        """The ``rollout/*`` fault metrics since the last call (see the module doc)."""
        now = time.monotonic()
        if self._none_since is not None:
            self._m["seconds_without_engine"] += now - self._none_since
            self._none_since = now
        out = {f"rollout/{k}": v for k, v in self._m.items()}
        out["rollout/retried_requests"] = self.client.retried_requests - self._retried_seen
        self._retried_seen = self.client.retried_requests
        out["rollout/kept_partial_tokens"] = self.client.kept_partial_tokens - self._kept_seen
        self._kept_seen = self.client.kept_partial_tokens
        self._m = dict.fromkeys(self._m, 0)
        self._m["seconds_without_engine"] = self._m["engine_recovery_seconds"] = 0.0
        return out

    def _publish(self) -> None:
        """The client's rotation := the serving engines; track time without any."""
        urls = [s.engine.url for s in self.slots if s.state == SERVING]
        self.client.set_engine_urls(urls)
        now = time.monotonic()
        if not urls and self._none_since is None:
            self._none_since = now
        elif urls and self._none_since is not None:
            self._m["seconds_without_engine"] += now - self._none_since
            self._none_since = None

    # ------------------------------------------------------------------------------------------ probes
    async def _probe(self, url: str) -> tuple[bool, str]:
        """``(ok, what)`` of one probe, bounded by the interval."""
        import aiohttp

        path = "/health_generate" if self.generating else "/health"
        if path == "/health_generate":
            self._generate_probes += 1
            self._no_generate_probe.clear()
        try:
            async with self._session.get(url + path,
                                         timeout=aiohttp.ClientTimeout(total=min(self.interval_s,
                                                                                 self.timeout_s))) as resp:
                await resp.read()
                return resp.status == 200, f"{path} answered {resp.status}"
        except asyncio.TimeoutError:
            return False, f"{path} timed out"
        except aiohttp.ClientConnectorError as e:
            return False, f"refused: {e}"
        except aiohttp.ClientError as e:
            return False, f"{type(e).__name__}: {e}"
        finally:
            if path == "/health_generate":
                self._generate_probes -= 1
                if not self._generate_probes:
                    self._no_generate_probe.set()

    async def quiesce(self) -> None:
        """Wait (at most one probe's bound) until no ``/health_generate`` probe is in flight: called when the
        engines stop generating, before the manager releases their memory or pauses them. Why: SGLang's probe
        is a one-token generation; in the quickstart on SGLang on a CPU (issue #53) one still in flight at the
        end of a rollout was answered between ``/release_memory_occupation`` and ``/resume_memory_occupation``,
        and the sync's ``/flush_cache`` after the next ``/pause_generation`` was never answered. This alone did
        not end those hangs (SGLang's ``/health`` generated too, until
        :func:`hpcrl.rollout.engines.engine_env` turned that off): it keeps the generating probe out of them."""
        if self._generate_probes:
            try:
                await asyncio.wait_for(self._no_generate_probe.wait(), min(self.interval_s, self.timeout_s))
            except asyncio.TimeoutError:
                pass

    async def _sleep(self, event: Optional[asyncio.Event], seconds: float) -> None:
        if event is None:
            await asyncio.sleep(seconds)
            return
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        event.clear()

    def _lost_if_ending(self) -> None:
        """Slurm is ending the job and no engine serves: requests stop waiting for a replacement."""
        if (self.job_ending() and self.client._lost is None
                and not any(s.state in (SERVING, SUSPECT) for s in self.slots)):
            self.client.set_lost("the job is ending (SIGTERM) and no engine is serving")

    async def _watch(self, slot: EngineSlot) -> None:
        while True:
            self._lost_if_ending()
            if slot.state in (SERVING, SUSPECT):
                reason = await self._check(slot)
                if reason is not None:
                    await self.replace(slot, reason)
            await self._sleep(slot.wake, self.interval_s)

    async def _check(self, slot: EngineSlot) -> Optional[str]:
        """Why the slot's engine is dead, or None (a good probe puts a suspect one back in rotation)."""
        alive = getattr(slot.engine, "alive", None)
        if alive is not None and not alive():
            return f"its process exited (status {slot.engine.process.returncode})"
        ok, what = await self._probe(slot.engine.url)
        now = time.monotonic()
        if ok:
            slot.last_ok = now
            if now - slot.started > self.timeout_s:
                slot.crashes_in_a_row = 0
            if slot.state == SUSPECT:
                slot.state = SERVING
                self._publish()
            return None
        if what.startswith("refused"):
            return f"it refuses connections ({what[9:]})"
        if now - slot.last_ok >= self.timeout_s:
            return f"no healthy answer for {now - slot.last_ok:.1f} s ({what}): hung"
        return None

    # ------------------------------------------------------------------------------------------ replace
    async def replace(self, slot: EngineSlot, reason: str) -> None:
        """Take ``slot``'s engine out, stop it, start a new one from the current weights (backoff, budget)
        and put it in rotation; or mark the slot lost (and the client, when no engine is left)."""
        t_dead = time.monotonic()
        old = slot.engine
        if time.monotonic() - slot.started < self.timeout_s:
            slot.crashes_in_a_row += 1
        log.warning("engine %d at %s is dead: %s; replacing it", slot.index, old.url, reason)
        slot.state = RESTARTING
        self._publish()
        if self.router is not None:
            await self._router_call("remove_worker", old.url)
        await asyncio.to_thread(old.stop, 0.0 if reason.endswith("hung") else 2.0)  # a hung one ignores SIGTERM
        while True:
            if self.restart_engine is None or slot.restarts >= self.max_restarts or self.job_ending():
                slot.state = LOST
                why = ("the job is ending (SIGTERM)" if self.job_ending()
                       else f"rollout.max_engine_restarts={self.max_restarts} used up"
                       if slot.restarts >= self.max_restarts else "the launcher cannot restart engines")
                log.error("engine %d is not restarted: %s", slot.index, why)
                if not any(s.state in (SERVING, SUSPECT, RESTARTING) for s in self.slots):
                    self.client.set_lost(f"engine {slot.index} died ({reason}) and {why}")
                return
            if slot.crashes_in_a_row > 1:
                await asyncio.sleep(min(2.0 ** (slot.crashes_in_a_row - 2), MAX_BACKOFF_S))
            slot.restarts += 1
            self._m["engine_restarts"] += 1
            try:
                engine = await self._start_current(slot)
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a failed start counts against the budget; reported
                slot.crashes_in_a_row += 1
                log.error("engine %d did not restart (attempt %d): %s", slot.index, slot.restarts, e)
        slot.engine, slot.started, slot.last_ok = engine, time.monotonic(), time.monotonic()
        slot.state = SERVING
        self._publish()
        took = time.monotonic() - t_dead
        self._m["engine_recovery_seconds"] = max(self._m["engine_recovery_seconds"], took)
        log.warning("engine %d serves again at %s (%.1f s after it was found dead)", slot.index, engine.url, took)

    async def _start_current(self, slot: EngineSlot):
        """A new engine for ``slot`` serving the current weight version, registered with the router; a
        weight sync that ran while it started is repeated on it (from the snapshot) before it joins."""
        path, version = await asyncio.to_thread(self.snapshot.folder)
        engine = await asyncio.to_thread(self.restart_engine, slot.index, path, version, slot.restarts)
        try:
            async with self.sync_lock:
                if self.snapshot.adapter_config is not None or self.snapshot.version != version:
                    await self.snapshot.load_on(self.client, engine.url)  # (adapters: always, on the base)
                if self.router is not None:
                    await self._router_call("add_worker", engine.url)
        except BaseException:
            await asyncio.to_thread(engine.stop, 2.0)
            raise
        return engine

    async def _router_call(self, name: str, url: str) -> None:
        from hpcrl.rollout.router import RouterError

        try:
            await asyncio.to_thread(getattr(self.router, name), url)
        except RouterError as e:  # the router's own watcher deals with a dead router
            log.warning("router %s %s: %s", name, url, e)

    # ------------------------------------------------------------------------------------------ router
    async def _watch_router(self) -> None:
        last_ok = time.monotonic()
        while True:
            await self._sleep(self._router_wake, self.interval_s)
            router = self.router
            if router.alive():
                status = await asyncio.to_thread(_http_status, router.url + "/health",
                                                 min(self.interval_s, self.timeout_s))
                if status == 200:
                    last_ok = time.monotonic()
                    continue
                if status is not None and time.monotonic() - last_ok < self.timeout_s:
                    continue
            if self.job_ending():  # (Slurm SIGTERMs every process of the step, the router too)
                log.error("the router at %s is dead and the job is ending (SIGTERM): not restarted", router.url)
                self.client.set_lost("the job is ending (SIGTERM) and the router died")
                return
            await self._restart_router(router)
            last_ok = time.monotonic()

    async def _restart_router(self, router) -> None:
        from urllib.parse import urlsplit

        log.warning("the router at %s is dead; restarting it", router.url)
        self.client.set_router(None)
        await asyncio.to_thread(router.stop, 2.0)
        urls = [s.engine.url for s in self.slots if s.state == SERVING]
        port = urlsplit(router.url).port
        try:
            new = await asyncio.to_thread(self.restart_router, urls, port)
        except Exception:  # noqa: BLE001 - the port may still be held: any free one
            new = await asyncio.to_thread(self.restart_router, urls, None)
        self.router = new
        self._m["router_restarts"] += 1
        self.client.set_router(new.url)
        log.warning("the router serves again at %s", new.url)


def _http_status(url: str, timeout_s: float) -> Optional[int]:
    from hpcrl.procs import http_status

    return http_status(url, timeout_s=timeout_s)
