"""The ``eval`` section: named eval sets with their own sampling settings, with its check (``check_eval``).

The run's *default* eval set is the one ``data`` defines (``data.eval_source``, or ``data.num_eval`` items held
out of ``data.source``); its metrics keep the plain names (``eval/accuracy``, ``eval/pass@4``). Every set of
``eval.sets`` logs ``eval/<name>/accuracy`` and the rest under its name. Sampling settings mirror slime's
``--n-samples-per-eval-prompt``, ``--eval-temperature``, ``--eval-top-p``, ``--eval-max-response-len``; a set's
own value overrides the section's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from hpcrl.config.checks import check_source, require

DEFAULT_EVAL_SET = "default"
"""Name of the eval set ``data`` defines (its metrics are ``eval/<metric>``, without the name)."""
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass
class EvalSetSection:
    """One named eval set (``eval.sets``)."""

    name: str = ""
    """Metric prefix, ``eval/<name>/accuracy``: letters, digits and ``._-``; unique; not ``default``."""
    source: str = ""
    """A built-in generator (``addition``, ``repeat``, ``reasoning_gym:<task>``) or a ``.jsonl`` /
    ``.parquet`` file (read with ``data.prompt_key`` / ``data.label_key`` / ``data.tools_key``, checked like
    the training data)."""
    num: Optional[int] = None
    """Items: a generator draws this many (default ``data.num_eval``); a file gives its first ``num`` rows
    (default all)."""
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of a generator source (default ``data.task_kwargs`` when the source is ``data.source``)."""
    n_samples: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_new_tokens: Optional[int] = None


@dataclass
class EvalSection:
    """Evaluation (every ``rollout.eval_interval`` steps, before the first and after the last): sampling settings
    of every set, and the named sets besides the default one."""

    n_samples: int = 1
    """Responses per eval prompt (slime ``--n-samples-per-eval-prompt``); ``pass@k`` is reported for k = 1,
    2, 4, ... up to it."""
    temperature: float = 0.0
    """Eval sampling temperature (slime ``--eval-temperature``); 0 is greedy."""
    top_p: float = 1.0
    """Eval nucleus sampling (slime ``--eval-top-p``)."""
    max_new_tokens: Optional[int] = None
    """Longest eval response in tokens (slime ``--eval-max-response-len``); default ``rollout.max_new_tokens``."""
    sets: list[EvalSetSection] = field(default_factory=list)
    """Named eval sets besides the default one (slime ``--eval-prompt-data NAME PATH ...``)."""


def _check_sampling(where: str, n: Optional[int], temperature: Optional[float], top_p: Optional[float],
                    max_new_tokens: Optional[int]) -> None:
    if n is not None:
        require(n >= 1, f"{where}.n_samples", n, "must be >= 1", f"set {where}.n_samples to 1 or more")
    if temperature is not None:
        require(temperature >= 0, f"{where}.temperature", temperature, "must be >= 0 (0 is greedy)",
                f"set {where}.temperature=0 for greedy decoding")
    if top_p is not None:
        require(0 < top_p <= 1, f"{where}.top_p", top_p, "must be in (0, 1]", f"set {where}.top_p=1.0")
    if max_new_tokens is not None:
        require(max_new_tokens >= 1, f"{where}.max_new_tokens", max_new_tokens, "must be >= 1",
                f"set {where}.max_new_tokens to a positive token count, or null for rollout.max_new_tokens")


def check_eval(cfg: Config, check_files: bool) -> None:
    e = cfg.eval
    _check_sampling("eval", e.n_samples, e.temperature, e.top_p, e.max_new_tokens)
    seen: set[str] = set()
    for i, s in enumerate(e.sets):
        where = f"eval.sets[{i}]"
        require(bool(_NAME_RE.fullmatch(s.name or "")), f"{where}.name", s.name,
                "must be a metric name: letters, digits and ._- (starting with a letter or digit)",
                f"name the set, e.g. {where}.name=gsm8k")
        require(s.name != DEFAULT_EVAL_SET, f"{where}.name", s.name,
                "is the name of the eval set data.eval_source / data.num_eval define",
                "pick another name")
        require(s.name not in seen, f"{where}.name", s.name, "names two eval sets", "give each set its own name")
        seen.add(s.name)
        require(bool(s.source), f"{where}.source", s.source, "is required",
                "set it to a generator (addition, repeat, reasoning_gym:<task>) or a .jsonl / .parquet file")
        check_source(f"{where}.source", s.source, check_files)
        if s.num is not None:
            require(s.num >= 1, f"{where}.num", s.num, "must be >= 1", f"set {where}.num or leave it unset")
        _check_sampling(where, s.n_samples, s.temperature, s.top_p, s.max_new_tokens)
