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


# --------------------------------------------------------------------- the server's endpoints and state rules
# Issue #32 point 3: SGLang's own server code, read from the wheel, against the CPU engine; a new endpoint or
# a new gating rule in an SGLang bump fails here, in CI, instead of on a cluster.

def _sglang_source(*parts: str) -> ast.Module:
    path = _sglang_root().joinpath(*parts)
    assert path.is_file(), f"{path} is missing: SGLang {SGLANG_VERSION}'s layout is what these tests read"
    return ast.parse(path.read_text())


def _literal(node: ast.AST, consts: dict[str, ast.AST]) -> object:
    """A route path: a string constant, ``os.environ.get(NAME, default)`` (its default: None when the route is
    only registered with the variable set) or a module-level name bound to either."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
        return _literal(node.args[1], consts) if len(node.args) > 1 else None
    if isinstance(node, ast.Name) and node.id in consts:
        return _literal(consts[node.id], consts)
    raise AssertionError(f"a route path hpcrl's test cannot read: {ast.unparse(node)}")


def _routes_in(tree: ast.Module, owner: str) -> dict[tuple[str, str], bool]:
    """``{(method, path): admin}`` of the routes registered on the object named ``owner`` (``app`` or an
    ``APIRouter``) in ``tree``: decorators ``@owner.get/post/put/delete/head/websocket`` and
    ``@owner.api_route``, ``admin`` when the handler carries ``@auth_level(AuthLevel.ADMIN_...)``."""
    consts = {n.targets[0].id: n.value for n in ast.walk(tree)
              if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
    routes: dict[tuple[str, str], bool] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        admin = any("AuthLevel.ADMIN" in ast.unparse(d) for d in fn.decorator_list)
        for d in fn.decorator_list:
            if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                    and ast.unparse(d.func.value) == owner and d.func.attr != "exception_handler"):
                continue
            path = _literal(d.args[0], consts)
            if path is None:
                continue
            if d.func.attr == "api_route":
                methods = [_literal(e, consts)
                           for e in next(k.value for k in d.keywords if k.arg == "methods").elts]
            else:
                methods = [d.func.attr.upper()]
            for method in methods:
                routes[(str(method), str(path))] = admin
    return routes


def sglang_routes() -> dict[tuple[str, str], bool]:
    """``{(method, path): admin}`` of every route SGLang's HTTP server registers: those of
    ``srt/entrypoints/http_server.py``'s ``app`` and of every router it includes (``app.include_router(X)``
    with ``from sglang.srt.entrypoints.M import router as X``)."""
    tree = _sglang_source("srt", "entrypoints", "http_server.py")
    routes = _routes_in(tree, "app")
    imported = {alias.asname or alias.name: (node.module, alias.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    included = [ast.unparse(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call)
                and ast.unparse(n.func) == "app.include_router"]
    assert included, "http_server.py includes no router any more: check how SGLang registers routes"
    for name in included:
        module, attr = imported[name]
        routes.update(_routes_in(_sglang_source(*module.split(".")[1:-1], module.split(".")[-1] + ".py"),
                                 attr))
    assert len(routes) > 80, f"only {len(routes)} routes read from SGLang's http_server.py"
    return routes


@pytest.fixture(scope="module")
def engine_routes(tiny_model_dir) -> set[tuple[str, str]]:
    """``{(method, path)}`` of the CPU engine's real aiohttp application (a tiny model loaded in-process)."""
    from hpcrl.engine.args import parse_args
    from hpcrl.engine.server import EngineServer

    app = EngineServer(parse_args(["--model-path", str(tiny_model_dir)])).build_app()
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


