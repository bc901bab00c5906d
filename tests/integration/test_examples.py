"""The example plug-ins (examples/plugins/, one per extension point) work: each called directly on real samples,
and all five plugged into one short ``hpcrl run`` (real engine and trainer) by their files
(``examples/plugins/rewards.py:partial_credit``: no ``PYTHONPATH`` needed)."""

from __future__ import annotations

import pytest

from hpcrl.data.sample import Sample
from tests.integration.test_loop import REPO, metrics, run_hpcrl

pytestmark = pytest.mark.integration

EXAMPLES = REPO / "examples"


@pytest.fixture
def plugins(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # for this test process's direct calls only; the run needs none
    import plugins

    return plugins


def test_reward_and_filter_examples_on_samples(plugins):
    from plugins.filters import any_rewarded
    from plugins.rewards import partial_credit

    def scored(response: str) -> Sample:
        s = Sample(label="579", response=response)
        s.reward = partial_credit(None, s)
        return s

    assert [scored(r).reward for r in ("579", "9", "12")] == [
        {"reward": 1.0, "exact": 1.0}, {"reward": 0.25, "exact": 0.0}, {"reward": 0.0, "exact": 0.0}]
    assert any_rewarded([scored("12"), scored("9")]) and not any_rewarded([scored("12"), scored("")])


def test_all_five_examples_plug_into_a_run(tmp_path, plugins):
    ex = EXAMPLES / "plugins"
    out = run_hpcrl(tmp_path, "ex", "rollout.max_new_tokens=8",
                    f"rollout.reward_function={ex / 'rewards.py'}:partial_credit",
                    f"rollout.dynamic_filter={ex / 'filters.py'}:any_rewarded",
                    f"rollout.generate_function={ex / 'generate.py'}:short_answers",
                    f"rollout.rollout_function={ex / 'rollout.py'}:counted_rollout",
                    f"rollout.data_source={ex / 'data_source.py'}:ShortPromptsFirst")
    assert out.returncode == 0, out.log[-3000:]
    steps = metrics(tmp_path / "runs" / "ex")[1:]
    assert [r["step"] for r in steps] == [0, 1, 2]
    # the rollout function's metric: every kept sample counted (4 groups of 4 unless the filter starved)
    assert all(r["rollout/example_samples"] == 16 - 4 * r["rollout/groups_short"] for r in steps)
    from plugins.generate import MAX_ANSWER_TOKENS

    assert all(r["rollout/response_length"] <= MAX_ANSWER_TOKENS for r in steps)  # the generate function's cap
    assert all(r["rollout/reward_mean"] > 0 for r in steps)  # the filter kept only groups with some reward
    # the reward function's values are 0, 0.25 and 1: the kept samples' reward sum is a multiple of 0.25
    sums = [r["rollout/reward_mean"] * r["rollout/example_samples"] * 4 for r in steps]
    assert all(abs(x - round(x)) < 1e-6 for x in sums), sums
    # the data source ran (its order is checked in tests/plugin_contracts) and the run folder's config names it
    assert "data_source.py:ShortPromptsFirst" in (tmp_path / "runs" / "ex" / "config.yaml").read_text()
