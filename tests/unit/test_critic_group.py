"""The link to a critic on ranks of its own (:mod:`hpcrl.train.critic_group`), in one process: the wire format
carries samples and per-sample rows exactly, and a wait on the link ends in a :class:`CriticError` (not a hang)
when the other side is gone. The whole critic world is tested in tests/integration/test_ppo_local.py."""

from __future__ import annotations

from multiprocessing import Pipe

import pytest
import torch

from hpcrl.data.sample import Sample
from hpcrl.train.critic_group import (CriticError, pack_rows, pack_samples, receive, send, unpack_rows,
                                      unpack_samples)


def test_samples_and_rows_round_trip_exactly():
    samples = [Sample(index=7, group_index=2, tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 0]),
               Sample(index=8, group_index=2, tokens=[5, 6, 9, 10, 11, 3], response_length=4,
                      loss_mask=[1, 1, 0, 1], segments=[4, 2], reward=1.0, rollout_log_probs=[-1.0] * 4),
               Sample(index=9, group_index=3, tokens=[4], response_length=0, loss_mask=[])]
    back = unpack_samples(pack_samples(samples))
    for s, b in zip(samples, back, strict=True):
        assert (b.index, b.group_index, b.tokens, b.response_length, b.loss_mask, b.segments) == \
            (s.index, s.group_index, s.tokens, s.response_length, s.loss_mask, s.segments)
        assert b.reward is None and b.rollout_log_probs == []  # only what the critic needs travels
    rows = [torch.randn(3), torch.zeros(0), torch.randn(5, dtype=torch.float64)]
    got = unpack_rows(pack_rows(rows))
    assert [g.dtype for g in got] == [torch.float32] * 3
    assert all(torch.equal(g, r.float()) for g, r in zip(got, rows, strict=True))


def test_a_wait_on_the_link_ends_when_the_other_side_is_gone():
    mine, theirs = Pipe()
    send(theirs, {"values": [1, 2]})
    assert receive(mine, lambda: None, "values") == {"values": [1, 2]}
    with pytest.raises(CriticError, match="while waiting for values: critic rank 0 exited with status 1"):
        receive(mine, lambda: "critic rank 0 exited with status 1", "values", poll_s=0.01)
    with pytest.raises(CriticError, match="no answer from the critic's ranks for 0 s"):
        receive(mine, lambda: None, "values", timeout_s=0.05, poll_s=0.01)
    theirs.close()
    with pytest.raises(CriticError, match="link closed while waiting for values"):
        receive(mine, lambda: None, "values", poll_s=0.01)
