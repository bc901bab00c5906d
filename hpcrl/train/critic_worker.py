"""One rank of PPO's critic on ranks of its own: ``python -m hpcrl.train.critic_worker --link HOST:PORT --secret
FILE --block-signal USR2`` (started by :class:`hpcrl.train.critic_group.LocalCriticLaunch` or the Slurm critic
step, :mod:`hpcrl.slurm.critic_step`; the protocol is in :mod:`hpcrl.train.critic_group`).

Each rank: blocks the preemption signal (the controller checkpoints the critic, then stops it), connects to the
actor's controller and says its rank, receives the run's config and the critic world's rendezvous, joins the
critic world (gloo on CPU, NCCL on GPUs; megatron-core's groups with ``critic.tensor_parallel_size``, default
``train.tensor_parallel_size``), builds its :class:`~hpcrl.train.critic.Critic` and then serves the
controller's requests, which rank 0 receives and broadcasts (:func:`serve`):

- ``values``: the rollout's samples -> its own micro-batches (:func:`hpcrl.train.actor.build_steps` at the
  critic's data-parallel size) -> every sample's values (:meth:`~hpcrl.train.critic.Critic.sample_values`);
- ``train``: every sample's returns -> the critic's optimizer steps -> their metrics;
- ``save``: its model and optimizer into ``FOLDER/dist_critic`` -> its ``COMPLETE`` entry and files;
- ``load``: a checkpoint's critic into its model and optimizer;
- ``stop``: exit 0.

Rank and world come from ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, else Slurm's ``SLURM_PROCID`` /
``SLURM_NTASKS`` / ``SLURM_LOCALID``. Any error ends the rank with status 1 after rank 0 sent it to the controller
as one line plus traceback (a rank that failed between collectives would leave the others waiting; the
controller sees the exit and stops them all).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # (imported in main(), after the preemption signal is blocked: see there)
    from hpcrl.train.critic_group import Setup


def _env_int(*names: str, default: int = 0) -> int:
    for name in names:
        value = os.environ.get(name)
        if value:
            return int(value)
    return default


def join_world(setup: Setup, rank: int, local_rank: int) -> Any:
    """Join the critic world over the controller's store and build megatron-core's groups: tensor parallel
    ``critic.tensor_parallel_size`` (default ``train.tensor_parallel_size``), expert parallel
    ``train.expert_parallel_size``, data parallel what remains; seeded with ``run.seed``. Returns the store
    (:func:`serve` signals each request on it)."""
    import datetime

    from torch.distributed import PrefixStore, TCPStore

    from hpcrl.train import parallel

    host, port = setup.store
    store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=600))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(setup.world_size), LOCAL_RANK=str(local_rank))
    cfg = setup.cfg
    parallel.init_distributed(store=PrefixStore("critic", store), timeout_s=cfg.train.collective_timeout_s)
    parallel.initialize_model_parallel(critic_tp(cfg), 1, 1, cfg.train.expert_parallel_size,
                                       timeout_s=cfg.train.collective_timeout_s,
                                       etp=cfg.train.expert_tensor_parallel_size)
    parallel.model_parallel_cuda_manual_seed(cfg.run.seed)
    parallel.deterministic_mode(cfg.run.deterministic)
    return store


def critic_tp(cfg: Any) -> int:
    """The critic's tensor-parallel size on ranks of its own: ``critic.tensor_parallel_size``, else the
    actor's."""
    return cfg.critic.tensor_parallel_size or cfg.train.tensor_parallel_size


