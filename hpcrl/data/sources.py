"""Prompt data from files (JSONL, Parquet) or a built-in generator, split into train and eval.

File rows become items ``{"prompt", "label", "metadata"}``: ``prompt`` is the row's ``prompt_key`` value (a
non-empty string, or a chat ``[{"role", "content"}, ...]`` list), ``label`` the ``label_key`` value (None when
absent), ``metadata`` the row's ``metadata`` object (if any) plus every other column. Blank JSONL lines are
ignored.

Malformed rows (bad JSON, not an object, no prompt, a prompt of the wrong type) raise :class:`DataError`
naming ``FILE:LINE`` (Parquet: ``FILE:ROW``, 1-based) with ``on_bad_row="error"``; with ``"skip"`` each is
logged as a warning naming ``FILE:LINE`` and skipped, and a count is logged at the end. Never silently.

:func:`load_datasets` builds the run's train and eval items from a :class:`~hpcrl.config.Config`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

from hpcrl.data.tasks import Task, VerifierTask, make_task

if TYPE_CHECKING:
    from hpcrl.config import Config

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".parquet")


class DataError(ValueError):
    """A dataset file problem; ``str(err)`` is ``data error: FILE:LINE: <what>; <fix>`` (one line).

    ``path`` is the file, ``line`` the 1-based line (JSONL) or row (Parquet), None for whole-file problems.
    """

    def __init__(self, path: str, line: Optional[int], what: str, fix: str):
        self.path = str(path)
        self.line = line
        self.what = what
        self.fix = fix
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"data error: {where}: {what}; {fix}")


@dataclass
class Datasets:
    """Train and eval items of a run and the task that scores them."""

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    task: Task


def _row_problem(row: Any, prompt_key: str) -> Optional[tuple[str, str]]:
    """(what, fix) if ``row`` is not a usable data row, else None."""
    if not isinstance(row, dict):
        return f"row is a JSON {type(row).__name__}, not an object", "each line must be one JSON object"
    if prompt_key not in row:
        keys = ", ".join(sorted(map(str, row))[:8]) or "none"
        return (f"no prompt key {prompt_key!r} (keys: {keys})",
                "add it, or set data.prompt_key to the column holding the prompt")
    p = row[prompt_key]
    if isinstance(p, str):
        return None if p.strip() else (f"prompt {prompt_key!r} is empty", "give every row a prompt")
    if isinstance(p, list) and p and all(isinstance(m, dict) and "role" in m and "content" in m for m in p):
        return None
    return (f"prompt {prompt_key!r} is a {type(p).__name__}, not a string or a list of "
            "{'role', 'content'} messages", "fix the row or pick another data.prompt_key")


def _to_item(row: dict[str, Any], prompt_key: str, label_key: str) -> dict[str, Any]:
    meta = dict(row["metadata"]) if isinstance(row.get("metadata"), dict) else {}
    meta.update({k: v for k, v in row.items() if k not in (prompt_key, label_key, "metadata")})
    return {"prompt": row[prompt_key], "label": row.get(label_key), "metadata": meta}


def _collect(path: str, rows: Iterable[tuple[int, Any, Optional[tuple[str, str]]]], prompt_key: str,
             label_key: str, on_bad_row: str) -> list[dict[str, Any]]:
    """Items from ``(line, row, parse_problem)`` triples, applying the bad-row policy."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    items, skipped, total = [], 0, 0
    for line, row, problem in rows:
        total += 1
        problem = problem or _row_problem(row, prompt_key)
        if problem is None:
            items.append(_to_item(row, prompt_key, label_key))
            continue
        if on_bad_row == "error":
            raise DataError(path, line, problem[0], problem[1] + " (or set data.on_bad_row: skip)")
        skipped += 1
        log.warning("data: %s:%d: %s; row skipped", path, line, problem[0])
    if skipped:
        log.warning("data: %s: skipped %d malformed of %d rows", path, skipped, total)
    if not items:
        raise DataError(path, None, f"no usable rows ({total} rows, {skipped} malformed)",
                        "check the file and data.prompt_key")
    return items


def _check_file(path: str) -> str:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(path, None, "file not found", "check data.source / data.eval_source")
    return path


def read_jsonl(path: str, prompt_key: str = "prompt", label_key: str = "label",
               on_bad_row: str = "error") -> list[dict[str, Any]]:
    """Items of a JSON-lines file (one object per line; line numbers are 1-based).

    Raises :class:`DataError` for a missing file, a file without usable rows, or (``on_bad_row="error"``) the
    first malformed row.
    """
    path = _check_file(path)

    def rows() -> Iterator[tuple[int, Any, Optional[tuple[str, str]]]]:
        with open(path, encoding="utf-8") as f:
            for n, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    yield n, json.loads(text), None
                except json.JSONDecodeError as e:
                    yield n, None, (f"bad JSON ({e.msg} at column {e.colno})",
                                    "each line must be one JSON object")

    return _collect(path, rows(), prompt_key, label_key, on_bad_row)


