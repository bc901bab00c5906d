"""generate_rollout's over-sampling cut and starving filter (issue #9 points 7 and 8), in process.

Generation goes through the custom-generate plug-in contract (``async def generate(client, sample, params)``),
here a seeded function whose finishing order is the reverse of the submission order, so a cut that depended on
timing would show; the engine path itself is covered by tests/integration/test_filter_errors.py. The client is
None: an abort would raise AttributeError, so these tests also show when nothing was aborted.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from hpcrl import errors
from hpcrl.config import Config
from hpcrl.data.sample import Status
from hpcrl.data.source import DataSource
from hpcrl.rollout.filters import nonzero_std
from hpcrl.rollout.rollout import (MAX_OVERSAMPLING_FACTOR, FilterStarved, RolloutContext, generate_rollout,
                                   group_multiple, split_trainable)

ITEMS = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(500)]


class CharTokenizer:
    """Prompt text -> one id per character (what tokenize_prompt needs of a tokenizer)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def make_config(**rollout) -> Config:
    cfg = Config()
    cfg.rollout.batch_size = 3
    cfg.rollout.n_samples_per_prompt = 2
    cfg.rollout.over_sampling_batch_size = 6
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def make_ctx(varied) -> RolloutContext:
    """Samples of group g get rewards [0, 1] when ``varied(g)`` else [1, 1]; later groups finish first."""

    async def generate(client, sample, params):
        await asyncio.sleep(0.001 * (50 - sample.group_index % 50))
        rng = random.Random(params["sampling_seed"])
        tok = rng.randrange(100)
        sample.append_response_tokens([tok], [-1.0], text=str(tok))
        sample.status = Status.COMPLETED
        return sample

    async def reward(sample):
        return float(sample.index % 2) if varied(sample.group_index) else 1.0

    return RolloutContext(client=None, tokenizer=CharTokenizer(), reward_fn=reward, generate_fn=generate,
                          dynamic_filter=nonzero_std, seed=3)


def test_split_trainable_and_group_multiple():
    groups = [[i] for i in range(5)]
    assert split_trainable(groups, 1) == (groups, [])
    assert split_trainable(groups, 2) == (groups[:4], groups[4:])
    assert split_trainable(groups[:1], 2) == ([], groups[:1])
    assert group_multiple(4, dp_size=2, num_steps_per_rollout=1) == 1  # 4 samples split over 2 ranks
    assert group_multiple(2, dp_size=2, num_steps_per_rollout=2) == 2
    assert group_multiple(3, dp_size=1, num_steps_per_rollout=2) == 2
    with pytest.raises(ValueError, match="multiple"):
        split_trainable(groups, 0)


def test_deterministic_partial_rollout_finishes_in_flight_groups_and_holds_them_back():
    cfg = make_config(partial_rollout=True)
    cfg.run.deterministic = True
    src = DataSource(ITEMS, 2, seed=0)
    out = asyncio.run(generate_rollout(cfg, 0, src, make_ctx(lambda g: g % 2 == 0)))
    # kept: the first 3 accepted in submission order (even positions 0, 2, 4); 1, 3 filtered; 5 held, finished
    assert [g[0].group_index for g in out.groups] == [0, 2, 4]
    assert out.metrics["rollout/groups_held"] == 1 and out.metrics["rollout/groups_aborted"] == 0
    assert out.metrics["rollout/groups_filtered"] == 2 and out.metrics["rollout/groups_short"] == 0
    [held] = src.buffer
    assert held[0].group_index == 5 and all(s.status == Status.COMPLETED and s.response_length == 1
                                            for s in held)
    # next step: the held group is served first, not generated again, and the filter sees it then
    tokens = [list(s.tokens) for s in held]
    out2 = asyncio.run(generate_rollout(cfg, 1, src, make_ctx(lambda g: True)))
    assert out2.groups[0] is held and [s.tokens for s in held] == tokens
    assert all(s.rollout_id == 1 for s in held)


