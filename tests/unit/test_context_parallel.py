"""The context-parallel split of a pack (hpcrl.train.context_parallel; issue #55 point 2): which rows each CP rank
holds and which response predictions it makes. The multi-rank exactness is tests/parallel/test_actor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from hpcrl.train.context_parallel import all_rows, local_rows, split_predictions


def test_local_rows_are_megatrons_load_balanced_chunks():
    assert local_rows(8, 1, 0).tolist() == list(range(8))
    assert local_rows(8, 2, 0).tolist() == [0, 1, 6, 7]  # chunks 0 and 3 of 4
    assert local_rows(8, 2, 1).tolist() == [2, 3, 4, 5]  # chunks 1 and 2
    assert local_rows(16, 4, 1).tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    rows = all_rows(48, 4)
    assert sorted(torch.cat(rows).tolist()) == list(range(48))  # every row on exactly one rank
    assert all(r.numel() == 12 and bool((r[1:] > r[:-1]).all()) for r in rows)  # equal parts, ascending
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        local_rows(10, 2, 0)


def test_split_predictions_covers_every_prediction_once():
    rows = all_rows(16, 2)  # rank 0: 0-3, 12-15; rank 1: 4-11
    logit_rows = torch.tensor([2, 3, 4, 11, 12, 5])
    where = None
    for rank in range(2):
        local, where = split_predictions(logit_rows, rows, rank)
        mine = logit_rows[where[rank]]
        assert rows[rank][local].tolist() == mine.tolist()  # the rank's own rows, in [K]'s order
    assert [w.tolist() for w in where] == [[0, 1, 4], [2, 3, 5]]
    assert sorted(torch.cat(where).tolist()) == list(range(6))