def read_parquet(path: str, prompt_key: str = "prompt", label_key: str = "label",
                 on_bad_row: str = "error") -> list[dict[str, Any]]:
    """Items of a Parquet file (pyarrow); ``line`` in errors is the 1-based row number.

    Raises :class:`DataError` for a missing or unreadable file, a file without usable rows, or
    (``on_bad_row="error"``) the first malformed row.
    """
    import pyarrow.parquet as pq

    path = _check_file(path)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-Parquet files
        raise DataError(path, None, f"not a readable Parquet file ({type(e).__name__}: {str(e)[:120]})",
                        "check the file") from e

    def rows() -> Iterator[tuple[int, Any, Optional[tuple[str, str]]]]:
        n = 0
        for batch in pf.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                n += 1
                yield n, row, None

    return _collect(path, rows(), prompt_key, label_key, on_bad_row)


def is_file_source(source: str) -> bool:
    """True if ``source`` names a data file (a ``.jsonl`` / ``.parquet`` suffix, or an existing file)."""
    return source.endswith(FILE_SUFFIXES) or os.path.isfile(source)


def read_items(path: str, prompt_key: str = "prompt", label_key: str = "label",
               on_bad_row: str = "error") -> list[dict[str, Any]]:
    """:func:`read_parquet` for ``*.parquet``, else :func:`read_jsonl`."""
    reader = read_parquet if str(path).endswith(".parquet") else read_jsonl
    return reader(path, prompt_key, label_key, on_bad_row)


def prompt_key_of(item: dict[str, Any]) -> str:
    """A hashable identity of an item's prompt (the string itself, or canonical JSON of a message list)."""
    p = item["prompt"]
    return p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str)


def load_datasets(cfg: "Config") -> Datasets:
    """Train and eval items for a run, and the task that scores them.

    Generator source (``addition``, ``reasoning_gym:<name>``; ``data.task_kwargs`` go to :func:`make_task`):
    train = ``task.generate(data.num_train, seed=run.seed)``, eval = ``task.generate(data.num_eval,
    seed=run.seed + 1)`` minus every item whose prompt also occurs in train (so eval may hold slightly fewer
    than ``num_eval`` items; for small problem spaces such as 1-digit addition, many fewer).

    File source (``.jsonl`` / ``.parquet``): every row is read (``data.num_train`` is ignored). Eval is read
    from ``data.eval_source`` when given (a file, or a generator name drawn with ``run.seed + 1``); otherwise
    the last ``data.num_eval`` rows are held out of train (in file order, no shuffle). The task is a
    :class:`VerifierTask` using ``rollout.reward_function`` when that is ``exact_match`` / ``math_answer`` /
    ``countdown``, else ``exact_match``.

    Raises :class:`DataError` for file problems (also when held-out eval would leave no train rows) and
    ValueError for unknown tasks.
    """
    d = cfg.data
    seed = cfg.run.seed
    if is_file_source(d.source):
        rows = read_items(d.source, d.prompt_key, d.label_key, d.on_bad_row)
        rf = cfg.rollout.reward_function
        verifier = rf if rf in ("exact_match", "math_answer", "countdown") else "exact_match"
        task: Task = VerifierTask(verifier=verifier, name=os.path.basename(d.source))
        if d.eval_source:
            train, eval_items = rows, _load_eval(cfg, task)
        else:
            if d.num_eval >= len(rows):
                raise DataError(d.source, None,
                                f"{len(rows)} rows cannot hold out data.num_eval={d.num_eval} eval rows",
                                "lower data.num_eval or set data.eval_source")
            cut = len(rows) - d.num_eval
            train, eval_items = rows[:cut], rows[cut:]
        return Datasets(train=train, eval=eval_items, task=task)

    task = make_task(d.source, **d.task_kwargs)
    train = task.generate(d.num_train, seed=seed)
    if d.eval_source:
        eval_items = _load_eval(cfg, task)
    else:
        eval_items = task.generate(d.num_eval, seed=seed + 1)
    seen = {prompt_key_of(it) for it in train}
    eval_items = [it for it in eval_items if prompt_key_of(it) not in seen]
    return Datasets(train=train, eval=eval_items, task=task)


def _load_eval(cfg: "Config", task: Task) -> list[dict[str, Any]]:
    """Eval items from ``data.eval_source``: a file, or a generator drawn with ``run.seed + 1``."""
    d = cfg.data
    assert d.eval_source is not None
    if is_file_source(d.eval_source):
        return read_items(d.eval_source, d.prompt_key, d.label_key, d.on_bad_row)
    other = task if d.eval_source == task.name else make_task(d.eval_source, **d.task_kwargs)
    return other.generate(d.num_eval, seed=cfg.run.seed + 1)
