"""The plug-in contracts (slime keeps the same folder): the signature hpcrl calls each extension point with, pinned
on the built-in default and on the example plug-in in examples/plugins/. A change here breaks users' plug-ins:
it needs a deprecation, not a quiet edit."""

from __future__ import annotations

import asyncio
import inspect
import sys
from pathlib import Path

import pytest

from hpcrl.config import Config
from hpcrl.data.sample import Sample

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_rollout_function():
    """``rollout.rollout_function``: ``async (cfg, rollout_id, data_source, ctx) -> RolloutOutput``."""
    from plugins.rollout import counted_rollout

    from hpcrl.rollout.rollout import RolloutOutput, generate_rollout

    assert params(generate_rollout)[:4] == ["cfg", "rollout_id", "data_source", "ctx"]
    assert params(counted_rollout) == ["cfg", "rollout_id", "data_source", "ctx"]
    assert inspect.iscoroutinefunction(generate_rollout) and inspect.iscoroutinefunction(counted_rollout)
    assert inspect.signature(generate_rollout).return_annotation in (RolloutOutput, "RolloutOutput")


def test_generate_function():
    """``rollout.generate_function``: ``async (client, sample, sampling_params) -> Sample``, and the loop takes it
    through ``get_generate_function``."""
    from plugins.generate import short_answers

    from hpcrl.rollout.generate import generate, get_generate_function

    assert params(generate) == params(short_answers) == ["client", "sample", "sampling_params"]
    assert inspect.iscoroutinefunction(generate) and inspect.iscoroutinefunction(short_answers)
    assert get_generate_function(None) is generate and get_generate_function(short_answers) is short_answers


def test_reward_function_is_called_with_cfg_and_sample():
    """``rollout.reward_function``: ``[async] (cfg, sample) -> float | dict``; hpcrl wraps it into
    ``async (sample)``."""
    from hpcrl.rewards import get_reward_function

    cfg = Config()
    cfg.rollout.reward_function = "plugins.rewards.partial_credit"
    fn = get_reward_function(cfg)
    sample = Sample(label="12", response="12")
    assert asyncio.run(fn(sample)) == {"reward": 1.0, "exact": 1.0}
    from plugins.rewards import partial_credit

    assert params(partial_credit) == ["cfg", "sample"]


def test_dynamic_filter():
    """``rollout.dynamic_filter``: ``(group: list[Sample]) -> bool``; a dotted path loads the function itself."""
    from plugins.filters import any_rewarded

    from hpcrl.rollout.filters import get_dynamic_filter, nonzero_std

    assert get_dynamic_filter("plugins.filters.any_rewarded") is any_rewarded
    assert params(nonzero_std) == params(any_rewarded) == ["group"]
    group = [Sample(index=0, reward=0.0), Sample(index=1, reward=1.0)]
    assert nonzero_std(group) is True and any_rewarded(group) is True


def test_slurm_bootstrap():
    """``$HPCRL_SLURM_BOOTSTRAP``: ``(cfg, run_dir) -> int`` (the exit status of the job's task)."""
    from hpcrl.slurm.entry import default_bootstrap, slurm_bootstrap

    assert params(default_bootstrap) == params(slurm_bootstrap) == ["cfg", "run_dir"]
    assert inspect.signature(default_bootstrap).return_annotation in (int, "int")


def test_examples_are_not_already_imported_from_elsewhere():
    """``plugins`` resolves to examples/plugins (not some installed package of that name)."""
    import plugins

    assert Path(plugins.__file__).parent == EXAMPLES / "plugins", sys.path[:3]
