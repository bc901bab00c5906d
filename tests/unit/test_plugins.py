"""Plug-ins by dotted import path: a real module on sys.path, and one-line errors for bad paths."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from hpcrl.config import ConfigError
from hpcrl.config.checks import check_plugin
from hpcrl.plugin_loader import PluginError, load_function
from hpcrl.validate import ENVIRONMENT

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def plugin_pkg(tmp_path, monkeypatch):
    """A package ``hpcrl_test_plugins`` with a module ``mod`` (functions, a constant) and a broken module."""
    pkg = tmp_path / "hpcrl_test_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent("""
        CONSTANT = 3

        def double(x):
            return 2 * x

        class Scorer:
            def __call__(self, x):
                return x + 1

        scorer = Scorer()
    """))
    (pkg / "broken.py").write_text("import hpcrl_no_such_dependency_xyz\n")
    (pkg / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "hpcrl_test_plugins"


def test_load_function(plugin_pkg):
    assert load_function(f"{plugin_pkg}.mod.double")(21) == 42
    assert load_function(f"  {plugin_pkg}.mod.scorer ")(1) == 2  # callable instances are fine
    assert load_function("os.path.join")("a", "b") == "a/b"


@pytest.mark.parametrize("path,reason", [
    ("double", "no module part"),
    ("", "expected a dotted import path"),
    ("hpcrl_no_such_pkg_xyz.fn", "module 'hpcrl_no_such_pkg_xyz' not found"),
    ("{pkg}.nomod.fn", "module '{pkg}.nomod' not found"),
    ("{pkg}.mod.missing", "module '{pkg}.mod' has no attribute 'missing'"),
    ("{pkg}.mod.CONSTANT", "is a int, not callable"),
    ("{pkg}.broken.fn", "importing module '{pkg}.broken' failed: ModuleNotFoundError"),
    ("{pkg}.raises.fn", "importing module '{pkg}.raises' failed: RuntimeError: boom at import"),
])
def test_load_function_errors(plugin_pkg, path, reason):
    path, reason = path.format(pkg=plugin_pkg), reason.format(pkg=plugin_pkg)
    with pytest.raises(PluginError) as ei:
        load_function(path)
    msg = str(ei.value)
    assert reason in msg and "\n" not in msg
    assert msg.startswith(f"plugin error: {path.strip()!r}: ")
    assert ei.value.path == path.strip()


def test_load_function_from_a_file_in_a_package_without_pythonpath(tmp_path, monkeypatch):
    """``path/to/module.py:attr`` (relative to the working directory): imported by its package name, so its
    relative imports work, from the folder above the package (no PYTHONPATH)."""
    top = tmp_path / "my_examples"
    (top / "hpcrl_test_filepkg").mkdir(parents=True)
    (top / "hpcrl_test_filepkg" / "__init__.py").write_text("")
    (top / "hpcrl_test_filepkg" / "helper.py").write_text("BASE = 40\n")
    (top / "hpcrl_test_filepkg" / "agent.py").write_text("from .helper import BASE\n\ndef solve(x):\n"
                                                         "    return BASE + x\n")
    (top / "hpcrl_test_lone.py").write_text("def one():\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    fn = load_function("my_examples/hpcrl_test_filepkg/agent.py:solve")
    assert fn(2) == 42 and fn.__module__ == "hpcrl_test_filepkg.agent"
    assert load_function(" my_examples/hpcrl_test_lone.py:one ")() == 1
    assert sys.path.count(str(top)) == 1 and sys.path[-1] == str(top)  # left at the end, once
    for path, reason in [
        ("my_examples/nope.py:solve", "no such file 'my_examples/nope.py' (relative to the working"),
        ("my_examples/hpcrl_test_filepkg/agent.py:missing", "has no attribute 'missing'"),
        ("my_examples/hpcrl_test_filepkg/helper.py:BASE", "is a int, not callable"),
    ]:
        with pytest.raises(PluginError, match=re.escape(reason)):
            load_function(path)
    # a module of the same name earlier on sys.path does not hide the file (benchmarks/agent_calculator.py
    # beside examples/agent_calculator/ once benchmarks/ is on sys.path) ...
    (tmp_path / "first").mkdir()
    (tmp_path / "first" / "hpcrl_test_twin.py").write_text("def f():\n    return 'first'\n")
    (tmp_path / "second").mkdir()
    (tmp_path / "second" / "hpcrl_test_twin.py").write_text("def f():\n    return 'second'\n")
    sys.path.insert(0, str(tmp_path / "first"))
    assert load_function("second/hpcrl_test_twin.py:f")() == "second"
    # ... but one already imported under that name is refused, not silently used in the file's place
    with pytest.raises(PluginError, match=r"module 'hpcrl_test_twin' is already imported from .*second.*"
                                          r"not .*first.*rename the file"):
        load_function("first/hpcrl_test_twin.py:f")
    (tmp_path / "bad-name.py").write_text("def f():\n    pass\n")
    with pytest.raises(PluginError, match="'bad-name' cannot be a Python module name"):
        load_function("bad-name.py:f")


def test_config_check_takes_the_file_form(monkeypatch):
    """The config check (``hpcrl validate``) accepts ``path/to/file.py:function`` and imports it; a bad one is
    a one-line error naming the field."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))
    agent = "examples/agent_calculator/agent.py"
    check_plugin("rollout.agent.function", f"{agent}:solve", (), check_files=True, env=ENVIRONMENT)
    with pytest.raises(ConfigError, match=rf"^config error: rollout.agent.function='{agent}:nope': module "
                                          r"'agent_calculator.agent' has no attribute 'nope'"):
        check_plugin("rollout.agent.function", f"{agent}:nope", (), check_files=True, env=ENVIRONMENT)
    with pytest.raises(ConfigError, match="or path/to/file.py:function"):
        check_plugin("rollout.agent.function", "agents/solve.py", (), check_files=False)  # no :function