def test_starving_filter_trains_on_the_kept_groups_or_raises(caplog):
    cfg = make_config()
    src = DataSource(ITEMS, 2, seed=0)
    out = asyncio.run(generate_rollout(cfg, 4, src, make_ctx(lambda g: g in (7, 40))))
    assert [g[0].group_index for g in out.groups] == [7, 40]
    assert out.metrics["rollout/groups_short"] == 1
    assert out.metrics["rollout/groups_submitted"] == MAX_OVERSAMPLING_FACTOR * 3
    assert "kept 2 of 96 groups (needed 3): training on the 2 kept groups" in caplog.text

    cfg = make_config(on_filter_starved="error")
    with pytest.raises(RuntimeError, match=r"rollout 4: the dynamic filter kept 2 of 96 groups \(needed 3\)"):
        asyncio.run(generate_rollout(cfg, 4, DataSource(ITEMS, 2, seed=0), make_ctx(lambda g: g in (7, 40))))
    with pytest.raises(FilterStarved, match="kept 0 of 96") as e:  # nothing to train on, whatever the setting
        asyncio.run(generate_rollout(make_config(), 4, DataSource(ITEMS, 2, seed=0), make_ctx(lambda g: False)))
    assert "lower the learning rate" in str(e.value)  # a later rollout: the policy may have collapsed
    assert (e.value.kept, e.value.submitted, e.value.needed) == (0, 96, 3)
    assert errors.exit_code_of(e.value) == errors.EXIT_FAILED  # a known error: one line, exit 1
    with pytest.raises(FilterStarved, match="from the starting model") as e:  # rollout 0: no update yet
        asyncio.run(generate_rollout(make_config(), 0, DataSource(ITEMS, 2, seed=0),
                                     make_ctx(lambda g: False)))
    assert "learning rate" not in str(e.value)


def test_a_failed_abort_leaves_no_unretrieved_task_errors():
    """An engine that died mid-rollout: the abort fails too. The in-flight groups are cancelled and awaited
    before the error propagates, so asyncio has no 'Task exception was never retrieved' to print at exit (it
    buried the job's one-line error under one traceback per group)."""
    import asyncio
    import gc

    from hpcrl.rollout.client import RolloutError
    from hpcrl.rollout.rollout import RolloutContext, _abort_rest

    class DeadClient:
        async def abort_all(self):
            raise RolloutError("POST http://n1:1/abort_request failed: connection refused", "http://n1:1")

    unretrieved = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))

        async def fails():
            raise RolloutError("POST http://n1:1/generate failed: connection refused", "http://n1:1")

        async def hangs():
            await asyncio.sleep(3600)

        pending = [(asyncio.ensure_future(fails()), []), (asyncio.ensure_future(hangs()), [])]
        await asyncio.sleep(0)
        ctx = RolloutContext(client=DeadClient(), tokenizer=None, reward_fn=None, generate_fn=None)
        with pytest.raises(RolloutError, match="abort_request"):
            await _abort_rest(ctx, pending, data_source=None, partial=False)
        assert all(t.done() for t, _ in pending)
        del pending
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert unretrieved == []


def test_a_reward_the_generate_function_fixed_is_kept():
    """An agent's posted reward (or a failed episode's) is not replaced by the scorer; every other sample of the
    group is scored."""
    from hpcrl.data.sample import Sample
    from hpcrl.rollout.rollout import generate_group

    async def generate(client, sample, params):
        sample.append_response_tokens([5], [-1.0], text="5")
        sample.status = Status.COMPLETED
        if sample.index == 0:
            sample.reward, sample.metadata["reward_source"] = 0.25, "agent"
        return sample

    async def reward(sample):
        return 9.0

    ctx = RolloutContext(client=None, tokenizer=CharTokenizer(), reward_fn=reward, generate_fn=generate,
                         dynamic_filter=None, seed=3)
    group = [Sample(prompt="1+1=", index=i) for i in range(2)]
    asyncio.run(generate_group(make_config(), ctx, group, {}, False))
    assert [s.reward for s in group] == [0.25, 9.0]
