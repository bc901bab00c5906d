"""The rollout side of a run as the loop sees it (slime's ``RolloutManager``): short verbs over the rollout
fleet (:mod:`hpcrl.rollout.fleet`), the colocated memory phases (:mod:`hpcrl.rollout.phases`) and the weight
sync.

:class:`RolloutManager` runs on the controller (trainer rank 0). Every other trainer rank gets a
:class:`FollowerRollout`: it holds no engines (``generate`` returns no samples: the loop broadcasts the
controller's), but moves its own trainer memory in the colocated phases and joins the weight sync, so the loop
never branches on the rank. :func:`rollout_manager` picks the one of a rank.

Colocated phase order per step (no-op adapters on CPU; see :mod:`hpcrl.rollout.phases`)::

    generate -> offload (engine memory off) -> onload_trainer -> train
    -> onload_weights (trainer off, engine weights on) -> update_weights -> onload_kv -> evaluate
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Callable

from hpcrl.rollout.fleet import EngineLauncher, RolloutFleet
from hpcrl.rollout.phases import ColocatedPhases, TrainerPhases
from hpcrl.rollout.stats import rollout_metrics, sample_lag
from hpcrl.run_setup import new_attempt_dir

__all__ = ["EngineLauncher", "FollowerRollout", "RolloutManager", "rollout_manager", "rollout_metrics",
           "sample_lag"]


class RolloutManager:
    """The controller's rollout side. ``launch()`` starts the fleet's engines without waiting (they load while
    the trainer builds its model); ``start(datasets)`` waits for them, starts the router, connects the client
    and builds the rollout context; the verbs then run one phase each; ``stop()`` ends only what this run
    started.

    Args:
        cfg: the resolved run config.
        run_dir: the run folder (its ``secret`` is created here).
        attempt_dir: this attempt's log folder (engine, router and phase logs).
        model_path: the HF folder the engines load.
        launcher: how the engines start (:data:`hpcrl.rollout.fleet.EngineLauncher`).
        job_ending: whether Slurm is ending the job (:meth:`hpcrl.preempt.PreemptionWatch.job_ending`; no
            engine is restarted then).
    """

    def __init__(self, cfg, run_dir: Path, attempt_dir: Path, model_path: Path, launcher: EngineLauncher,
                 job_ending: Callable[[], bool] = lambda: False) -> None:
        self.cfg, self.run_dir, self.attempt_dir, self.model_path = cfg, run_dir, attempt_dir, model_path
        self.fleet = RolloutFleet(cfg, run_dir, attempt_dir, model_path, launcher, job_ending)
        self.datasets = None
        self.phases: ColocatedPhases | None = None  # from start()
        self.eval_sets: list = []  # hpcrl.rollout.evaluate.EvalSet, from start()
        self.eval_rewards: dict = {}  # eval set name -> its reward function, from start()
        self.producer = None  # hpcrl.rollout.fully_async.AsyncProducer, between start_stream and stop_stream

    @property
    def client(self):
        """The fleet's :class:`hpcrl.rollout.client.RolloutClient` (None before :meth:`start`)."""
        return self.fleet.client

    @property
    def engine_tp_sizes(self) -> list[int]:
        """Each engine's tensor-parallel size (empty before :meth:`start`)."""
        return self.fleet.engine_tp_sizes

    # ------------------------------------------------------------------------------------------------------
    def call(self, coro):
        """Run a coroutine on the rollout's event loop, wait and return its result (:meth:`result`)."""
        return self.fleet.call(coro)

    def result(self, future: concurrent.futures.Future):
        """Wait for a coroutine started on the rollout's event loop and return its result
        (:meth:`hpcrl.rollout.fleet.RolloutFleet.result`: a dead job step of engines raises its error)."""
        return self.fleet.result(future)

    def launch(self, early: bool = False) -> None:
        """Start the engines, router and teachers and return while they load
        (:meth:`hpcrl.rollout.fleet.RolloutFleet.launch`; ``early=True``: before the trainer builds its
        model)."""
        self.fleet.launch(early)

    def start(self, datasets) -> None:
        """Start the fleet (:meth:`hpcrl.rollout.fleet.RolloutFleet.start`: engines, router, client, monitor,
        teachers), then build the memory phases, the rollout context (the agent gateway with
        ``rollout.agent``) and the eval sets. ``datasets``: :class:`hpcrl.data.datasets.Datasets` (eval items
        and the task that scores them). Raises what the launcher raises
        (:class:`hpcrl.procs.ProcessStartError`, a job step's error)."""
        from transformers import AutoTokenizer

        from hpcrl.offload import ColocatedMemory, create_trainer_memory
        from hpcrl.rollout.plugins import resolve_plugins
        from hpcrl.rollout.rollout import RolloutContext

        cfg, rc = self.cfg, self.cfg.rollout
        self.datasets = datasets
        self.fleet.start()
        colocate = cfg.run.placement == "colocate"
        self.phases = ColocatedPhases(ColocatedMemory(create_trainer_memory(colocate), self.fleet.client,
                                                      colocate=colocate), self.fleet.call)
        tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        plugins = resolve_plugins(cfg, self.datasets.task)
        self.rollout_fn = plugins.rollout_fn  # by default hpcrl.rollout.rollout.generate_rollout
        generate_fn = plugins.generate_fn
        if rc.agent.enabled:  # agentic rollouts: the gateway in this process, in front of the router
            generate_fn = self.fleet.start_agent_gateway(tokenizer)
        self.ctx = RolloutContext(client=self.fleet.client, tokenizer=tokenizer, reward_fn=plugins.reward_fn,
                                  generate_fn=generate_fn, dynamic_filter=plugins.dynamic_filter,
                                  seed=cfg.run.seed)
        from hpcrl.rewards import get_reward_function
        from hpcrl.rollout.evaluate import eval_sets

        self.eval_sets = eval_sets(cfg, self.datasets)
        # a set of another task scores with its own (the task reward); the others share the rollout's function
        self.eval_rewards = {es.name: (plugins.reward_fn if es.task is self.datasets.task
                                       else get_reward_function(cfg, es.task)) for es in self.eval_sets}

    # ------------------------------------------------------------------------------------------------------
    def generate(self, rollout_id: int, data_source, multiple: int = 1) -> tuple[list, dict[str, float]]:
        """One rollout step on the engines. Returns ``(flat samples, rollout/* metrics)``.

        Trains the largest count of the kept groups that is a multiple of ``multiple`` (whole groups that
        split over data-parallel ranks x optimizer steps; all of them with ``batch_size`` groups) and pushes
        the other kept groups back to ``data_source`` for the next step (``rollout/groups_held``);
        ``rollout/groups_short`` is ``batch_size`` minus the trained groups. Raises RuntimeError when no
        whole multiple was kept, and what the rollout function raises
        (:class:`hpcrl.rollout.client.RolloutError`, a starving filter).
        """
        return self.call(self._generate(rollout_id, data_source, multiple))

    def generate_async(self, rollout_id: int, data_source, multiple: int = 1) -> concurrent.futures.Future:
        """Start :meth:`generate` on the rollout's event loop and return at once (async mode: the engines
        generate rollout k+1 while the trainer trains on rollout k). ``result(future)`` waits for
        ``(samples, metrics)``. ``data_source`` must not be used by the caller until then."""
        return self.fleet.events.submit(self._generate(rollout_id, data_source, multiple))

    async def _generate(self, rollout_id: int, data_source, multiple: int) -> tuple[list, dict[str, float]]:
        from hpcrl.rollout.rollout import split_trainable

        self.phases.mark("generate")
        self.fleet.generating(True)
        try:
            out = await self.rollout_fn(self.cfg, rollout_id, data_source, self.ctx)
        finally:
            self.fleet.generating(False)
            await self.fleet.quiesce()  # no one-token probe left in the engines when they are released
        out.metrics.update(self.fleet.served())
        groups, hold = split_trainable(out.groups, multiple)
        if not groups:
            raise RuntimeError(f"rollout {rollout_id}: {len(out.groups)} groups kept, fewer than the "
                               f"{multiple} that split over data-parallel ranks x "
                               "train.num_steps_per_rollout; loosen rollout.dynamic_filter or use fewer "
                               "trainer ranks or steps per rollout")
        if hold:
            data_source.add_samples(hold)
        samples = [s for g in groups for s in g]
        await self._score_teachers(samples, out.metrics)
        return samples, rollout_metrics(self.cfg, samples, out.metrics, len(groups), len(hold))

    async def _score_teachers(self, samples: list, metrics: dict) -> None:
        """On-policy distillation (``algorithm.opd``): the teachers score the trained samples' tokens
        (``rollout/opd_*`` into ``metrics``); nothing without teachers."""
        if self.fleet.teachers:
            from hpcrl.rollout.teacher import opd_metrics, score_samples

            metrics["rollout/opd_teacher_seconds"] = await score_samples(self.fleet.teachers, samples,
                                                                         self.cfg.rollout.temperature)
            metrics.update(opd_metrics(samples))

    # ------------------------------------------------------------------------------ fully async stream
    def start_stream(self, data_source, version: int, restored=None) -> None:
        """Start the fully-async producer (:class:`hpcrl.rollout.fully_async.AsyncProducer`) on the rollout's
        event loop: from now on up to ``rollout.max_inflight_groups`` groups generate from ``data_source``
        (which the caller must not use until :meth:`stop_stream`), the engines holding weights ``version``.
        ``restored``: a checkpoint's :class:`hpcrl.rollout.fully_async.StreamSnapshot` (finished groups served
        first, partial groups continued), or None. The health monitor probes ``/health_generate`` from now
        on."""
        self.call(self._start_stream(data_source, version, restored))

    async def _start_stream(self, data_source, version: int, restored) -> None:
        from hpcrl.rollout.fully_async import AsyncProducer

        self.phases.mark("generate")
        self.producer = AsyncProducer(self.cfg, self.ctx, data_source, version,
                                      finished=restored.finished if restored else None,
                                      inflight=restored.inflight if restored else None,
                                      ledger=restored.ledger if restored else None)
        self.fleet.generating(True)
        self.producer.task = asyncio.ensure_future(self.producer.run())

    def take(self, rollout_id: int, multiple: int = 1) -> tuple[list, dict[str, float]]:
        """The next ``rollout.batch_size`` finished groups of the stream (a multiple of ``multiple``, at least
        one multiple) for training step ``rollout_id``, waiting for them: ``(flat samples, rollout/*
        metrics)``
        (:meth:`hpcrl.rollout.fully_async.AsyncProducer.take`, plus the trained samples' statistics,
        :func:`hpcrl.rollout.stats.rollout_metrics`, and OPD teacher scores as :meth:`generate`). Raises the
        error that stopped the stream (:class:`hpcrl.rollout.client.RolloutError`, a reward's error)."""
        return self.call(self._take(rollout_id, multiple))

    async def _take(self, rollout_id: int, multiple: int) -> tuple[list, dict[str, float]]:
        groups, metrics = await self.producer.take(self.cfg.rollout.batch_size, rollout_id, multiple)
        metrics.update(self.fleet.served())
        samples = [s for g in groups for s in g]
        await self._score_teachers(samples, metrics)
        return samples, rollout_metrics(self.cfg, samples, metrics, len(groups), 0)

    def snapshot(self, partials: bool = False):
        """The stream at one instant (:meth:`hpcrl.rollout.fully_async.AsyncProducer.snapshot`, taken on the
        event loop, so the producer cannot change the data source halfway): what a checkpoint saves. With
        ``partials`` (a step whose checkpoint is saved), the generating groups' calls are aborted first and
        their partial responses taken into the snapshot
        (:meth:`~hpcrl.rollout.fully_async.AsyncProducer.capture_partials`); they continue after it."""
        return self.call(self._snapshot(partials))

    async def _snapshot(self, partials: bool):
        if not partials:
            return self.producer.snapshot()
        await self.producer.capture_partials()
        try:
            return self.producer.snapshot()
        finally:
            self.producer.release()

    def stop_stream(self) -> None:
        """Stop the producer: no new group, the generating ones aborted on the engines and cancelled."""
        if self.producer is not None:
            self.call(self._stop_stream())

    async def _stop_stream(self) -> None:
        from hpcrl.rollout.client import RolloutError

        producer, self.producer = self.producer, None
        producer.stopping = True
        try:
            await self.fleet.client.abort_all()
        except RolloutError as e:  # the run's outcome stands; the engines are stopped next anyway
            logging.getLogger("hpcrl.rollout").warning("could not abort the stream's requests: %s", e)
        finally:
            await producer.stop()
            self.fleet.generating(False)
            await self.fleet.quiesce()

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
        self.fleet.generating(True)
        try:
            return await evaluate(self.cfg, self.ctx, self.eval_sets, rollout_id,
                                  lambda es: self.eval_rewards[es.name])
        except EnginesLost as e:  # the step stays whole and is checkpointed; the next rollout stops the run
            logging.getLogger("hpcrl.health").error("eval skipped: %s", e)
            return {}
        finally:
            self.fleet.generating(self.producer is not None)  # a fully-async stream still generates
            if self.producer is None:
                await self.fleet.quiesce()

    # ---------------------------------------------------------------------------------- colocated memory
    def offload(self) -> None:
        """Engines release their memory (weights and KV cache) for the trainer (slime ``offload``)."""
        self.phases.offload()

    def onload_trainer(self) -> None:
        """The trainer's memory back on the device before it trains."""
        self.phases.onload_trainer()

    def onload_weights(self) -> None:
        """Trainer memory off, the engines' weight memory back, ready for the weight sync (slime
        ``onload_weights``)."""
        self.phases.onload_weights()

    @property
    def trainer_paused_during_sync(self) -> bool:
        """Whether :meth:`onload_weights` unmaps this rank's trainer memory (colocated on GPUs), so the
        weights to sync must be read before it."""
        return self.phases.trainer_paused_during_sync

    def trainer_onloaded(self) -> contextlib.AbstractContextManager:
        """A context with this rank's trainer memory on the device (for a checkpoint save while colocated
        engines hold the GPUs: onload, save, offload again); nothing to do before :meth:`start`."""
        return self.phases.trainer_onloaded() if self.phases is not None else contextlib.nullcontext()

    def update_weights(self, syncer, named, version: int) -> dict[str, Any]:
        """Send the trainer's weights ``named`` (an iterator of ``(name, tensor)``) to the engines as weight
        version ``version``; returns the syncer's metrics (seconds, bytes, GB/s). Raises
        :class:`hpcrl.weights.WeightSyncError`."""
        return self.call(self._update_weights(syncer, named, version))

    async def _update_weights(self, syncer, named, version: int) -> dict[str, Any]:
        out = await self._sync_weights(syncer, named, version)
        if self.producer is not None:  # fully async: newer weights admit more groups
            self.producer.set_version(version)
        return out

    async def _sync_weights(self, syncer, named, version: int) -> dict[str, Any]:
        fleet = self.fleet
        if self.cfg.weights.rollout_dtype == "fp8":  # what the engines hold (hpcrl.weights.fp8)
            from hpcrl.rollout.engines import engine_dtype
            from hpcrl.weights.fp8 import quantize_stream

            import torch

            named = quantize_stream(named, getattr(torch, engine_dtype(self.cfg)))
        if fleet.snapshot is not None:  # a restarted engine loads this version (hpcrl.weights.snapshot)
            named = fleet.snapshot.tee(named, version)
        if fleet.monitor is None:
            return await syncer.sync(named, str(version))
        from hpcrl.rollout.client import RolloutError
        from hpcrl.weights import WeightSyncError

        async with fleet.monitor.sync_lock:  # no engine joins halfway through
            t0 = time.perf_counter()
            if not fleet.client.engine_urls:  # all being replaced (they load the snapshot), or lost
                for _ in named:  # (the next rollout raises EnginesLost, after this step is checkpointed)
                    pass
                return {"method": "snapshot", "weight_version": str(version),
                        "seconds": time.perf_counter() - t0}
            try:
                return await syncer.sync(named, str(version))
            except (WeightSyncError, RolloutError):
                # an engine that died mid-sync is replaced by the monitor; the others get this version from
                # the snapshot, which the failed sync still completed (it drains its stream)
                if (fleet.snapshot is None or fleet.snapshot.version != str(version)
                        or not await fleet.monitor.settle()):
                    raise
                return await self._resync_from_snapshot(t0)

    async def _resync_from_snapshot(self, t0: float) -> dict[str, Any]:
        """Load the snapshot's version on every engine in rotation (``/update_weights_from_disk``, or the LoRA
        adapter: :meth:`hpcrl.weights.snapshot.WeightSnapshot.load_on`) and let them generate again: the end of
        a weight sync an engine died in. Raises RolloutError."""
        from hpcrl.weights.adapter import adapter_name

        client = self.fleet.client
        snapshot, timeout = self.fleet.snapshot, self.cfg.weights.timeout_s
        version = snapshot.version
        # (adapters: under a name of their own, which the requests take once every engine has it)
        name = None if snapshot.adapter_config is None else adapter_name(version, f"resync{time.monotonic_ns()}")
        for url in client.engine_urls:
            await snapshot.load_on(client, url, timeout, name=name)
        if name is not None:
            client.generate_fields["lora_path"] = name
        for url in client.engine_urls:
            await client.request("POST", "/continue_generation", {}, base_url=url, timeout_s=timeout)
        return {"method": "snapshot", "weight_version": version, "seconds": time.perf_counter() - t0,
                "recovered": 1}

    def onload_kv(self) -> None:
        """The engines' KV cache back after the weights (slime ``onload_kv``)."""
        self.phases.onload_kv()

    # ------------------------------------------------------------------------------------------------------
    def release_weight_sync(self, syncer) -> None:
        """The end of the run's weight syncs (:meth:`hpcrl.weights.sync.WeightSyncer.release`), before
        :meth:`stop`: the engines drop their side of a distributed group. Never raises: the run's outcome
        stands."""
        try:
            self.call(syncer.release())
        except Exception as e:  # noqa: BLE001 - teardown must not mask the run's outcome
            logging.getLogger("hpcrl.weights").warning("releasing the weight-update group: %s", e)

    def stop(self) -> None:
        """Write the colocated phase order of this attempt to ``phases.jsonl``
        (:meth:`hpcrl.rollout.phases.ColocatedPhases.write`), then stop the fleet (only what this run started:
        :meth:`hpcrl.rollout.fleet.RolloutFleet.stop`)."""
        try:
            if self.phases is not None:
                self.phases.write(self.attempt_dir / "phases.jsonl")
        finally:
            self.fleet.stop()


