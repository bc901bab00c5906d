"""Plug-ins by dotted import path: a real module on sys.path, and one-line errors for bad paths."""

from __future__ import annotations

import textwrap

import pytest

from hpcrl.plugins import PluginError, load_function


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
