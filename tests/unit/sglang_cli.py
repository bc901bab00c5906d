"""Parse ``sglang.launch_server`` command lines with SGLang's own parser, on a CPU machine (a subprocess
helper of ``test_sglang_conformance.py``).

SGLang 0.5.23 builds its parser from the dataclasses under ``sglang/srt/arg_groups/``
(``ServerArgs.add_cli_args``); ``prepare_server_args`` merges a ``--config`` YAML file into the command line
with ``ConfigArgumentMerger`` first. Both are used unchanged from the installed wheel
(``pip install --no-deps``, as ``.ci/install`` does). Importing ``sglang.srt.server_args`` on CPU needs these
four modules, which the wheel's runtime requires but never calls while parsing; each becomes an empty stub
module (attribute access returns another stub), installed only in this process:

- ``pybase64`` (fast base64 for tensor payloads), ``zmq`` (the scheduler's IPC), ``IPython`` (debug helpers)
  and ``triton`` (GPU kernels): imported at module level by ``sglang.srt.utils.common`` and its neighbours.

Run as ``python sglang_cli.py`` with a JSON list of argument lists (without ``python -m
sglang.launch_server``) on stdin; prints one JSON object per list: ``{"ok", "error", "deprecated", "values"}``
where ``deprecated`` names the flags given that SGLang registers as deprecated and ``values`` maps each given
flag's ``dest`` to its parsed value.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import sys
import types

STUBS = ("pybase64", "zmq", "IPython", "triton")


class _Stub(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _Stub(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return _Stub(f"{self.__name__}()")

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def parse_all(argvs: list[list[str]]) -> list[dict]:
    """Parse each argument list with a fresh SGLang parser (see the module docstring)."""
    import argparse

    sys.meta_path.insert(0, _StubFinder())
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    out = []
    for argv in argvs:
        parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
        ServerArgs.add_cli_args(parser)
        by_flag = {opt: a for a in parser._actions for opt in a.option_strings}
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                merged = (ConfigArgumentMerger(parser).merge_config_with_args(list(argv))
                          if "--config" in argv else list(argv))
                ns = parser.parse_args(merged)
        except (SystemExit, argparse.ArgumentError, ValueError) as e:
            out.append({"ok": False, "error": (err.getvalue() or str(e)).strip(), "deprecated": [],
                        "values": {}})
            continue
        given = [a.split("=", 1)[0] for a in merged if a.startswith("--")]
        actions = [by_flag[g] for g in given if g in by_flag]
        out.append({"ok": True, "error": "",
                    "deprecated": [g for g in given
                                   if g in by_flag and type(by_flag[g]).__name__.startswith("Deprecated")],
                    "values": {a.dest: getattr(ns, a.dest, None) for a in actions}})
    return out


if __name__ == "__main__":
    print(json.dumps(parse_all(json.load(sys.stdin)), default=str))
