"""The fully-async producer's bookkeeping (issue #37 points 1, 3 and 5), in process: admission control, the
continuation of groups aborted by a weight update's pause, FIFO takes with ``rollout_id`` set to the training
step and whole multiples, the three stale policies, the dynamic filter's ledger, and the checkpoint snapshot
(copies taken at one instant; through the buffer file and back, finished groups served first and partial
responses continued; every drawn group accounted for exactly once).

Generation goes through the custom-generate plug-in contract (``async def generate(client, sample, params)``):
a scripted function that labels its tokens with the "engine's" current weight version, can be held at a gate,
and aborts a sample's first call when told to (what ``/pause_generation {"mode": "abort"}`` does). The engine
path is covered by tests/integration/test_fully_async_local.py.
"""

from __future__ import annotations

import asyncio

import pytest

from hpcrl.config import Config
from hpcrl.data.sample import Status
from hpcrl.data.source import DataSource
from hpcrl.rollout.filters import nonzero_std
from hpcrl.rollout.fully_async import DROPPED, FILTERED, REGENERATED, AsyncProducer, StreamState, is_stale
from hpcrl.rollout.stats import group_oldest_version as oldest_version
from hpcrl.rollout.rollout import RolloutContext

ITEMS = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(50)]


class CharTokenizer:
    """Prompt text -> one id per character (what tokenize_prompt needs of a tokenizer)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


class Engine:
    """A scripted engine behind the generate plug-in: ``version`` labels the tokens it samples; ``gate``
    holds every call until set (a first call to abort is aborted at once); group indices in ``abort_once``
    have their samples' first call aborted after one token; ``varied(g)`` says whether group g's rewards
    differ (else the nonzero-std filter drops it)."""

    def __init__(self, varied=lambda g: True) -> None:
        self.version = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.abort_once: set[int] = set()
        self.calls = 0
        self.varied = varied
        self.waiting: list[asyncio.Future] = []  # calls held at the gate, which abort_all aborts

    async def generate(self, client, sample, params):
        self.calls += 1
        await asyncio.sleep(0.001 * (sample.group_index % 3))  # finishing order differs from submission
        v = self.version
        if sample.group_index in self.abort_once and sample.response_length == 0:
            sample.append_response_tokens([7], [-0.5], versions=[v])
            sample.weight_versions.append(str(v))
            sample.status = Status.ABORTED
            return sample
        if not self.gate.is_set():
            aborted = asyncio.get_running_loop().create_future()
            self.waiting.append(aborted)
            gate = asyncio.ensure_future(self.gate.wait())
            await asyncio.wait([gate, aborted], return_when=asyncio.FIRST_COMPLETED)
            gate.cancel()
            if aborted.done():  # /abort_request: the call returns the one token it had sampled
                sample.append_response_tokens([5], [-0.3], versions=[v])
                sample.weight_versions.append(str(v))
                sample.status = Status.ABORTED
                return sample
            self.waiting.remove(aborted)
        v = self.version
        sample.append_response_tokens([1, 2], [-0.1, -0.2], versions=[v, v])
        sample.weight_versions.append(str(v))
        sample.status = Status.COMPLETED
        return sample

    def ctx(self, dynamic_filter=None) -> RolloutContext:
        async def reward(sample):
            return float(sample.index % 2) if self.varied(sample.group_index) else 1.0

        return RolloutContext(client=self, tokenizer=CharTokenizer(), reward_fn=reward,
                              generate_fn=self.generate, dynamic_filter=dynamic_filter, seed=3)


    async def abort_all(self) -> list:
        """The client's ``/abort_request {"abort_all": true}``: every call held at the gate returns."""
        waiting, self.waiting = self.waiting, []
        for f in waiting:
            f.set_result(True)
        return []


def make_config(**rollout) -> Config:
    cfg = Config()
    cfg.rollout.batch_size = 2
    cfg.rollout.n_samples_per_prompt = 2
    cfg.rollout.max_staleness = 1
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


async def settle(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0.002)


def start(producer: AsyncProducer) -> AsyncProducer:
    producer.task = asyncio.ensure_future(producer.run())
    return producer


def drawn(src: DataSource) -> int:
    return src.epoch * len(src) + src.offset