class FollowerRollout:
    """The rollout side of a trainer rank that is not the controller: it holds no engines, so ``generate``
    returns no samples and no metrics and ``evaluate`` no metrics, but it moves its own trainer memory in the
    colocated phases where the controller does (:class:`hpcrl.rollout.phases.TrainerPhases`) and takes part
    in the weight sync without sending (every rank iterates the weights: tensor-parallel all-gathers).

    Args:
        trainer: this rank's trainer memory (:func:`hpcrl.offload.create_trainer_memory`); the no-op
            :class:`hpcrl.offload.TrainerMemory` when None.
    """

    client = None
    engine_tp_sizes = None

    def __init__(self, trainer=None) -> None:
        from hpcrl.offload import TrainerMemory

        self.phases = TrainerPhases(trainer or TrainerMemory())

    @property
    def trainer_paused_during_sync(self) -> bool:
        """Whether :meth:`onload_weights` unmaps this rank's trainer memory."""
        return self.phases.trainer_paused_during_sync

    def trainer_onloaded(self) -> contextlib.AbstractContextManager:
        """A context with this rank's trainer memory on the device."""
        return self.phases.trainer_onloaded()

    def launch(self, early: bool = False) -> None:
        """Nothing: the engines are the controller's."""

    def start(self, datasets) -> None:
        """Nothing: the engines are the controller's."""

    def generate(self, rollout_id: int, data_source, multiple: int = 1) -> tuple[None, dict[str, float]]:
        """No samples (the loop broadcasts the controller's) and no metrics."""
        return None, {}

    def generate_async(self, rollout_id: int, data_source, multiple: int = 1) -> concurrent.futures.Future:
        """A future already done with :meth:`generate`'s ``(None, {})``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result((None, {}))
        return future

    def result(self, future: concurrent.futures.Future):
        """The future's result."""
        return future.result()

    def start_stream(self, data_source, version: int, restored=None) -> None:
        """Nothing: the controller's producer generates."""

    def take(self, rollout_id: int, multiple: int = 1) -> tuple[None, dict[str, float]]:
        """No samples (the loop broadcasts the controller's) and no metrics."""
        return None, {}

    def snapshot(self, partials: bool = False) -> None:
        """None: the controller's checkpoint files hold the stream."""
        return None

    def stop_stream(self) -> None:
        """Nothing: the controller's producer generates."""

    def release_weight_sync(self, syncer) -> None:
        """Nothing: only the controller sends, so only it holds a weight-update group."""

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """No metrics: the controller evaluates."""
        return {}

    def offload(self) -> None:
        """Nothing: the engines are the controller's."""
        self.phases.offload()

    def onload_trainer(self) -> None:
        """This rank's trainer memory back on the device."""
        self.phases.onload_trainer()

    def onload_weights(self) -> None:
        """This rank's trainer memory off for the engines' weights."""
        self.phases.onload_weights()

    def update_weights(self, syncer, named, version: int) -> dict[str, Any]:
        """Take part in the weight sync of version ``version`` without sending (``syncer.is_sender`` is
        False); returns the syncer's metrics. Raises :class:`hpcrl.weights.WeightSyncError`."""
        return asyncio.run(syncer.sync(named, str(version)))

    def onload_kv(self) -> None:
        """Nothing: the engines are the controller's."""
        self.phases.onload_kv()

    def stop(self) -> None:
        """Nothing: this rank started nothing."""


def rollout_manager(controller: bool, cfg, run_dir: Path, model_path: Path, launcher: EngineLauncher,
                    job_ending: Callable[[], bool] = lambda: False) -> "RolloutManager | FollowerRollout":
    """The rollout side of a trainer rank: a :class:`RolloutManager` (with a new ``logs/attempt-N`` folder) on
    the controller, a :class:`FollowerRollout` on every other rank. ``job_ending()``: whether Slurm is ending
    the job (:meth:`hpcrl.preempt.PreemptionWatch.job_ending`; no engine is restarted then)."""
    if not controller:
        from hpcrl.offload import create_trainer_memory

        return FollowerRollout(create_trainer_memory(cfg.run.placement == "colocate"))
    return RolloutManager(cfg, run_dir, new_attempt_dir(run_dir), model_path, launcher, job_ending)
