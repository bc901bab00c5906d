"""``hpcrl run``: the run on this machine without Slurm (:func:`main`), in this process or, with
``train.nprocs > 1``, as several trainer processes (:func:`run_local_workers`).

Each worker gets torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) and a ``file://``
rendezvous in a new temporary folder (:data:`hpcrl.train.parallel.INIT_METHOD_ENV`: no port is picked, so none
can be taken by another process before rank 0 binds it) and runs the loop of ``run.mode``
(:func:`hpcrl.loop.loop_of`: :func:`hpcrl.loop.train_main` or :func:`hpcrl.loop_async.train_async_main`);
rank 0 is the controller. Under
Slurm the same function runs as a job step instead (``hpcrl submit``). With ``run.placement: disaggregate``
the trainer is pinned to its CPU set and the engines to theirs (:mod:`hpcrl.placement`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from hpcrl.config import Config
from hpcrl.errors import EXIT_RETRY
from hpcrl.validate import save_resolved
from hpcrl.run_setup import quiet_logs, run_dir_of
from hpcrl.stages import prepare_base, run_stages

WAIT_S = 0.1
"""Seconds the launcher waits at most between looks at its workers; the preemption signal is passed on the
moment it comes."""

__all__ = ["main", "resolve_cpu_sets", "check_local_trainer", "check_local_engine", "run_local_workers",
           "engine_forks", "engine_launcher"]


def main(cfg: Config, warm_start_only: bool = False) -> int:
    """``hpcrl run``: write the run folder, prepare the base model, run the trainer (the warm start when
    enabled, then the loop: :func:`hpcrl.stages.run_stages`); 0 on success. The run's state for
    ``hpcrl status`` goes to ``local_run.json`` (:func:`hpcrl.slurm.state.local_run_record`).
    ``warm_start_only`` (``hpcrl sft``): the warm start alone, no run folder.

    With ``train.nprocs == 1`` the trainer runs in this process (the CPU quickstart); more trainer processes
    are started as local torch.distributed workers on this machine. Returns :data:`hpcrl.errors.EXIT_RETRY`
    (75) when the run stopped early on the preemption signal (``kill -USR2``) with a checkpoint.
    """
    from hpcrl.slurm.state import local_run_record

    quiet_logs()
    cpus = resolve_cpu_sets(cfg)
    run_dir = run_dir_of(cfg)
    # before anything runs a tensor operation or starts a thread: the engines' fork server (one trainer process)
    with engine_forks(cfg, cfg.train.nprocs == 1) as forks:
        if warm_start_only:
            return _run_trainer(cfg, run_dir, prepare_base(cfg), cpus, warm_start_only=True, forks=forks)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(cfg, run_dir)
        with local_run_record(run_dir, stopped_codes=(EXIT_RETRY,)) as record:  # for hpcrl status
            record.exit_code = _run_trainer(cfg, run_dir, prepare_base(cfg), cpus, forks=forks)
            return record.exit_code


def engine_forks(cfg: Config, starts_engines: bool = True):
    """A context manager giving the fork server this trainer process forks its CPU engines from
    (:class:`hpcrl.fork_server.ForkServer`, closed at the end), or None where engines are started with
    ``subprocess``: ``starts_engines`` False (this process does not start them), engines that are not the CPU
    engine, a GPU present, ``HPCRL_ENGINE_FORK=0`` (:func:`hpcrl.fork_server.fork_allowed`). Enter it before
    this process runs a tensor operation or starts a thread."""
    import contextlib

    from hpcrl.fork_server import ForkServer
    from hpcrl.rollout.engines import resolve_engine

    if not (starts_engines and resolve_engine(cfg.rollout.engine) == "cpu"):
        return contextlib.nullcontext()
    return ForkServer.start() or contextlib.nullcontext()  # (None where forking is not allowed)


def engine_launcher(forks):
    """The engine launcher (:data:`hpcrl.rollout.fleet.EngineLauncher`) of a local run whose CPU engines are
    forked from ``forks`` (None: the default, engines started with ``subprocess``)."""
    import functools

    from hpcrl.rollout.engines import launch_local_engines

    return None if forks is None else functools.partial(launch_local_engines, forks=forks)


def starting_model(cfg: Config) -> Path:
    """``hpcrl sft`` and ``hpcrl eval``: the HF folder the run starts from, made on this machine first when
    it is a warm start that is not cached (:func:`main` with ``warm_start_only``; on ``train.nprocs``
    processes). Raises RuntimeError when the warm start stopped early (preempted) or a worker failed, and what
    the warm start raises."""
    from hpcrl.sft import warm_start_folder

    code = main(cfg, warm_start_only=True)
    if code != 0:
        raise RuntimeError(f"the warm start stopped early (exit status {code}); run it again to resume it")
    base = prepare_base(cfg)
    return warm_start_folder(cfg, base) if cfg.sft.enabled and cfg.run.mode != "sft" else base


def _run_trainer(cfg: Config, run_dir: Path, base: Path, cpus, warm_start_only: bool = False,
                 forks=None) -> int:
    """The trainer's stages in this process (``train.nprocs == 1``; CPU engines forked from ``forks`` when
    given) or in worker processes; 0, or :data:`EXIT_RETRY` when stopped early with a checkpoint, or a failed
    worker's exit status."""
    from hpcrl.placement import pin, unpin
    from hpcrl.train.critic_group import local_threads

    if cfg.train.nprocs > 1:
        return run_local_workers(cfg, run_dir, base, warm_start_only)
    # with a critic on processes of its own, each process gets its share of the CPUs (unless
    # OMP_NUM_THREADS says how many)
    threads = (local_threads(cfg) if cfg.critic.nprocs > 0 and "OMP_NUM_THREADS" not in os.environ
               else None)
    before = (pin(cpus.train, threads) if cpus is not None else
              pin(os.sched_getaffinity(0), threads) if threads is not None else None)
    try:
        result = run_stages(cfg, run_dir, base, launch_engines=engine_launcher(forks),
                            warm_start_only=warm_start_only)
    finally:
        if before is not None:
            unpin(before)
    return EXIT_RETRY if result.get("preempted") else 0


