"""Plug-ins by dotted import path (slime's ``load_function``).

Custom reward, generate, rollout and filter functions are named in the config as ``pkg.module.attr``: the
module part is imported (it must be importable from ``sys.path``, e.g. the working directory or an installed
package) and the attribute after the last dot is returned.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


class PluginError(ValueError):
    """A dotted import path that does not resolve to a callable; ``str(err)`` is one line: path and reason."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"plugin error: {path!r}: {reason}")


def load_function(path: str) -> Callable[..., Any]:
    """Import ``pkg.module.attr`` and return ``attr`` (slime ``load_function``, split by ``rpartition('.')``).

    Raises :class:`PluginError` when the path has no dot, the module is not found or fails to import, the
    attribute is missing, or it is not callable.
    """
    if not isinstance(path, str) or not path.strip():
        raise PluginError(str(path), "expected a dotted import path 'pkg.module.function'")
    path = path.strip()
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(path, "expected a dotted import path 'pkg.module.function' (no module part)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise PluginError(path, f"module {module_name!r} not found "
                                    "(is its folder on sys.path / PYTHONPATH?)") from e
        raise PluginError(path, f"importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    except Exception as e:  # an error inside the plug-in module itself
        msg = str(e).splitlines()[0] if str(e) else ""
        raise PluginError(path, f"importing module {module_name!r} failed: {type(e).__name__}: {msg}") from e
    if not hasattr(module, attr):
        raise PluginError(path, f"module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise PluginError(path, f"{attr!r} in module {module_name!r} is a {type(fn).__name__}, not callable")
    return fn
