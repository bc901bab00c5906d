"""Disaggregated weight sync: one torch.distributed group of sender and engine ranks, data by broadcast.

slime's ``UpdateWeightFromDistributed``: the sender (trainer rank 0) is rank 0 of a weight-update group of
``1 + sum(engine TP sizes)`` ranks; engine ``i`` joins through ``/init_weights_update_group`` with
``rank_offset = 1 + sum of the TP sizes of engines 0..i-1``. Per bucket (``--update-weight-buffer-size``), the
names, dtypes and shapes go to every engine with ``/update_weights_from_distributed`` while the sender
broadcasts each tensor from rank 0; the last bucket carries ``weight_version`` and ``flush_cache``. The group
is created on the first sync and reused until :meth:`DistributedGroup.close`.

Backend: ``nccl`` with CUDA, ``gloo`` without; the backend actually used is what the engines are told. The
group's timeout (rendezvous and every collective) is ``timeout_s``, so a broadcast to an engine that stopped
receiving fails after that long instead of hanging. Collectives and the rendezvous run in a worker thread so
that the HTTP calls they pair with stay in flight on the event loop.

Networks: the engines connect to ``master_address`` (default: the sender's address on the route to the first
engine); gloo and NCCL pick their own interface for the data, so on multi-homed nodes set
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` on both sides as for any torch.distributed job.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from hpcrl.weights.buckets import iter_buckets
from hpcrl.weights.common import EngineCalls, WeightSyncError

logger = logging.getLogger(__name__)

INIT = "/init_weights_update_group"
UPDATE = "/update_weights_from_distributed"
DESTROY = "/destroy_weights_update_group"


def wire_view(t: Any) -> Any:
    """The tensor a broadcast moves: a float8 tensor as its ``uint8`` bytes (gloo has no float8 type; NCCL
    moves torch's float8 as bytes too), anything else as it is. Both ends use it, so the bytes are the
    tensor's either way."""
    import torch

    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def sender_address(engine_url: str) -> str:
    """The sender's IP address on the interface that routes to ``engine_url``'s host (no packet is sent)."""
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def rank_offsets(engine_tp_sizes: Sequence[int]) -> list[int]:
    """``rank_offset`` of each engine: ``1 + sum of the TP sizes of the engines before it``."""
    out, acc = [], 1
    for tp in engine_tp_sizes:
        out.append(acc)
        acc += int(tp)
    return out


def host_store(address: str, world_size: int, timeout: datetime.timedelta) -> Any:
    """The weight-update group's TCPStore server, listening on ``address`` and a port the OS picks as it binds
    (``store.port``), so no other process can take the port between a pick and the bind; returns at once
    (the engines connect when they are told the port).

    Created explicitly rather than by torch's ``tcp://`` rendezvous: under torchrun
    (``TORCHELASTIC_USE_AGENT_STORE=True``) that makes every rank, rank 0 included, a *client* of the agent's
    store, so no one would listen and the engines' rendezvous would time out. Raises on a bind failure.
    """
    from torch.distributed import TCPStore

    store = TCPStore(address, 0, world_size, True, timeout, wait_for_workers=False)
    store.set_timeout(timeout)
    return store


def join_group(backend: str, store: Any, world_size: int, group_name: str,
               timeout: datetime.timedelta) -> Any:
    """Join weight-update group ``group_name`` as rank 0 over ``store`` (:func:`host_store`).

    The equivalent of :func:`hpcrl.engine.weights.init_custom_process_group` (SGLang's helper) for rank 0. The
    store keys are prefixed with ``group_name`` (as on the engine side). Blocks until every rank joined;
    raises on timeout (``timeout``). Returns the ``ProcessGroup``.
    """
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    pg, _ = _new_process_group_helper(world_size, 0, [], Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class DistributedGroup:
    """The sender's side of one weight-update group (rank 0) and the engines that joined it."""

    calls: EngineCalls
    group_name: str
    backend: str
    master_address: str
    master_port: int
    world_size: int
    pg: Any = field(repr=False)
    closed: bool = False

    @classmethod
    async def create(cls, calls: EngineCalls, engine_tp_sizes: Sequence[int], group_name: str, *,
                     master_address: str | None = None, backend: str | None = None) -> DistributedGroup:
        """Create the group: POST ``/init_weights_update_group`` to every engine while joining as rank 0.

        ``master_address`` defaults to :func:`sender_address` of the first engine; the port is the one the
        group's store bound (:func:`host_store`: held from the pick on, never raced for).
        ``backend`` defaults to ``nccl`` with CUDA, else ``gloo``. Rendezvous and each call are bounded by
        ``calls.timeout_s`` seconds. Raises WeightSyncError if an engine refuses or the local join fails.
        """
        import torch

        if len(engine_tp_sizes) != len(calls.urls):
            raise ValueError(f"{len(engine_tp_sizes)} TP sizes for {len(calls.urls)} engines")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        address = master_address or sender_address(calls.urls[0])
        world = 1 + sum(int(t) for t in engine_tp_sizes)
        timeout = datetime.timedelta(seconds=calls.timeout_s)
        try:
            store = host_store(address, world, timeout)
        except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError: name the address
            raise WeightSyncError(f"tcp://{address}", "host the weight-update group's store (rank 0)",
                                  f"{type(e).__name__}: {e}") from e
        port = int(store.port)
        bodies = [{"master_address": address, "master_port": port, "rank_offset": off, "world_size": world,
                   "group_name": group_name, "backend": backend} for off in rank_offsets(engine_tp_sizes)]
        posts = asyncio.ensure_future(calls.each(INIT, bodies, per_engine=True))
        join = asyncio.ensure_future(asyncio.to_thread(join_group, backend, store, world, group_name,
                                                       timeout))
        results = await asyncio.gather(posts, join, return_exceptions=True)
        if isinstance(results[1], BaseException):
            if isinstance(results[0], WeightSyncError):
                raise results[0]
            raise WeightSyncError(f"tcp://{address}:{port}", "join weight-update group (rank 0)",
                                  f"{type(results[1]).__name__}: {results[1]}") from results[1]
        pg = results[1]
        if isinstance(results[0], BaseException):
            _destroy_local(pg)
            raise results[0]
        logger.info("weight-update group %s: %s on %s:%d, world size %d", group_name, backend, address, port,
                    world)
        return cls(calls, group_name, backend, address, port, world, pg)

    def _broadcast_all(self, tensors: list) -> None:
        import torch
        import torch.distributed as dist

        if tensors and tensors[0].is_cuda:  # a worker thread starts on device 0
            torch.cuda.set_device(tensors[0].device)
        for t in tensors:
            dist.broadcast(wire_view(t), src=0, group=self.pg)

    async def send_bucket(self, tensors: list[tuple[str, Any]], weight_version: str | None,
                          is_last: bool, flush: bool = True, load_format: str | None = None) -> None:
        """POST the bucket's names/dtypes/shapes to every engine and broadcast its tensors from rank 0.

        ``weight_version`` is sent when ``is_last``, and ``flush_cache`` then too unless ``flush`` is False.
        ``load_format``: sent along (hpcrl's CPU engine takes :data:`hpcrl.weights.delta.DELTA_LOADER`
        there). The calls must run inside a weight-update session (SGLang refuses them otherwise, without
        receiving the broadcast). Raises WeightSyncError if an engine
        refuses (after receiving all broadcasts, the engine names the bad tensor) or a call or broadcast does
        not finish within the group's timeout.
        """
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
        data = [t.detach().to(device).contiguous() for _, t in tensors]
        body: dict[str, Any] = {"names": [n for n, _ in tensors],
                                "dtypes": [_dtype_name(t.dtype) for t in data],
                                "shapes": [list(t.shape) for t in data],
                                "group_name": self.group_name, "flush_cache": bool(is_last and flush)}
        if is_last and weight_version is not None:
            body["weight_version"] = str(weight_version)
        if load_format is not None:
            body["load_format"] = load_format
        posts = asyncio.ensure_future(self.calls.each(UPDATE, body))
        cast = asyncio.ensure_future(asyncio.to_thread(self._broadcast_all, data))
        results = await asyncio.gather(posts, cast, return_exceptions=True)
        if isinstance(results[0], WeightSyncError) and isinstance(results[1], BaseException):
            err = results[0]
            note = f"; the broadcast from rank 0 failed too: {type(results[1]).__name__}: {results[1]}"
            raise WeightSyncError(err.url, err.endpoint, err.message + note, err.failures) from results[1]
        if isinstance(results[0], BaseException):
            raise results[0]
        if isinstance(results[1], BaseException):
            raise WeightSyncError(f"tcp://{self.master_address}:{self.master_port}", "broadcast (rank 0)",
                                  f"{type(results[1]).__name__}: {results[1]}") from results[1]

    async def close(self) -> None:
        """POST ``/destroy_weights_update_group`` to every engine and destroy the local group (idempotent).

        The local group is destroyed even if an engine fails; then raises WeightSyncError.
        """
        if self.closed:
            return
        self.closed = True
        try:
            await self.calls.each(DESTROY, {"group_name": self.group_name})
        finally:
            _destroy_local(self.pg)


def _destroy_local(pg: Any) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except Exception as e:  # noqa: BLE001 - teardown must not mask the real error
        logger.warning("destroying the local weight-update group: %s", e)


async def send_distributed(group: DistributedGroup, named_tensors: Iterable, weight_version: str, *,
                           bucket_bytes: int, flush: bool = True, load_format: str | None = None) -> dict:
    """Send every tensor of ``named_tensors`` over ``group`` in buckets of at most ``bucket_bytes`` bytes
    (``flush``, ``load_format``: :meth:`DistributedGroup.send_bucket`).

    Returns ``{"bytes", "buckets", "tensors", "post_seconds"}``. Raises WeightSyncError (see
    :meth:`DistributedGroup.send_bucket`), ValueError for an empty stream.
    """
    stats = {"bytes": 0, "buckets": 0, "tensors": 0, "post_seconds": 0.0}
    for bucket in iter_buckets(named_tensors, bucket_bytes):
        t0 = time.perf_counter()
        await group.send_bucket(bucket.tensors, weight_version, bucket.is_last, flush, load_format)
        stats["post_seconds"] += time.perf_counter() - t0
        stats["bytes"] += bucket.nbytes
        stats["buckets"] += 1
        stats["tensors"] += len(bucket)
    if stats["buckets"] == 0:
        raise ValueError("no tensors to send")
    return stats
