"""The producer of ``run.mode: fully_async`` (slime's ``examples/fully_async``, AReaL's rollout controller):
:class:`AsyncProducer`, a task on the rollout's event loop that keeps groups generating across step
boundaries, and hands finished groups to the trainer when it asks (:meth:`AsyncProducer.take`).

One group's path::

    drawn (data source) -> generating (rollout.generate_group; an abort by a weight update's pause:
    continued with its partial response) -> dynamic filter (rejected: ledger "filtered") -> finished
    (FIFO) -> take(n, k): staleness check at step k -> trained | regenerated (fresh prompt, ledger
    "regenerated", served again first) | dropped (ledger "dropped")

**Staleness** (docs/algorithms.md): a token sampled by weights version v and trained at step k has staleness
k - v; a group's age at step k is k minus its oldest token version (per-token versions
``Sample.rollout_token_versions`` when the client labelled them, else the per-call
``Sample.weight_versions``). A group older than ``rollout.max_staleness`` (K) meets ``rollout.stale_policy``.

**Admission control** (AReaL's ``max_head_offpolicyness``): with B = ``rollout.batch_size``, a new group is
not started while ``taken + finished + generating >= (v - v0 + K + 1) x B``, where ``v`` is the engines'
weight version, ``v0`` the version the stream started at and ``taken`` the groups handed to the trainer
since (filtered, dropped and regenerated groups do not count). Group n (in start order) thus starts no
earlier than version ``n // B - K``, and is trained at about step ``n // B``: staleness <= K unless groups
finish far out of order (then ``stale_policy``). Also at most ``rollout.max_inflight_groups`` generate.

**Checkpoint** (:meth:`AsyncProducer.snapshot`): a plain function with no ``await``, so called on the event
loop it sees one instant of the data source, the finished groups and the generating ones. At a step whose
checkpoint is saved, :meth:`AsyncProducer.capture_partials` first aborts the generating calls and parks each
group with its partial response (tokens, log-probs, per-token weight versions), so the snapshot holds every
in-flight response as far as it got; the groups then continue (one re-prefill each), and a resumed run
continues them from the checkpoint. Between checkpoints a snapshot is taken without it (a generating group
as after its last finished ``/generate`` call).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from hpcrl.data.sample import Sample, Status
from hpcrl.data.source import load_buffer_files, save_buffer_files
from hpcrl.rollout.rollout import RolloutContext, generate_group, reset_sample, sampling_params
from hpcrl.rollout.stats import group_staleness

log = logging.getLogger("hpcrl.rollout")

FILTERED, DROPPED, REGENERATED = 0, 1, 2
"""Ledger kinds: a group rejected by the dynamic filter, dropped as stale, regenerated as stale."""
LEDGER_KINDS = {FILTERED: "filtered", DROPPED: "dropped", REGENERATED: "regenerated"}


def is_stale(group: list[Sample], step: int, max_staleness: int) -> bool:
    """Whether ``group`` trained at step ``step`` would hold a token older than ``max_staleness`` versions
    (:func:`hpcrl.rollout.stats.group_staleness` > ``max_staleness``); False when no version is known."""
    staleness = group_staleness(group, step)
    return staleness is not None and staleness > max_staleness


def length_metrics(key: str, lengths: list[int], mean: bool = True) -> dict[str, float]:
    """``{key: mean, key_p90: 90th percentile}`` of response ``lengths`` (tokens; nearest rank), the mean left
    out with ``mean=False``; {} for no lengths. What the benchmark compares between the samples generated
    (``rollout/sampled_response_length``) and those trained, per ``rollout.stale_policy``."""
    if not lengths:
        return {}
    ordered = sorted(lengths)
    out = {f"{key}_p90": float(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))])}
    if mean:
        out[key] = sum(ordered) / len(ordered)
    return out


@dataclass
class StreamSnapshot:
    """One instant of a fully-async stream (:meth:`AsyncProducer.snapshot`), copies only: the data source's
    ``state_dict()``, the finished groups (FIFO order), the generating groups (partial, as PENDING), the
    ledger rows ``(rollout_id, group_index, kind)`` and the counters of :class:`AsyncProducer`."""

    data_source: dict[str, Any]
    finished: list[list[Sample]]
    inflight: list[list[Sample]]
    ledger: list[tuple[int, int, int]]
    counters: dict[str, int] = field(default_factory=dict)


class AsyncProducer:
    """Keeps up to ``max_inflight`` groups generating, filters finished ones into a FIFO buffer and hands
    them to the trainer (:meth:`take`). Every method runs on the rollout's event loop.

    Args:
        cfg: the run config (``rollout.*``: batch size, staleness bound and policy, sampling).
        ctx: the rollout context (client, reward, generate function, filter, seed).
        data_source: where prompts are drawn from and stale groups are requeued to.
        version: the engines' weight version when the stream starts (the trainer's step).
        max_inflight: groups generating at most (``rollout.max_inflight_groups``, default 2 x batch size).
        finished: finished groups restored from a checkpoint (served first), or None.
        inflight: partial groups restored from a checkpoint (continued first), or None.
        ledger: ledger rows restored from a checkpoint.
    """

    def __init__(self, cfg, ctx: RolloutContext, data_source, version: int,
                 max_inflight: Optional[int] = None, finished: Optional[list] = None,
                 inflight: Optional[list] = None, ledger: Optional[list] = None) -> None:
        rc = cfg.rollout
        self.cfg, self.ctx, self.data_source = cfg, ctx, data_source
        self.batch_size, self.max_staleness, self.policy = rc.batch_size, rc.max_staleness, rc.stale_policy
        self.max_inflight = max_inflight or rc.max_inflight_groups or 2 * rc.batch_size
        self.params = sampling_params(rc)
        self.version = self.start_version = version
        self.finished: collections.deque[list[Sample]] = collections.deque(finished or [])
        self.generating: dict[asyncio.Task, list[Sample]] = {}
        self.ledger: list[tuple[int, int, int]] = [tuple(r) for r in (ledger or [])]
        self.taken = 0  # groups handed to the trainer since the stream started
        self.counts = collections.Counter()  # filtered, dropped, regenerated, started, continued (this run)
        if inflight:
            for g in inflight:
                for s in g:
                    if s.status == Status.ABORTED:
                        s.status = Status.PENDING
            data_source.add_samples(inflight)  # served first: continued by generate()
            self.counts["resumed_partial_groups"] = sum(any(s.response_length for s in g) for g in inflight)
        self.error: Optional[BaseException] = None
        self.stopping = False
        self.hold: Optional[asyncio.Event] = None  # set by capture_partials: groups park instead of continuing
        self.parked: set[asyncio.Task] = set()
        self.changed = asyncio.Event()  # a group finished, the version moved, or the stream stopped
        self.task: Optional[asyncio.Task] = None
        self.last_take = time.perf_counter()
        self.reported = collections.Counter()  # counts as of the last take (its metrics are the differences)
        self.sampled_lengths: list[int] = []  # response lengths (tokens) of every sample finished since a take

    # ------------------------------------------------------------------------------------------ producing
    def capacity(self) -> int:
        """Groups that may start now (admission control of the module doc; >= 0)."""
        bound = (self.version - self.start_version + self.max_staleness + 1) * self.batch_size
        staleness_room = bound - self.taken - len(self.finished) - len(self.generating)
        return max(0, min(staleness_room, self.max_inflight - len(self.generating)))

    def set_version(self, version: int) -> None:
        """The engines hold weights ``version`` now (after a sync): more groups may start."""
        self.version = version
        self.changed.set()

    async def run(self) -> None:
        """Draw and start groups while :meth:`capacity` allows, until :meth:`stop`; a group's error stops the
        stream and is raised by the next :meth:`take`."""
        try:
            while not self.stopping and self.error is None:
                n = 0 if self.hold is not None else self.capacity()  # no new group while partials are held
                if n:
                    for group in self.data_source.get_samples(n):
                        self.counts["started"] += 1
                        task = asyncio.ensure_future(self._generate(group))
                        self.generating[task] = group
                        task.add_done_callback(self._done)
                self.changed.clear()
                if self.capacity() == 0 or n == 0:
                    await self.changed.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer by take()
            if not isinstance(e, asyncio.CancelledError):
                self.error = e
            raise
        finally:
            self.changed.set()

    async def _generate(self, group: list[Sample]) -> list[Sample]:
        """Generate and score ``group``; a sample aborted by a weight update's pause (``weights.pause_mode:
        abort``) is continued from its partial response, not failed as in a step-scoped rollout."""
        while True:
            await generate_group(self.cfg, self.ctx, group, self.params, evaluation=False)
            if self.stopping or all(s.status != Status.ABORTED for s in group):
                return group
            self.counts["continued"] += 1
            for s in group:
                if s.status == Status.ABORTED:
                    s.status = Status.PENDING  # keeps its partial response; generate() continues it
            if self.hold is not None:  # a checkpoint is taking its partial response: wait until it is saved
                me = asyncio.current_task()
                self.parked.add(me)
                self.changed.set()
                try:
                    await self.hold.wait()
                finally:
                    self.parked.discard(me)

    def _done(self, task: asyncio.Task) -> None:
        group = self.generating.pop(task)
        self.changed.set()
        if task.cancelled() or self.stopping:
            return
        if task.exception() is not None:
            self.error = self.error or task.exception()
            return
        self.sampled_lengths.extend(s.response_length for s in group)  # before the filter and staleness
        if self.ctx.dynamic_filter is not None and not self.ctx.dynamic_filter(group):
            self.counts["filtered"] += 1
            self.ledger.append((self.version, group[0].group_index, FILTERED))
            return
        self.finished.append(group)

    # ------------------------------------------------------------------------------------------ consuming
    async def take(self, n_groups: int, step: int, multiple: int = 1) -> tuple[list[list[Sample]], dict]:
        """The next ``n_groups`` finished groups (FIFO) for training step ``step`` (rounded down to a multiple
        of ``multiple``, at least ``multiple``), waiting for them; each sample's ``rollout_id`` is set to
        ``step``. A group older than ``max_staleness`` at ``step`` meets the stale policy (keep: trained and
        counted; regenerate: reset and requeued; drop: counted). Returns ``(groups, metrics)``:
        ``rollout/wait_seconds`` (this call), ``rollout/seconds`` (since the last take); since the last take
        ``rollout/groups_filtered``, ``rollout/stale_{kept,regenerated,dropped}`` and
        ``rollout/groups_continued`` (continued after an abort), ``rollout/groups_started`` and
        ``rollout/groups_resumed_partial`` (partial groups a checkpoint gave back); now ``rollout/groups_in_flight`` and
        ``rollout/groups_finished_buffered``. Raises the error that stopped the stream (a group's generation
        or reward), RuntimeError when it was stopped."""
        if self.stopping:
            raise RuntimeError("the fully-async stream is stopped")
        need = max(multiple, n_groups - n_groups % multiple)
        t0 = time.perf_counter()
        if step > self.version:  # the trainer is ahead of the last sync the producer heard of
            self.set_version(step)
        out: list[list[Sample]] = []
        while len(out) < need:
            while not self.finished:
                if self.error is not None:
                    raise self.error
                if self.stopping or self.task is None or self.task.done():
                    raise RuntimeError("the fully-async stream is stopped")
                self.changed.clear()
                await self.changed.wait()
            group = self.finished.popleft()
            if is_stale(group, step, self.max_staleness):
                self.changed.set()  # dropped or requeued: room for new groups (the producer may be waiting)
                if self.policy == "drop":
                    self.counts["stale_dropped"] += 1
                    self.ledger.append((step, group[0].group_index, DROPPED))
                    continue
                if self.policy == "regenerate":
                    self.counts["stale_regenerated"] += 1
                    self.ledger.append((step, group[0].group_index, REGENERATED))
                    for s in group:
                        reset_sample(s)
                    self.data_source.add_samples([group])
                    continue
                self.counts["stale_kept"] += 1
            for s in group:
                s.rollout_id = step
            out.append(group)
            self.taken += 1  # counted at once: a group taken is no longer finished, but still admitted
        self.changed.set()
        now, since = time.perf_counter(), self.last_take
        self.last_take = now
        diff = {k: self.counts[k] - self.reported[k] for k in (
            "started", "filtered", "stale_kept", "stale_regenerated", "stale_dropped", "continued",
            "resumed_partial_groups")}
        self.reported = collections.Counter(self.counts)
        sampled, self.sampled_lengths = self.sampled_lengths, []
        trained = [s.response_length for g in out for s in g]
        return out, {**length_metrics("rollout/sampled_response_length", sampled),
                     **length_metrics("rollout/response_length", trained, mean=False),"rollout/wait_seconds": now - t0, "rollout/seconds": now - since,
                     "rollout/groups_filtered": diff["filtered"],
                     "rollout/stale_kept": diff["stale_kept"],
                     "rollout/stale_regenerated": diff["stale_regenerated"],
                     "rollout/stale_dropped": diff["stale_dropped"],
                     "rollout/groups_continued": diff["continued"],
                     "rollout/groups_started": diff["started"],
                     "rollout/groups_resumed_partial": diff["resumed_partial_groups"],
                     "rollout/groups_in_flight": len(self.generating),
                     "rollout/groups_finished_buffered": len(self.finished)}

    # ------------------------------------------------------------------------------------- checkpointing
    async def capture_partials(self) -> None:
        """Before a checkpoint's :meth:`snapshot`: abort the generating groups' calls on every engine and wait
        until each group has its partial response back (tokens, log-probs, weight versions) and is parked,
        or has finished; no new group starts meanwhile. The snapshot then holds every in-flight response as
        far as it got, and a resumed run continues it (issue #37: the in-flight partial responses are part of
        the checkpoint). :meth:`release` lets the parked groups continue (one re-prefill each). Raises what
        the client's ``abort_all`` raises (the groups are released first)."""
        self.hold = asyncio.Event()
        self.changed.set()
        try:
            if self.generating:
                await self.ctx.client.abort_all()
            while any(t not in self.parked for t in self.generating) and self.error is None:
                self.changed.clear()
                await self.changed.wait()
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Let the groups :meth:`capture_partials` parked continue, and new groups start."""
        if self.hold is not None:
            self.hold.set()
            self.hold = None
            self.changed.set()

    def snapshot(self) -> StreamSnapshot:
        """Copies of the data source's state, the finished and the generating groups and the ledger, at one
        instant (no ``await`` inside: call it on the event loop). Generating samples are saved as after their
        last finished call, ABORTED ones as PENDING (continued after a resume)."""
        inflight = copy.deepcopy(list(self.generating.values()))
        for g in inflight:
            for s in g:
                if s.status == Status.ABORTED:
                    s.status = Status.PENDING
        return StreamSnapshot(data_source=copy.deepcopy(self.data_source.state_dict()),
                              finished=copy.deepcopy(list(self.finished)), inflight=inflight,
                              ledger=list(self.ledger), counters=dict(self.counts))

    async def stop(self) -> None:
        """Stop drawing, cancel the generating groups (their engines' requests are aborted by the caller or
        the fleet's stop) and wait for them and the producer task."""
        self.stopping = True
        self.changed.set()
        tasks = list(self.generating)
        for t in tasks:
            t.cancel()
        if self.task is not None:
            self.task.cancel()
            tasks.append(self.task)
        await asyncio.gather(*tasks, return_exceptions=True)


class StreamState:
    """The checkpoint state of a fully-async stream (a :class:`hpcrl.checkpoint.manager.FileStateful`, name
    ``stream``): the last :class:`StreamSnapshot` the loop :meth:`put`, its finished and generating groups as
    the buffer file's ``finished/`` and ``inflight/`` parts, its ledger as ``stream_ledger`` (int64
    ``[n, 3]``: rollout id, group index, kind), the counters in ``state.json``.

    The data source is saved from the same snapshot: the loop registers :attr:`data_source_state` under the
    name ``data_source`` (replacing the data source itself among the checkpoint manager's states), because
    the producer changes the data source on the event loop while the checkpoint manager reads its states on
    the trainer thread. After a load, :meth:`attach` hands the saved data-source state to the data source and
    :attr:`restored` holds the snapshot to resume the stream from (None for a new run)."""

    file_keys = ("finished", "inflight", "ledger")

    def __init__(self) -> None:
        self.snapshot: Optional[StreamSnapshot] = None
        self.restored: Optional[StreamSnapshot] = None
        self.data_source_state = _DataSourceState(self)

    def put(self, snapshot: Optional[StreamSnapshot]) -> None:
        """The stream as the next checkpoint saves it (None on a rank without the producer: ignored)."""
        if snapshot is not None:
            self.snapshot = snapshot

    def attach(self, data_source) -> None:
        """Load the checkpoint's data-source state (if any) into ``data_source``, which until the first
        :meth:`put` is also what a save reads (the producer does not run yet)."""
        view = self.data_source_state
        view.target = data_source
        if view.loaded is not None:
            data_source.load_state_dict(view.loaded)
            view.loaded = None

    def state_dict(self) -> dict[str, Any]:
        snap = self.snapshot or StreamSnapshot({}, [], [], [])
        return {"finished": snap.finished, "inflight": snap.inflight, "ledger": snap.ledger,
                "counters": dict(snap.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = StreamSnapshot({}, list(state.get("finished") or []),
                                       list(state.get("inflight") or []),
                                       [tuple(r) for r in state.get("ledger") or []],
                                       dict(state.get("counters") or {}))

    def save_files(self, state: dict[str, Any], folder) -> None:
        """Write the finished and generating groups and the ledger into the buffer file in ``folder``."""
        from pathlib import Path

        import numpy as np

        from hpcrl.data.buffer import BUFFER_FILE, open_for_part, write_groups_part

        path = Path(folder) / BUFFER_FILE
        write_groups_part(path, "finished", state["finished"])
        write_groups_part(path, "inflight", state["inflight"])
        with open_for_part(path) as f:
            f.create_dataset("stream_ledger", data=np.asarray(state["ledger"], dtype=np.int64).reshape(-1, 3))

    def load_files(self, state: dict[str, Any], folder) -> dict[str, Any]:
        """``state`` with the groups and the ledger read back from ``folder`` (empty when absent)."""
        from pathlib import Path

        import h5py

        from hpcrl.data.buffer import BUFFER_FILE, read_groups_part

        path = Path(folder) / BUFFER_FILE
        ledger: list = []
        if path.exists():
            with h5py.File(path, "r") as f:
                if "stream_ledger" in f:
                    ledger = [tuple(int(x) for x in r) for r in f["stream_ledger"][()].tolist()]
        return {**state, "finished": read_groups_part(path, "finished") or [],
                "inflight": read_groups_part(path, "inflight") or [], "ledger": ledger}


class _DataSourceState:
    """The ``data_source`` checkpoint state of a fully-async run: the data source's state from the stream's
    last snapshot (or the data source's own before the stream starts); its held-back groups in the buffer
    file's ``groups/`` as :class:`hpcrl.data.source.DataSource` keeps them."""

    file_keys = ("buffer",)

    def __init__(self, stream: StreamState) -> None:
        self.stream = stream
        self.target = None  # the data source, from StreamState.attach
        self.loaded: Optional[dict[str, Any]] = None  # a checkpoint's state, until attach

    def state_dict(self) -> dict[str, Any]:
        if self.stream.snapshot is not None:
            state = dict(self.stream.snapshot.data_source)
        elif self.target is not None:
            state = self.target.state_dict()
        else:
            state = dict(self.loaded or {})
        state.setdefault("buffer", [])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state
        if self.target is not None:
            self.stream.attach(self.target)

    def save_files(self, state: dict[str, Any], folder) -> None:
        """The held-back groups as the buffer file's ``groups/``, as the data source writes them."""
        save_buffer_files(state, folder)

    def load_files(self, state: dict[str, Any], folder) -> dict[str, Any]:
        """``state`` with its held-back groups read back, as the data source reads them."""
        return load_buffer_files(state, folder)
