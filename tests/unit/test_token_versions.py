"""Per-token weight versions from streamed chunks (hpcrl.rollout.token_versions) and the pause mode a run's
weight sync uses (hpcrl.weights.sync.resolve_pause_mode / WeightSyncer.from_config)."""

from __future__ import annotations

import pytest

from hpcrl.config import WeightsSection
from hpcrl.rollout.token_versions import UNKNOWN_VERSION, ChunkLabeller, version_number
from hpcrl.weights.sync import WeightSyncer, resolve_pause_mode


def labels_of(chunks, previous=None):
    """Feed ``(ids, version)`` chunks to one labeller; the labels after each."""
    lab = ChunkLabeller(previous)
    out = []
    for ids, version in chunks:
        lab.add(ids, version)
        out.append(list(lab.labels))
    return out


def test_version_number():
    assert [version_number(v) for v in ("12", 7, " 3", "-1", "+4")] == [12, 7, 3, -1, 4]
    assert {version_number(v) for v in (None, "default", "step-7", "1.5", True, "")} == {UNKNOWN_VERSION}


def test_one_token_per_chunk_switches_at_the_update():
    # the CPU engine: one chunk per sampled token; an update lands between tokens 2 and 3
    chunks = [([5], "3"), ([5, 6], "3"), ([5, 6, 7], "4"), ([5, 6, 7, 8], "4")]
    assert labels_of(chunks)[-1] == ["3", "3", "4", "4"]


def test_a_chunk_that_may_straddle_an_update_gets_the_older_version():
    # stream_interval 3: the second chunk brings 3 tokens and a new version; where the update landed is
    # unknown, so all three keep the older version; the next chunk (same version again) is the new one
    chunks = [([1, 2, 3], "3"), ([1, 2, 3, 4, 5, 6], "4"), ([1, 2, 3, 4, 5, 6, 7, 8, 9], "4")]
    assert labels_of(chunks) == [["3"] * 3, ["3"] * 6, ["3"] * 6 + ["4"] * 3]
    # a single new token with a new version is exact; a first multi-token chunk has nothing older to use
    assert labels_of([([1], "3"), ([1, 2], "4")])[-1] == ["3", "4"]
    assert labels_of([([1, 2], "4")])[-1] == ["4", "4"]
    # a continued response (a retry after a dead engine) names its last known version
    assert labels_of([([1, 2], "4")], previous="3")[-1] == ["3", "3"]


def test_an_abort_chunk_adds_nothing_and_a_restart_relabels_from_the_common_prefix():
    chunks = [([1], "3"), ([1, 2], "3"), ([1, 2], "3")]  # the last: the abort answer, no new token
    assert labels_of(chunks)[-1] == ["3", "3"]
    # a router that re-sent the request to another worker: its chunks start again from one token
    restarted = [([1], "3"), ([1, 2], "3"), ([1, 2, 3], "3"), ([1], "4"), ([1, 9], "4")]
    assert labels_of(restarted)[-2:] == [["3"], ["3", "4"]]


def test_pause_mode_resolution():
    assert resolve_pause_mode(None, "fully_async") == "in_place"
    assert resolve_pause_mode(None, "sync") == resolve_pause_mode(None, "async") == "abort"
    assert resolve_pause_mode("retract", "fully_async") == "retract"
    assert resolve_pause_mode("abort", "fully_async") == "abort"
    with pytest.raises(ValueError, match="sideways"):
        resolve_pause_mode("sideways", "sync")


@pytest.mark.parametrize("pause_mode, run_mode, expected, flushes", [
    (None, "fully_async", "in_place", False), (None, "async", "abort", True),
    ("retract", "sync", "retract", True), ("in_place", "async", "in_place", False)])
def test_from_config_resolves_the_pause_mode(pause_mode, run_mode, expected, flushes):
    weights = WeightsSection(method="tensor", pause_mode=pause_mode)
    syncer = WeightSyncer.from_config(None, weights, run_mode, is_sender=False)
    assert syncer.pause_mode == expected and syncer.flushes is flushes
    default = WeightSyncer.from_config(None, WeightsSection(method="tensor"), is_sender=False)
    assert default.pause_mode == "abort"
