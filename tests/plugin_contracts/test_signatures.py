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


def test_data_source():
    """``rollout.data_source``: a class called ``cls(items, n_samples_per_prompt, seed=, shuffle=)`` with
    ``get_samples(n)``, ``add_samples(groups)``, ``state_dict()``, ``load_state_dict(state)``; the example
    subclass keeps the built-in's contract and exact resume."""
    from plugins.data_source import ShortPromptsFirst

    from hpcrl.data.source import DataSource
    from hpcrl.rollout.plugins import DEFAULT_DATA_SOURCE, make_data_source

    cfg = Config()
    assert make_data_source(cfg, [{"prompt": "a"}]).__class__ is DataSource
    assert DEFAULT_DATA_SOURCE == "hpcrl.data.source.DataSource" == cfg.rollout.data_source
    assert params(DataSource)[:4] == ["items", "n_samples_per_prompt", "seed", "shuffle"]
    cfg.rollout.data_source = "plugins.data_source.ShortPromptsFirst"
    cfg.rollout.n_samples_per_prompt = 2
    items = [{"prompt": p} for p in ("333+1=", "1+1=", "22+1=", "4444+1=")]
    src = make_data_source(cfg, items)
    assert isinstance(src, ShortPromptsFirst)
    assert [g[0].prompt for g in src.get_samples(2)] == ["1+1=", "22+1="]
    state = src.state_dict()
    again = make_data_source(cfg, items)
    again.load_state_dict(state)
    assert [g[0].prompt for g in again.get_samples(2)] == [g[0].prompt for g in src.get_samples(2)] \
        == ["333+1=", "4444+1="]


def test_defaults_are_the_built_ins_resolved_in_one_place():
    """Every plug-in field defaults to the dotted path of the built-in, and resolve_plugins loads exactly it."""
    from hpcrl.rollout.generate import generate
    from hpcrl.rollout.plugins import resolve_plugins
    from hpcrl.rollout.rollout import generate_rollout

    cfg = Config()
    assert (cfg.rollout.rollout_function, cfg.rollout.generate_function) == (
        "hpcrl.rollout.rollout.generate_rollout", "hpcrl.rollout.generate.generate")
    cfg.rollout.reward_function = "exact_match"
    resolved = resolve_plugins(cfg)
    assert resolved.rollout_fn is generate_rollout and resolved.generate_fn is generate
    assert resolved.dynamic_filter is None and asyncio.run(resolved.reward_fn(Sample(label="3", response="3"))) == 1.0
    cfg.rollout.rollout_function = cfg.rollout.generate_function = None  # null: the built-in, as before
    resolved = resolve_plugins(cfg)
    assert resolved.rollout_fn is generate_rollout and resolved.generate_fn is generate


def test_slurm_bootstrap():
    """``$HPCRL_SLURM_BOOTSTRAP``: ``(cfg, run_dir) -> int`` (the exit status of the job's task)."""
    from hpcrl.slurm.entry import default_bootstrap, slurm_bootstrap

    assert params(default_bootstrap) == params(slurm_bootstrap) == ["cfg", "run_dir"]
    assert inspect.signature(default_bootstrap).return_annotation in (int, "int")


def test_examples_are_not_already_imported_from_elsewhere():
    """``plugins`` resolves to examples/plugins (not some installed package of that name)."""
    import plugins

    assert Path(plugins.__file__).parent == EXAMPLES / "plugins", sys.path[:3]
