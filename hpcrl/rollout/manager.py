"""The rollout side of a run as the loop sees it (slime's ``RolloutManager``): engines, router, client, the asyncio
event loop and the colocated memory phases, behind short verbs.

:class:`RolloutManager` runs on the controller (trainer rank 0). Every other trainer rank gets a
:class:`NullRolloutManager`, whose verbs do nothing (``generate`` returns no samples: the loop broadcasts the
controller's), so the loop never branches on the rank. How the engines start is passed in as an
:data:`EngineLauncher`: :func:`hpcrl.rollout.engines.launch_local_engines` (local processes, ``hpcrl run``) or
:func:`hpcrl.slurm.rollout_step.launch_engine_step` (a Slurm job step, inside a job).

Colocated phase order per step (no-op adapters on CPU; see :mod:`hpcrl.offload`)::

    generate -> offload (engine memory off) -> onload_trainer -> train
    -> onload_weights (trainer off, engine weights on) -> update_weights -> onload_kv -> evaluate
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from hpcrl.procs import ManagedProcess
from hpcrl.rollout.engines import engine_sglang_args
from hpcrl.run_setup import new_attempt_dir

EngineLauncher = Callable[[Any, Path, Path, Path, Path], Any]
"""``launch(cfg, run_dir, attempt_dir, model_path, secret_path) -> pending``: starts the run's engines and
returns at once, so they load while the trainer builds its model. ``pending.wait() -> (engines, step)`` waits
until they are healthy (raising with their log tail when one died); ``pending.stop()`` stops them. ``engines``
have ``.url`` and ``.stop()``; ``step`` is None, or the job step hosting them with ``.check()`` (raises with its
log tail when it died) and ``.stop()``."""


class RolloutManager:
    """The controller's rollout side. ``launch()`` starts the engines without waiting (they load while the
    trainer builds its model); ``start(datasets)`` waits for them, starts the router, connects the client and
    builds the rollout context; the verbs then run one phase each; ``stop()`` ends only what this run started.

    Args:
        cfg: the resolved run config.
        run_dir: the run folder (its ``secret`` is created here).
        attempt_dir: this attempt's log folder (engine, router and phase logs).
        model_path: the HF folder the engines load.
        launcher: how the engines start (:data:`EngineLauncher`).
    """

    def __init__(self, cfg, run_dir: Path, attempt_dir: Path, model_path: Path, launcher: EngineLauncher) -> None:
        self.cfg, self.run_dir, self.attempt_dir, self.model_path = cfg, run_dir, attempt_dir, model_path
        self.launcher = launcher
        self.pending = None  # what the launcher returned, until start() has waited for it
        self.secret_path: Path | None = None
        self.datasets = None
        # the rollout's event loop runs in its own thread, so a rollout can run while the trainer trains
        # (async mode: generate_async); the verbs wait for their coroutine there
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hpcrl-rollout-loop", daemon=True)
        self._thread.start()
        self.step = None  # the job step hosting the engines, when the launcher made one
        self.engines: list = []
        self.router = None
        self.client = None
        self.memory = None
        self.engine_tp_sizes: list[int] = []
        self.monitor = None  # hpcrl.rollout.health.HealthMonitor, once started
        self.snapshot = None  # hpcrl.weights.snapshot.WeightSnapshot, when engines may restart
        self.job_ending: Callable[[], bool] = lambda: False  # Slurm is ending the job: restart nothing
        self.teachers: list = []  # hpcrl.rollout.teacher.Teacher, with algorithm.opd.teachers
        self.gateway = None  # hpcrl.agent.gateway.AgentGateway, with rollout.agent
        self.eval_sets: list = []  # hpcrl.rollout.evaluate.EvalSet, from start()
        self.eval_rewards: dict = {}  # eval set name -> its reward function, from start()

    # ------------------------------------------------------------------------------------------------------
    def call(self, coro):
        """Run a coroutine on the rollout's event loop, wait and return its result (:meth:`result`)."""
        return self.result(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def result(self, future: concurrent.futures.Future):
        """Wait for a coroutine started on the rollout's event loop and return its result. When the engines
        run as a job step and it failed with the step gone (or going: ``srun`` gets up to 10 s to notice),
        raises the step's error (its log tail) instead."""
        try:
            return future.result()
        except Exception:
            if self.step is not None and self.snapshot is None:  # engines are not restarted: say why they died
                self.step.check(grace_s=10.0)
            raise
        except BaseException:  # KeyboardInterrupt while waiting: the coroutine must not go on alone
            future.cancel()
            raise

    def launch(self, early: bool = False) -> None:
        """Start the engines (the run secret first) and, with ``rollout.router``, the router beside them (no
        workers yet: :meth:`start` registers the engines), and return while they load. Idempotent. Raises
        what the launcher raises.

        ``early=True`` is the call before the trainer builds its model: it does nothing when engines and
        trainer share GPUs (``run.placement: colocate`` with SGLang), so that, as before, SGLang sizes its
        memory pool with the trainer's model already resident; :meth:`start` launches them then.
        """
        from hpcrl.rollout.engines import resolve_engine
        from hpcrl.rollout.secret import create_run_secret

        if early and self.cfg.run.placement == "colocate" and resolve_engine(self.cfg.rollout.engine) != "cpu":
            return
        if self.pending is None and not self.engines:
            self.secret_path = create_run_secret(self.run_dir)
            self.pending = self.launcher(self.cfg, self.run_dir, self.attempt_dir, self.model_path, self.secret_path)
            if self.cfg.rollout.router and self.router is None:  # it starts beside them; start() adds them
                from hpcrl.rollout.router import spawn_router
                from hpcrl.rollout.secret import read_secret

                self.router = spawn_router([], api_key=read_secret(self.secret_path),
                                           log_path=self.attempt_dir / "router.log", cpus=self._router_cpus())
            if self.cfg.algorithm.opd.teachers and not self.teachers:
                from hpcrl.rollout.teacher import start_teacher

                self.teachers = [start_teacher(self.cfg, t, i, self.run_dir, self.attempt_dir, self.secret_path,
                                               self.launcher)
                                 for i, t in enumerate(self.cfg.algorithm.opd.teachers)]

    def _router_cpus(self):
        """The router's CPUs: the rollout's (``rollout.cpus``) in a disaggregated run, else None (inherit)."""
        from hpcrl.placement import parse_cpu_list

        rc = self.cfg.rollout
        disaggregated = self.cfg.run.placement == "disaggregate"
        return parse_cpu_list(rc.cpus) if disaggregated and rc.cpus is not None else None

    def start(self, datasets) -> None:
        """Wait for the engines (launching them first unless :meth:`launch` did) and for the router that
        :meth:`launch` spawned beside them, register the engines with it, connect the client, build the
        rollout context. ``datasets``: :class:`hpcrl.data.sources.Datasets` (eval items
        and the task that scores them). Raises what the launcher raises (:class:`hpcrl.procs.ProcessStartError`,
        a job step's error)."""
        from transformers import AutoTokenizer

        from hpcrl.offload import ColocatedMemory, create_trainer_memory
        from hpcrl.rollout.client import RolloutClient
        from hpcrl.rollout.plugins import resolve_plugins
        from hpcrl.rollout.rollout import RolloutContext
        from hpcrl.rollout.secret import read_secret

        cfg, rc = self.cfg, self.cfg.rollout
        self.datasets = datasets
        self.launch()
        key = read_secret(self.secret_path)
        pending, self.pending = self.pending, None
        self.engines, self.step = pending.wait()  # on failure it has stopped what it started
        self.engine_tp_sizes = [int(engine_sglang_args(cfg).get("tp_size", 1))] * len(self.engines)
        urls = [e.url for e in self.engines]
        if self.router is not None:  # spawned by launch() while the engines loaded
            self.router.wait_ready(urls, register=True)
        self.client = RolloutClient(self.router.url if self.router else None, urls, api_key=key,
                                    timeout_s=rc.request_timeout_s, max_retries=rc.max_retries,
                                    keep_partial=rc.partial_rollout,
                                    generate_fields={"return_routed_experts": True}
                                    if cfg.algorithm.routing_replay else None)
        self.call(self.client.open())
        self.call(self.client.wait_healthy(timeout_s=600))
        self.call(self._start_monitor(pending, key))
        if self.teachers:
            from hpcrl.rollout.teacher import connect_teacher

            for teacher in self.teachers:
                self.call(connect_teacher(teacher, cfg, key))
        self.memory = ColocatedMemory(create_trainer_memory(cfg.run.placement == "colocate"), self.client,
                                      colocate=cfg.run.placement == "colocate")
        tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        plugins = resolve_plugins(cfg, self.datasets.task)
        self.rollout_fn = plugins.rollout_fn
        generate_fn = plugins.generate_fn
        if rc.agent.enabled:  # agentic rollouts: the gateway in this process, in front of the router
            self.gateway, generate_fn = self.call(self._start_gateway(tokenizer))
        self.ctx = RolloutContext(client=self.client, tokenizer=tokenizer, reward_fn=plugins.reward_fn,
                                  generate_fn=generate_fn, dynamic_filter=plugins.dynamic_filter,
                                  seed=cfg.run.seed)
        from hpcrl.rewards import get_reward_function
        from hpcrl.rollout.evaluate import eval_sets

        self.eval_sets = eval_sets(cfg, self.datasets)
        # a set of another task scores with its own (the task reward); the others share the rollout's function
        self.eval_rewards = {es.name: (plugins.reward_fn if es.task is self.datasets.task
                                       else get_reward_function(cfg, es.task)) for es in self.eval_sets}

    async def _start_gateway(self, tokenizer):
        """The agent gateway (:mod:`hpcrl.agent.gateway`) and the agent generate function."""
        from transformers import AutoConfig

        from hpcrl.agent.gateway import AgentGateway
        from hpcrl.agent.runner import agent_generate
        from hpcrl.models.hf import context_length
        from hpcrl.plugins import load_function
        from hpcrl.rollout.rollout import sampling_params

        a = self.cfg.rollout.agent
        client = self.client

        async def generate(ids: list[int], sp: dict) -> dict:
            return await client.generate(ids, sp, return_logprob=True)

        context = context_length(AutoConfig.from_pretrained(str(self.model_path)))
        template = Path(a.chat_template).read_text() if a.chat_template else None
        command = list(a.command)
        host, public = "127.0.0.1", None
        if self.cfg.rollout.agent_step:  # episodes on other nodes: listen on all interfaces
            import socket

            from hpcrl.agent.runner import agent_step_prefix

            het = 1 if self.cfg.run.placement == "disaggregate" and self.cfg.slurm.rollout is not None else None
            command = agent_step_prefix(f"{self.cfg.run.name}-agent", het) + command
            host, public = "0.0.0.0", socket.gethostbyname(socket.gethostname())
        gateway = AgentGateway(generate, tokenizer, sampling_params(self.cfg.rollout), context,
                               chat_template=template, tool_parser=a.tool_parser, host=host,
                               public_host=public)
        await gateway.start()
        logging.getLogger("hpcrl.agent").info("agent gateway at %s", gateway.url)
        for name in ("httpx", "httpx2"):  # in-process OpenAI clients log every request at INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        function = load_function(a.function) if a.function else None
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        return gateway, agent_generate(gateway, function, command if a.command else [], a.timeout_s,
                                       a.failure_reward, eos)

    async def _start_monitor(self, launched, key: str) -> None:
        """The health monitor (:mod:`hpcrl.rollout.health`): engines that die or hang are restarted by the
        launcher (``launched.restart``, where it has one) from the weight snapshot; so is the router."""
        from hpcrl.rollout.health import HealthMonitor
        from hpcrl.rollout.router import start_router
        from hpcrl.weights.snapshot import WeightSnapshot

        rc = self.cfg.rollout
        restart = getattr(launched, "restart", None)
        if restart is not None and rc.max_engine_restarts > 0:
            self.snapshot = WeightSnapshot(self.run_dir / "weights-rejoin", self.model_path,
                                           self.cfg.weights.bucket_bytes)
        router_cpus = self._router_cpus()

        def restart_router(urls: list[str], port):
            return start_router(urls, port=port, api_key=key, cpus=router_cpus,
                                log_path=self.attempt_dir / "router.log")  # appended

        self.monitor = HealthMonitor(self.client, list(self.engines), restart,
                                     self.snapshot, rc.heartbeat_interval_s, rc.heartbeat_timeout_s,
                                     rc.max_engine_restarts, api_key=key, router=self.router,
                                     restart_router=restart_router, job_ending=self.job_ending)
        await self.monitor.start()

    def _generating(self, on: bool) -> None:
        if self.monitor is not None:
            self.monitor.generating = on

    # ------------------------------------------------------------------------------------------------------
    def generate(self, rollout_id: int, data_source, multiple: int = 1) -> tuple[list, dict[str, float]]:
        """One rollout step on the engines. Returns ``(flat samples, rollout/* metrics)``.

        Trains the largest count of the kept groups that is a multiple of ``multiple`` (whole groups that split
        over data-parallel ranks x optimizer steps; all of them with ``batch_size`` groups) and pushes the other
        kept groups back to ``data_source`` for the next step (``rollout/groups_held``); ``rollout/groups_short``
        is ``batch_size`` minus the trained groups. Raises RuntimeError when no whole multiple was kept, and
        what the rollout function raises (:class:`hpcrl.rollout.client.RolloutError`, a starving filter).
        """
        return self.call(self._generate(rollout_id, data_source, multiple))

    def generate_async(self, rollout_id: int, data_source, multiple: int = 1) -> concurrent.futures.Future:
        """Start :meth:`generate` on the rollout's event loop and return at once (async mode: the engines
        generate rollout k+1 while the trainer trains on rollout k). ``result(future)`` waits for
        ``(samples, metrics)``. ``data_source`` must not be used by the caller until then."""
        return asyncio.run_coroutine_threadsafe(self._generate(rollout_id, data_source, multiple), self.loop)

    async def _generate(self, rollout_id: int, data_source, multiple: int) -> tuple[list, dict[str, float]]:
        from hpcrl.rollout.rollout import split_trainable

        self.memory.mark("generate")
        self._generating(True)
        try:
            out = await self.rollout_fn(self.cfg, rollout_id, data_source, self.ctx)
        finally:
            self._generating(False)
        if self.monitor is not None:
            self.monitor.served()
            out.metrics.update(self.monitor.take_metrics())
        groups, hold = split_trainable(out.groups, multiple)
        if not groups:
            raise RuntimeError(f"rollout {rollout_id}: {len(out.groups)} groups kept, fewer than the {multiple} "
                               "that split over data-parallel ranks x train.num_steps_per_rollout; loosen "
                               "rollout.dynamic_filter or use fewer trainer ranks or steps per rollout")
        if hold:
            data_source.add_samples(hold)
        samples = [s for g in groups for s in g]
        if self.teachers:  # on-policy distillation: the teachers score the trained samples' tokens
            from hpcrl.rollout.teacher import opd_metrics, score_samples

            out.metrics["rollout/opd_teacher_seconds"] = await score_samples(self.teachers, samples,
                                                                             self.cfg.rollout.temperature)
            out.metrics.update(opd_metrics(samples))
        return samples, rollout_metrics(self.cfg, samples, out.metrics, len(groups), len(hold))

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Every eval set through the rollout's path (:mod:`hpcrl.rollout.evaluate`: the same prompt
        rendering, generate function or agent, stop rules and reward function, with the eval sampling
        settings): ``eval/accuracy``, ``eval/pass@k``, ... of the default set, ``eval/<name>/...`` of the
        named ones, and ``eval/seconds``. Empty when there is no eval item, or when every engine was lost."""
        return self.call(self._evaluate(rollout_id))

    async def _evaluate(self, rollout_id: int) -> dict[str, float]:
        from hpcrl.rollout.client import EnginesLost
        from hpcrl.rollout.evaluate import evaluate

        if not self.eval_sets:
            return {}
        self._generating(True)
        try:
            return await evaluate(self.cfg, self.ctx, self.eval_sets, rollout_id,
                                  lambda es: self.eval_rewards[es.name])
        except EnginesLost as e:  # the step stays whole and is checkpointed; the next rollout stops the run
            logging.getLogger("hpcrl.health").error("eval skipped: %s", e)
            return {}
        finally:
            self._generating(False)

    # ---------------------------------------------------------------------------------- colocated memory
    def offload(self) -> None:
        """Engines release their memory (weights and KV cache) for the trainer (slime ``offload``)."""
        self.call(self.memory.offload_engine())

    def onload_trainer(self) -> None:
        """The trainer's memory back on the device before it trains."""
        self.memory.onload_trainer()
        self.memory.mark("train")

    def onload_weights(self) -> None:
        """Trainer memory off, the engines' weight memory back, ready for the weight sync (slime
        ``onload_weights``)."""
        self.memory.offload_trainer()
        self.call(self.memory.onload_engine_weights())
        self.memory.mark("sync")

    @property
    def trainer_paused_during_sync(self) -> bool:
        """Whether :meth:`onload_weights` unmaps this rank's trainer memory (colocated on GPUs), so the weights
        to sync must be read before it."""
        return self.memory.colocate and self.memory.trainer.pauses_device_memory

    def trainer_onloaded(self) -> contextlib.AbstractContextManager:
        """A context with this rank's trainer memory on the device (for a checkpoint save while colocated
        engines hold the GPUs: onload, save, offload again); nothing to do before :meth:`start`."""
        memory = getattr(self, "memory", None)
        return memory.trainer.onloaded() if memory is not None and memory.colocate else contextlib.nullcontext()

    def update_weights(self, syncer, named, version: int) -> dict[str, Any]:
        """Send the trainer's weights ``named`` (an iterator of ``(name, tensor)``) to the engines as weight
        version ``version``; returns the syncer's metrics (seconds, bytes, GB/s). Raises
        :class:`hpcrl.weights.WeightSyncError`."""
        return self.call(self._update_weights(syncer, named, version))

    async def _update_weights(self, syncer, named, version: int) -> dict[str, Any]:
        if self.snapshot is not None:  # a restarted engine loads this version (hpcrl.weights.snapshot)
            named = self.snapshot.tee(named, version)
        if self.monitor is None:
            return await syncer.sync(named, str(version))
        from hpcrl.rollout.client import RolloutError
        from hpcrl.weights import WeightSyncError

        async with self.monitor.sync_lock:  # no engine joins halfway through
            t0 = time.perf_counter()
            if not self.client.engine_urls:  # all being replaced (they load the snapshot), or lost
                for _ in named:  # (the next rollout raises EnginesLost, after this step is checkpointed)
                    pass
                return {"method": "snapshot", "weight_version": str(version), "seconds": time.perf_counter() - t0}
            try:
                return await syncer.sync(named, str(version))
            except (WeightSyncError, RolloutError):
                # an engine that died mid-sync is replaced by the monitor; the others get this version from
                # the snapshot, which the failed sync still completed (it drains its stream)
                if self.snapshot is None or self.snapshot.version != str(version) or not await self.monitor.settle():
                    raise
                return await self._resync_from_snapshot(t0)

    async def _resync_from_snapshot(self, t0: float) -> dict[str, Any]:
        """Load the snapshot's version on every engine in rotation (``/update_weights_from_disk``) and let
        them generate again: the end of a weight sync an engine died in. Raises RolloutError."""
        path, version = await asyncio.to_thread(self.snapshot.folder)
        timeout = self.cfg.weights.timeout_s
        for url in self.client.engine_urls:
            await self.client.request("POST", "/update_weights_from_disk",
                                      {"model_path": str(path), "weight_version": version}, base_url=url,
                                      retry=False, timeout_s=timeout)
            await self.client.request("POST", "/continue_generation", {}, base_url=url, timeout_s=timeout)
        return {"method": "snapshot", "weight_version": version, "seconds": time.perf_counter() - t0,
                "recovered": 1}

    def onload_kv(self) -> None:
        """The engines' KV cache back after the weights (slime ``onload_kv``)."""
        self.call(self.memory.onload_engine_kv())

    # ------------------------------------------------------------------------------------------------------
    def write_phases(self) -> None:
        """Write the colocated phase order of this attempt to ``phases.jsonl``: one ``{"phase", "t"
        (monotonic seconds), "wall" (Unix seconds)}`` per line."""
        with open(self.attempt_dir / "phases.jsonl", "w") as f:
            offset = time.time() - time.monotonic()  # wall clock, for timings across processes
            for phase, t in self.memory.events:
                f.write(json.dumps({"phase": phase, "t": t, "wall": t + offset}) + "\n")

    def stop(self) -> None:
        """Close the client, stop router, engines and the job step (only what this run started)."""
        try:
            if self.memory is not None:
                self.write_phases()
            if self.monitor is not None:
                self.call(self.monitor.stop())
            if self.gateway is not None:
                self.call(self.gateway.stop())
            if self.client is not None:
                self.call(self.client.close())
            if self.teachers:
                from hpcrl.rollout.teacher import stop_teacher

                for teacher in self.teachers:
                    self.call(stop_teacher(teacher))
        finally:
            for teacher in self.teachers:  # stopped above unless that failed; stopping again is harmless
                teacher.launch.stop()
            if self.monitor is not None:
                self.router = self.monitor.router  # restarted ones included
                self.engines = list(self.engines) + [e for e in self.monitor.engines() if e not in self.engines]
            for server in [self.router, *self.engines]:  # local servers: SIGTERM all first, they shut down
                if isinstance(server, ManagedProcess):  # side by side (a job step's engines stop with it)
                    server.terminate()
            if self.router is not None:
                self.router.stop()
            if self.pending is not None:  # launched, never waited for (the trainer failed to start)
                self.pending.stop()
            for e in self.engines:
                e.stop()
            if self.step is not None:
                self.step.stop()
            self._stop_loop()

    def _stop_loop(self) -> None:
        """Cancel what still runs on the event loop (a rollout the trainer no longer waits for), stop and
        close it."""
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=30)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()


