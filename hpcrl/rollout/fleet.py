"""The rollout fleet: the servers a run's rollout talks to (engines, router, OPD teachers, the agent gateway),
the health monitor that restarts engines, and the event loop the client and the monitor run on.

:class:`RolloutFleet` starts them (:meth:`~RolloutFleet.launch` without waiting,
:meth:`~RolloutFleet.start` waiting), exposes :attr:`~RolloutFleet.client`, the engine URLs and their
tensor-parallel sizes, and stops only what it started. How the engines start is passed in as an
:data:`EngineLauncher`: :func:`hpcrl.rollout.engines.launch_local_engines` (local processes, ``hpcrl run``)
or :func:`hpcrl.slurm.rollout_step.launch_engine_step` (a Slurm job step, inside a job). What runs on the
fleet (generate, evaluate, the memory phases, the weight sync) is
:class:`hpcrl.rollout.manager.RolloutManager`'s.
"""

from __future__ import annotations

import concurrent.futures
import logging
from pathlib import Path
from typing import Any, Callable

from hpcrl.procs import ManagedProcess
from hpcrl.rollout.engines import engine_sglang_args
from hpcrl.rollout.event_loop import EventLoopThread

EngineLauncher = Callable[[Any, Path, Path, Path, Path], Any]
"""``launch(cfg, run_dir, attempt_dir, model_path, secret_path) -> pending``: starts the run's engines and
returns at once, so they load while the trainer builds its model. ``pending.wait() -> (engines, step)``
waits until they are healthy (raising with their log tail when one died); ``pending.stop()`` stops them.
``engines`` have ``.url`` and ``.stop()``; ``step`` is None, or the job step hosting them with ``.check()``
(raises with its log tail when it died) and ``.stop()``."""


def run_span_lag(cfg) -> int:
    """The client's ``span_lag`` for the run's engines (:func:`hpcrl.rollout.token_versions.span_lag`): by
    whether they are SGLang, its flags and the run's resolved ``weights.pause_mode``."""
    from hpcrl.rollout.engines import sglang_engines
    from hpcrl.rollout.token_versions import span_lag
    from hpcrl.weights.sync import resolve_pause_mode

    return span_lag(sglang_engines(cfg), engine_sglang_args(cfg),
                    resolve_pause_mode(cfg.weights.pause_mode, cfg.run.mode))


