"""Helpers the sections' checks share: the one-line error helpers (:func:`require`, :func:`positive`, :func:`non_negative`),
data sources and plug-in paths (:func:`check_source`, :func:`check_plugin`).

``Config`` in the annotations of this module and of the section modules is
:class:`hpcrl.config.schema.Config`, not imported (not even under ``TYPE_CHECKING``): schema imports the
sections, which import these helpers."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Optional

from hpcrl import names
from hpcrl.config.environment import Environment
from hpcrl.config.errors import ConfigError

BUILTIN_DATA_SOURCES = names.TASKS
"""Built-in generators besides ``reasoning_gym:<task>`` (the names :mod:`hpcrl.data.tasks` implements)."""


DATA_FILE_SUFFIXES = (".jsonl", ".parquet")


_DOTTED_PATH_RE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def get_field(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def require(ok: bool, field_name: str, value: Any, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(field_name, value, problem, fix)


def positive(cfg: Config, *fields: str) -> None:
    for f in fields:
        v = get_field(cfg, f)
        if v is not None:
            require(v > 0, f, v, "must be > 0", f"set {f} to a positive value")


def non_negative(cfg: Config, *fields: str) -> None:
    for f in fields:
        v = get_field(cfg, f)
        if v is not None:
            require(v >= 0, f, v, "must be >= 0", f"set {f} to 0 or more")


def _reasoning_gym_tasks(field_name: str, value: str) -> list[str]:
    try:
        from reasoning_gym.factory import DATASETS
    except Exception as e:  # any import failure is reported on the field
        raise ConfigError(field_name, value, f"cannot import reasoning_gym ({type(e).__name__}: {e})",
                          "pip install reasoning-gym") from None
    return sorted(DATASETS)


def check_source(field_name: str, value: str, check_files: bool) -> None:
    if value in BUILTIN_DATA_SOURCES:
        return
    if value.startswith("reasoning_gym:"):
        task = value.split(":", 1)[1]
        require(bool(re.fullmatch(r"[A-Za-z0-9_]+", task)), field_name, value,
                 "reasoning-gym task name missing or malformed", "write e.g. reasoning_gym:basic_arithmetic")
        if check_files:
            known = _reasoning_gym_tasks(field_name, value)
            if task not in known:
                close = difflib.get_close_matches(task, known, n=1)
                raise ConfigError(field_name, value, f"reasoning-gym has no task {task!r}",
                                  f"did you mean reasoning_gym:{close[0]}?" if close
                                  else "see reasoning_gym.factory.DATASETS for the task names")
        return
    if value.endswith(DATA_FILE_SUFFIXES):
        if check_files:
            require(Path(value).is_file(), field_name, value,
                     "is a directory, not a data file" if Path(value).is_dir() else "no such data file",
                     "check the path (relative paths are relative to the working directory)")
        return
    close = difflib.get_close_matches(value, list(BUILTIN_DATA_SOURCES), n=1)
    raise ConfigError(field_name, value, "unknown data source",
                      f"did you mean {close[0]!r}?" if close else
                      "use 'addition', 'repeat', 'reasoning_gym:<task>' or a .jsonl/.parquet file")


def check_plugin(field_name: str, value: Optional[str], builtins: tuple[str, ...],
                  check_files: bool, env: Optional[Environment] = None) -> None:
    """A plug-in is a builtin name, a dotted ``pkg.module.attr`` or a file's ``path/to/module.py:attr`` that
    imports to a callable (``env.plugin_problem``: :func:`hpcrl.plugin_loader.load_function`, the loader the rollout
    uses). Raises ConfigError naming ``field_name`` when it does not (the import is tried only with
    ``check_files`` and an ``env``)."""
    if value is None or value in builtins:
        return
    if field_name == "rollout.reward_function" and (url := names.remote_rm_url(value)) is not None:
        require(bool(url), field_name, value, "remote_rm needs the reward server's URL",
                 "write e.g. remote_rm:http://127.0.0.1:8000/reward")
        return
    shown = names.REWARD_CHOICES if field_name == "rollout.reward_function" else builtins
    kinds = f"{', '.join(repr(b) for b in shown)} or a dotted path" if shown else "a dotted path"
    kinds += " pkg.module.function or path/to/file.py:function"
    if not (_DOTTED_PATH_RE.fullmatch(value) or names.FILE_FORM_RE.fullmatch(value)):
        close = difflib.get_close_matches(value, list(builtins), n=1)
        raise ConfigError(field_name, value, f"must be {kinds}",
                          f"did you mean {close[0]!r}?" if close else
                          "write e.g. my_rewards.math.score (a module on PYTHONPATH and a function in it) or "
                          "my_rewards/math.py:score")
    if not check_files or env is None:
        return
    reason = env.plugin_problem(value)
    if reason is not None:
        raise ConfigError(field_name, value, reason,
                          "fix the dotted path pkg.module.function or the file path path/to/file.py:function")