def resolve_cpu_sets(cfg: Config):
    """A disaggregated local run's CPU sets (:func:`hpcrl.placement.local_cpu_sets`), written into
    ``cfg.train.cpus`` / ``cfg.rollout.cpus`` (so the resolved config and the engine launcher see them);
    None when colocated. Idempotent (``hpcrl run`` calls it before :func:`main` to refuse bad sets as config
    errors). Raises ConfigError (CPUs this machine does not give the run, or only one CPU)."""
    from hpcrl.placement import format_cpu_list, run_cpu_sets

    cpus = run_cpu_sets(cfg)
    if cpus is not None:
        cfg.train.cpus, cfg.rollout.cpus = format_cpu_list(cpus.train), format_cpu_list(cpus.rollout)
    return cpus


def check_local_trainer(cfg: Config) -> None:
    """A local run's trainer can be built on this machine: megatron-core's CPU optimizer offload
    (``megatron.optimizer_cpu_offload``, its HybridDeviceOptimizer) moves the Adam update to the host from a
    GPU and opens CUDA streams at build, so it needs one. Raises ConfigError (one line, before anything starts)
    on a machine with no GPU device node (:func:`hpcrl.procs.cuda_possible`; torch is not imported); before,
    such a run failed at its trainer's build with "Torch not compiled with CUDA enabled"."""
    from hpcrl.config import ConfigError
    from hpcrl.procs import cuda_possible

    if (cfg.megatron or {}).get("optimizer_cpu_offload") and not cuda_possible():
        raise ConfigError("megatron.optimizer_cpu_offload", True, "it moves Adam to the host from a GPU "
                          "(megatron-core's HybridDeviceOptimizer opens CUDA streams) and this machine has none",
                          "set megatron.optimizer_cpu_offload=false for a run on CPUs (Adam is on the host "
                          "there already)")