class NullRolloutManager:
    """The rollout manager of a trainer rank that is not the controller: every verb does nothing
    (``generate`` returns no samples and no metrics, ``evaluate`` no metrics), except ``update_weights``,
    which takes part in the weight sync without sending (every rank iterates the weights: tensor-parallel
    all-gathers), and the trainer's own memory phases: colocated, this rank offloads and onloads its trainer
    memory where the controller does (``trainer``: :func:`hpcrl.offload.create_trainer_memory`)."""

    client = None
    engine_tp_sizes = None

    def __init__(self, trainer=None) -> None:
        from hpcrl.offload import TrainerMemory

        self.trainer = trainer or TrainerMemory()

    @property
    def trainer_paused_during_sync(self) -> bool:
        return self.trainer.pauses_device_memory

    def trainer_onloaded(self) -> contextlib.AbstractContextManager:
        return self.trainer.onloaded()

    def launch(self, early: bool = False) -> None:
        pass

    def start(self, datasets) -> None:
        pass

    def generate(self, rollout_id: int, data_source, multiple: int = 1) -> tuple[None, dict[str, float]]:
        return None, {}

    def generate_async(self, rollout_id: int, data_source, multiple: int = 1) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result((None, {}))
        return future

    def result(self, future: concurrent.futures.Future):
        return future.result()

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        return {}

    def offload(self) -> None:
        pass

    def onload_trainer(self) -> None:
        self.trainer.onload()

    def onload_weights(self) -> None:
        self.trainer.offload()

    def update_weights(self, syncer, named, version: int) -> dict[str, Any]:
        return asyncio.run(syncer.sync(named, str(version)))

    def onload_kv(self) -> None:
        pass

    def stop(self) -> None:
        pass