def test_versions_and_staleness_of_a_group():
    from hpcrl.data.sample import Sample

    a, b = Sample(group_index=0, index=0), Sample(group_index=0, index=1)
    a.append_response_tokens([1, 2], [-1.0, -1.0])
    b.append_response_tokens([3], [-1.0])
    a.weight_versions, b.weight_versions = ["3", "4"], ["5"]
    assert oldest_version([a, b]) == 3  # per call, when no token is labelled
    a.rollout_token_versions = [-1, 6]
    assert oldest_version([a, b]) == 5  # labelled tokens win over the sample's calls; -1 is unknown
    assert not is_stale([a, b], 6, 1) and is_stale([a, b], 7, 1)
    c = Sample(group_index=1, index=2)
    c.append_response_tokens([4], [-1.0])
    c.weight_versions = ["policy-a"]
    assert oldest_version([c]) is None and not is_stale([c], 100, 0)


def test_admission_control_bounds_what_generates_by_staleness_and_inflight():
    """(v - v0 + K + 1) x B groups may be started, taken or waiting; never more than max_inflight generate."""
    async def main():
        eng = Engine()
        eng.gate.clear()  # nothing finishes
        src = DataSource(ITEMS, 2, seed=0)
        p = start(AsyncProducer(make_config(), eng.ctx(), src, version=0, max_inflight=5))
        await settle()
        assert len(p.generating) == 4 and drawn(src) == 4  # (0 + 1 + 1) x 2
        p.set_version(1)
        await settle()
        assert len(p.generating) == 5 and drawn(src) == 5  # 6 allowed, max_inflight 5
        eng.gate.set()
        groups, m = await p.take(2, step=1)
        assert len(groups) == 2 and m["rollout/groups_in_flight"] + m["rollout/groups_finished_buffered"] <= 6
        await settle()
        # (1 + 1 + 1) x 2 - taken 2 = 4 started or waiting
        assert len(p.generating) + len(p.finished) == 4 and drawn(src) == 6
        await p.stop()

    asyncio.run(main())


def test_take_is_fifo_sets_the_training_step_and_returns_whole_multiples():
    async def main():
        eng = Engine()
        src = DataSource(ITEMS, 2, seed=0)
        p = start(AsyncProducer(make_config(max_staleness=5), eng.ctx(), src, version=3))
        await settle()
        order = [g[0].group_index for g in p.finished]
        groups, m = await p.take(3, step=3, multiple=2)  # 3 asked, 2 per multiple: 2 returned
        assert [g[0].group_index for g in groups] == order[:2]
        assert all(s.rollout_id == 3 for g in groups for s in g)
        assert m["rollout/wait_seconds"] >= 0 and m["rollout/stale_kept"] == 0
        groups, _ = await p.take(1, step=4, multiple=2)  # fewer than one multiple asked: one multiple
        assert len(groups) == 2
        await p.stop()
        with pytest.raises(RuntimeError, match="stopped"):
            await p.take(2, step=5)

    asyncio.run(main())


def test_a_group_aborted_by_a_weight_update_is_continued_not_failed():
    async def main():
        eng = Engine()
        eng.abort_once = {0, 1, 2, 3}
        src = DataSource(ITEMS, 2, seed=0, shuffle=False)
        p = start(AsyncProducer(make_config(max_staleness=5), eng.ctx(), src, version=0))
        groups, m = await p.take(2, step=0)
        for s in (s for g in groups for s in g):
            assert s.status == Status.COMPLETED and s.response_length == 3  # 1 before the abort, 2 after
            assert s.rollout_log_probs == [-0.5, -0.1, -0.2] and s.reward is not None
            assert s.weight_versions == ["0", "0"]
        assert m["rollout/groups_continued"] >= 2
        await p.stop()

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["keep", "drop", "regenerate"])
def test_stale_policies(policy):
    """Groups sampled at version 0 and taken at step 2 with K = 1 are stale: kept (counted), dropped (ledger)
    or regenerated (ledger, reset, served again first, sampled anew)."""
    async def main():
        eng = Engine()
        src = DataSource(ITEMS, 2, seed=0, shuffle=False)
        p = start(AsyncProducer(make_config(stale_policy=policy), eng.ctx(), src, version=0, max_inflight=4))
        await settle()
        stale = [g[0].group_index for g in p.finished]
        assert len(stale) == 4
        eng.version = 2  # what the engines sample with from now on
        p.set_version(2)
        groups, m = await p.take(2, step=2)
        got = [g[0].group_index for g in groups]
        if policy == "keep":
            assert got == stale[:2] and m["rollout/stale_kept"] == 2 and not p.ledger
        elif policy == "drop":
            assert not set(got) & set(stale) and m["rollout/stale_dropped"] == 4
            assert sorted(g for _, g, kind in p.ledger if kind == DROPPED) == sorted(stale)
        else:
            assert m["rollout/stale_regenerated"] >= 2
            regenerated = [g for _, g, kind in p.ledger if kind == REGENERATED]
            assert set(regenerated) <= set(stale) and len(regenerated) == m["rollout/stale_regenerated"]
            groups2, _ = await p.take(2, step=2)
            again = [g for g in groups + groups2 if g[0].group_index in regenerated]
            assert again and all(s.weight_versions == ["2"] for g in again for s in g)  # sampled anew
        await p.stop()

    asyncio.run(main())


