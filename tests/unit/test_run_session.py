"""Both loops are their ``for`` loop inside one :class:`hpcrl.run_session.RunSession`: the set-up and tear-down
(preemption watch, rollout manager, trainer, syncer, first sync, run log, destroy) is written once, in the
session, and neither loop file does any of it itself; the Slurm entry does not import the local launcher."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "hpcrl"
SET_UP = {"install", "uninstall", "rollout_manager", "build_trainer", "from_config", "launch", "start",
          "destroy", "RunLog", "close"}


def function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def called_names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


@pytest.mark.parametrize("module,name", [("loop.py", "train_main"), ("loop_async.py", "train_async_main")])
def test_each_loop_is_a_for_loop_inside_one_run_session(module, name):
    fn = function(ROOT / module, name)
    withs = [n for n in ast.walk(fn) if isinstance(n, ast.With)]
    assert len(withs) == 1 and called_names(withs[0].items[0].context_expr) >= {"RunSession"}
    assert any(isinstance(n, ast.For) for n in withs[0].body)
    assert not called_names(fn) & SET_UP, called_names(fn) & SET_UP


def test_the_slurm_entry_does_not_import_the_local_launcher():
    for path in (ROOT / "slurm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "hpcrl.launch_local", path
            elif isinstance(node, ast.Import):
                assert all(a.name != "hpcrl.launch_local" for a in node.names), path
