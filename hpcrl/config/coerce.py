"""Typed conversion of a raw (YAML) dict into the dataclasses, driven by their annotations, with one-line errors for
unknown keys (closest known name) and wrong types; ``key=value`` overrides and dotted keys."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
from typing import Any, Iterable, Literal, Optional, Union, get_args, get_origin, get_type_hints

from hpcrl.config.errors import FILE_FIELD, OVERRIDE_FIELD, ConfigError, short_repr
from hpcrl.config.yaml_io import parse_yaml
from hpcrl.config.schema import Config


_PLURAL = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def unwrap_optional(tp: Any) -> Any:
    if _is_union(tp):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _describe(tp: Any) -> str:
    """Human description of an annotation: ``an integer``, ``one of 'a', 'b'``, ``a list of strings``."""
    if tp is Any:
        return "any value"
    if _is_union(tp):
        parts = [_describe(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in get_args(tp) else "")
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        (arg,) = get_args(tp) or (Any,)
        return "a list" if arg is Any else f"a list of {_PLURAL.get(arg, 'values')}"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def value_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__)


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _type_error(value: Any, tp: Any, path: str) -> ConfigError:
    want = _describe(tp)
    fix = f"set {path} to {want}"
    base = unwrap_optional(tp)
    if isinstance(value, str) and base in (int, float):
        try:
            float(value)
            fix = f"write the number without quotes ({path.rsplit('.', 1)[-1]}: {value})"
        except ValueError:
            pass
    elif isinstance(value, bool) and base in (int, float):
        fix = f"use a number for {path}, not true/false"
    elif isinstance(value, (int, float)) and base is str:
        fix = f"quote it: {path.rsplit('.', 1)[-1]}: '{value}'"
    elif base is list or get_origin(base) is list:
        fix = f"write a list, e.g. {path.rsplit('.', 1)[-1]}: [{short_repr(value, 40)}]"
    return ConfigError(path, value, f"expected {want}, got {value_kind(value)}", fix)


def convert_value(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` (plain YAML data) against annotation ``tp`` and build it.

    Raises ConfigError naming ``path``."""
    if tp is Any:
        return copy.deepcopy(value)
    if _is_union(tp):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            if value is None:
                raise _type_error(value, tp, path)
            return convert_value(value, options[0], path)
        for option in options:
            try:
                return convert_value(value, option, path)
            except ConfigError:
                continue
        raise _type_error(value, tp, path)
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if any(type(value) is type(a) and value == a for a in allowed):
            return value
        close = difflib.get_close_matches(value, [a for a in allowed if isinstance(a, str)], n=1) \
            if isinstance(value, str) else []
        fix = f"did you mean {close[0]!r}?" if close else f"set {path} to one of the allowed values"
        raise ConfigError(path, value, "must be " + _describe(tp), fix)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(value, tp, path)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(value, tp, path)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(path, value, "must be a finite number", f"set {path} to a finite number")
            return float(value)
        raise _type_error(value, tp, path)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(value, tp, path)
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(value, tp, path)
        (arg,) = get_args(tp) or (Any,)
        return [convert_value(v, arg, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(value, tp, path)
        _, val_tp = get_args(tp) or (str, Any)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(_join(path, k), v, f"keys of {path} must be strings, got {value_kind(k)} {k!r}",
                                  "quote the key")
            out[k] = convert_value(v, val_tp, _join(path, k))
        return out
    if dataclasses.is_dataclass(tp):
        return convert_dataclass(value, tp, path)
    raise TypeError(f"hpcrl.config: unsupported annotation {tp!r} at {path!r}")


def convert_dataclass(value: Any, cls: type, path: str) -> Any:
    if not isinstance(value, dict):
        if not path:
            raise ConfigError(FILE_FIELD, value,
                              f"the top level must be a mapping of sections, got {value_kind(value)}",
                              "start the file with sections such as 'run:', 'model:', 'rollout:'")
        raise _type_error(value, cls, path)
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, v in value.items():
        if key not in names:
            raise _unknown_key(path, key, v, names)
        ftype = hints[key]
        if v is None and (dataclasses.is_dataclass(ftype) or get_origin(ftype) is dict):
            continue  # an empty section (``sglang:`` with nothing under it) keeps its defaults
        kwargs[key] = convert_value(v, ftype, _join(path, key))
    return cls(**kwargs)


def _all_field_paths(cls: Optional[type] = None, prefix: str = "") -> list[str]:
    """Dotted paths of every field of the schema (sections included), in declaration order."""
    cls = Config if cls is None else cls
    out = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = _join(prefix, f.name)
        out.append(dotted)
        inner = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            out.extend(_all_field_paths(inner, dotted))
    return out


def _unknown_key(section: str, key: Any, value: Any, names: list[str], field_name: Optional[str] = None
                 ) -> ConfigError:
    """An 'unknown key' error with a did-you-mean among the siblings, else anywhere in the schema."""
    skey = str(key)
    field_name = field_name or _join(section, skey)
    close = difflib.get_close_matches(skey, names, n=1, cutoff=0.6)
    if close:
        fix = f"did you mean {_join(section, close[0])}?"
    else:
        paths = _all_field_paths()
        leaves = {p.rsplit(".", 1)[-1] for p in paths}
        leaf = difflib.get_close_matches(skey, sorted(leaves), n=1, cutoff=0.75)
        where = [p for p in paths if leaf and p.rsplit(".", 1)[-1] == leaf[0]]
        if where:
            fix = f"did you mean {where[0]}?"
        else:
            fix = f"known keys{' of ' + section if section else ''}: {', '.join(names)}"
    what = (f"unknown key {skey!r} in section {section!r}" if section
            else f"unknown top-level section {skey!r}")
    return ConfigError(field_name, value, what, fix)


def schema_lookup(key: str, field_name: str, value: Any = None) -> tuple[Any, int]:
    """Walk dotted ``key`` through the schema.

    Returns ``(annotation, n)``: the annotation of the addressed value and how many leading parts of ``key``
    are schema fields; when ``n < len(parts)``, the rest (joined with dots) is one key of a free-form dict
    (``sglang.enable_memory_saver``, ``sweep.grid.train.lr``). Raises ConfigError (field ``field_name``) for
    an unknown key or a key below a plain value.
    """
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(field_name, value, f"{key!r} is not a dotted config key",
                          "write e.g. rollout.batch_size")
    tp: Any = Config
    for i, part in enumerate(parts):
        inner = unwrap_optional(tp)
        if dataclasses.is_dataclass(inner):
            hints = get_type_hints(inner)
            if part not in hints:
                raise _unknown_key(".".join(parts[:i]), part, value, list(hints), field_name)
            tp = hints[part]
        elif get_origin(inner) is dict:
            return get_args(inner)[1], i
        else:
            parent = ".".join(parts[:i])
            raise ConfigError(field_name, value,
                              f"{parent} is a single value ({_describe(tp)}), not a section",
                              f"set {parent}=... directly")
    return tp, len(parts)


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key=value`` and parse the value as YAML (``16`` -> int, ``[a,b]`` -> list, ``true`` -> bool).

    Returns ``(key, value)``. Raises ConfigError: field :data:`OVERRIDE_FIELD` when there is no ``=`` or no
    key; field ``key`` when the value is not valid YAML.
    """
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(OVERRIDE_FIELD, text, "an override must look like key=value",
                          "write e.g. rollout.batch_size=16")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(OVERRIDE_FIELD, text, "the override has no key before '='",
                          "write e.g. rollout.batch_size=16")
    try:
        value = parse_yaml(raw, "override")
    except ConfigError as e:
        problem = e.problem.replace("invalid YAML at line 1, ", "")
        raise ConfigError(key, raw, f"cannot parse the value as YAML ({problem})",
                          "quote strings and close brackets, e.g. slurm.extra_sbatch=[--a, --b]") from None
    return key, value


def set_dotted(raw: dict, key: str, value: Any) -> dict:
    """Set dotted ``key`` (a schema field, or a key below a free-form dict such as ``sglang``) to ``value`` in a
    raw (untyped) config dict, creating sections as needed; returns ``raw``. The value is not converted
    (:func:`build` does that).

    Raises ConfigError: an unknown key (with the closest known one), or a section on the way that the file
    set to a single value.
    """
    tp, n = schema_lookup(key, key, value)
    parts = key.split(".")
    if n == len(parts):
        container, last = parts[:-1], parts[-1]
    else:  # the rest is one key of a free-form dict
        container, last = parts[:n], ".".join(parts[n:])
    node = raw
    for i, part in enumerate(container):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(where, child, f"expected a mapping, got {value_kind(child)}",
                              f"fix {where} in the file")
        node = child
    node[last] = value
    return raw


def apply_override(raw: dict, text: str) -> dict:
    """Apply one ``key=value`` override (:func:`parse_override`) to a raw config dict; returns ``raw``.

    A number or boolean given to a string field is kept as its text (``run.name=2024``); ``key=`` sets a
    string field to ``""``. Raises ConfigError as :func:`parse_override` and :func:`set_dotted` do.
    """
    key, value = parse_override(text)
    tp, n = schema_lookup(key, key, value)
    if n == len(key.split(".")) and unwrap_optional(tp) is str and isinstance(value, (bool, int, float)):
        value = text.partition("=")[2].strip()  # name=2024 or tag=1e-3 on a string field: keep the text
    elif n == len(key.split(".")) and tp is str and value is None and not text.partition("=")[2].strip():
        value = ""  # sft.output= on a (non-optional) string field: the empty string
    return set_dotted(raw, key, value)


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """Apply ``key=value`` overrides in order (:func:`apply_override`); returns ``raw`` (changed in place).
    Raises TypeError when ``overrides`` is one string rather than a list of them."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    for text in overrides:
        apply_override(raw, text)
    return raw