def test_filtered_groups_go_to_the_ledger():
    async def main():
        eng = Engine(varied=lambda g: g % 2 == 0)
        src = DataSource(ITEMS, 2, seed=0, shuffle=False)
        p = start(AsyncProducer(make_config(), eng.ctx(nonzero_std), src, version=0))
        groups, m = await p.take(2, step=0)
        assert all(g[0].group_index % 2 == 0 for g in groups)
        filtered = [g for _, g, kind in p.ledger if kind == FILTERED]
        assert filtered and all(g % 2 == 1 for g in filtered)
        assert m["rollout/groups_filtered"] == len(filtered)
        await p.stop()

    asyncio.run(main())


def test_an_error_of_a_group_reaches_take():
    async def main():
        eng = Engine()

        async def failing(client, sample, params):
            raise ValueError("reward server down")

        ctx = eng.ctx()
        ctx.generate_fn = failing
        p = start(AsyncProducer(make_config(), ctx, DataSource(ITEMS, 2, seed=0), version=0))
        with pytest.raises(ValueError, match="reward server down"):
            await p.take(2, step=0)
        await p.stop()

    asyncio.run(main())


def test_snapshot_round_trip_accounts_for_every_group_and_continues_partials(tmp_path):
    """A snapshot taken while groups are partial: copies (later progress does not change it); through the
    buffer file and back; a new producer serves the finished groups first and continues the partial
    responses; drawn = trained + filtered + finished + in flight + pushed back, each group once."""
    async def main():
        eng = Engine(varied=lambda g: g % 3 != 1)
        src = DataSource(ITEMS, 2, seed=0, shuffle=False)
        cfg = make_config(max_staleness=3)
        p = start(AsyncProducer(cfg, eng.ctx(nonzero_std), src, version=0, max_inflight=6))
        trained, _ = await p.take(2, step=0)
        await settle()
        eng.abort_once = set(range(50))
        eng.gate.clear()
        p.set_version(1)  # new groups start: their first calls are aborted, the continued ones wait
        await settle()
        # partial responses: groups whose first call was aborted are continued and now wait at the gate
        snap = p.snapshot()
        assert any(s.response_length == 1 and s.status == Status.PENDING for g in snap.inflight for s in g)
        first_finished = [g[0].group_index for g in snap.finished]
        eng.gate.set()
        await settle()
        assert all(s.response_length in (0, 1) for g in snap.inflight for s in g)  # a copy: unchanged
        ids = lambda gs: [g[0].group_index for g in gs]  # noqa: E731
        ledger = [g for _, g, _ in snap.ledger]
        pushed = [g[0]["group_index"] for g in snap.data_source["buffer"]]
        accounted = ids(trained) + ledger + ids(snap.finished) + ids(snap.inflight) + pushed
        assert sorted(accounted) == list(range(snap.data_source["offset"]))  # each drawn group once
        await p.stop()

        # checkpoint files and back (the data source's state from the same snapshot)
        state = StreamState()
        state.put(snap)
        folder = tmp_path / "ckpt"
        folder.mkdir()
        ds_state = state.data_source_state.state_dict()
        state.data_source_state.save_files(ds_state, folder)
        full = state.state_dict()
        state.save_files(full, folder)
        loaded = StreamState()
        loaded.load_state_dict(loaded.load_files({"counters": full["counters"]}, folder))
        loaded.data_source_state.load_state_dict(loaded.data_source_state.load_files(
            {k: v for k, v in ds_state.items() if k != "buffer"}, folder))
        src2 = DataSource(ITEMS, 2, seed=0, shuffle=False)
        loaded.attach(src2)
        assert src2.offset == snap.data_source["offset"]
        restored = loaded.restored
        assert ids(restored.finished) == first_finished and restored.ledger == snap.ledger
        partial = {s.index: s.response_length for g in restored.inflight for s in g}

        eng2 = Engine(varied=lambda g: g % 3 != 1)
        p2 = start(AsyncProducer(cfg, eng2.ctx(nonzero_std), src2, version=1, finished=restored.finished,
                                 inflight=restored.inflight, ledger=restored.ledger))
        got, _ = await p2.take(len(first_finished), step=1)
        assert ids(got) == first_finished  # finished groups first, in their order
        more, _ = await p2.take(len(restored.inflight) + 2, step=2)
        continued = [s for g in more for s in g if partial.get(s.index)]
        assert continued and all(s.response_length == partial[s.index] + 2 for s in continued)
        await p2.stop()

    asyncio.run(main())