def rollout_manager(controller: bool, cfg, run_dir: Path, model_path: Path, launcher: EngineLauncher,
                    job_ending: Callable[[], bool] = lambda: False) -> "RolloutManager | NullRolloutManager":
    """The rollout manager of a trainer rank: a :class:`RolloutManager` (with a new ``logs/attempt-N`` folder)
    on the controller, a :class:`NullRolloutManager` on every other rank. ``job_ending()``: whether Slurm is
    ending the job (:meth:`hpcrl.preempt.PreemptionWatch.job_ending`; no engine is restarted then)."""
    if not controller:
        from hpcrl.offload import create_trainer_memory

        return NullRolloutManager(create_trainer_memory(cfg.run.placement == "colocate"))
    manager = RolloutManager(cfg, run_dir, new_attempt_dir(run_dir), model_path, launcher)
    manager.job_ending = job_ending
    return manager


def rollout_metrics(cfg, samples: list, metrics: dict[str, float], trained_groups: int,
                    held_groups: int) -> dict[str, Any]:
    """The ``rollout/*`` metrics of one step's trained samples, added to the rollout function's own:
    reward mean and std (:meth:`hpcrl.data.sample.Sample.scalar_reward`), accuracy (share of rewards >= 1),
    mean response length (tokens), truncated share, tokens per second, weight version, groups held and short,
    and the policy lag of the samples (``rollout/lag_mean``, ``rollout/lag_max``: :func:`sample_lag`)."""
    rewards = [s.scalar_reward() for s in samples]
    n = max(len(samples), 1)
    lengths = [s.response_length for s in samples]
    secs = metrics.get("rollout/seconds", 0.0)
    m = dict(metrics)
    m["rollout/groups_held"] = m.get("rollout/groups_held", 0) + held_groups
    m["rollout/groups_short"] = cfg.rollout.batch_size - trained_groups
    m.update({
        "rollout/reward_mean": sum(rewards) / n,
        "rollout/reward_std": (sum((r - sum(rewards) / n) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/accuracy": sum(r >= 1.0 for r in rewards) / n,
        "rollout/response_length": sum(lengths) / n,
        "rollout/truncated": sum(s.status.value == "truncated" for s in samples) / n,
        "rollout/tokens_per_s": sum(lengths) / secs if secs > 0 else 0.0,
        "rollout/weight_version": samples[0].weight_version if samples else None,
    })
    if cfg.rollout.agent.enabled:
        m.update({
            "rollout/agent_failed": sum("agent_failure" in s.metadata for s in samples) / n,
            "rollout/agent_calls": sum(s.metadata.get("agent_calls", 0) for s in samples) / n,
            "rollout/agent_tool_call_rate": sum(s.metadata.get("agent_tool_calls", 0) > 0 for s in samples) / n,
            "rollout/agent_split_episodes": sum(s.metadata.get("agent_chains", 1) > 1 for s in samples) / n,
        })
    lags = [lag for lag in (sample_lag(s) for s in samples) if lag is not None]
    if lags:
        m["rollout/lag_mean"], m["rollout/lag_max"] = sum(lags) / len(lags), max(lags)
    return m


def sample_lag(sample) -> "int | None":
    """How many optimizer-step versions the policy that generated ``sample`` is behind the one it is trained
    for: its rollout id minus the oldest weight version its tokens came from (0 in sync mode, 1 one step off,
    more for a partial rollout continued across steps); None when the engine's versions are not integers."""
    try:
        return sample.rollout_id - min(int(v) for v in sample.weight_versions)
    except ValueError:  # no versions, or not integers (an engine's own version names)
        return None
