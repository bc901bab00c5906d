"""The shape issue #10 gave the package, read from the source (ast) so that it stays true: no import cycle between
hpcrl modules (function-level imports and ``if TYPE_CHECKING:`` blocks included: a circle of annotations is a
circle of meaning), config at the bottom (``hpcrl.config`` imports only itself and the leaf
:mod:`hpcrl.names`), no ``from hpcrl.x import _name`` across modules, no module over 700 lines, the loop
function at most 100 lines with no branch on the rank, and the loop importing nothing from ``hpcrl.slurm``."""

from __future__ import annotations

import ast

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hpcrl"
MAX_MODULE_LINES = 700
MAX_LOOP_LINES = 100


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(tree: ast.AST):
    """Every import node: module level, inside functions and under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, path in mods.items():
        for node in imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    target = full if full in mods else node.module
                    if target in mods and target != m:
                        edges[m].add(target)
                    if (node.module.startswith("hpcrl") and alias.name.startswith("_")
                            and not alias.name.startswith("__") and target != m):
                        private.append((m, node.module, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods and alias.name != m:
                        edges[m].add(alias.name)
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_hpcrl_modules():
    edges, _ = import_graph()
    assert cycles(edges) == []


LEAF = "hpcrl.names"
"""The one module outside ``hpcrl/config/`` that config may import: the built-ins' names (it imports nothing
from hpcrl)."""


def test_config_imports_only_config_and_the_leaf_of_names():
    """``hpcrl.config`` is the bottom layer: it imports nothing from hpcrl but ``hpcrl.config.*`` and
    :mod:`hpcrl.names`, which imports nothing from hpcrl (the checks that read the model or import plug-ins
    reach them through the :class:`hpcrl.config.Environment` that :mod:`hpcrl.validate` passes)."""
    edges, _ = import_graph()
    assert edges[LEAF] == set()
    for m in (m for m in modules() if m == "hpcrl.config" or m.startswith("hpcrl.config.")):
        outside = {t for t in edges[m] if t not in (LEAF, "hpcrl.config")
                   and not t.startswith("hpcrl.config.")}
        assert outside == set(), (m, outside)


def test_no_private_name_imported_across_modules():
    _, private = import_graph()
    assert private == []


def test_no_module_over_700_lines():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def loop_function(module: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize("module,name", [("loop", "train_main"), ("loop_async", "train_async_main"),
                                         ("loop_fully_async", "train_fully_async_main")])
def test_the_loop_is_a_page_without_rank_branches_or_slurm(module, name):
    """The sync loop and the async one beside it (issue #11: at most the sync one's length)."""
    fn = loop_function(module, name)
    assert fn.end_lineno - fn.lineno + 1 <= MAX_LOOP_LINES
    tests = [ast.unparse(n.test) for n in ast.walk(fn) if isinstance(n, (ast.If, ast.IfExp))]
    assert not [t for t in tests if "controller" in t or "rank" in t or "rollout is" in t], tests
    edges, _ = import_graph()
    assert not [m for m in edges[f"hpcrl.{module}"] if m.startswith("hpcrl.slurm")]


def test_the_async_loop_is_no_longer_than_the_sync_one():
    sync, async_ = loop_function("loop", "train_main"), loop_function("loop_async", "train_async_main")
    assert async_.end_lineno - async_.lineno <= sync.end_lineno - sync.lineno


def test_the_checks_find_what_they_look_for():
    """The cycle finder fires on a cycle; imports under ``if TYPE_CHECKING:`` and function-level ones
    count."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x import y\n"
                     "def f():\n    from hpcrl.z import _w\n")
    found = sorted((n.module, n.names[0].name) for n in imports(tree) if isinstance(n, ast.ImportFrom))
    assert found == [("hpcrl.z", "_w"), ("typing", "TYPE_CHECKING"), ("x", "y")]


def test_built_in_names_come_from_the_implementing_modules():
    """Config validation knows the tasks, rewards, filters, estimators and losses by the leaf's names
    (:mod:`hpcrl.names`), which are the implementing modules' (each registry asserts it on import)."""
    from typing import get_args, get_type_hints

    from hpcrl import config, names
    from hpcrl.config.train import GROUP_ESTIMATORS, AlgorithmSection
    from hpcrl.data.tasks import BUILTIN_TASKS
    from hpcrl.rewards.resolve import BUILTIN_REWARD_FACTORIES, BUILTIN_REWARDS
    from hpcrl.rollout.filters import BUILTIN_FILTERS
    from hpcrl.rollout import plugins
    from hpcrl.train import algorithms

    assert config.BUILTIN_DATA_SOURCES == tuple(BUILTIN_TASKS) == names.TASKS
    assert config.BUILTIN_REWARD_FUNCTIONS == tuple(BUILTIN_REWARD_FACTORIES) == names.REWARDS
    assert BUILTIN_REWARDS == (*names.REWARDS, config.REMOTE_RM_PREFIX + "<url>")
    assert config.BUILTIN_DYNAMIC_FILTERS == tuple(BUILTIN_FILTERS) == names.FILTERS
    hints = get_type_hints(AlgorithmSection)
    assert get_args(hints["advantage_estimator"]) == algorithms.ESTIMATORS == names.ESTIMATORS
    assert get_args(hints["kl_loss_type"]) == algorithms.KL_KINDS == names.KL_KINDS
    assert get_args(hints["policy_loss"]) == algorithms.POLICY_LOSSES == names.POLICY_LOSSES
    assert set(GROUP_ESTIMATORS) <= set(algorithms.ESTIMATORS)
    assert config.RolloutSection().data_source == plugins.DEFAULT_DATA_SOURCE == names.DEFAULT_DATA_SOURCE


def test_one_parser_of_the_remote_reward_model_url():
    """``remote_rm:<url>``: the URL, "" when it is missing or not http(s), None for other names."""
    from hpcrl.names import remote_rm_url

    assert remote_rm_url("remote_rm:http://127.0.0.1:8000/reward") == "http://127.0.0.1:8000/reward"
    assert remote_rm_url(" remote_rm: https://rm/x ") == "https://rm/x"
    assert remote_rm_url("remote_rm") == remote_rm_url("remote_rm:ftp://x") == ""
    assert remote_rm_url("exact_match") is remote_rm_url("remote_rmx.score") is None


def test_test_files_have_unique_basenames():
    """pytest imports test files by basename (no packages under tests/): two files of one name in different
    tiers stop the whole collection ("import file mismatch"), as tests/unit and tests/integration test_opd.py did."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