def test_an_absolute_file_path_names_the_same_plugin_from_any_directory(tmp_path, monkeypatch):
    """``/abs/path/module.py:attr`` works from any working directory and is the module the relative form of
    the same file imports (the calculator example's agent, with its relative import of the tool)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    monkeypatch.chdir(tmp_path)
    agent = REPO / "examples" / "agent_calculator" / "agent.py"
    absolute = load_function(f"{agent}:solve")
    assert absolute.__module__ == "agent_calculator.agent"
    monkeypatch.chdir(REPO)
    assert load_function("examples/agent_calculator/agent.py:solve") is absolute
    with pytest.raises(PluginError, match=re.escape(f"no such file '{tmp_path}/nope.py'")):
        load_function(f"{tmp_path}/nope.py:solve")


def test_default_plug_in_paths_load_the_builtins_the_resolver_uses_directly():
    """hpcrl.rollout.plugins hands out the built-in objects themselves for unset or default plug-in fields (a
    name a reader can follow), so each default path in hpcrl.names must load exactly that object."""
    from hpcrl.data.source import DataSource
    from hpcrl.names import DEFAULT_DATA_SOURCE, DEFAULT_GENERATE_FUNCTION, DEFAULT_ROLLOUT_FUNCTION
    from hpcrl.plugin_loader import load_function
    from hpcrl.rollout.generate import generate
    from hpcrl.rollout.plugins import builtin_or_load
    from hpcrl.rollout.rollout import generate_rollout

    for path, builtin in ((DEFAULT_DATA_SOURCE, DataSource), (DEFAULT_GENERATE_FUNCTION, generate),
                          (DEFAULT_ROLLOUT_FUNCTION, generate_rollout)):
        assert load_function(path) is builtin
        assert builtin_or_load(None, path, builtin) is builtin_or_load(path, path, builtin) is builtin
    assert builtin_or_load("hpcrl.rollout.rollout.split_trainable", DEFAULT_ROLLOUT_FUNCTION,
                           generate_rollout).__name__ == "split_trainable"