class RolloutFleet:
    """The controller's rollout servers and the event loop their client runs on (its thread starts here).

    Args:
        cfg: the resolved run config.
        run_dir: the run folder (its ``secret`` is created here; ``weights-rejoin`` holds the weight snapshot
            restarted engines load).
        attempt_dir: this attempt's log folder (engine, router and teacher logs).
        model_path: the HF folder the engines load.
        launcher: how the engines start (:data:`EngineLauncher`).
        job_ending: whether Slurm is ending the job (:meth:`hpcrl.preempt.PreemptionWatch.job_ending`): then
            the health monitor restarts nothing.
    """

    def __init__(self, cfg, run_dir: Path, attempt_dir: Path, model_path: Path, launcher: EngineLauncher,
                 job_ending: Callable[[], bool] = lambda: False) -> None:
        self.cfg, self.run_dir, self.attempt_dir, self.model_path = cfg, run_dir, attempt_dir, model_path
        self.launcher = launcher
        self.job_ending = job_ending
        self.pending = None  # what the launcher returned, until start() has waited for it
        self.secret_path: Path | None = None
        # the rollout's event loop runs in its own thread, so a rollout can run while the trainer trains
        # (async mode: generate_async); the verbs wait for their coroutine there
        self.events = EventLoopThread("hpcrl-rollout-loop")
        self.step = None  # the job step hosting the engines, when the launcher made one
        self.engines: list = []
        self.router = None
        self.client = None  # hpcrl.rollout.client.RolloutClient, from start()
        self.engine_tp_sizes: list[int] = []
        self.monitor = None  # hpcrl.rollout.health.HealthMonitor, once started
        self.snapshot = None  # hpcrl.weights.snapshot.WeightSnapshot, when engines may restart
        self.teachers: list = []  # hpcrl.rollout.teacher.Teacher, with algorithm.opd.teachers
        self.gateway = None  # hpcrl.agent.gateway.AgentGateway, with rollout.agent

    # ------------------------------------------------------------------------------------------------------
    def call(self, coro):
        """Run a coroutine on the rollout's event loop, wait and return its result (:meth:`result`)."""
        return self.result(self.events.submit(coro))

    def result(self, future: concurrent.futures.Future):
        """Wait for a coroutine started on the rollout's event loop and return its result. When the engines
        run as a job step and it failed with the step gone (or going: ``srun`` gets up to 10 s to notice),
        raises the step's error (its log tail) instead."""
        try:
            return future.result()
        except Exception:
            if self.step is not None and self.snapshot is None:  # no engine restarts: say why they died
                self.step.check(grace_s=10.0)
            raise
        except BaseException:  # KeyboardInterrupt while waiting: the coroutine must not go on alone
            future.cancel()
            raise

    def launch(self, early: bool = False) -> None:
        """Start the engines (the run secret first) and, with ``rollout.router``, the router beside them (no
        workers yet: :meth:`start` registers the engines), and the OPD teachers, and return while they load.
        Idempotent. Raises what the launcher raises.

        ``early=True`` is the call before the trainer builds its model: it does nothing when engines and
        trainer share GPUs (``run.placement: colocate`` with SGLang), so that, as before, SGLang sizes its
        memory pool with the trainer's model already resident; :meth:`start` launches them then.
        """
        from hpcrl.rollout.engines import resolve_engine
        from hpcrl.rollout.secret import create_run_secret

        cfg = self.cfg
        if early and cfg.run.placement == "colocate" and resolve_engine(cfg.rollout.engine) != "cpu":
            return
        if self.pending is None and not self.engines:
            self.secret_path = create_run_secret(self.run_dir)
            self.pending = self.launcher(cfg, self.run_dir, self.attempt_dir, self.model_path,
                                         self.secret_path)
            if cfg.rollout.router and self.router is None:  # it starts beside them; start() adds them
                from hpcrl.rollout.router import spawn_router
                from hpcrl.rollout.secret import read_secret

                self.router = spawn_router([], api_key=read_secret(self.secret_path),
                                           log_path=self.attempt_dir / "router.log", cpus=self._router_cpus())
            if cfg.algorithm.opd.teachers and not self.teachers:
                from hpcrl.rollout.teacher import start_teacher

                self.teachers = [start_teacher(cfg, t, i, self.run_dir, self.attempt_dir, self.secret_path,
                                               self.launcher)
                                 for i, t in enumerate(cfg.algorithm.opd.teachers)]

    def _router_cpus(self):
        """The router's CPUs: the rollout's (``rollout.cpus``) in a disaggregated run, else None (inherit)."""
        from hpcrl.placement import parse_cpu_list

        rc = self.cfg.rollout
        disaggregated = self.cfg.run.placement == "disaggregate"
        return parse_cpu_list(rc.cpus) if disaggregated and rc.cpus is not None else None

    def start(self) -> None:
        """Wait for the engines (launching them first unless :meth:`launch` did) and for the router that
        :meth:`launch` spawned beside them, register the engines with it, connect the client, start the
        health monitor and connect the teachers. Raises what the launcher raises
        (:class:`hpcrl.procs.ProcessStartError`, a job step's error)."""
        from hpcrl.rollout.client import RolloutClient
        from hpcrl.rollout.secret import read_secret

        cfg, rc = self.cfg, self.cfg.rollout
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
                                    # streamed: an engine's death costs only the tokens it had not sent.
                                    # Not forced in fully_async: the engines' weight-version spans label
                                    # tokens exactly without it, and batched, unstreamed groups generate
                                    # faster on a busy engine
                                    keep_partial=rc.partial_rollout,
                                    generate_fields={"return_routed_experts": True}
                                    if cfg.algorithm.routing_replay else None,
                                    span_lag=run_span_lag(cfg))
        self.call(self.client.open())
        self.call(self.client.wait_healthy(timeout_s=600))
        self.call(self._start_monitor(pending, key))
        if self.teachers:
            from hpcrl.rollout.teacher import connect_teacher

            for teacher in self.teachers:
                self.call(connect_teacher(teacher, cfg, key))

    def start_agent_gateway(self, tokenizer):
        """Start the agent gateway (:mod:`hpcrl.agent.gateway`, ``rollout.agent``) in this process, in front
        of the client, and return the agent generate function (:func:`hpcrl.agent.runner.agent_generate`)
        whose episodes talk to it. ``tokenizer``: the policy's HF tokenizer."""
        self.gateway, generate_fn = self.call(self._start_gateway(tokenizer))
        return generate_fn

    async def _start_gateway(self, tokenizer):
        """The agent gateway (:mod:`hpcrl.agent.gateway`) and the agent generate function."""
        from transformers import AutoConfig

        from hpcrl.agent.gateway import AgentGateway
        from hpcrl.agent.runner import agent_generate
        from hpcrl.models.hf import context_length
        from hpcrl.plugin_loader import load_function
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

            het = (1 if self.cfg.run.placement == "disaggregate" and self.cfg.slurm.rollout is not None
                   else None)
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
            from hpcrl.weights.adapter import adapter_sync_config

            self.snapshot = WeightSnapshot(self.run_dir / "weights-rejoin", self.model_path,
                                           self.cfg.weights.bucket_bytes,
                                           adapter_config=adapter_sync_config(self.cfg, self.model_path))
        router_cpus = self._router_cpus()

        def restart_router(urls: list[str], port):
            return start_router(urls, port=port, api_key=key, cpus=router_cpus,
                                log_path=self.attempt_dir / "router.log")  # appended

        self.monitor = HealthMonitor(self.client, list(self.engines), restart,
                                     self.snapshot, rc.heartbeat_interval_s, rc.heartbeat_timeout_s,
                                     rc.max_engine_restarts, api_key=key, router=self.router,
                                     restart_router=restart_router, job_ending=self.job_ending)
        await self.monitor.start()

    # ------------------------------------------------------------------------------------------------------
    def generating(self, on: bool) -> None:
        """Tell the health monitor whether the engines generate now (it probes ``/health_generate`` then,
        ``/health`` otherwise); nothing without a monitor."""
        if self.monitor is not None:
            self.monitor.generating = on

    async def quiesce(self) -> None:
        """After ``generating(False)``: wait for the monitor's ``/health_generate`` probes still in flight
        (:meth:`hpcrl.rollout.health.HealthMonitor.quiesce`); nothing without a monitor."""
        if self.monitor is not None:
            await self.monitor.quiesce()

    def served(self) -> dict[str, float]:
        """A rollout step finished: the monitor clears the engines' crash counts and hands over its
        ``rollout/*`` fault metrics since the last call (:mod:`hpcrl.rollout.health`); {} without a
        monitor."""
        if self.monitor is None:
            return {}
        self.monitor.served()
        return self.monitor.take_metrics()

    def stop(self) -> None:
        """Stop the monitor and the gateway, close the client, stop teachers, router, engines and the job step
        (only what this run started; restarted engines and routers included), then the event loop."""
        try:
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
                restarted = [e for e in self.monitor.engines() if e not in self.engines]
                self.engines = list(self.engines) + restarted
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
            self.events.stop()