def test_every_sglang_endpoint_is_served_or_listed_as_not(engine_routes):
    from hpcrl.engine.endpoints import HPCRL_ONLY, NOT_SERVED

    theirs = sglang_routes()
    ours = {(m, p) for m, p in engine_routes if p not in HPCRL_ONLY}
    assert ours - set(theirs) == set(), ("the CPU engine serves routes SGLang does not have "
                                         "(or with other methods)")
    unknown = {(m, p) for m, p in theirs if (m, p) not in ours and p not in NOT_SERVED}
    assert unknown == set(), ("SGLang serves endpoints hpcrl's engine neither serves nor lists in "
                              "hpcrl.engine.endpoints.NOT_SERVED (with why)")
    assert not set(NOT_SERVED) & {p for _, p in ours}, "an endpoint is both served and listed as not served"
    assert set(NOT_SERVED) <= {p for _, p in theirs}, "NOT_SERVED names a path SGLang does not have"
    assert not set(HPCRL_ONLY) & {p for _, p in theirs}, "an hpcrl-only alias is an SGLang endpoint now"


def test_admin_endpoints_are_sglangs(engine_routes):
    from hpcrl.engine.auth import ADMIN_PATHS

    theirs = sglang_routes()
    served = {p for _, p in engine_routes}
    admin = {p for (_, p), is_admin in theirs.items() if is_admin and p in served}
    assert admin == set(ADMIN_PATHS), "hpcrl's admin paths differ from SGLang's ADMIN_OPTIONAL ones it serves"


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _message_of(node: ast.AST) -> str:
    """The ``message=`` keyword of the first call in ``node`` that has one (implicitly joined strings)."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            for kw in call.keywords:
                if kw.arg == "message" and isinstance(kw.value, ast.Constant):
                    return kw.value.value
    raise AssertionError(f"no message= in {ast.unparse(node)[:200]}")


@pytest.fixture(scope="module")
def weight_updater() -> ast.ClassDef:
    tree = _sglang_source("srt", "managers", "scheduler_components", "weight_updater.py")
    return next(n for n in tree.body
                if isinstance(n, ast.ClassDef) and n.name == "SchedulerWeightUpdaterManager")


def test_session_gated_updates_and_messages_are_sglangs(weight_updater):
    """Which updates check ``self._session is None`` (SGLang adds one: this fails), and their refusal
    texts."""
    from hpcrl.engine import state

    gated = {}
    for fn in weight_updater.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "self._session is None":
                gated[fn.name] = _message_of(node)
    assert gated.pop("end_weight_update") == state.END_WITHOUT_BEGIN
    assert set(gated) == set(state.SESSION_GATED), "SGLang gates other updates than hpcrl.engine.state knows"
    for name, message in gated.items():
        assert message == state.outside_session(name)
    nested = next(n for n in ast.walk(_method(weight_updater, "begin_weight_update"))
                  if isinstance(n, ast.If) and ast.unparse(n.test) == "self._session is not None")
    assert _message_of(nested) == state.NESTED_BEGIN
    selector = _sglang_source("srt", "managers", "io_struct.py")
    begin = next(n for n in selector.body
                 if isinstance(n, ast.ClassDef) and n.name == "BeginWeightUpdateReqInput")
    assert ("Literal['target', 'draft', 'all']" in ast.unparse(begin)
            and state.SELECTORS == ("target", "draft", "all"))


def test_idle_and_flush_rules_are_sglangs(weight_updater):
    from hpcrl.engine import state

    release = _method(weight_updater, "release_memory_occupation")
    asserts = [n for n in ast.walk(release) if isinstance(n, ast.Assert)]
    assert len(asserts) == 1 and "self.is_fully_idle" in ast.unparse(asserts[0].test)
    assert "ignore_waiting=scheduler is not None and scheduler._engine_paused" in ast.unparse(asserts[0].test)
    assert asserts[0].msg.value == state.RELEASE_NOT_IDLE
    resume = ast.unparse(_method(weight_updater, "resume_memory_occupation"))
    # a tag that was not released: KeyError, the scheduler dies
    assert "self.offload_tags.remove(tag)" in resume
    flush = _method(weight_updater, "flush_cache_after_weight_update")
    assert ast.unparse(flush).count("return (False,") == 1
    text = next(n.value for n in ast.walk(flush) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and n.value.startswith("Weights were updated"))
    assert text == state.UPDATE_NOT_FLUSHED
    for name in ("update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed"):
        assert "flush_cache_after_weight_update" in ast.unparse(_method(weight_updater, name)), name
    scheduler = _sglang_source("srt", "managers", "scheduler.py")
    flush_cache = next(n for n in ast.walk(scheduler)
                       if isinstance(n, ast.FunctionDef) and n.name == "flush_cache")
    assert "self.is_fully_idle(ignore_waiting=self._engine_paused)" in ast.unparse(flush_cache)
    wrapper = ast.unparse(_sglang_source("srt", "managers", "scheduler_components", "flush_wrapper.py"))
    assert repr(state.FLUSH_TIMED_OUT) in wrapper
    server = ast.unparse(_sglang_source("srt", "entrypoints", "http_server.py"))
    assert repr(state.FLUSH_FAILED) in server


# ---------------------------------------------------------------------------------- the launch_server command
KEYS_MARK = "<!-- sglang-keys:"


def documented_sglang_keys() -> dict:
    """The ``sglang:`` keys docs/engine-and-security.md names (its YAML block after :data:`KEYS_MARK`)."""
    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "engine-and-security.md").read_text()
    block = text.split(KEYS_MARK, 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    keys = yaml.safe_load(block)
    assert isinstance(keys, dict) and len(keys) >= 8, keys
    return keys


def _launch_commands(tmp_path: Path) -> dict[str, list[str]]:
    """``{what: argv}``: every ``sglang.launch_server`` command line hpcrl builds for the configs under
    ``configs/`` (and ``configs/cluster/``) and for the documented keys (with everything hpcrl adds switched on), with the key on the
    command line and in a ``--config`` file, and a restarted engine's ``--weight-version``."""
    import dataclasses

    from unittest import mock

    from hpcrl.config import load_config
    from hpcrl.rollout import engines
    from hpcrl.rollout.engines import engine_command, engine_sglang_args

    secret = tmp_path / "secret"
    secret.write_text("k3y-" + "x" * 28 + "\n")
    secret.chmod(0o600)
    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "configs").glob("*.yaml")) + sorted((root / "configs").glob("cluster/*.yaml"))
    cfgs = {str(p.relative_to(root / "configs")): load_config(p, check_files=False) for p in files}
    assert len(cfgs) >= 5, sorted(cfgs)
    everything = load_config(None, ["model.path=/models/policy", "run.placement=colocate",
                                    "run.deterministic=true", "model.dtype=bfloat16",
                                    "algorithm.routing_replay=true", "rollout.router=false"],
                             check_files=False)
    everything = dataclasses.replace(everything, sglang=documented_sglang_keys())
    cfgs["documented sglang: keys"] = everything
    out = {}
    for name, cfg in cfgs.items():
        args = engine_sglang_args(cfg)
        with mock.patch.object(engines, "on_gpu", lambda: True):  # the GPU nodes' lines
            for via in ("argv", "config"):
                cmd = engine_command(cfg.rollout, args, "/models/policy", "0.0.0.0", 31000, secret,
                                     engine="sglang", key_via=via)
                assert cmd[1:3] == ["-m", "sglang.launch_server"], cmd
                out[f"{name} (key via {via})"] = cmd[3:]
            out[f"{name} (restarted engine)"] = engine_command(cfg.rollout, {**args, "weight_version": "7"},
                                                               "/snap/weight_v000007", "0.0.0.0", 31001, secret,
                                                               engine="sglang")[3:]
        with mock.patch.object(engines, "on_gpu", lambda: False):  # SGLang's CPU path (issue #53)
            out[f"{name} (CPU)"] = engine_command(cfg.rollout, args, "/models/policy", "0.0.0.0", 31000, secret,
                                                  engine="sglang")[3:]
    return out