def check_local_engine(cfg: Config) -> None:
    """A local run's engines start on this machine: with ``rollout.engine`` ``sglang`` (or ``auto`` where torch
    sees CUDA) SGLang's server must import here, in the engines' environment (``rollout.engine_env``;
    :func:`hpcrl.rollout.engines.sglang_missing`). Raises ConfigError (one line, before anything starts) when
    it does not; seen on an H200 without SGLang, where the run stopped with "engine exited with code 1" and
    the reason sat in the engine's log. On a CPU, fp8 rollout weights need AMX (SGLang's fp8 method there)."""
    from hpcrl.config import ConfigError
    from hpcrl.rollout.engines import (amx_tile_supported, engine_env, engine_sglang_args, on_gpu,
                                       resolve_engine, sglang_cpu_args, sglang_missing)

    if resolve_engine(cfg.rollout.engine) != "sglang":
        return
    if cfg.weights.rollout_dtype == "fp8" and not on_gpu():
        if not amx_tile_supported():
            raise ConfigError("weights.rollout_dtype", "fp8", "SGLang on a CPU serves fp8 weights only with AMX and "
                              "its CPU kernels ('Fp8LinearMethod on CPU requires that CPU has AMX support'), and "
                              "this CPU has no AMX", "set weights.rollout_dtype=null here (fp8 engines need GPUs, "
                              "or an AMX CPU with sgl_kernel built for CPU)")
        dtype = sglang_cpu_args(engine_sglang_args(cfg))["dtype"]
        if dtype == "float32":
            raise ConfigError("model.dtype", cfg.model.dtype, "SGLang serves fp8 weights with bfloat16 or float16 "
                              "activations only, and its CPU engines here would run float32",
                              "set sglang.dtype=bfloat16 (or model.dtype=bfloat16)")
    missing = sglang_missing(dict(os.environ, **engine_env(cfg.rollout)))
    if missing:
        why = "auto picks SGLang where torch sees CUDA, and " if cfg.rollout.engine == "auto" else ""
        raise ConfigError("rollout.engine", cfg.rollout.engine,
                          f"{why}SGLang's server cannot import {', '.join(missing)} here (with "
                          "rollout.engine_env)", "pip install sglang (the gpu extra; on a CPU: tests/sglang_cpu), "
                          "or set rollout.engine=cpu")


def _worker(rank: int, world_size: int, init_method: str, cfg, run_dir: Path, base: Path,
            warm_start_only: bool = False) -> None:
    from hpcrl.procs import die_with_parent
    from hpcrl.train.parallel import INIT_METHOD_ENV

    # a launcher killed outright (SIGKILL, or SIGTERM outside Slurm) takes its trainer processes with it, and
    # they their engines: left alone they held the cores, ports and the run folder (seen after `kill` of a
    # two-rank run)
    die_with_parent()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", **{INIT_METHOD_ENV: init_method})
    os.environ.pop("MASTER_PORT", None)
    # the controller starts the engines: their fork server, forked before this process ran anything
    with engine_forks(cfg, rank == 0) as forks:
        import torch

        from hpcrl.placement import parse_cpu_list, pin
        from hpcrl.train.critic_group import local_threads

        if cfg.run.placement == "disaggregate" and cfg.train.cpus is not None:  # resolved by main()
            pin(parse_cpu_list(cfg.train.cpus), threads=local_threads(cfg))
        else:
            torch.set_num_threads(local_threads(cfg))
        from hpcrl.errors import run_worker

        # a known error is handed to the parent (one line there), not printed here as a traceback
        def stages() -> None:
            result = run_stages(cfg, run_dir, base, launch_engines=engine_launcher(forks),
                                warm_start_only=warm_start_only)
            if result.get("preempted"):
                raise SystemExit(EXIT_RETRY)

        run_worker(run_dir, rank, stages)


