"""One entry point for weight sync: :class:`WeightSyncer` (per run) and :func:`iterate_for_sync` (per sync).

Every trainer rank calls ``await syncer.sync(iterate_for_sync(model), version)`` after each train step,
because the export all-gathers each tensor over the TP group (all ranks of rank 0's TP group must iterate
together). Only the sender (trainer global rank 0, ``is_sender=True``) talks to the engines; the other ranks
just drive the iterator (ranks outside rank 0's TP group get an empty one).

The sender does what slime's ``update_weights`` does around the transfer:

1. ``/pause_generation`` (``weights.pause_mode``, :func:`resolve_pause_mode`: ``abort``, SGLang's default,
   except ``in_place`` in fully asynchronous runs; ``abort``: running requests return early with
   ``finish_reason.type == "abort"``), then ``/flush_cache`` (asked again while it answers 400); with mode
   ``in_place`` the running requests keep their KV cache, so there is no flush (SGLang would refuse it) and
   the updates are sent with ``flush_cache: false``;
2. ``/begin_weight_update`` on every engine for ``tensor`` and ``distributed``: SGLang 0.5.23 refuses those
   updates outside a weight-update session (:mod:`hpcrl.engine.state`; ``disk`` is not gated);
3. transfer with ``tensor``, ``distributed`` or ``disk`` (see :mod:`hpcrl.weights`); the last call sets
   ``weight_version``;
4. ``/end_weight_update`` on every engine (SGLang finalises in-place-quantised weights there);
5. check that every engine reports the new ``weight_version`` in ``/get_model_info`` (slime's CI check);
6. ``/continue_generation``.

Every call is bounded by ``timeout_s`` (the group's collectives too). On any failure the sync raises
:class:`~hpcrl.weights.common.WeightSyncError` (one line naming the engine) and leaves the engines **paused**,
so no rollout runs on partially updated weights; a failure inside the session closes it first on every engine
(the error says so, or names the engines it could not be closed on; the next sync closes it there). The
caller may retry the sync or give up (``client.resume()`` resumes them on the old or mixed weights). In
colocated runs the caller brings the engines' weights memory back (``/resume_memory_occupation``) before the
sync and the KV cache after it, as slime's ``onload_weights`` / ``onload_kv`` do; this module does not touch
memory occupation.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpcrl.weights.common import EngineCalls, WeightSyncError

logger = logging.getLogger(__name__)

METHODS = ("tensor", "distributed", "disk")
PAUSE_MODES = ("abort", "retract", "in_place")


def resolve_pause_mode(pause_mode: str | None, run_mode: str) -> str:
    """``weights.pause_mode`` with null resolved: ``in_place`` in ``run.mode: fully_async`` (in-flight
    responses keep their tokens and KV cache across the update, miles' ``--pause-generation-mode in_place``),
    ``abort`` otherwise (the sync and one-step-off loops sync between rollouts, with the engines idle).

    What the rollout records per mode (the behaviour log-prob is always the engine's sampled log-prob, the
    distribution the token was actually drawn from): ``abort``: the running responses end aborted and are
    continued by a new call, so each token comes from one version's policy given its prefix; ``retract``: the
    running responses are re-prefilled with the new weights, likewise one version per token; ``in_place``:
    tokens sampled after the update come from the new weights over the KV cache the old weights computed for
    the earlier tokens, a mixture that is neither version's policy. Per-token versions come from the streaming
    client (:mod:`hpcrl.rollout.token_versions`). Raises ValueError on an unknown mode."""
    mode = pause_mode if pause_mode is not None else ("in_place" if run_mode == "fully_async" else "abort")
    if mode not in PAUSE_MODES:
        raise ValueError(f"unknown pause_mode {mode!r}; use one of {PAUSE_MODES}")
    return mode


def needs_session(method: str) -> bool:
    """Whether ``method``'s update endpoint (its transport module's) runs only inside a weight-update session
    on SGLang 0.5.23 (:data:`hpcrl.engine.state.SESSION_GATED`: ``tensor`` and ``distributed``, not
    ``disk``)."""
    from hpcrl.engine.state import SESSION_GATED
    from hpcrl.weights import disk, distributed, tensor

    endpoint = {"tensor": tensor.ENDPOINT, "distributed": distributed.UPDATE, "disk": disk.ENDPOINT}[method]
    return endpoint.lstrip("/") in SESSION_GATED


def iterate_for_sync(model: Any, dtype: Any = None, adapters: bool = False) -> Iterator[tuple[str, Any]]:
    """The ``(hf_name, full_tensor)`` stream of ``model`` for :meth:`WeightSyncer.sync` on this rank.

    ``model``: the trainer's megatron-core GPTModel (possibly wrapped). ``dtype``: cast each tensor (None:
    keep the parameters' dtype; the engine casts to its own). Tensors that need no gather or reshuffle are
    views of the parameters (``export_hf_weights(copy=False)``): every consumer of a sync copies each tensor
    once (into the staging arena, a broadcast, a file, the snapshot) before the parameters change. On ranks of rank 0's TP group (data-parallel
    and context-parallel rank 0) this is :func:`hpcrl.train.bridge.export_hf_weights`, whose every tensor is
    an all-gather over the TP group, so all of them must consume it; other ranks get an empty iterator (they
    hold replicas and take no part). With expert parallelism every rank exports (a routed expert is gathered
    over its expert-parallel group, which spans data-parallel ranks); rank 0 still sends alone. Needs
    megatron-core's parallel state to be initialised. ``adapters``: the LoRA adapters alone, under PEFT's names
    (:func:`hpcrl.train.lora.peft_state_dict`; a sync with ``adapter_config``), ``dtype`` ignored.
    """
    from megatron.core import parallel_state

    from hpcrl.train.bridge import export_hf_weights
    from hpcrl.train.lora import peft_state_dict

    def stream():
        return peft_state_dict(model) if adapters else export_hf_weights(model, dtype, copy=False)

    if parallel_state.get_expert_model_parallel_world_size() > 1:
        return stream()  # every rank: expert gathers span DP ranks
    if parallel_state.get_data_parallel_rank() != 0 or parallel_state.get_context_parallel_rank() != 0:
        return iter(())
    return stream()


def _torch_dtype(name: str | None) -> Any:
    """``"bfloat16"`` -> ``torch.bfloat16``; None -> None."""
    if name is None:
        return None
    import torch

    return getattr(torch, str(name).removeprefix("torch."))


def _drain(stream: Iterator) -> None:
    """Consume what is left of ``stream`` (keeps TP peers' collectives matched); errors are ignored."""
    try:
        for _ in stream:
            pass
    except Exception:  # noqa: BLE001 - the original failure is what gets raised
        pass


def tensor_format_for(sglang_engines: bool) -> str:
    """The payload format of ``weights.method: tensor``: ``flattened_bucket`` (slime's: one shared buffer per
    bucket) for hpcrl's CPU engine, and for real SGLang when its own ``FlattenedTensorMetadata`` imports in this
    process (:func:`hpcrl.engine.serialize.metadata_class` then pickles that class, the only one SGLang
    unpickles: any other makes its scheduler exit); otherwise ``direct`` (named tensors, which SGLang takes
    from any trainer), with a log line. Raises nothing."""
    if not sglang_engines:
        return "flattened_bucket"
    import importlib

    from hpcrl.engine.serialize import SGLANG_METADATA_MODULE

    try:
        importlib.import_module(SGLANG_METADATA_MODULE)
        return "flattened_bucket"
    except Exception as e:  # noqa: BLE001 - any failure of SGLang's import means: not here
        logger.info("SGLang engines: tensor payloads as named tensors ('direct'): %s does not import in the "
                    "trainer (%s: %s)", SGLANG_METADATA_MODULE, type(e).__name__, e)
        return "direct"


@dataclass
class WeightSyncer:
    """Pushes trainer weights to the engines of ``client``; one per run (it owns the distributed group).

    Args:
        client: a :class:`hpcrl.rollout.client.RolloutClient` with the engine URLs (and API key); needed on
            the sender only.
        method: ``tensor`` (colocated), ``distributed`` (disaggregated) or ``disk``.
        bucket_bytes: bytes per bucket (slime ``--update-weight-buffer-size``, 512 MiB); a larger tensor goes
            alone. Any value >= 1 is accepted here (the run config demands >= 1 MiB).
        timeout_s: bound on each HTTP call, on the group's rendezvous and on each broadcast, seconds.
        is_sender: True on the trainer's global rank 0 only.
        engine_tp_sizes: TP size of each engine in ``client.engine_urls`` order; None: read ``tp_size`` from
            each engine's ``/get_server_info`` on the first sync (1 if absent).
        disk_dir: shared folder for ``disk`` (required there), readable by every engine at the same path.
        hf_checkpoint: HF folder whose config/tokenizer files are copied into each ``disk`` checkpoint.
        master_address: the sender's address the engines connect to (``distributed``); default: the local
            address that routes to the first engine.
        backend: ``nccl`` / ``gloo`` for ``distributed``; default ``nccl`` with CUDA, else ``gloo``.
        group_name: base name of the weight-update group (a counter is appended per group created).
        tensor_format: ``flattened_bucket`` (slime's) or ``direct`` for ``tensor``.
        pause_mode: mode of ``/pause_generation``: ``abort`` (SGLang's default), ``retract`` or ``in_place``.
        verify: check every engine's ``weight_version`` after the transfer.
        delta: send only the changed words of each tensor (:mod:`hpcrl.weights.delta`, ``load_format``
            :data:`~hpcrl.weights.delta.DELTA_LOADER` on every update); a full sync is sent the first time,
            after a failed sync, when the engines' URLs changed (an engine replaced or restarted) or one
            reports another weight version than the last sync's, and every ``full_every`` syncs.
        full_every: see ``delta`` (0: never on a count).
        engine_dtype: the engines' parameter dtype (``float32``, ``bfloat16``): a delta compares words in
            it; None: the trainer's.
        adapter_config: PEFT's ``adapter_config.json`` of the actor's LoRA adapters when a sync sends them
            alone (``model.lora.sync: adapter``; :mod:`hpcrl.weights.adapter`): the stream is then
            :func:`hpcrl.train.lora.peft_state_dict`'s, loaded as a new adapter (``tensor``: from tensors;
            ``disk`` and ``distributed``: from a folder in ``disk_dir``) that the client's requests name from
            then on. None: the stream is the model's weights.

    Raises ValueError on an unknown method, format or pause mode, ``bucket_bytes`` < 1, ``timeout_s`` <= 0,
    or ``disk`` without ``disk_dir``.
    """

    client: Any
    method: str = "tensor"
    bucket_bytes: int = 512 * 1024 * 1024
    timeout_s: float = 300.0
    is_sender: bool = True
    engine_tp_sizes: Sequence[int] | None = None
    disk_dir: str | None = None
    hf_checkpoint: str | None = None
    master_address: str | None = None
    backend: str | None = None
    group_name: str = "hpcrl_weight_update"
    tensor_format: str = "flattened_bucket"
    pause_mode: str = "abort"
    verify: bool = True
    delta: bool = False
    full_every: int = 20
    engine_dtype: str | None = None
    adapter_config: dict | None = None
    num_syncs: int = field(default=0, init=False)
    _adapters: list = field(default_factory=list, init=False, repr=False)
    """Names of the adapters this run loaded on the engines, oldest first (adapter syncs)."""
    _adapter_syncs: int = field(default=0, init=False, repr=False)
    _delta: Any = field(default=None, init=False, repr=False)
    _delta_engines: tuple = field(default=(), init=False, repr=False)
    """``(engine URLs, weight version)`` of the last successful sync of a delta run."""
    _delta_count: int = field(default=0, init=False, repr=False)
    """Delta syncs since the last full one."""
    _arena: Any = field(default=None, init=False, repr=False)
    _group: Any = field(default=None, init=False, repr=False)
    _groups_created: int = field(default=0, init=False, repr=False)
    _group_urls: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown weight sync method {self.method!r}; use one of {METHODS} "
                             "(resolve 'auto' with hpcrl.config first)")
        if self.tensor_format not in ("flattened_bucket", "direct"):
            raise ValueError(f"unknown tensor_format {self.tensor_format!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause_mode {self.pause_mode!r}; use one of {PAUSE_MODES}")
        if int(self.bucket_bytes) < 1 or self.timeout_s <= 0:
            raise ValueError("bucket_bytes must be >= 1 and timeout_s > 0")
        if self.method == "disk" and self.is_sender and not self.disk_dir:
            raise ValueError("weights method 'disk' needs disk_dir (a folder shared with the engines)")
        if self.is_sender and self.client is None:
            raise ValueError("the sender needs a RolloutClient")
        if self.adapter_config is not None and self.delta:
            raise ValueError("an adapter sync sends the adapters whole: no delta")
        if self.adapter_config is not None and self.method != "tensor" and self.is_sender and not self.disk_dir:
            raise ValueError("an adapter sync without weights method 'tensor' needs disk_dir (a folder shared "
                             "with the engines)")

    @classmethod
    def from_config(cls, client: Any, weights: Any, run_mode: str = "sync", sglang_engines: bool = False,
                    **kwargs: Any) -> WeightSyncer:
        """Build from a :class:`hpcrl.config.WeightsSection` (``method`` already resolved from ``auto``) and
        the run's ``run.mode`` (which decides a null ``weights.pause_mode``, :func:`resolve_pause_mode`);
        ``kwargs`` are the other fields (``is_sender``, ``disk_dir``...); ``sglang_engines``: the engines are
        real SGLang, which decides the tensor payload's format (:func:`tensor_format_for`). Raises ValueError
        as the class."""
        if weights.method == "tensor" and "tensor_format" not in kwargs:
            kwargs["tensor_format"] = tensor_format_for(sglang_engines)
        return cls(client, method=weights.method, bucket_bytes=weights.bucket_bytes,
                   timeout_s=weights.timeout_s, pause_mode=resolve_pause_mode(weights.pause_mode, run_mode),
                   delta=weights.delta, full_every=weights.full_every, **kwargs)

    @property
    def flushes(self) -> bool:
        """Whether the sync flushes the engines' cache (``/flush_cache`` after the pause and ``flush_cache``
        on the last update): not after a pause in place, whose requests keep their KV cache (SGLang refuses
        the flush then, :mod:`hpcrl.engine.state`)."""
        return self.pause_mode != "in_place"

    @property
    def loaded_adapters(self) -> list[str]:
        """Names of the LoRA adapters this syncer left loaded on the engines, oldest first (adapter syncs)."""
        return list(self._adapters)

    def _calls(self) -> EngineCalls:
        return EngineCalls(self.client, self.timeout_s)

    async def _tp_sizes(self, calls: EngineCalls) -> list[int]:
        if self.engine_tp_sizes is None:
            infos = await calls.server_infos()
            self.engine_tp_sizes = [int(i.get("tp_size") or 1) for i in infos]
        sizes = [int(t) for t in self.engine_tp_sizes]
        if len(set(sizes)) == 1 and len(sizes) != len(calls.urls):  # engines replaced or out of rotation
            sizes = sizes[:1] * len(calls.urls)
        if len(sizes) != len(calls.urls) or min(sizes) < 1:
            raise ValueError(f"engine_tp_sizes {sizes} do not fit {len(calls.urls)} engines")
        return sizes

    async def sync(self, named_tensors: Iterable[tuple[str, Any]], weight_version: str) -> dict:
        """Push ``named_tensors`` (HF names, full tensors) to every engine and set ``weight_version``.

        Call on every trainer rank with :func:`iterate_for_sync`; non-senders only consume the stream.
        Returns metrics: ``seconds`` (whole sync), ``pause_seconds`` (pause + flush), ``transfer_seconds``,
        ``bytes`` (sent), ``gb_per_s`` (bytes / transfer seconds / 1e9), ``buckets``, ``tensors``,
        ``weight_version``, ``method`` (non-senders: ``bytes``/``tensors`` they consumed, zero seconds); with
        ``delta`` also ``full`` (1 for a full sync, 0 for a delta), ``model_bytes`` (the whole model in the
        engines' dtype), ``delta_density`` (share of its words that changed; 1 for a full sync) and
        ``model_gb_per_s`` (model bytes / transfer seconds / 1e9).
        Raises WeightSyncError (engine URL, endpoint, message) when an engine refuses, does not answer within
        ``timeout_s``, or reports another version afterwards; ValueError for an empty stream. Engines stay
        paused on failure.

        On failure the sender still consumes the rest of the stream before raising, so that the other ranks
        of its TP group, which iterate the same all-gathers, are not left waiting in a collective. They do not
        learn of the failure: a caller that wants to go on after one must agree on the outcome across ranks
        (e.g. all-reduce a flag).
        """
        weight_version = str(weight_version)
        stream = iter(named_tensors)
        if not self.is_sender:
            nbytes = tensors = 0
            for _, t in stream:
                nbytes += int(t.numel()) * int(t.element_size())
                tensors += 1
            self.num_syncs += 1
            return {"method": self.method, "weight_version": weight_version, "seconds": 0.0,
                    "pause_seconds": 0.0, "transfer_seconds": 0.0, "bytes": nbytes, "gb_per_s": 0.0,
                    "buckets": 0, "tensors": tensors}
        try:
            return await self._sync(stream, weight_version)
        except BaseException:
            if self._delta is not None:  # the engines may hold part of it: the next sync is full
                self._delta.reset()
            _drain(stream)
            raise

    async def _sync(self, stream: Iterator, weight_version: str) -> dict:
        start = time.perf_counter()
        first = next(stream, None)  # an empty stream fails before the engines are paused
        if first is None:
            raise ValueError("no tensors to sync")
        stream = itertools.chain([first], stream)
        calls = self._calls()
        tp_sizes = await self._tp_sizes(calls) if self.method != "disk" else None
        adapter = self.adapter_config is not None
        if adapter:
            self._adapter_syncs += 1
        elif self.method == "distributed" and self._group is not None and self._group_urls != list(calls.urls):
            await self._drop_group()  # an engine was replaced: a new group with today's engines (slime reconnects)
        if not adapter and self.method == "distributed" and self._group is None:  # before the pause: engines serve
            await self._create_group(calls, tp_sizes)
            self._group_urls = list(calls.urls)
        full = None
        if self.delta:
            full = await self._needs_full(calls)
            stream = self._delta.encode(stream, full)
        t0 = time.perf_counter()
        await calls.pause(self.pause_mode)
        if self.flushes:
            await calls.flush_cache()
        t1 = time.perf_counter()
        session = needs_session(self.method) and not adapter
        if session:
            await calls.begin_sessions()
        try:
            stats = await self._transfer(calls, stream, weight_version, tp_sizes)
        except BaseException as e:
            if not session:
                raise
            note = await calls.close_sessions_after()
            if isinstance(e, WeightSyncError):
                raise e.with_note(note) from e
            raise
        if session:
            await calls.end_sessions()
        t2 = time.perf_counter()
        if self.verify:
            await calls.check_versions(weight_version)
        if adapter:  # the requests from now on go through the new adapter
            from hpcrl.weights.adapter import adapter_name

            self._adapters.append(adapter_name(weight_version, self._adapter_syncs))
            self.client.generate_fields["lora_path"] = self._adapters[-1]
        await calls.resume()
        if adapter:
            from hpcrl.weights.adapter import unload_old

            await unload_old(calls, self._adapters, self.disk_dir if self.method != "tensor" else None)
        self.num_syncs += 1
        transfer = t2 - t1
        out = {"method": self.method, "weight_version": weight_version,
               "seconds": time.perf_counter() - start, "pause_seconds": t1 - t0,
               "transfer_seconds": transfer,
               "bytes": stats["bytes"], "gb_per_s": stats["bytes"] / transfer / 1e9 if transfer > 0 else 0.0,
               "buckets": stats["buckets"], "tensors": stats["tensors"]}
        if full is not None:
            d = self._delta.stats
            self._delta_engines = (list(calls.urls), weight_version)
            self._delta_count = 0 if full else self._delta_count + 1
            out.update(full=int(full), model_bytes=d.full_bytes, delta_density=1.0 if full else d.density,
                       model_gb_per_s=d.full_bytes / transfer / 1e9 if transfer > 0 else 0.0)
        return out

    async def _needs_full(self, calls: EngineCalls) -> bool:
        """Whether this delta run's sync must be full: no base yet (first sync, or one failed), other
        engines than at the last sync (one replaced or restarted: it holds no base), the ``full_every``-th
        sync, or an engine reporting another weight version than the last sync set."""
        from hpcrl.weights.delta import DeltaSender

        if self._delta is None:
            self._delta = DeltaSender(_torch_dtype(self.engine_dtype))
        urls, version = self._delta_engines or ([], None)
        if (not self._delta.ready or list(calls.urls) != urls
                or (self.full_every and self._delta_count + 1 >= self.full_every)):
            return True
        infos = await calls.each("/get_model_info", None, method="GET")
        return any(str(i.get("weight_version")) != str(version) for i in infos)

    async def _create_group(self, calls: EngineCalls, tp_sizes: list[int]) -> None:
        from hpcrl.weights.distributed import DistributedGroup

        name = f"{self.group_name}_{self._groups_created}"
        self._groups_created += 1
        self._group = await DistributedGroup.create(calls, tp_sizes, name, master_address=self.master_address,
                                                    backend=self.backend)

    async def _transfer(self, calls: EngineCalls, named_tensors: Iterable, weight_version: str,
                        tp_sizes: list[int] | None) -> dict:
        from hpcrl.weights.delta import DELTA_LOADER

        load_format = DELTA_LOADER if self.delta else None
        if self.adapter_config is not None:
            from hpcrl.weights.adapter import adapter_name, send_adapter

            return await send_adapter(calls, named_tensors, weight_version,
                                      adapter_name(weight_version, self._adapter_syncs),
                                      config=self.adapter_config, method=self.method, tp_sizes=tp_sizes,
                                      disk_dir=self.disk_dir)
        if self.method == "tensor":
            from hpcrl.engine.serialize import StagingArena
            from hpcrl.weights.tensor import send_tensor_buckets

            if self._arena is None:
                self._arena = StagingArena()  # kept for the run: its shared memory is reused by every sync
            return await send_tensor_buckets(calls, named_tensors, weight_version,
                                             bucket_bytes=int(self.bucket_bytes), engine_tp_sizes=tp_sizes,
                                             fmt="direct" if self.delta else self.tensor_format,
                                             flush=self.flushes, arena=self._arena, load_format=load_format)
        if self.method == "distributed":
            from hpcrl.weights.distributed import send_distributed

            try:
                return await send_distributed(self._group, named_tensors, weight_version,
                                              bucket_bytes=int(self.bucket_bytes), flush=self.flushes,
                                              load_format=load_format)
            except WeightSyncError:
                await self._drop_group()
                raise
        from hpcrl.weights.disk import send_disk

        index = int(weight_version) if weight_version.isdigit() else self.num_syncs + 1
        return await send_disk(calls, named_tensors, weight_version, disk_dir=self.disk_dir, index=index,
                               bucket_bytes=int(self.bucket_bytes), hf_checkpoint=self.hf_checkpoint,
                               flush=self.flushes, load_format=load_format)

    async def _drop_group(self) -> None:
        """After a failed distributed transfer the group's state is unknown: destroy it locally, ask the
        engines to drop it (best effort, a short timeout), and create a new one on the next sync."""
        group, self._group = self._group, None
        if group is None:
            return
        import asyncio

        try:
            await asyncio.wait_for(group.close(), timeout=min(10.0, self.timeout_s))
        except (TimeoutError, WeightSyncError):
            pass

    async def release(self) -> None:
        """At the end of a run, or of a stage of one such as the warm start: the distributed group, if any,
        destroyed locally and on the engines (best effort, at most 10 s; :meth:`_drop_group`). Without it the
        group's name stayed taken in this process, so the next stage's syncer could not create its own group
        of that name (torch: "group name has already been created") and its engines waited for it until their
        timeout (seen in a Slurm job: a warm start, then RL with ``weights.method: distributed``)."""
        await self._drop_group()

    async def close(self) -> None:
        """Destroy the distributed group, if any, on the engines (``/destroy_weights_update_group``) and
        locally. Idempotent. Raises WeightSyncError if an engine refuses (the local group is gone anyway)."""
        group, self._group = self._group, None
        if group is not None:
            await group.close()