def test_dropping_every_finished_group_wakes_the_producer():
    """K = 0 and nothing generating: the finished groups fill the bound, all are stale at the next step and
    dropped; the producer must start new groups (not wait for a finish that cannot come)."""
    async def main():
        eng = Engine()
        src = DataSource(ITEMS, 2, seed=0, shuffle=False)
        p = start(AsyncProducer(make_config(max_staleness=0, stale_policy="drop"), eng.ctx(), src, version=0))
        await settle()
        assert len(p.finished) == 2 and not p.generating  # (0 + 0 + 1) x 2: the bound is reached
        eng.version = 1
        p.set_version(1)
        await settle()
        assert len(p.finished) == 4 and not p.generating  # (1 + 0 + 1) x 2: two of version 0, two of 1
        groups, m = await asyncio.wait_for(p.take(4, step=1), timeout=10)
        assert m["rollout/stale_dropped"] == 2 and all(s.weight_versions == ["1"] for g in groups for s in g)
        await p.stop()

    asyncio.run(main())


def test_the_checkpointed_data_source_state_is_the_snapshot_not_the_live_source():
    """The producer keeps drawing after the snapshot; the checkpoint's ``data_source`` state is the
    snapshot's (consistent with its finished and in-flight groups), not the live source's, which has moved
    on: a save read on the trainer thread cannot be torn."""
    async def main():
        eng = Engine()
        src = DataSource(ITEMS, 2, seed=0, shuffle=False)
        p = start(AsyncProducer(make_config(max_staleness=0), eng.ctx(), src, version=0))
        await settle()
        state = StreamState()
        state.attach(src)
        assert state.data_source_state.state_dict()["offset"] == src.offset  # before any snapshot: live
        state.put(p.snapshot())
        await p.take(2, step=0)
        p.set_version(1)
        await settle()
        saved = state.data_source_state.state_dict()
        assert src.offset > saved["offset"] == 2  # the source moved on; the checkpoint did not
        drawn = sorted(g[0].group_index for g in state.snapshot.finished + state.snapshot.inflight)
        assert drawn == list(range(saved["offset"]))  # the same instant as the groups it saves
        await p.stop()

    asyncio.run(main())


def test_a_checkpoint_captures_the_in_flight_partial_responses_then_they_continue():
    """At a checkpoint step (``capture_partials``) the generating calls are aborted and each group parks with
    its partial response, so the snapshot holds their tokens, log-probs and versions; no new group starts
    meanwhile; after ``release`` the same groups continue from those tokens and finish."""
    async def main():
        eng = Engine()
        src = DataSource(ITEMS, 2, seed=0, shuffle=False)
        p = start(AsyncProducer(make_config(max_staleness=5), eng.ctx(), src, version=0, max_inflight=3))
        eng.gate.clear()
        eng.version = 4
        await settle()
        assert len(p.generating) == 3 and all(s.response_length == 0 for g in p.generating.values() for s in g)
        started = src.offset
        await p.capture_partials()
        snap = p.snapshot()
        assert len(snap.inflight) == 3 and src.offset == started  # parked, nothing new drawn
        for s in (s for g in snap.inflight for s in g):
            assert (s.status, s.tokens[s.prompt_length:]) == (Status.PENDING, [5])
            assert s.rollout_log_probs == [-0.3] and s.rollout_token_versions == [4]
        p.release()
        eng.gate.set()
        want, resumed = {s.index for g in snap.inflight for s in g}, {}
        for step in range(5, 30):  # new groups start too and may finish first (kept when stale)
            groups, _ = await p.take(1, step=step)
            resumed.update({s.index: s for g in groups for s in g})
            if want <= set(resumed):
                break
        for s in (s for g in snap.inflight for s in g):  # the same samples went on from their partial tokens
            assert resumed[s.index].tokens[s.prompt_length:] == [5, 1, 2]
        await p.stop()

    asyncio.run(main())
