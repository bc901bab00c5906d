"""Plug-ins by dotted import path (slime's ``load_function``) or by file.

Custom reward, generate, rollout, filter and agent functions are named in the config as ``pkg.module.attr``:
the module part is imported (it must be importable from ``sys.path``, e.g. an installed package or a folder
on ``PYTHONPATH``) and the attribute after the last dot is returned. Or as ``path/to/module.py:attr``
(relative to the working directory, like the config's other paths): the file is imported by its package name
(the folders above it that hold an ``__init__.py``) from the first folder above them, searched first for that
import only and then left at the end of ``sys.path`` (so it shadows nothing), so relative imports inside the
package work and no ``PYTHONPATH`` is needed: ``examples/agent_calculator/agent.py:solve`` is module
``agent_calculator.agent`` from ``examples/``.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from hpcrl.names import FILE_FORM_RE  # ``path/to/module.py:attr``: a plug-in named by its file


class PluginError(ValueError):
    """A dotted import path that does not resolve to a callable; ``str(err)`` is one line: path and reason."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"plugin error: {path!r}: {reason}")


def load_function(path: str) -> Callable[..., Any]:
    """Import ``pkg.module.attr`` and return ``attr`` (slime ``load_function``, split by ``rpartition('.')``),
    or import the file of ``path/to/module.py:attr`` (:func:`module_of_file`) and return ``attr``.

    Raises :class:`PluginError` when the path has no dot, the module (or file) is not found or fails to
    import, the file imports as another module of the same name, the attribute is missing, or it is not
    callable.
    """
    if not isinstance(path, str) or not path.strip():
        raise PluginError(str(path), "expected a dotted import path 'pkg.module.function'")
    path = path.strip()
    file_form = FILE_FORM_RE.fullmatch(path)
    if file_form:
        module, attr = _import_file(path, file_form["file"]), file_form["attr"]
        module_name = module.__name__
    else:
        module_name, _, attr = path.rpartition(".")
        if not module_name or not attr:
            raise PluginError(path, "expected a dotted import path 'pkg.module.function' (no module part)")
        module = _import(path, module_name)
    if not hasattr(module, attr):
        raise PluginError(path, f"module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise PluginError(path, f"{attr!r} in module {module_name!r} is a {type(fn).__name__}, not callable")
    return fn


def module_of_file(file: str | os.PathLike) -> tuple[Path, str]:
    """``(folder, module_name)`` of a ``.py`` file: the dotted name of the file below the folders above it
    that hold an ``__init__.py`` (its package), and the first folder above those (absolute), from which that
    name imports. ``examples/agent_calculator/agent.py`` -> ``(/abs/examples, "agent_calculator.agent")``."""
    f = Path(file).resolve()
    parts, folder = ([] if f.stem == "__init__" else [f.stem]), f.parent
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    if not parts:  # a package's __init__.py outside any package: it is no module of its own
        parts, folder = [f.stem], f.parent
    return folder, ".".join(parts)


def _import_file(path: str, file: str) -> ModuleType:
    """Import ``file`` as the module :func:`module_of_file` names, from its folder: that folder goes first on
    ``sys.path`` for this import only, then stays at its end (once). Raises :class:`PluginError` when the file
    does not exist, a name on its way is no Python identifier, a module of that name (or of one of its
    packages) is already imported from another file, or the import fails."""
    if not Path(file).is_file():
        raise PluginError(path, f"no such file {file!r} (relative to the working directory {os.getcwd()})")
    target = Path(file).resolve()
    folder, name = module_of_file(target)
    parts = name.split(".")
    bad = [p for p in parts if not p.isidentifier()]
    if bad:
        raise PluginError(path, f"{bad[0]!r} cannot be a Python module name (module {name!r} of {file!r}): "
                                "rename it with letters, digits and underscores")
    for i in range(1, len(parts) + 1):  # a module of that name imported before would be used instead
        expected = target if i == len(parts) else folder.joinpath(*parts[:i], "__init__.py")
        seen = sys.modules.get(".".join(parts[:i]))
        where = getattr(seen, "__file__", None)
        if seen is not None and (not where or Path(where).resolve() != expected):
            raise PluginError(path, f"module {'.'.join(parts[:i])!r} is already imported from {where!r}, not "
                                    f"{str(expected)!r}: rename the file or its package")
    sys.path.insert(0, str(folder))
    try:
        return _import(path, name)
    finally:
        sys.path.remove(str(folder))  # the first occurrence: the one inserted above
        if str(folder) not in sys.path:
            sys.path.append(str(folder))  # for what the plug-in imports later


def _import(path: str, module_name: str) -> ModuleType:
    """``importlib.import_module(module_name)``; its errors as :class:`PluginError` of ``path``."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise PluginError(path, f"module {module_name!r} not found "
                                    "(is its folder on sys.path / PYTHONPATH?)") from e
        raise PluginError(path, f"importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    except Exception as e:  # an error inside the plug-in module itself
        msg = str(e).splitlines()[0] if str(e) else ""
        raise PluginError(path, f"importing module {module_name!r} failed: {type(e).__name__}: {msg}") from e
