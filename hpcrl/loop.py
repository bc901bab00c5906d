"""The RL loop (``hpcrl run``), written out top to bottom like slime's ``train.py``.

Synchronous mode, one rollout step::

    rollout (engines, over-sampling + dynamic filter) -> rewards -> advantages -> train (Megatron)
    -> weight sync -> metrics -> eval -> checkpoint

Every trainer rank runs :func:`train_main`; global rank 0 is the controller: it starts the engines and the
router, drives the rollout and broadcasts the samples to the other ranks. Colocated runs move device memory
between trainer and engines in the order :mod:`hpcrl.offload` documents (no-op adapters on CPU).

Run folder (``run.output_dir/run.name``): ``config.yaml`` (resolved), ``secret`` (0600, the engines' key),
``logs/attempt-N/`` (engine, router and phase logs of each attempt), ``checkpoints/iter_XXXXXXX/``,
``metrics.jsonl``, ``tensorboard/``, ``curves.png``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hpcrl.config import Config, save_resolved

log = logging.getLogger("hpcrl.loop")

EXIT_PREEMPTED = 75
"""Exit status of a run that stopped early on the preemption signal or its deadline, after a checkpoint
(``EX_TEMPFAIL``: run it again, or requeue it, and it resumes)."""


def run_dir_of(cfg: Config) -> Path:
    """The run folder ``run.output_dir/run.name``."""
    return Path(cfg.run.output_dir) / cfg.run.name


def new_attempt_dir(run_dir: Path) -> Path:
    """Create ``logs/attempt-N`` with N one more than the last attempt's (0 for a new run)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    n = 0
    while True:
        try:
            (logs / f"attempt-{n}").mkdir()
            return logs / f"attempt-{n}"
        except FileExistsError:
            n += 1


def prepare_model(cfg: Config) -> Path:
    """The HF folder RL starts from: the base model (created if asked), or its SFT warm start when enabled."""
    from hpcrl.models.hf import ensure_model

    if cfg.sft.enabled:
        from hpcrl.sft import run_sft

        return run_sft(cfg)
    return ensure_model(cfg.model, seed=cfg.run.seed)


def _quiet_logs() -> None:
    """hpcrl at INFO; megatron-core's start-up chatter (configs, parameter lists, missing-TE warnings) off."""
    import warnings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|cuda_graph_scope).*")


def main(cfg: Config) -> int:
    """``hpcrl run``: write the run folder, prepare the model, run the trainer; 0 on success. The run's
    state for ``hpcrl status`` goes to ``local_run.json`` (:func:`hpcrl.slurm.state.local_run_record`).

    With ``train.nprocs == 1`` the trainer runs in this process (the CPU quickstart); more trainer processes
    are started as local torch.distributed workers on this machine. Returns :data:`EXIT_PREEMPTED` when the
    run stopped early on the preemption signal (``kill -USR2``) with a checkpoint.
    """
    from hpcrl.slurm.state import local_run_record

    _quiet_logs()
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, run_dir)
    with local_run_record(run_dir, stopped_codes=(EXIT_PREEMPTED,)) as record:  # for hpcrl status
        model_path = prepare_model(cfg)
        if cfg.train.nprocs == 1:
            result = train_main(cfg, run_dir, model_path)
            record.exit_code = EXIT_PREEMPTED if result.get("preempted") else 0
        else:
            from hpcrl.launch_local import run_local_workers

            record.exit_code = run_local_workers(cfg, run_dir, model_path)
        return record.exit_code


