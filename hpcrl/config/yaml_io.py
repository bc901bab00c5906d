"""YAML as configs read it: YAML-1.2-style numbers (``3e-5`` a float, ``12:00:00`` and ``010`` strings), duplicate keys are
errors; and the dumper that writes ``config.yaml``."""

from __future__ import annotations

import re
from typing import Any

import yaml

from hpcrl.config.errors import FILE_FIELD, ConfigError


_INT_TAG = "tag:yaml.org,2002:int"


_FLOAT_TAG = "tag:yaml.org,2002:float"


_INT_RE = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?0b[01_]+)$")


_FLOAT_RE = re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def _yaml12_resolvers() -> dict:
    table = {ch: [(tag, rx) for tag, rx in rules if tag not in (_INT_TAG, _FLOAT_TAG)]
             for ch, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for tag, rx, first in ((_INT_TAG, _INT_RE, "-+0123456789"), (_FLOAT_TAG, _FLOAT_RE, "-+0123456789.")):
        for ch in first:
            table.setdefault(ch, []).append((tag, rx))
    return table


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML-1.2 numbers (``3e-5`` is a float; ``1:30`` and ``010`` are strings) that rejects
    duplicate keys."""

    yaml_implicit_resolvers = _yaml12_resolvers()

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first given on line {first + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class YamlDumper(yaml.SafeDumper):
    """SafeDumper that quotes exactly the strings :class:`_Loader` would read back as numbers."""

    yaml_implicit_resolvers = _yaml12_resolvers()


def parse_yaml(text: str, where: str) -> Any:
    """Parse YAML text; a syntax error becomes a ConfigError naming ``where`` and the line."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = f"{where}:{mark.line + 1}" if mark is not None else where
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = e.problem or e.context or "syntax error"
        if e.context and e.problem and e.context_mark is not None:
            what += f" ({e.context} that starts on line {e.context_mark.line + 1})"
        if what.startswith("duplicate key"):
            fix = "remove one of the two"
        else:
            fix = "fix the YAML there (close brackets and quotes; quote values that contain ': ' or ' #')"
        raise ConfigError(FILE_FIELD, loc, f"invalid YAML{at}: {what}", fix) from None
    except yaml.YAMLError as e:
        raise ConfigError(FILE_FIELD, where, f"invalid YAML: {e}", "fix the YAML syntax") from None
