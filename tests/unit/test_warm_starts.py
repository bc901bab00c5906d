"""The warm starts shipped with the tests (``tests/warm_starts``, issue #52 point 2) are the ones their configs
make today: the cache key each was made under equals the key the config and a freshly created base model give
now, and every shipped file is the one that was made. When a recipe, the tiny model's definition or anything
else in the key changes, this fails and names the command that rebuilds the entry.

Also checked: an installed warm start is found by the config's own run (the store's lookup, as ``hpcrl run``
does it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.warm_starts import WARM_STARTS, check, install, load, stores


@pytest.mark.parametrize("name", sorted(WARM_STARTS))
def test_shipped_warm_start_matches_its_config_and_model(name):
    """The key holds the sha256 of a base model created now (with AVX2 kernels): equal keys also say the base
    model is made the same bytes as when the entry was built."""
    problems = check(name)
    assert not problems, "\n".join(problems)
    made = json.loads((WARM_STARTS[name].folder / "made.json").read_text())
    assert made["command"] == WARM_STARTS[name].build_command()


def test_an_installed_warm_start_is_found_by_its_runs_cache_lookup(tmp_path):
    from hpcrl.sft import WarmStartStore, cache_key, key_digest

    ws = WARM_STARTS["quickstart-teacher"]  # a config with overrides (another target, another store)
    got = install(ws.name, tmp_path)
    assert got["base"] == tmp_path / load(ws).model.path
    assert [store for store, _ in stores(ws)] == ["tiny-qwen2-addition-teacher"]
    for store, c in stores(ws):
        key = cache_key(c, got["base"])
        found = WarmStartStore(tmp_path / c.sft.output)
        assert found.cached(key_digest(key), key), store
        assert got[store] == found.folder(key_digest(key))
        assert (tmp_path / c.sft.output).resolve() == got[store].resolve()  # sft.output links to it
