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
from hpcrl.loop import loop_of
from hpcrl.validate import save_resolved
from hpcrl.run_setup import prepare_model, quiet_logs, run_dir_of

__all__ = ["main", "resolve_cpu_sets", "check_local_engine", "run_local_workers"]


def main(cfg: Config) -> int:
    """``hpcrl run``: write the run folder, prepare the model, run the trainer; 0 on success. The run's
    state for ``hpcrl status`` goes to ``local_run.json`` (:func:`hpcrl.slurm.state.local_run_record`).

    With ``train.nprocs == 1`` the trainer runs in this process (the CPU quickstart); more trainer processes
    are started as local torch.distributed workers on this machine. Returns :data:`hpcrl.errors.EXIT_RETRY`
    (75) when the run stopped early on the preemption signal (``kill -USR2``) with a checkpoint.
    """
    from hpcrl.placement import pin, unpin
    from hpcrl.slurm.state import local_run_record
    from hpcrl.train.critic_group import local_threads

    quiet_logs()
    cpus = resolve_cpu_sets(cfg)
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, run_dir)
    with local_run_record(run_dir, stopped_codes=(EXIT_RETRY,)) as record:  # for hpcrl status
        model_path = prepare_model(cfg)
        if cfg.train.nprocs == 1:
            # with a critic on processes of its own, each process gets its share of the CPUs (unless
            # OMP_NUM_THREADS says how many)
            threads = (local_threads(cfg) if cfg.critic.nprocs > 0 and "OMP_NUM_THREADS" not in os.environ
                       else None)
            before = (pin(cpus.train, threads) if cpus is not None else
                      pin(os.sched_getaffinity(0), threads) if threads is not None else None)
            try:
                result = loop_of(cfg)(cfg, run_dir, model_path)
            finally:
                if before is not None:
                    unpin(before)
            record.exit_code = EXIT_RETRY if result.get("preempted") else 0
        else:
            record.exit_code = run_local_workers(cfg, run_dir, model_path)
        return record.exit_code


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


def check_local_engine(cfg: Config) -> None:
    """A local run's engines start on this machine: with ``rollout.engine`` ``sglang`` (or ``auto`` where torch
    sees CUDA) SGLang must import here. Raises ConfigError (one line, before anything starts) when it does not;
    seen on an H200 without SGLang, where the run stopped with "engine exited with code 1" and the reason sat
    in the engine's log."""
    import importlib.util

    from hpcrl.config import ConfigError
    from hpcrl.rollout.engines import resolve_engine

    if resolve_engine(cfg.rollout.engine) == "sglang" and importlib.util.find_spec("sglang") is None:
        why = "auto picks SGLang where torch sees CUDA, and " if cfg.rollout.engine == "auto" else ""
        raise ConfigError("rollout.engine", cfg.rollout.engine, f"{why}sglang is not installed here",
                          "pip install sglang (the gpu extra), or set rollout.engine=cpu")


def _worker(rank: int, world_size: int, init_method: str, cfg, run_dir: Path, model_path: Path) -> None:
    from hpcrl.train.parallel import INIT_METHOD_ENV

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", **{INIT_METHOD_ENV: init_method})
    os.environ.pop("MASTER_PORT", None)
    import torch

    from hpcrl.placement import parse_cpu_list, pin
    from hpcrl.train.critic_group import local_threads

    if cfg.run.placement == "disaggregate" and cfg.train.cpus is not None:  # resolved by main()
        pin(parse_cpu_list(cfg.train.cpus), threads=local_threads(cfg))
    else:
        torch.set_num_threads(local_threads(cfg))
    from hpcrl.errors import run_worker

    # a known error is handed to the parent (one line there), not printed here as a traceback
    run_worker(run_dir, rank, lambda: loop_of(cfg)(cfg, run_dir, model_path))


def run_local_workers(cfg, run_dir: Path, model_path: Path) -> int:
    """Start ``cfg.train.nprocs`` trainer processes, wait for all; 0 when every one exited 0.

    If one worker fails the others are terminated (they would block in a collective), and its exit code is
    returned; when it failed on a known error (:mod:`hpcrl.errors`) that error is raised here instead, as a
    :class:`~hpcrl.errors.WorkerError` carrying its one line, exit status and traceback.
    """
    import shutil
    import tempfile

    n = cfg.train.nprocs
    rendezvous = Path(tempfile.mkdtemp(prefix="hpcrl-rendezvous-"))  # a new file each launch (torch's rule)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker,
                         args=(r, n, f"file://{rendezvous / 'store'}", cfg, run_dir, model_path),
                         name=f"trainer-{r}") for r in range(n)]
    try:
        return _join_workers(procs, run_dir)
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)


def _join_workers(procs: list, run_dir: Path) -> int:
    """Start ``procs`` and wait for all (see :func:`run_local_workers`)."""
    from hpcrl.errors import worker_error

    n = len(procs)
    for p in procs:
        p.start()
    failed, failed_rank = 0, None
    alive = list(procs)
    while alive:
        for p in list(alive):
            p.join(timeout=0.5)
            if p.exitcode is None:
                continue
            alive.remove(p)
            if p.exitcode != 0 and not failed:
                failed, failed_rank = p.exitcode, procs.index(p)
                for q in alive:
                    q.terminate()
    if failed:
        errors = [worker_error(run_dir, r) for r in range(n)]  # read (and remove) every report
        known = errors[failed_rank] or next((e for e in errors if e is not None), None)
        if known is not None:
            raise known
    return failed