class CriticServer:
    """The requests a critic rank serves, on its :class:`~hpcrl.train.critic.Critic` (every rank runs each,
    rank 0 returns the answer)."""

    def __init__(self, cfg: Any, model_path: str) -> None:
        from megatron.core import parallel_state

        from hpcrl.train.critic import Critic

        self.cfg = cfg
        self.critic = Critic(cfg, model_path)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.samples = 0

    def info(self) -> dict[str, Any]:
        """What the controller learns once the critic is built."""
        import torch.distributed as dist

        return {"dp_size": self.critic.dp_size, "tp_size": dist.get_world_size() // self.critic.dp_size,
                "path": self.critic.path}

    def values(self, rollout_id: int, samples: dict) -> dict[str, Any]:
        import torch

        from hpcrl.train.actor import build_steps
        from hpcrl.train.critic_group import pack_rows, unpack_samples

        rows = unpack_samples(samples)
        masks = [torch.as_tensor(s.loss_mask, dtype=torch.float32) for s in rows]
        steps, sums = build_steps(rows, masks, [torch.zeros_like(m) for m in masks], self.cfg.train,
                                  self.critic.model.config, self.dp_rank, self.critic.dp_size,
                                  self.critic.device, with_rollout_log_probs=False)
        self.critic.begin(rollout_id, rows, steps, sums)
        return {"values": pack_rows(self.critic.sample_values(len(rows)))}

    def train(self, returns: dict) -> dict[str, Any]:
        from hpcrl.train.critic_group import unpack_rows

        self.critic.begin_train(unpack_rows(returns))
        return {"metrics": self.critic.end_train()}

    def save(self, folder: str) -> dict[str, Any]:
        import torch.distributed as dist

        from hpcrl.checkpoint.layout import files_of, model_dist_dir
        from hpcrl.checkpoint.manager import CRITIC
        from hpcrl.checkpoint.save import list_own_files, model_part, write_part
        from hpcrl.checkpoint.state import DISTRIB_OPTIM_SHARDING

        tmp = Path(folder)
        part = model_part(model_dist_dir(CRITIC), self.critic.ddp_model, self.critic.optimizer,
                          DISTRIB_OPTIM_SHARDING)
        write_part(tmp, part)
        rank, world = dist.get_rank(), dist.get_world_size()
        names = [f"{part.dist}/{n}" for n in files_of(tmp / part.dist)]
        mine = list_own_files(tmp, names, True, rank, world)
        gathered: list[Optional[dict]] = [None] * world
        dist.all_gather_object(gathered, mine)
        files: dict[str, tuple] = {}
        for g in gathered:
            files.update(g or {})
        return {"marker": part.marker(), "files": files}

    def load(self, path: str, entry: dict) -> dict[str, Any]:
        from hpcrl.checkpoint.load import load_model

        load_model(Path(path), entry, self.critic.ddp_model, self.critic.optimizer, strict=True)
        return {}


def serve(conn: Any, server: CriticServer, rank: int, store: Any) -> int:
    """Answer the controller's requests until ``stop`` (returns 0). Rank 0 receives each and broadcasts it to
    the critic's ranks; every rank runs it; rank 0 sends the answer. Between requests (a rollout can take
    longer than a collective's timeout) the other ranks wait on the store, not in a collective: rank 0 sets
    key ``request/<n>`` once request ``n`` arrived. A store that goes away (the controller died) ends them."""
    import time

    import torch.distributed as dist

    from hpcrl.train.critic_group import receive, send

    handlers = {"values": server.values, "train": server.train, "save": server.save, "load": server.load}
    for n in itertools.count():
        key = f"request/{n}"
        if rank == 0:
            message = receive(conn, lambda: None, "a request")
            store.set(key, b"1")
        else:
            while not store.check([key]):
                time.sleep(0.01)
            message = None
        box = [message]
        dist.broadcast_object_list(box, src=0)
        request = dict(box[0])
        op = request.pop("op")
        if op == "stop":
            if rank == 0:
                send(conn, {})
            return 0
        answer = handlers[op](**request)
        if rank == 0:
            send(conn, answer)


def main(argv: Optional[list[str]] = None) -> int:
    """Run one critic rank (see the module doc); 0 after ``stop``, 1 after an error."""
    p = argparse.ArgumentParser(prog="python -m hpcrl.train.critic_worker")
    p.add_argument("--link", required=True, help="the actor controller's HOST:PORT")
    p.add_argument("--secret", required=True, help="the run secret's file (the link's key)")
    p.add_argument("--block-signal", default="USR2", help="the preemption signal, blocked here")
    args = p.parse_args(argv)
    from hpcrl.preempt import signal_by_name

    # Blocked before anything starts a thread (numpy's import starts OpenBLAS's pool; torch and gloo start
    # more): a thread that does not block it would take the signal Slurm sends every step, and die of it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal_by_name(args.block_signal)})
    from hpcrl.rollout.secret import read_secret
    from hpcrl.train.critic_group import connect, receive, send
    rank = _env_int("RANK", "SLURM_PROCID")
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID")
    conn = connect(args.link, read_secret(args.secret).encode())
    send(conn, {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()})
    setup: Setup = receive(conn, lambda: None, "the run's setup")
    if rank != 0:
        conn.close()
        conn = None
    try:
        import torch

        threads = _env_int("SLURM_CPUS_PER_TASK") if "OMP_NUM_THREADS" not in os.environ else 0
        if threads > 0 and not torch.cuda.is_available():
            torch.set_num_threads(threads)
        store = join_world(setup, rank, local_rank)
        server = CriticServer(setup.cfg, setup.model_path)
        if rank == 0:
            send(conn, server.info())
        return serve(conn, server, rank, store)
    except BaseException as e:  # noqa: BLE001 - reported to the controller, then this rank ends
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        if conn is not None and not isinstance(e, KeyboardInterrupt):
            try:
                send(conn, {"error": f"rank {rank}: {type(e).__name__}: {e}", "traceback": text})
            except OSError:
                pass
        return 1
    finally:
        if conn is not None:
            conn.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a rank that failed between collectives must not wait in one
