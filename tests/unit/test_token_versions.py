"""Per-token weight versions from streamed chunks (hpcrl.rollout.token_versions) and the pause mode a run's
weight sync uses (hpcrl.weights.sync.resolve_pause_mode / WeightSyncer.from_config)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from hpcrl.config import WeightsSection
from hpcrl.engine.protocol import weight_version_spans
from hpcrl.rollout.token_versions import (UNKNOWN_VERSION, ChunkLabeller, labels_from_spans, span_lag,
                                          version_number)
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


EVENT_CASES = [  # (events (old version, output tokens then), current version, output tokens now)
    ([], "3", 5), ([], "3", 0), ([("3", 2)], "4", 5), ([("3", 2), ("4", 4)], "5", 6),
    ([("3", 5)], "4", 5),  # changed when the response was already complete (an aborted row, say)
    ([("3", 2), ("4", 2)], "5", 4),  # two updates with no token between
    ([("3", 7)], "4", 5),  # more tokens then than now (SGLang's retraction of an input_embeds request)
]


def test_weight_version_spans_by_hand():
    assert weight_version_spans([], "3", 5) == [{"version": "3", "start": 0, "end": 5}]
    assert weight_version_spans([("3", 2), ("4", 4)], "5", 6) == [
        {"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 4},
        {"version": "5", "start": 4, "end": 6}]
    assert weight_version_spans([("3", 2), ("4", 2)], "5", 4) == [
        {"version": "3", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 4}]
    assert weight_version_spans([], "3", 0) == [{"version": "3", "start": 0, "end": 0}]


@pytest.fixture(scope="module")
def sglang_weight_versions():
    """SGLang's ``srt/utils/weight_versions.py`` from the installed wheel, run as a module of its own (its one
    import of the package, a pydantic-schema helper, is replaced: importing the package needs its runtime)."""
    pytest.importorskip("msgspec", reason="SGLang's weight_versions needs msgspec (hpcrl's dev extra has it)")
    spec = importlib.util.find_spec("sglang")  # the package's folder, without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed (`pip install --no-deps sglang==0.5.23`, as .ci/install does)")
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "utils" / "weight_versions.py"
    if not path.is_file():
        pytest.skip(f"{path} is missing: this SGLang predates per-token weight-version spans")
    helper = "from sglang.srt.utils.msgspec_utils import msgspec_struct_pydantic_core_schema"
    source = path.read_text()
    assert helper in source, "SGLang's weight_versions.py imports changed: update this fixture"
    module = types.ModuleType("sglang_weight_versions")
    sys.modules[module.__name__] = module
    exec(compile(source.replace(helper, "msgspec_struct_pydantic_core_schema = None"), str(path), "exec"),
         module.__dict__)
    return module


@pytest.mark.parametrize("events, current, n", EVENT_CASES)
def test_weight_version_spans_match_sglang(sglang_weight_versions, events, current, n):
    """The CPU engine's spans are SGLang 0.5.23's (its own function, from the installed wheel), and the
    client turns them into one version per token."""
    sglang = sglang_weight_versions
    theirs = sglang.compute_weight_version_spans(
        [sglang.WeightVersionEvent(old_version=v, num_output_tokens=k) for v, k in events], current, n)
    mine = weight_version_spans(events, current, n)
    assert mine == [{"version": s.version, "start": s.start, "end": s.end} for s in theirs]
    # token i was sampled by the version the first change after it replaced (the current one if none)
    assert labels_from_spans(mine, n) == [next((v for v, k in events if i < k), current) for i in range(n)]


def test_labels_from_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert labels_from_spans(spans, 5) == ["3", "3", "4", "4", "4"]
    assert labels_from_spans(spans, 6) is None  # not a cover of the tokens
    assert labels_from_spans([spans[1]], 3) is None  # not from token 0
    assert labels_from_spans(None, 0) is None and labels_from_spans([], 0) is None
    assert labels_from_spans([{"version": "3"}], 0) is None


def test_labels_from_spans_with_a_lag():
    """SGLang's overlap scheduler counts one old-version token in the new span of an in-place update: with
    ``lag=1`` it keeps the older label (tests/sglang measures the lag)."""
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5},
             {"version": "5", "start": 5, "end": 6}]
    assert labels_from_spans(spans, 6, lag=1) == ["3", "3", "3", "4", "4", "4"]
    assert labels_from_spans(spans[:1], 2, lag=1) == ["3", "3"]  # the first span has no older version


@pytest.mark.parametrize("sglang, args, mode, lag", [
    (True, {}, "in_place", 1), (True, {"disable_overlap_schedule": True}, "in_place", 0),
    (True, {}, "retract", 0), (True, {}, "abort", 0), (False, {}, "in_place", 0)])
def test_span_lag(sglang, args, mode, lag):
    assert span_lag(sglang, args, mode) == lag


def test_run_span_lag_follows_the_config():
    from hpcrl.config import load_config
    from hpcrl.rollout.fleet import run_span_lag

    def cfg(*overrides):
        return load_config("configs/quickstart.yaml",
                           ["run.placement=disaggregate", "algorithm.use_tis=true", *overrides])

    assert run_span_lag(cfg("rollout.engine=sglang", "run.mode=fully_async")) == 1
    assert run_span_lag(cfg("rollout.engine=sglang", "run.mode=fully_async", "weights.pause_mode=retract")) == 0
    assert run_span_lag(cfg("rollout.engine=sglang", "run.mode=fully_async",
                            "sglang.disable_overlap_schedule=true")) == 0
    assert run_span_lag(cfg("rollout.engine=cpu", "run.mode=fully_async")) == 0


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
