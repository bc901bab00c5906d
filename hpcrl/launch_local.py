"""``hpcrl run``: the run on this machine without Slurm (:func:`main`), in this process or, with
``train.nprocs > 1``, as several trainer processes (:func:`run_local_workers`).

Each worker gets torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` on loopback) and runs :func:`hpcrl.loop.train_main`; rank 0 is the controller. Under Slurm the
same function runs as a job step instead (``hpcrl submit``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from hpcrl.config import Config, save_resolved
from hpcrl.procs import find_free_port
from hpcrl.run_setup import prepare_model, quiet_logs, run_dir_of
from hpcrl.slurm.requeue import EXIT_REQUEUE

EXIT_PREEMPTED = EXIT_REQUEUE
"""Exit status of a run that stopped early on the preemption signal or its deadline, after a checkpoint
(``EX_TEMPFAIL``: run it again, or requeue it, and it resumes); :data:`hpcrl.slurm.requeue.EXIT_REQUEUE`."""


def main(cfg: Config) -> int:
    """``hpcrl run``: write the run folder, prepare the model, run the trainer; 0 on success. The run's
    state for ``hpcrl status`` goes to ``local_run.json`` (:func:`hpcrl.slurm.state.local_run_record`).

    With ``train.nprocs == 1`` the trainer runs in this process (the CPU quickstart); more trainer processes
    are started as local torch.distributed workers on this machine. Returns :data:`EXIT_PREEMPTED` when the
    run stopped early on the preemption signal (``kill -USR2``) with a checkpoint.
    """
    from hpcrl.loop import train_main
    from hpcrl.slurm.state import local_run_record

    quiet_logs()
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, run_dir)
    with local_run_record(run_dir, stopped_codes=(EXIT_PREEMPTED,)) as record:  # for hpcrl status
        model_path = prepare_model(cfg)
        if cfg.train.nprocs == 1:
            result = train_main(cfg, run_dir, model_path)
            record.exit_code = EXIT_PREEMPTED if result.get("preempted") else 0
        else:
            record.exit_code = run_local_workers(cfg, run_dir, model_path)
        return record.exit_code


def _worker(rank: int, world_size: int, port: int, cfg, run_dir: Path, model_path: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    from hpcrl.errors import run_worker
    from hpcrl.loop import train_main

    # a known error is handed to the parent (one line there), not printed here as a traceback
    run_worker(run_dir, rank, lambda: train_main(cfg, run_dir, model_path))


def run_local_workers(cfg, run_dir: Path, model_path: Path) -> int:
    """Start ``cfg.train.nprocs`` trainer processes, wait for all; 0 when every one exited 0.

    If one worker fails the others are terminated (they would block in a collective), and its exit code is
    returned; when it failed on a known error (:mod:`hpcrl.errors`) that error is raised here instead, as a
    :class:`~hpcrl.errors.WorkerError` carrying its one line, exit status and traceback.
    """
    from hpcrl.errors import worker_error

    n = cfg.train.nprocs
    port = find_free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, n, port, cfg, run_dir, model_path), name=f"trainer-{r}")
             for r in range(n)]
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