def train_main(cfg: Config, run_dir: Path, model_path: Path, ci_checks: Optional[bool] = None,
               slurm_rollout_step: bool = False) -> dict[str, Any]:
    """One trainer rank's whole run. Returns the last step's metrics on the controller ({} elsewhere).

    ``slurm_rollout_step``: the controller starts the engines as a Slurm job step
    (:mod:`hpcrl.slurm.rollout_step`) instead of local subprocesses.
    """
    import torch

    from hpcrl.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint
    from hpcrl.data.buffer import BUFFER_FILE, read_buffer, trained_rows, write_buffer
    from hpcrl.preempt import PreemptionWatch, agree
    from hpcrl.data.source import DataSource
    from hpcrl.data.sources import load_datasets
    from hpcrl.metrics import MetricsLogger, truncate_metrics
    from hpcrl.rollout.rollout import group_multiple
    from hpcrl.train.actor import Actor
    from hpcrl.weights import WeightSyncer
    from hpcrl.train.parallel import (destroy, init_distributed, initialize_model_parallel,
                                      model_parallel_cuda_manual_seed)

    # --- processes, model, optimizer -------------------------------------------------------------------
    _quiet_logs()
    env = init_distributed()
    tc = cfg.train
    initialize_model_parallel(tc.tensor_parallel_size, tc.pipeline_parallel_size, tc.context_parallel_size,
                              tc.expert_parallel_size)
    model_parallel_cuda_manual_seed(cfg.run.seed)
    if cfg.run.deterministic:
        torch.use_deterministic_algorithms(True)
    is_controller = env.rank == 0
    ci = cfg.run.deterministic if ci_checks is None else ci_checks
    actor = Actor(cfg, model_path, ci_checks=ci)

    # --- data ------------------------------------------------------------------------------------------
    datasets = load_datasets(cfg)
    data_source = DataSource(datasets.train, cfg.rollout.n_samples_per_prompt, seed=cfg.run.seed,
                             shuffle=cfg.data.shuffle)

    # --- resume ----------------------------------------------------------------------------------------
    start_rollout_id = 0
    last_saved: Optional[int] = None  # rollout id of the newest checkpoint of this run
    trained: list[tuple[int, int, int]] = []  # (rollout id, group index, sample index) of every trained sample
    ckpt = find_latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    if ckpt is not None:
        extra = load_checkpoint(ckpt, actor.ddp_model, actor.optimizer)
        data_source.load_state_dict(extra["data_source"])
        if (ckpt / BUFFER_FILE).exists():
            data_source.buffer, rows = read_buffer(ckpt / BUFFER_FILE)
            trained = [tuple(r) for r in rows.tolist()]
        start_rollout_id = extra["rollout_id"] + 1
        last_saved = extra["rollout_id"]
        if is_controller:
            truncate_metrics(run_dir, extra["rollout_id"])
            log.info("resumed from %s: next rollout %d (%d held-back groups)", ckpt, start_rollout_id,
                     len(data_source.buffer))
    elif is_controller:
        truncate_metrics(run_dir, -2)  # a start killed before its first checkpoint: its rows are redone

    def save(rollout_id: int) -> None:
        nonlocal last_saved
        t0 = time.perf_counter()
        save_checkpoint(run_dir, rollout_id, actor.ddp_model, actor.optimizer,
                        _extra_state(cfg, rollout_id, data_source, run_dir, is_controller),
                        keep_last=cfg.checkpoint.keep_last,
                        extra_files={BUFFER_FILE: lambda p: write_buffer(p, data_source.buffer, trained)})
        watch.record_save(time.perf_counter() - t0)
        last_saved = rollout_id

    # --- preemption: the signal sets a flag (and is blocked for every child process); see hpcrl.preempt -------
    watch = PreemptionWatch.from_config(cfg, is_controller)
    watch.install()
    stopped: Optional[str] = None

    # --- engines, router, client (controller only) -----------------------------------------------------
    rollout = _Rollout(cfg, run_dir, model_path, datasets, slurm_rollout_step) if is_controller else None
    multiple = group_multiple(cfg.rollout.n_samples_per_prompt, actor.dp_size, tc.num_steps_per_rollout)
    failure: Optional[Exception] = None
    last: dict[str, Any] = {}
    try:
        if rollout is not None:
            rollout.start()
        mem = rollout.memory if rollout is not None else None
        metrics_log = (MetricsLogger(run_dir, cfg.run.num_rollout, start_rollout_id)
                       if is_controller else None)
        if rollout is not None:
            rollout.call(mem.offload_engine())  # slime: engines give their memory back before the actor is up
        syncer = WeightSyncer.from_config(
            rollout.client if rollout else None, cfg.weights, is_sender=is_controller,
            engine_tp_sizes=rollout.engine_tp_sizes if rollout else None, hf_checkpoint=str(model_path),
            disk_dir=str(run_dir / "weights"))
        _sync(actor, syncer, rollout, version=start_rollout_id)  # engines may hold older weights after a resume
        if rollout is not None and start_rollout_id == 0:
            last = rollout.call(rollout.evaluate(-1))
            metrics_log.log(-1, last, advance=False)

        # --- the loop --------------------------------------------------------------------------------
        for rollout_id in range(start_rollout_id, cfg.run.num_rollout):
            step: dict[str, Any] = {}
            t_step = time.perf_counter()
            samples = None
            if rollout is not None:
                before = data_source.state_dict()  # the data as the last finished step left it (copies)
                try:
                    samples, rollout_metrics = rollout.call(rollout.generate(rollout_id, data_source, multiple))
                    step.update(rollout_metrics)
                    rollout.call(mem.offload_engine())
                except Exception as e:  # noqa: BLE001 - every rank learns of it below, then it is re-raised
                    failure, samples = e, _StepFailed(f"rollout {rollout_id} failed on the controller: "
                                                      f"{type(e).__name__}: {e}")
            samples = _broadcast(samples)
            if isinstance(samples, _StepFailed):  # before the weights changed: keep the last finished step
                if rollout is not None:
                    data_source.load_state_dict(before)
                    mem.onload_trainer()
                if rollout_id > 0 and last_saved != rollout_id - 1:
                    log.error("%s; saving the checkpoint of rollout %d first, a rerun resumes from it",
                              samples.message, rollout_id - 1)
                    save(rollout_id - 1)
                if failure is not None:
                    raise failure
                raise RuntimeError(samples.message)
            if rollout is not None:
                mem.onload_trainer()
                mem.mark("train")
            step.update(actor.train(rollout_id, samples))
            trained.extend(trained_rows(rollout_id, samples))
            step.update(_sync(actor, syncer, rollout, version=rollout_id + 1))
            if rollout is not None and _due(rollout_id, cfg.rollout.eval_interval, cfg.run.num_rollout):
                step.update(rollout.call(rollout.evaluate(rollout_id)))
            step["timing/step_seconds"] = time.perf_counter() - t_step
            watch.record_step(step["timing/step_seconds"])
            if is_controller:  # before the checkpoint: a resume truncates the lines after the checkpoint's step
                metrics_log.log(rollout_id, step)
                last = step
            saved = _due(rollout_id, cfg.checkpoint.save_interval, cfg.run.num_rollout)
            if saved:
                save(rollout_id)
            # Preemption or the time limit: every rank stops at this same step boundary, with a checkpoint.
            if rollout_id + 1 < cfg.run.num_rollout:
                stopped = agree(watch.local_reason())
                if stopped is not None:
                    if not saved:
                        save(rollout_id)
                    log.warning("stopping after rollout %d (%s): checkpoint saved, the run resumes from it",
                                rollout_id, stopped)
                    break
        if is_controller:
            png = metrics_log.close()
            log.info("%s: %s (curves: %s)", "stopped" if stopped else "done", run_dir, png)
    finally:
        if rollout is not None:
            rollout.stop()
        watch.uninstall()
        destroy()
    if stopped is not None:
        last = dict(last, preempted=stopped)
    return last


