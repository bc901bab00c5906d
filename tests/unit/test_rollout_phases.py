"""The rollout's event-loop thread and the memory phases of both kinds of trainer rank, without engines: the
controller's phases record the order ``phases.jsonl`` is written in; a follower rank moves only its trainer
memory, where the controller does."""

from __future__ import annotations

import asyncio
import json

from hpcrl.offload import ColocatedMemory, TrainerMemory
from hpcrl.rollout.event_loop import EventLoopThread
from hpcrl.rollout.manager import FollowerRollout
from hpcrl.rollout.phases import ColocatedPhases


class Recording(TrainerMemory):
    def __init__(self, events: list[str], pauses: bool = False) -> None:
        self.events = events
        self.pauses_device_memory = pauses

    def offload(self) -> None:
        super().offload()
        self.events.append("trainer off")

    def onload(self) -> None:
        super().onload()
        self.events.append("trainer on")


def test_the_event_loop_thread_runs_coroutines_and_cancels_what_is_left_at_stop():
    events = EventLoopThread("test-loop")

    async def double(x: int) -> int:
        await asyncio.sleep(0)
        return 2 * x

    cancelled = []

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    assert events.submit(double(21)).result(timeout=10) == 42
    pending = events.submit(forever())
    events.stop()
    assert cancelled == [True] and pending.cancelled()
    assert not events.thread.is_alive() and events.loop.is_closed()


def test_controller_phases_record_the_step_order_and_write_it(tmp_path):
    """Disaggregated (``colocate=False``): no memory moves, the non-memory phases are still recorded."""
    events = EventLoopThread("test-loop")
    try:
        moved: list[str] = []
        phases = ColocatedPhases(ColocatedMemory(Recording(moved), client=None, colocate=False),
                                 lambda coro: events.submit(coro).result(timeout=10))
        phases.mark("generate")
        phases.offload()
        phases.onload_trainer()
        phases.onload_weights()
        phases.onload_kv()
        assert moved == [] and not phases.trainer_paused_during_sync
        with phases.trainer_onloaded():
            pass
        phases.write(tmp_path / "phases.jsonl")
    finally:
        events.stop()
    rows = [json.loads(x) for x in (tmp_path / "phases.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["generate", "train", "sync"]
    assert all(set(r) == {"phase", "t", "wall"} and r["wall"] > r["t"] for r in rows)
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)


def test_a_follower_rank_moves_its_trainer_memory_where_the_controller_does():
    moved: list[str] = []
    rank = FollowerRollout(Recording(moved, pauses=True))
    assert rank.client is None and rank.engine_tp_sizes is None
    rank.launch(early=True)
    rank.offload()
    rank.onload_trainer()
    rank.onload_weights()
    assert rank.trainer_paused_during_sync
    with rank.trainer_onloaded():  # a checkpoint save after the sync: onloaded for the block only
        pass
    rank.onload_kv()
    assert moved == ["trainer on", "trainer off", "trainer on", "trainer off"]
    assert rank.generate(3, None) == (None, {}) and rank.result(rank.generate_async(3, None)) == (None, {})
    assert rank.evaluate(3) == {}
    rank.stop()
