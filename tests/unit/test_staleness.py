"""hpcrl.rollout.stats' staleness of trained tokens (docs/algorithms.md, "Fully asynchronous training")
against hand counts on hand-built samples: per-token versions (mixed, unknown -1, tool tokens), the
per-call fallback, a group's oldest version, and what rollout_metrics adds (nothing without token
versions)."""

from __future__ import annotations

import pytest

from hpcrl.config import Config
from hpcrl.data.sample import Sample, Status
from hpcrl.rollout import stats


def sample(*parts, weight_versions=(), rollout_id=5) -> Sample:
    """A sample whose response is ``parts``: ``(n_tokens, trainable, versions or None)`` each."""
    s = Sample(index=0, prompt="1+1=", tokens=[7, 8], reward=1.0, status=Status.COMPLETED,
               weight_versions=list(weight_versions), rollout_id=rollout_id)
    for n, trainable, versions in parts:
        s.append_response_tokens([9] * n, [-0.5] * n, trainable=trainable, versions=versions)
    return s


def samples_by_hand() -> dict[str, Sample]:
    return {
        # in_place across a sync: versions 3, 3 then 4, 4 -> mixed; staleness at step 5: 2, 2, 1, 1
        "mixed": sample((4, True, [3, 3, 4, 4]), weight_versions=["3"]),
        # a token of unknown version, tool output (not trained), one more trainable token: known 4, 4
        "tool": sample((2, True, [4, -1]), (2, False, None), (1, True, [4]), weight_versions=["4"]),
        # no token versions (an older buffer): the oldest call version 2 for its 3 trainable tokens; two calls
        # (a response continued after a sync) -> mixed
        "fallback": Sample(index=1, tokens=[7, 9, 9, 9], response_length=3, loss_mask=[1, 1, 1],
                           rollout_log_probs=[-1.0] * 3, reward=0.0, status=Status.COMPLETED,
                           weight_versions=["2", "4"], rollout_id=5),
        # nothing known: tokens -1 and an engine's own version name
        "unknown": sample((3, True, None), weight_versions=["default"]),
    }


def test_trainable_token_versions_by_hand():
    s = samples_by_hand()
    assert stats.trainable_token_versions(s["mixed"]) == [3, 3, 4, 4]
    assert stats.trainable_token_versions(s["tool"]) == [4, 4]
    assert stats.trainable_token_versions(s["fallback"]) == [2, 2, 2]
    assert stats.trainable_token_versions(s["unknown"]) == []
    assert [stats.oldest_version(x) for x in s.values()] == [3, 4, 2, None]
    assert [stats.is_mixed_version(x) for x in s.values()] == [True, False, True, False]
    assert [stats.has_token_versions(x) for x in s.values()] == [True, True, False, False]


def test_group_age_is_its_oldest_token():
    s = samples_by_hand()
    assert stats.group_oldest_version([s["tool"], s["mixed"]]) == 3
    assert stats.group_staleness([s["tool"], s["mixed"]], step=5) == 2  # admissible iff max_staleness >= 2
    assert stats.group_staleness([s["tool"], s["unknown"]], step=4) == 0
    assert stats.group_staleness([s["unknown"]], step=4) is None


def test_staleness_metrics_token_weighted_by_hand():
    s = samples_by_hand()
    m = stats.staleness_metrics(list(s.values()), step=5)
    # tokens: mixed 2+2+1+1, tool 1+1, fallback 3+3+3 -> 17 over 9 tokens; max 3; mixed: 2 of the 3 known
    assert m == {"rollout/staleness_mean": pytest.approx(17 / 9), "rollout/staleness_max": 3,
                 "rollout/mixed_version_share": pytest.approx(2 / 3)}
    assert stats.staleness_metrics(list(s.values())) == m  # default step: each sample's rollout_id (5)
    m7 = stats.staleness_metrics([s["mixed"]], step=7)
    assert m7["rollout/staleness_mean"] == pytest.approx((4 + 4 + 3 + 3) / 4)
    assert m7["rollout/staleness_max"] == 4
    assert stats.staleness_metrics([s["unknown"]], step=5) == {}


def test_rollout_metrics_adds_staleness_only_with_token_versions():
    cfg = Config()
    s = samples_by_hand()
    plain = stats.rollout_metrics(cfg, [s["fallback"], s["unknown"]], {}, 1, 0)
    assert not any(k.startswith(("rollout/staleness", "rollout/mixed")) for k in plain)
    assert plain["rollout/lag_max"] == 3  # the existing per-call lag is unchanged
    full = stats.rollout_metrics(cfg, list(s.values()), {}, 1, 0)
    assert full["rollout/staleness_mean"] == pytest.approx(17 / 9) and full["rollout/staleness_max"] == 3
    assert full["rollout/mixed_version_share"] == pytest.approx(2 / 3)
    assert set(full) - set(plain) == {"rollout/staleness_mean", "rollout/staleness_max",
                                      "rollout/mixed_version_share"}