def test_every_launch_server_flag_parses_with_sglangs_parser(tmp_path):
    """SGLang 0.5.23's parser (``tests/unit/sglang_cli.py``: the wheel's own ``ServerArgs.add_cli_args``, four
    stub modules named there) accepts every command line hpcrl builds, none uses a deprecated flag, and the
    values arrive: the key (also through ``--config``), the port, the documented keys."""
    import json
    import subprocess
    import sys

    _sglang_root()
    cmds = _launch_commands(tmp_path)
    helper = Path(__file__).with_name("sglang_cli.py")
    proc = subprocess.run([sys.executable, str(helper)], input=json.dumps(list(cmds.values())), text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = dict(zip(cmds, json.loads(proc.stdout.strip().splitlines()[-1]), strict=True))
    for what, res in results.items():
        assert res["ok"], f"{what}: SGLang refuses {cmds[what]}: {res['error']}"
        assert res["deprecated"] == [], f"{what}: deprecated SGLang flags {res['deprecated']}"
        values = res["values"]
        assert values["api_key"] == "k3y-" + "x" * 28 and values["model_path"].startswith("/"), what
        assert int(values["port"]) in (31000, 31001) and values["host"] == "0.0.0.0", what
    documented = results["documented sglang: keys (key via config)"]["values"]
    for key, value in documented_sglang_keys().items():
        assert str(documented[key]) == str(value), (key, documented.get(key), value)
    for added in ("enable_memory_saver", "enable_deterministic_inference", "enable_return_routed_experts"):
        assert documented[added] is True, added
    assert documented["dtype"] == "bfloat16"
    assert results["documented sglang: keys (restarted engine)"]["values"]["weight_version"] == "7"
    for what, res in results.items():  # without a GPU: SGLang's CPU path, a bounded KV pool, no memory saver
        if what.endswith("(CPU)"):
            assert res["values"]["device"] == "cpu" and "enable_memory_saver" not in res["values"], what
            assert int(res["values"]["max_total_tokens"]) > 0, what
            assert res["values"]["sleep_on_idle"] is True, what


def test_lora_requests_are_sglangs_structs():
    """What an adapter sync sends (:mod:`hpcrl.weights.adapter`) fits SGLang 0.5.23's request structs: only their
    fields, every required one, of their types; and the tensor payload is SGLang's ``{name: tensor}`` dict."""
    import torch

    from hpcrl.engine.serialize import deserialize_tensor_dict, serialize_tensor_dict
    from hpcrl.weights import adapter

    root = _sglang_root() / "srt" / "managers" / "io_struct.py"
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    payload = serialize_tensor_dict([("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                                      torch.ones(4, 8))])
    sent = {"LoadLoRAAdapterFromTensorsReqInput": adapter.tensors_body("n", config, payload, 2),
            "LoadLoRAAdapterReqInput": adapter.folder_body("n", Path("/shared/adapter_v000001")),
            "UnloadLoRAAdapterReqInput": adapter.unload_body("n"),
            "UpdateWeightVersionReqInput": adapter.version_body("3")}
    types = {"lora_name": str, "lora_path": str, "config_dict": dict, "serialized_named_tensors": list,
             "new_version": str, "abort_all_requests": bool}
    for struct, body in sent.items():
        fields = _class_fields(root, struct, "sglang.srt.managers.io_struct")
        fields = {k: v for k, v in fields.items() if k not in ("rid", "http_worker_ipc")}  # BaseReq's
        assert set(body) <= set(fields), (struct, set(body) - set(fields))
        required = {k for k, v in fields.items() if v is ...}
        assert required <= set(body), (struct, required - set(body))
        assert all(isinstance(v, types[k]) for k, v in body.items()), (struct, body)
    payloads = sent["LoadLoRAAdapterFromTensorsReqInput"]["serialized_named_tensors"]
    assert len(payloads) == 2 and deserialize_tensor_dict(payloads[1])[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].equal(torch.ones(4, 8))
    assert sent["UpdateWeightVersionReqInput"]["abort_all_requests"] is False  # (SGLang's default aborts)