def _due(rollout_id: int, interval: int, num_rollout: int) -> bool:
    """True at every ``interval``-th step and at the last step (interval 0: only the last)."""
    last = rollout_id == num_rollout - 1
    return last or (interval > 0 and (rollout_id + 1) % interval == 0)


def _extra_state(cfg: Config, rollout_id: int, data_source, run_dir: Path, is_controller: bool) -> dict:
    from hpcrl.config import config_to_dict
    from hpcrl.metrics import read_metrics

    return {"rollout_id": rollout_id, "data_source": data_source.state_dict(with_buffer=False),
            "metrics": read_metrics(run_dir) if is_controller else [], "config": config_to_dict(cfg)}


@dataclass
class _StepFailed:
    """What the controller broadcasts instead of the samples when a step's rollout failed (every rank then
    checkpoints the last finished step and raises)."""

    message: str


def _broadcast(obj: Any) -> Any:
    """Send the controller's object to every trainer rank (a no-op with one rank)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sync(actor, syncer, rollout: Optional["_Rollout"], version: int) -> dict[str, Any]:
    """Weight sync, colocated phase order around it: offload trainer, onload engine weights, sync, onload KV.

    Every trainer rank iterates the exported weights (TP all-gathers); only the controller sends.
    Returns the sync metrics (seconds, bytes, GB/s) prefixed ``sync/``.
    """
    from hpcrl.weights import iterate_for_sync

    named = iterate_for_sync(actor.ddp_model)
    if rollout is None:
        m = asyncio.run(syncer.sync(named, str(version)))
    else:
        rollout.memory.offload_trainer()
        rollout.call(rollout.memory.onload_engine_weights())
        rollout.memory.mark("sync")
        m = rollout.call(syncer.sync(named, str(version)))
        rollout.call(rollout.memory.onload_engine_kv())
    return {f"sync/{k}": v for k, v in m.items() if isinstance(v, (int, float))}


class _Rollout:
    """The controller's rollout side: engine and router processes, the client, and the asyncio loop."""

    def __init__(self, cfg: Config, run_dir: Path, model_path: Path, datasets, slurm_step: bool = False) -> None:
        self.cfg, self.run_dir, self.model_path, self.datasets = cfg, run_dir, model_path, datasets
        self.loop = asyncio.new_event_loop()
        self.slurm_step = slurm_step
        self.step = None  # the Slurm rollout step, when the engines run as one
        self.engines: list = []
        self.router = None
        self.client = None
        self.memory = None
        self.engine_tp_sizes: list[int] = []
        self.attempt_dir = new_attempt_dir(run_dir)

    def call(self, coro):
        """Run a coroutine on the rollout's event loop and return its result. When the engines run as a Slurm
        job step and a call fails with the step gone, raises RolloutStepError with the step's log tail."""
        try:
            return self.loop.run_until_complete(coro)
        except Exception:
            if self.step is not None:
                self.step.check()
            raise

    def start(self) -> None:
        """Start engines (and the router), wait until healthy, build the rollout context."""
        from transformers import AutoTokenizer

        from hpcrl.offload import ColocatedMemory, create_trainer_memory
        from hpcrl.plugins import load_function
        from hpcrl.rewards import get_reward_function
        from hpcrl.rollout.client import RolloutClient
        from hpcrl.rollout.filters import get_dynamic_filter
        from hpcrl.rollout.generate import get_generate_function
        from hpcrl.rollout.rollout import RolloutContext
        from hpcrl.rollout.router import start_router
        from hpcrl.rollout.secret import create_run_secret, read_secret
        from hpcrl.rollout.engines import start_engine

        from hpcrl.slurm.rollout_step import engine_sglang_args, start_rollout_step

        cfg, rc = self.cfg, self.cfg.rollout
        secret_path = create_run_secret(self.run_dir)
        key = read_secret(secret_path)
        sglang_args = engine_sglang_args(cfg)
        if self.slurm_step:
            self.step = start_rollout_step(cfg, self.run_dir, self.attempt_dir, Path(self.model_path).absolute(),
                                           secret_path)
            self.engines = list(self.step.engines)
        else:
            for i in range(rc.num_engines):
                self.engines.append(start_engine(rc, sglang_args, self.model_path, api_key_file=secret_path,
                                                 log_path=self.attempt_dir / f"engine-{i}.log"))
        self.engine_tp_sizes = [int(sglang_args.get("tp_size", 1))] * len(self.engines)
        urls = [e.url for e in self.engines]
        if rc.router:
            self.router = start_router(urls, api_key=key, log_path=self.attempt_dir / "router.log")
        self.client = RolloutClient(self.router.url if self.router else None, urls, api_key=key,
                                    timeout_s=rc.request_timeout_s, max_retries=rc.max_retries)
        self.call(self.client.open())
        self.call(self.client.wait_healthy(timeout_s=600))
        self.memory = ColocatedMemory(create_trainer_memory(cfg.run.placement == "colocate"), self.client,
                                      colocate=cfg.run.placement == "colocate")
        tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        custom_generate = load_function(rc.generate_function) if rc.generate_function else None
        self.rollout_fn = None
        if rc.rollout_function:
            self.rollout_fn = load_function(rc.rollout_function)
        self.ctx = RolloutContext(client=self.client, tokenizer=tokenizer,
                                  reward_fn=get_reward_function(cfg, self.datasets.task),
                                  generate_fn=get_generate_function(custom_generate),
                                  dynamic_filter=get_dynamic_filter(rc.dynamic_filter), seed=cfg.run.seed)

    async def generate(self, rollout_id: int, data_source, multiple: int = 1) -> tuple[list, dict[str, float]]:
        """Engines on, one rollout step, metrics of its samples. Returns (flat samples, metrics).

        Trains the largest count of the kept groups that is a multiple of ``multiple`` (whole groups that split
        over data-parallel ranks x optimizer steps; all of them with ``batch_size`` groups) and pushes the other
        kept groups back to ``data_source`` for the next step (``rollout/groups_held``); ``rollout/groups_short``
        is ``batch_size`` minus the trained groups. Raises RuntimeError when no whole multiple was kept.
        """
        from hpcrl.rollout.rollout import generate_rollout, split_trainable

        self.memory.mark("generate")
        fn = self.rollout_fn or generate_rollout
        out = await fn(self.cfg, rollout_id, data_source, self.ctx)
        groups, hold = split_trainable(out.groups, multiple)
        if not groups:
            raise RuntimeError(f"rollout {rollout_id}: {len(out.groups)} groups kept, fewer than the {multiple} "
                               "that split over data-parallel ranks x train.num_steps_per_rollout; loosen "
                               "rollout.dynamic_filter or use fewer trainer ranks or steps per rollout")
        if hold:
            data_source.add_samples(hold)
        samples = [s for g in groups for s in g]
        rewards = [s.scalar_reward() for s in samples]
        n = max(len(samples), 1)
        lengths = [s.response_length for s in samples]
        secs = out.metrics.get("rollout/seconds", 0.0)
        m = dict(out.metrics)
        m["rollout/groups_held"] = m.get("rollout/groups_held", 0) + len(hold)
        m["rollout/groups_short"] = self.cfg.rollout.batch_size - len(groups)
        m.update({
            "rollout/reward_mean": sum(rewards) / n,
            "rollout/reward_std": (sum((r - sum(rewards) / n) ** 2 for r in rewards) / n) ** 0.5,
            "rollout/accuracy": sum(r >= 1.0 for r in rewards) / n,
            "rollout/response_length": sum(lengths) / n,
            "rollout/truncated": sum(s.status.value == "truncated" for s in samples) / n,
            "rollout/tokens_per_s": sum(lengths) / secs if secs > 0 else 0.0,
            "rollout/weight_version": samples[0].weight_version if samples else None,
        })
        return samples, m

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Greedy accuracy on the held-out eval items, through the engines (``eval/accuracy``)."""
        from hpcrl.rollout.rollout import sampling_params

        t0 = time.perf_counter()
        params = sampling_params(self.cfg.rollout, evaluation=True)
        params["no_stop_trim"] = False
        items = self.datasets.eval
        tok = self.ctx.tokenizer

        async def one(item) -> float:
            ids = tok(item["prompt"], add_special_tokens=True)["input_ids"]
            out = await self.client.generate(ids, params, return_logprob=False)
            return float(self.datasets.task.score(out.get("text") or "", item))

        scores = await asyncio.gather(*(one(it) for it in items))
        return {"eval/accuracy": sum(scores) / max(len(scores), 1), "eval/seconds": time.perf_counter() - t0}

    def write_phases(self) -> None:
        """Write the colocated phase order of this attempt to ``phases.jsonl``: one ``{"phase", "t"
        (monotonic seconds), "wall" (Unix seconds)}`` per line."""
        with open(self.attempt_dir / "phases.jsonl", "w") as f:
            offset = time.time() - time.monotonic()  # wall clock, for timings across processes
            for phase, t in self.memory.events:
                f.write(json.dumps({"phase": phase, "t": t, "wall": t + offset}) + "\n")

    def stop(self) -> None:
        """Close the client, stop router and engines (only the processes this run started)."""
        try:
            if self.memory is not None:
                self.write_phases()
            if self.client is not None:
                self.call(self.client.close())
        finally:
            if self.router is not None:
                self.router.stop()
            for e in self.engines:
                e.stop()
            if self.step is not None:
                self.step.stop()
            self.loop.close()
