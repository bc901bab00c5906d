"""hpcrl's engine protocol against SGLang's own schema (issue #16 point 3).

SGLang's request types are read from the installed ``sglang`` package (``.ci/install`` puts SGLang 0.5.23 in
with ``pip install --no-deps``): ``sglang/api/v1/api_types.py`` (the generated HTTP JSON contract of
``/generate``; needs only msgspec) is imported as a module, and ``GenerateReqInput`` (``io_struct.py``) plus
the OpenAI request models (``entrypoints/openai/protocol.py``) are imported when their heavy imports work (a
GPU machine) and otherwise read from their source with :mod:`ast` - the same class bodies, without running
SGLang's imports of torch kernels and zmq. Skipped with the reason when the package is absent.

Checked: every ``/generate`` field hpcrl names exists in ``GenerateReqInput`` and the three tables cover it
exactly; every sampling key hpcrl accepts is in SGLang's contract, in its order (so the "unknown field" text is
SGLang's own) and with SGLang's default; the requests SGLang's contract refuses are refused here and the
requests accepted here pass SGLang's contract; every OpenAI field hpcrl reads or refuses exists in SGLang's
request models with SGLang's default.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from hpcrl.engine import openai_api, protocol

SGLANG_VERSION = "0.5.23"


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed: `pip install --no-deps sglang==0.5.23` (as .ci/install does) "
                    "lets this test read its schema")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def api_types():
    """SGLang's generated ``sglang.api.v1.api_types`` module, imported from its file."""
    pytest.importorskip("msgspec", reason="SGLang's api_types needs msgspec (hpcrl's dev extra has it)")
    path = _sglang_root() / "api" / "v1" / "api_types.py"
    if not path.is_file():
        pytest.skip(f"{path} is missing: this SGLang predates the generated API contract (0.5.23 has it)")
    spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _class_fields(path: Path, name: str, module: str) -> dict[str, object]:
    """``{field: default}`` of class ``name`` (and its bases in the same file): imported from ``module`` when
    it imports, else read from the source at ``path`` (defaults that are not literals become ``...``)."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - SGLang's runtime imports need a GPU stack; read the source instead
        cls = None
    if cls is not None and dataclasses.is_dataclass(cls):
        return {f.name: (f.default if f.default is not dataclasses.MISSING else ...)
                for f in dataclasses.fields(cls)}
    if cls is not None and hasattr(cls, "model_fields"):
        return {k: (v.default if not v.is_required() else ...) for k, v in cls.model_fields.items()}
    tree = ast.parse(path.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields_of(node: ast.ClassDef) -> dict[str, object]:
        out: dict[str, object] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields_of(classes[base.id]))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                    and not stmt.target.id.startswith("_"):
                value = stmt.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("Field", "field"):
                    value = next((k.value for k in value.keywords if k.arg == "default"), None)
                try:
                    out[stmt.target.id] = ast.literal_eval(value) if value is not None else ...
                except ValueError:
                    out[stmt.target.id] = ...
        return out

    assert name in classes, f"{name} not found in {path}"
    return fields_of(classes[name])


@pytest.fixture(scope="module")
def generate_req_fields() -> dict[str, object]:
    root = _sglang_root()
    return _class_fields(root / "srt" / "managers" / "io_struct.py", "GenerateReqInput",
                         "sglang.srt.managers.io_struct")


def _openai_fields(name: str) -> dict[str, object]:
    root = _sglang_root()
    return _class_fields(root / "srt" / "entrypoints" / "openai" / "protocol.py", name,
                         "sglang.srt.entrypoints.openai.protocol")


def test_installed_sglang_is_the_measured_version():
    import importlib.metadata

    _sglang_root()
    found = importlib.metadata.version("sglang")
    assert found == SGLANG_VERSION, f"the tables were checked against SGLang {SGLANG_VERSION}, found {found}"


def test_generate_fields_partition_sglangs_generate_req_input(generate_req_fields):
    tables = [protocol.GENERATE_FIELDS_IMPLEMENTED, protocol.GENERATE_FIELDS_NO_EFFECT,
              protocol.GENERATE_FIELDS_UNSUPPORTED]
    named = set().union(*tables)
    assert sum(len(t) for t in tables) == len(named), "a field is in two tables"
    assert named - generate_req_fields.keys() == set(), "hpcrl names fields SGLang does not have"
    assert generate_req_fields.keys() - named == set(), "SGLang fields hpcrl neither serves nor refuses"
    for name in protocol.GENERATE_FIELDS_UNSUPPORTED:  # "off" means SGLang's default
        default = generate_req_fields[name]
        assert default is ... or not default, (name, default)


def test_sampling_keys_are_sglangs_in_its_order(api_types):
    assert tuple(api_types.SamplingParams.__struct_fields__) == protocol.SGLANG_SAMPLING_FIELDS
    assert set(protocol.SAMPLING_FIELDS_UNSUPPORTED) <= set(protocol.SGLANG_SAMPLING_FIELDS)


def test_unknown_sampling_key_is_refused_with_sglangs_text(api_types):
    with pytest.raises(api_types.JsonContractError) as theirs:
        api_types.SamplingParams.from_json_value({"max_tokens": 8})
    with pytest.raises(protocol.ContractError) as ours:
        protocol.SamplingParams.from_json({"max_tokens": 8})
    assert str(ours.value) == str(theirs.value)


def test_sampling_defaults_mean_the_same(api_types):
    theirs = api_types.SamplingParams()
    ours = protocol.SamplingParams.from_json({})
    for name in ("max_new_tokens", "temperature", "top_p", "min_p", "min_new_tokens", "n", "ignore_eos",
                 "skip_special_tokens", "no_stop_trim", "sampling_seed"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert theirs.top_k == protocol.TOP_K_OFF and ours.top_k == -1  # both: no top-k filtering
    assert theirs.stop is None and ours.stop == [] and theirs.stop_token_ids is None and ours.stop_token_ids == []
    for name, offs in protocol.SAMPLING_FIELDS_UNSUPPORTED.items():  # SGLang's default is an "off" value
        default = getattr(theirs, name)
        assert default in offs or (default in ({}, []) and None in offs), (name, default)


class _CharTokenizer:
    def __call__(self, text):
        return {"input_ids": [3 + (ord(c) % 40) for c in text]}


BODIES = [
    {"text": "1+1="},
    {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "top_k": 5,
                                                 "top_p": 0.9, "min_p": 0.1, "stop": ["x"], "n": 2,
                                                 "stop_token_ids": [2], "sampling_seed": 3, "ignore_eos": True,
                                                 "no_stop_trim": True, "skip_special_tokens": False,
                                                 "min_new_tokens": 1}},
    {"input_ids": [[5, 6], [7]], "return_logprob": [True, False], "logprob_start_len": [0, -1],
     "top_logprobs_num": [2, 0], "rid": "batch"},
    {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}], "rid": ["p", "q"]},
    {"text": "x", "sampling_params": {"frequency_penalty": 0.0, "logit_bias": {}, "stop_regex": None}},
    {"text": "x", "unknown_top_level_key": 1},  # ignored by both
    # refused by SGLang's contract
    {"text": "x", "sampling_params": {"max_tokens": 8}},
    {"text": "x", "sampling_params": {"temperature": "hot"}},
    {"text": "x", "sampling_params": {"n": 1.5}},
    {"text": "x", "stream": "yes"},
    {"text": "x", "return_logprob": "yes"},
    {"input_ids": [["a"]]},
    {"text": 5},
    {"text": "x", "rid": 5},
]


def test_what_sglangs_contract_refuses_is_refused_and_what_we_accept_it_accepts(api_types):
    for body in BODIES:
        try:
            api_types.GenerateRequest.from_json_value(body)
            sglang_ok = True
        except api_types.JsonContractError:
            sglang_ok = False
        try:
            protocol.parse_generate(body, _CharTokenizer(), vocab_size=64, context_len=256)
            ours_ok = True
        except protocol.RequestError:
            ours_ok = False
        assert sglang_ok or not ours_ok, f"hpcrl accepts what SGLang refuses: {body}"
        assert ours_ok <= sglang_ok, body
        if body.get("sampling_params") == {"max_tokens": 8}:
            assert not ours_ok


@pytest.mark.parametrize("ours, theirs, unsupported", [
    (openai_api.CompletionRequest, "CompletionRequest", openai_api.COMPLETION_UNSUPPORTED),
    (openai_api.ChatCompletionRequest, "ChatCompletionRequest", openai_api.CHAT_UNSUPPORTED),
])
def test_openai_fields_are_sglangs_with_its_defaults(ours, theirs, unsupported):
    fields = _openai_fields(theirs)
    for name, info in ours.model_fields.items():
        assert name in fields, f"{ours.__name__}.{name} is not a field of SGLang's {theirs}"
        if fields[name] is not ... and not info.is_required():
            assert info.default == fields[name], (name, info.default, fields[name])
    for name, offs in unsupported.items():
        assert name in fields, f"refused field {name} is not a field of SGLang's {theirs}"
        assert fields[name] is ... or fields[name] in offs, (name, fields[name])


def test_tokenize_fields_are_sglangs():
    for ours, theirs in ((openai_api.TokenizeRequest, "TokenizeRequest"),
                         (openai_api.DetokenizeRequest, "DetokenizeRequest")):
        fields = _openai_fields(theirs)
        assert set(ours.model_fields) <= set(fields), set(ours.model_fields) - set(fields)