def run_local_workers(cfg, run_dir: Path, base: Path, warm_start_only: bool = False) -> int:
    """Start ``cfg.train.nprocs`` trainer processes running :func:`hpcrl.stages.run_stages` from
    ``base``, wait for all; 0 when every one exited 0 (:data:`EXIT_RETRY` when they stopped early with a
    checkpoint).

    If one worker fails the others are terminated (they would block in a collective), and its exit code is
    returned; when it failed on a known error (:mod:`hpcrl.errors`) that error is raised here instead, as a
    :class:`~hpcrl.errors.WorkerError` carrying its one line, exit status and traceback.

    The preemption signal (``slurm.signal``, USR2) sent to this launcher (``kill -USR2 PID``) is passed on to
    every worker, which checkpoints and stops at the same step as on Slurm. It is blocked here before the
    workers start, so they inherit it blocked and one that comes while they import is held pending until
    their watch reads it (:class:`hpcrl.preempt.PreemptionWatch`), never killing a worker half started.
    """
    import shutil
    import signal
    import tempfile
    import threading

    from hpcrl.preempt import signal_from_config, take_pending

    n = cfg.train.nprocs
    rendezvous = Path(tempfile.mkdtemp(prefix="hpcrl-rendezvous-"))  # a new file each launch (torch's rule)
    ctx = worker_context()
    procs = [ctx.Process(target=_worker,
                         args=(r, n, f"file://{rendezvous / 'store'}", cfg, run_dir, base, warm_start_only),
                         name=f"trainer-{r}") for r in range(n)]
    signum = signal_from_config(cfg.slurm.signal)
    main_thread = threading.current_thread() is threading.main_thread()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signum}) if main_thread else None
    try:
        return _join_workers(procs, run_dir, signum if main_thread else None)
    finally:
        if old_mask is not None:
            take_pending(signum)  # came after the workers ended: nothing is left to stop
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        shutil.rmtree(rendezvous, ignore_errors=True)


def worker_context():
    """The multiprocessing context the trainer processes start in: a fork server (one per launcher, started with
    the first worker) that imports :mod:`hpcrl.train.preload` (torch, megatron-core, transformers, the trainer)
    once, so each process forked from it skips those ~5 CPU-seconds of imports; where a GPU is present
    (``/dev/nvidiactl``) the server imports nothing (CUDA must not be initialised before a fork), and each
    process imports what it needs itself, as with ``spawn``. The server inherits this process's environment and
    blocked signals when it starts, and with them every worker. It dies with this process
    (:mod:`hpcrl.train.forkserver_guard`), and the workers with it."""
    from hpcrl.procs import LAUNCHER_PID_ENV

    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # read by the guard in the server this process starts
    ctx = mp.get_context("forkserver")
    gpu = Path("/dev/nvidiactl").exists()
    ctx.set_forkserver_preload(["hpcrl.train.forkserver_guard"] + ([] if gpu else ["hpcrl.train.preload"]))
    return ctx


def _join_workers(procs: list, run_dir: Path, forward_signal=None) -> int:
    """Start ``procs`` and wait for all (see :func:`run_local_workers`); ``forward_signal``, blocked in this
    thread, is passed on to the workers still running the moment it comes (within :data:`WAIT_S`)."""
    import signal
    from multiprocessing import connection as mp_connection

    from hpcrl.errors import worker_error

    n = len(procs)
    for p in procs:
        p.start()
    failed, failed_rank, stopped = 0, None, False
    alive = list(procs)
    while alive:
        # wait for the signal or a worker's end, whichever comes first: a step can take a fraction of a
        # second, and a signal passed on a second late lands after the run's last step (nothing is saved)
        if forward_signal is not None:
            if signal.sigtimedwait({forward_signal}, WAIT_S) is not None:
                for p in alive:  # every one was started above
                    os.kill(p.pid, forward_signal)
        else:
            mp_connection.wait([p.sentinel for p in alive], timeout=WAIT_S)
        for p in list(alive):
            if p.exitcode is None:
                continue
            p.join()
            alive.remove(p)
            if p.exitcode == EXIT_RETRY:  # stopped early with a checkpoint: the others stop at the same step
                stopped = True
            elif p.exitcode != 0 and not failed:
                failed, failed_rank = p.exitcode, procs.index(p)
                for q in alive:
                    q.terminate()
    if failed:
        errors = [worker_error(run_dir, r) for r in range(n)]  # read (and remove) every report
        known = errors[failed_rank] or next((e for e in errors if e is not None), None)
        if known is not None:
            raise known
    return failed or (EXIT_RETRY if stopped else 0)
