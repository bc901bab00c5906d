"""The CPU engine's LoRA flags and registry refuse what SGLang 0.5.23 refuses, with its messages (issue #56
point 3; the served adapters themselves: tests/integration/test_engine_lora.py)."""

from __future__ import annotations

import pytest

from hpcrl.engine.args import parse_args
from hpcrl.engine.lora import EngineAdapters, LoraError, LoraOptions, parse_lora_paths
from hpcrl.engine.protocol import ContractError, RequestError, parse_generate


def test_flags_as_sglang_reads_them():
    args = parse_args(["--model-path", "m", "--lora-paths", "x=/a", "/b", '{"lora_name": "y", "lora_path": "/c", "pinned": true}'])
    assert args.enable_lora  # --lora-paths alone turns LoRA on
    assert args.lora_options().paths == (("x", "/a", False), ("/b", "/b", False), ("y", "/c", True))
    assert not parse_args(["--model-path", "m"]).enable_lora
    with pytest.raises(ValueError, match="you need to specify both --max-lora-rank and --lora-target-modules"):
        parse_args(["--model-path", "m", "--enable-lora", "--max-lora-rank", "8"])
    with pytest.raises(ValueError, match="it should be the only module specified"):
        parse_args(["--model-path", "m", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
                    "q_proj"])
    with pytest.raises(ValueError, match="needs lora_name and lora_path"):
        parse_lora_paths(['{"lora_name": "z"}'])


def test_registry_refusals():
    off = EngineAdapters(None, LoraOptions())
    with pytest.raises(LoraError, match="LoRA is not enabled. Please set `--enable-lora` to enable LoRA."):
        off.register("a", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, "/a")
    with pytest.raises(RequestError, match="LoRA adapter 'a' was requested, but LoRA is not enabled"):
        off.check_request([None, "a"])
    off.check_request([None, None])  # the base model needs nothing

    on = EngineAdapters(None, LoraOptions(enabled=True, max_rank=8, target_modules=frozenset({"q_proj", "v_proj"}),
                                          max_loaded_loras=8))
    ok = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    on.register("a", ok, "/a")
    assert on.add("a", "/a") == []
    with pytest.raises(LoraError, match="^Failed to load LoRA adapter a because it is already loaded$"):
        on.register("a", ok, "/a")
    for bad in ({"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]},
                {"r": 4, "lora_alpha": 16, "target_modules": ["down_proj"]}):
        with pytest.raises(LoraError, match="is incompatible with the current LoRA memory pool configuration"):
            on.register("b", bad, "/b")
    with pytest.raises(LoraError, match="doesn't support DoRA adapters"):
        on.register("b", {**ok, "use_dora": True}, "/b")
    with pytest.raises(RequestError, match="Got LoRA adapter that has never been loaded: b"):
        on.check_request(["a", "b"])
    with pytest.raises(LoraError, match=r"LoRA with name b does not exist. Loaded LoRAs: odict_keys\(\['a'\]\)"):
        on.remove("b")


def test_eviction_over_max_loaded_loras():
    on = EngineAdapters(None, LoraOptions(enabled=True, max_rank=8, target_modules=frozenset({"q_proj"}),
                                          max_loras_per_batch=1, max_loaded_loras=2))
    assert on.add("a", "/a") == [] and on.add("b", "/b") == []
    on.check_request(["a"])  # a is now the most recently used
    assert on.add("c", "/c") == ["b"]


class _Tok:
    def __call__(self, text):
        return {"input_ids": [1] * len(text)}


def test_lora_path_per_row():
    rows = parse_generate({"input_ids": [[1, 2], [3]], "lora_path": ["a", None],
                           "sampling_params": {"n": 2}}, _Tok(), 10, 100).rows
    assert [r.lora for r in rows] == ["a", "a", None, None]
    assert [r.lora for r in parse_generate({"input_ids": [[1], [2]], "lora_path": "a"}, _Tok(), 10, 100).rows] == ["a", "a"]
    assert [r.lora for r in parse_generate({"input_ids": [1], "lora_path": ""}, _Tok(), 10, 100).rows] == [None]
    with pytest.raises(RequestError, match=r"lora_path list length \(1\) must match batch size \(2\)"):
        parse_generate({"input_ids": [[1], [2]], "lora_path": ["a"]}, _Tok(), 10, 100)
    with pytest.raises(ContractError, match="invalid type"):
        parse_generate({"input_ids": [1], "lora_path": 5}, _Tok(), 10, 100)
