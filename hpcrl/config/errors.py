"""The one config error type: :class:`ConfigError`, whose message is one line naming the dotted field, the value and the fix."""

from __future__ import annotations

import re
from typing import Any




FILE_FIELD = "<file>"
"""``ConfigError.field`` for errors about a config file as a whole (missing, YAML syntax, not a mapping)."""


OVERRIDE_FIELD = "<override>"
"""``ConfigError.field`` for a command-line override that is not of the form ``key=value``."""


MIB = 1024 * 1024


class ConfigError(ValueError):
    """A bad configuration value.

    ``str(err)`` is one line: ``config error: <dotted.field>=<value!r>: <what is wrong>; <fix>``.

    Attributes:
        field: dotted path of the bad field (``rollout.batch_size``, ``slurm.extra_sbatch[1]``,
            ``sweep.grid.train.lr``), or :data:`FILE_FIELD` / :data:`OVERRIDE_FIELD`.
        value: the offending value as given.
        problem: what is wrong.
        fix: how to fix it (may be empty).
    """

    def __init__(self, field: str, value: Any, problem: str, fix: str = "") -> None:
        super().__init__(field, value, problem, fix)
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        msg = f"config error: {self.field}={short_repr(self.value)}: {self.problem}"
        if self.fix:
            msg += f"; {self.fix}"
        return re.sub(r"\s*[\r\n]+\s*", " ", msg)


def short_repr(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
