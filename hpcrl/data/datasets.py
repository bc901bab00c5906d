"""Prompt data from files (JSONL, Parquet) or a built-in generator, split into train and eval.

File rows become items ``{"prompt", "label", "metadata"}``: ``prompt`` is the row's ``prompt_key`` value (a
non-empty string, or a chat ``[{"role", "content"}, ...]`` list), ``label`` the ``label_key`` value (None when
absent), ``metadata`` the row's ``metadata`` object (if any) plus every other column. Blank JSONL lines are
ignored; a UTF-8 byte-order mark at the start of a JSONL file is accepted (it is read as ``utf-8-sig``).

Malformed rows raise :class:`DataError` naming ``FILE:LINE`` (Parquet: ``FILE:ROW``, 1-based) with
``on_bad_row="error"``; with ``"skip"`` each is logged as a warning naming ``FILE:LINE`` and skipped, and a
count is logged at the end. Never silently. Malformed: bad JSON, invalid UTF-8, a line longer than
:data:`MAX_ROW_BYTES`, not an object, no prompt, a prompt of the wrong type or empty; where the reward scores
against labels (:data:`LABEL_REWARDS`) no label or a null / non-scalar one; and, when the model folder
exists, a prompt of at least the model's context length (``max_position_embeddings``) in tokens, which the
engines would refuse. Whole-file problems (missing, a directory, unreadable, not Parquet, no usable row)
raise :class:`DataError` without a line.

:func:`load_datasets` builds the run's train and eval items from a :class:`~hpcrl.config.Config` (at the
start of a run); :func:`check_data` runs the very same reader on the login node (``hpcrl validate``,
``submit``, ``sweep``) and reports the first bad row as one :class:`~hpcrl.config.ConfigError` line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

from hpcrl import names
from hpcrl.config import ConfigError
from hpcrl.data.chat import TOOLS_KEY, chat_messages, prompt_token_ids
from hpcrl.data.tasks import Task, VerifierTask, make_task

if TYPE_CHECKING:
    from hpcrl.config import Config

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".parquet")
MAX_ROW_BYTES = 4 * 1024 * 1024
"""Longest JSONL line in bytes (newline excluded); a longer line is a malformed row (read no further)."""
LABEL_REWARDS = ("task", "exact_match", "math_answer")
"""``rollout.reward_function`` values that score a file row against its label: every row needs one."""

Problem = Optional[tuple[str, str]]
"""``(what, fix)`` of an unusable row, or None."""
RowCheck = Callable[[dict[str, Any]], Problem]
"""An extra check of a parsed item (e.g. :class:`PromptLengthCheck`)."""


class DataError(ValueError):
    """A dataset file problem; ``str(err)`` is ``data error: FILE:LINE: <what>; <fix>`` (one line).

    ``path`` is the file, ``line`` the 1-based line (JSONL) or row (Parquet), None for whole-file problems.
    """

    def __init__(self, path: str, line: Optional[int], what: str, fix: str):
        self.path = str(path)
        self.line = line
        self.what = what
        self.fix = fix
        super().__init__(f"data error: {self.where}: {what}; {fix}")

    @property
    def where(self) -> str:
        """``FILE:LINE``, or ``FILE`` for a whole-file problem."""
        return f"{self.path}:{self.line}" if self.line is not None else self.path


@dataclass
class BadRows:
    """What the bad-row policy did to one file: ``total`` rows seen (blank lines not counted), ``skipped``
    malformed rows, ``first`` the first of them (a :class:`DataError`, None when none was skipped)."""

    path: str
    total: int = 0
    skipped: int = 0
    first: Optional[DataError] = None


@dataclass
class EvalItems:
    """The items of one named eval set (``eval.sets``) and the task that scores them (the ``task`` reward)."""

    name: str
    items: list[dict[str, Any]]
    task: Task


@dataclass
class Datasets:
    """Train and eval items of a run and the task that scores them; ``eval`` is the default eval set (the one
    ``data`` defines), ``eval_sets`` the named ones of ``eval.sets``, in their order."""

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    task: Task
    eval_sets: list[EvalItems] = field(default_factory=list)


def _keys(row: dict) -> str:
    return ", ".join(sorted(map(str, row))[:8]) or "none"


def _row_problem(row: Any, prompt_key: str, label_key: str = "label", require_label: bool = False) -> Problem:
    """(what, fix) if ``row`` is not a usable data row, else None."""
    if not isinstance(row, dict):
        return f"row is a JSON {type(row).__name__}, not an object", "each line must be one JSON object"
    if prompt_key not in row:
        return (f"no prompt key {prompt_key!r} (keys: {_keys(row)})",
                "add it, or set data.prompt_key to the column holding the prompt")
    p = row[prompt_key]
    if isinstance(p, str):
        if not p.strip():
            return f"prompt {prompt_key!r} is empty", "give every row a prompt"
    elif not (isinstance(p, list) and p and all(isinstance(m, dict) and "role" in m and "content" in m
                                                  for m in p)):
        return (f"prompt {prompt_key!r} is a {type(p).__name__}, not a string or a list of "
                "{'role', 'content'} messages", "fix the row or pick another data.prompt_key")
    if require_label:
        if label_key not in row:
            return (f"no label key {label_key!r} (keys: {_keys(row)})",
                    "add it, set data.label_key to the column holding the answer, or score with a reward "
                    "plug-in that needs no label")
        lab = row[label_key]
        if lab is None or isinstance(lab, bool) or not isinstance(lab, (str, int, float)):
            kind = "null" if lab is None else f"a {type(lab).__name__}"
            return (f"label {label_key!r} is {kind}, not a string or number",
                    "give every row the answer its reward checks against")
    return None


def _to_item(row: dict[str, Any], prompt_key: str, label_key: str) -> dict[str, Any]:
    meta = dict(row["metadata"]) if isinstance(row.get("metadata"), dict) else {}
    meta.update({k: v for k, v in row.items() if k not in (prompt_key, label_key, "metadata")})
    return {"prompt": row[prompt_key], "label": row.get(label_key), "metadata": meta}


def _collect(path: str, rows: Iterable[tuple[int, Any, Problem]], prompt_key: str, label_key: str,
             on_bad_row: str, require_label: bool = False, row_check: Optional[RowCheck] = None,
             stats: Optional[BadRows] = None) -> list[dict[str, Any]]:
    """Items from ``(line, row, parse_problem)`` triples, applying the bad-row policy."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    stats = stats if stats is not None else BadRows(path)
    items = []
    for line, row, problem in rows:
        stats.total += 1
        problem = problem or _row_problem(row, prompt_key, label_key, require_label)
        item = None
        if problem is None:
            item = _to_item(row, prompt_key, label_key)
            problem = row_check(item) if row_check is not None else None
        if problem is None:
            items.append(item)
            continue
        if on_bad_row == "error":
            raise DataError(path, line, problem[0], problem[1] + " (or set data.on_bad_row: skip)")
        stats.skipped += 1
        if stats.first is None:
            stats.first = DataError(path, line, problem[0], problem[1])
        log.warning("data: %s:%d: %s; row skipped", path, line, problem[0])
    if stats.skipped:
        log.warning("data: %s: skipped %d malformed of %d rows", path, stats.skipped, stats.total)
    if not items:
        what = (f"no usable rows ({stats.total} rows, {stats.skipped} malformed)" if stats.total
                else "no rows (the file is empty or only blank lines)")
        raise DataError(path, None, what, "check the file and data.prompt_key")
    return items


def _check_file(path: str) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        raise DataError(path, None, "is a directory, not a data file",
                        "point data.source / data.eval_source at a .jsonl or .parquet file")
    if not os.path.isfile(path):
        raise DataError(path, None, "file not found", "check data.source / data.eval_source")
    return path


def _unreadable(path: str, e: OSError) -> DataError:
    return DataError(path, None, f"cannot read the file ({e.strerror or type(e).__name__})",
                     "make it readable by the user that runs hpcrl (chmod / chgrp), or copy it")


def _jsonl_rows(path: str) -> Iterator[tuple[int, Any, Problem]]:
    """``(line, parsed row or None, problem)`` of each non-blank line, read in binary with a line-length cap
    (a huge line is never held whole in memory beyond :data:`MAX_ROW_BYTES`)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise _unreadable(path, e) from None
    with f:
        n = 0
        while True:
            try:
                raw = f.readline(MAX_ROW_BYTES + 1)
            except OSError as e:  # e.g. EISDIR races, EIO
                raise _unreadable(path, e) from None
            if not raw:
                return
            n += 1
            if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # the UTF-8 byte-order mark (Windows editors write one): utf-8-sig
            if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
                size = len(raw)
                while True:  # the rest of the line, in chunks
                    chunk = f.readline(1 << 20)
                    size += len(chunk)
                    if not chunk or chunk.endswith(b"\n"):
                        break
                yield n, None, (f"line is {size / 2**20:.1f} MiB, over the {MAX_ROW_BYTES // 2**20} MiB "
                                "limit of a row", "shorten the row (a prompt that long cannot fit a context)")
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield n, None, (f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})",
                                "save the file as UTF-8")
                continue
            if not text.strip():
                continue
            try:
                yield n, json.loads(text), None
            except json.JSONDecodeError as e:
                hint = ("each line must be one JSON object (this looks like a JSON array over several lines: "
                        "write one object per line)" if n == 1 and text.strip() == "["
                        else "each line must be one JSON object")
                yield n, None, (f"bad JSON ({e.msg} at column {e.colno})", hint)


def read_jsonl(path: str, prompt_key: str = "prompt", label_key: str = "label", on_bad_row: str = "error",
               require_label: bool = False, row_check: Optional[RowCheck] = None,
               stats: Optional[BadRows] = None) -> list[dict[str, Any]]:
    """Items of a JSON-lines file (one object per line; line numbers are 1-based).

    ``require_label``: a row without a string/number label is malformed. ``row_check``: an extra check of
    each item. ``stats``: filled with the counts of the bad-row policy. Raises :class:`DataError` for a
    missing, unreadable or directory path, a file without usable rows, or (``on_bad_row="error"``) the first
    malformed row.
    """
    path = _check_file(path)
    return _collect(path, _jsonl_rows(path), prompt_key, label_key, on_bad_row, require_label, row_check,
                    stats)


def read_parquet(path: str, prompt_key: str = "prompt", label_key: str = "label", on_bad_row: str = "error",
                 require_label: bool = False, row_check: Optional[RowCheck] = None,
                 stats: Optional[BadRows] = None) -> list[dict[str, Any]]:
    """Items of a Parquet file (pyarrow); ``line`` in errors is the 1-based row number.

    Arguments as :func:`read_jsonl`. Raises :class:`DataError` for a missing, unreadable or non-Parquet file,
    a file whose data pages cannot be decoded (truncated or corrupt; naming the first row of the batch), a
    file without usable rows, or (``on_bad_row="error"``) the first malformed row.
    """
    import pyarrow.parquet as pq

    path = _check_file(path)
    try:
        pf = pq.ParquetFile(path)
    except OSError as e:
        if isinstance(e, PermissionError) or getattr(e, "errno", None):
            raise _unreadable(path, e) from None
        raise DataError(path, None, f"not a readable Parquet file ({type(e).__name__}: {str(e)[:120]})",
                        "check the file (truncated? not Parquet?)") from None
    except Exception as e:  # pyarrow raises ArrowInvalid for non-Parquet files
        raise DataError(path, None, f"not a readable Parquet file ({type(e).__name__}: {str(e)[:120]})",
                        "check the file (truncated? not Parquet?)") from None

    def rows() -> Iterator[tuple[int, Any, Problem]]:
        n = 0
        batches = pf.iter_batches(batch_size=4096)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as e:  # corrupt or truncated data pages behind an intact footer
                raise DataError(path, n + 1, f"cannot decode the rows from here on ({type(e).__name__}: "
                                f"{str(e)[:120]})", "rewrite the file (truncated or corrupt)") from None
            for row in batch.to_pylist():
                n += 1
                yield n, row, None

    return _collect(path, rows(), prompt_key, label_key, on_bad_row, require_label, row_check, stats)


def is_file_source(source: str) -> bool:
    """True if ``source`` names a data file (a ``.jsonl`` / ``.parquet`` suffix, or an existing file)."""
    return source.endswith(FILE_SUFFIXES) or os.path.isfile(source)


def read_items(path: str, prompt_key: str = "prompt", label_key: str = "label", on_bad_row: str = "error",
               require_label: bool = False, row_check: Optional[RowCheck] = None,
               stats: Optional[BadRows] = None) -> list[dict[str, Any]]:
    """:func:`read_parquet` for ``*.parquet``, else :func:`read_jsonl`."""
    reader = read_parquet if str(path).endswith(".parquet") else read_jsonl
    return reader(path, prompt_key, label_key, on_bad_row, require_label, row_check, stats)


def prompt_key_of(item: dict[str, Any]) -> str:
    """A hashable identity of an item's prompt (the string itself, or canonical JSON of a message list)."""
    p = item["prompt"]
    return p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str)


class PromptLengthCheck:
    """A :data:`RowCheck`: an item whose prompt has at least ``context`` tokens is malformed (the engines refuse
    a prompt that leaves no room for one new token; SGLang's and hpcrl's engines both answer HTTP 400).

    Tokenises as the rollout does (:func:`hpcrl.rollout.rollout.tokenize_prompt`: the chat template for message
    lists when ``apply_chat_template``). ``context`` is the model's ``max_position_embeddings`` (tokens).
    """

    def __init__(self, model_path: str | os.PathLike, apply_chat_template: bool = False):
        from transformers import AutoTokenizer

        cfg = json.loads((Path(model_path) / "config.json").read_text())
        self.context = int(cfg.get("max_position_embeddings") or 0)
        self.model_path = str(model_path)
        self.apply_chat_template = apply_chat_template
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))

    def __call__(self, item: dict[str, Any]) -> Problem:
        if self.context <= 0:
            return None
        p = item["prompt"]
        if isinstance(p, str) and len(p.encode()) + 8 < self.context:
            return None  # tokens <= bytes + special tokens (byte-level BPE, byte-fallback and char tokenizers)
        n = self.num_tokens(item)
        if n is None or n < self.context:
            return None
        return (f"prompt is {n} tokens, not less than the model's context of {self.context} tokens "
                f"(max_position_embeddings of {self.model_path})", "shorten the prompt")


    def num_tokens(self, item: dict[str, Any]) -> Optional[int]:
        """Tokens of the item's prompt as the rollout tokenises it (:func:`hpcrl.data.chat.prompt_token_ids`,
        with the item's tools); None for a message list without ``apply_chat_template`` (refused anyway)."""
        p = item["prompt"]
        if isinstance(p, list) and not self.apply_chat_template:
            return None
        return len(prompt_token_ids(self.tokenizer, p, self.apply_chat_template,
                                    (item.get("metadata") or {}).get(TOOLS_KEY)))


def check_microbatch_budget(cfg: "Config", items: Sequence[dict[str, Any]], check: PromptLengthCheck) -> None:
    """With ``train.max_tokens_per_microbatch``: the longest prompt of ``items`` plus ``rollout.max_new_tokens``
    fits the budget (a sample longer than a micro-batch could not be trained). Prompts whose bytes + 8 +
    ``max_new_tokens`` fit are not tokenised (tokens <= bytes + special tokens). Raises ConfigError naming the
    budget and the longest sample."""
    from hpcrl.config.train import check_microbatch_budget as require_budget

    budget, m = cfg.train.max_tokens_per_microbatch, cfg.rollout.max_new_tokens
    if budget is None:
        return
    longest = 0
    for item in items:
        p = item["prompt"]
        if isinstance(p, str) and len(p.encode()) + 8 + m <= budget:
            continue
        longest = max(longest, check.num_tokens(item) or 0)
    if longest:
        require_budget(cfg, longest + m, "the longest prompt")


def _prompt_length_check(cfg: "Config") -> Optional[PromptLengthCheck]:
    """The prompt-length check against ``model.path`` when that folder exists (None otherwise: the model is
    created at the start of the run, and the check runs there). Raises ConfigError when
    ``data.apply_chat_template`` is on and the tokenizer has no chat template."""
    path = Path(cfg.model.path) if cfg.model.path else None
    if path is None or not (path / "config.json").is_file():
        return None
    try:
        check = PromptLengthCheck(path, cfg.data.apply_chat_template)
    except Exception as e:  # noqa: BLE001 - no tokenizer: the engine start reports that on its own
        log.warning("data: prompt lengths not checked: cannot load the tokenizer of %s (%s: %s)", path,
                    type(e).__name__, e)
        return None
    if cfg.data.apply_chat_template and not getattr(check.tokenizer, "chat_template", None):
        raise ConfigError("data.apply_chat_template", True, f"the tokenizer of {path} has no chat template",
                          "add one (chat_template in tokenizer_config.json, or chat_template.jinja) or set "
                          "data.apply_chat_template=false")
    return check


class ChatRowCheck:
    """A :data:`RowCheck` for prompts rendered through the chat template (:mod:`hpcrl.data.chat`): a
    message-list prompt needs ``data.apply_chat_template``; the row's ``data.system_key`` column (a string)
    becomes the first message; its ``data.tools_key`` column (a list of JSON tool schemas, or that list as a
    JSON string, as Parquet often stores it) goes to ``metadata["tools"]``. Normalises the item in place."""

    def __init__(self, apply_chat_template: bool, system_key: Optional[str], tools_key: Optional[str]):
        self.apply_chat_template, self.system_key, self.tools_key = apply_chat_template, system_key, tools_key

    def __call__(self, item: dict[str, Any]) -> Problem:
        meta = item.setdefault("metadata", {})
        if isinstance(item["prompt"], list) and not self.apply_chat_template:
            return ("prompt is a chat message list, but data.apply_chat_template is false",
                    "set data.apply_chat_template=true (the model's tokenizer needs a chat template)")
        if self.system_key and meta.get(self.system_key) is not None:
            system = meta[self.system_key]
            if not isinstance(system, str):
                return (f"system prompt {self.system_key!r} is a {type(system).__name__}, not a string",
                        "fix the row or data.system_key")
            item["prompt"] = chat_messages(item["prompt"], system)
        if self.tools_key and meta.get(self.tools_key) is not None:
            tools = meta[self.tools_key]
            if isinstance(tools, str):
                try:
                    tools = json.loads(tools)
                except ValueError:
                    tools = None
            if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                return (f"tools {self.tools_key!r} is not a list of tool schemas (JSON objects)",
                        "fix the row or data.tools_key")
            meta[TOOLS_KEY] = tools
        return None


def _both(first: RowCheck, second: Optional[RowCheck]) -> RowCheck:
    return first if second is None else (lambda item: first(item) or second(item))


def _read_file(cfg: "Config", path: str, row_check: Optional[RowCheck] = None,
               stats: Optional[BadRows] = None) -> list[dict[str, Any]]:
    """The one reader of a run's data files (training, eval sets and :func:`check_data`): the chat rows'
    check (:class:`ChatRowCheck`), then ``row_check``."""
    d = cfg.data
    chat = ChatRowCheck(d.apply_chat_template, d.system_key, d.tools_key)
    return read_items(path, d.prompt_key, d.label_key, d.on_bad_row,
                      require_label=cfg.rollout.reward_function in LABEL_REWARDS,
                      row_check=_both(chat, row_check), stats=stats)


def load_datasets(cfg: "Config", stats: Optional[dict[str, BadRows]] = None) -> Datasets:
    """Train and eval items for a run, and the task that scores them.

    Generator source (``addition``, ``repeat``, ``reasoning_gym:<name>``; ``data.task_kwargs`` go to
    :func:`make_task`): train = ``task.generate(data.num_train, seed=run.seed)``, eval = ``task.generate(data.num_eval,
    seed=run.seed + 1)`` minus every item whose prompt also occurs in train (so eval may hold slightly fewer
    than ``num_eval`` items; for small problem spaces such as 1-digit addition, many fewer).

    File source (``.jsonl`` / ``.parquet``): every row is read (``data.num_train`` is ignored) and checked
    (see the module doc; prompt lengths against ``model.path`` when it exists). Eval is read from
    ``data.eval_source`` when given (a file, or a generator name drawn with ``run.seed + 1``); otherwise the
    last ``data.num_eval`` rows are held out of train (in file order, no shuffle). The task is a
    :class:`VerifierTask` using ``rollout.reward_function`` when that is ``exact_match`` / ``math_answer`` /
    ``countdown``, else ``exact_match``.

    Named eval sets (``eval.sets``, :func:`_load_eval_set`) are read the same way: a file's rows (its first
    ``num``), or a generator's ``num`` (default ``data.num_eval``) items drawn with ``run.seed + 1``, minus
    those whose prompt is in train.

    ``stats``: filled with ``{"data.source" | "data.eval_source" | "eval.sets[i].source": BadRows}`` for each
    file read.

    Raises :class:`DataError` for file problems (also when held-out eval would leave no train rows) and
    ValueError for unknown tasks.
    """
    d = cfg.data
    seed = cfg.run.seed
    stats = stats if stats is not None else {}
    check = (_prompt_length_check(cfg) if any(is_file_source(s) for s in _sources(cfg).values()) else None)
    if is_file_source(d.source):
        stats["data.source"] = BadRows(d.source)
        rows = _read_file(cfg, d.source, check, stats["data.source"])
        task: Task = _file_task(cfg, d.source)
        if d.eval_source:
            train, eval_items = rows, _load_eval(cfg, task, check, stats)
        else:
            if d.num_eval >= len(rows):
                raise DataError(d.source, None,
                                f"{len(rows)} rows cannot hold out data.num_eval={d.num_eval} eval rows",
                                "lower data.num_eval or set data.eval_source")
            cut = len(rows) - d.num_eval
            train, eval_items = rows[:cut], rows[cut:]
        _check_budget(cfg, train, check)
        return Datasets(train=train, eval=eval_items, task=task,
                        eval_sets=[_load_eval_set(cfg, i, task, train, check, stats)
                                   for i in range(len(cfg.eval.sets))])

    task = make_task(d.source, **d.task_kwargs)
    train = task.generate(d.num_train, seed=seed)
    if d.eval_source:
        eval_items = _load_eval(cfg, task, check, stats)
    else:
        eval_items = task.generate(d.num_eval, seed=seed + 1)
    seen = {prompt_key_of(it) for it in train}
    eval_items = [it for it in eval_items if prompt_key_of(it) not in seen]
    _check_budget(cfg, train, check)
    return Datasets(train=train, eval=eval_items, task=task,
                    eval_sets=[_load_eval_set(cfg, i, task, train, check, stats)
                               for i in range(len(cfg.eval.sets))])


def _file_task(cfg: "Config", path: str) -> VerifierTask:
    """The task that scores a data file's rows: ``rollout.reward_function``'s verifier when it is one
    (``exact_match`` / ``math_answer`` / ``countdown``), else ``exact_match``."""
    rf = cfg.rollout.reward_function
    verifier = rf if rf in names.VERIFIER_REWARDS else "exact_match"
    return VerifierTask(verifier=verifier, name=os.path.basename(path))


def _sources(cfg: "Config") -> dict[str, str]:
    """Every data source of a run by its field: ``data.source``, ``data.eval_source``,
    ``eval.sets[i].source``."""
    out = {"data.source": cfg.data.source}
    if cfg.data.eval_source:
        out["data.eval_source"] = cfg.data.eval_source
    out.update({f"eval.sets[{i}].source": s.source for i, s in enumerate(cfg.eval.sets)})
    return out


def _load_eval_set(cfg: "Config", i: int, task: Task, train: Sequence[dict[str, Any]],
                   check: Optional[RowCheck], stats: dict[str, BadRows]) -> EvalItems:
    """The items of ``eval.sets[i]``: a file's rows (its first ``num``) scored like the training file (a
    :class:`VerifierTask`), or ``num`` (default ``data.num_eval``) items of a generator drawn with
    ``run.seed + 1`` (``task_kwargs``, default ``data.task_kwargs`` for ``data.source`` itself), minus train's
    prompts."""
    s, d = cfg.eval.sets[i], cfg.data
    if is_file_source(s.source):
        bad = stats.setdefault(f"eval.sets[{i}].source", BadRows(s.source))
        items = _read_file(cfg, s.source, check, bad)
        if s.num is not None:
            items = items[:s.num]
        return EvalItems(s.name, items, task if isinstance(task, VerifierTask) else _file_task(cfg, s.source))
    kwargs = s.task_kwargs or (d.task_kwargs if s.source == d.source else {})
    other = task if s.source == task.name and kwargs == d.task_kwargs else make_task(s.source, **kwargs)
    seen = {prompt_key_of(it) for it in train}
    items = other.generate(s.num or d.num_eval, seed=cfg.run.seed + 1)
    return EvalItems(s.name, [it for it in items if prompt_key_of(it) not in seen], other)


def _check_budget(cfg: "Config", train: Sequence[dict[str, Any]], check: Optional[PromptLengthCheck]) -> None:
    """:func:`check_microbatch_budget` of the train items when a token budget is set and the model's tokenizer
    is there (otherwise it runs at the start of the run, where the model exists)."""
    if cfg.train.max_tokens_per_microbatch is None:
        return
    check = check or _prompt_length_check(cfg)
    if check is not None:
        check_microbatch_budget(cfg, train, check)


def _load_eval(cfg: "Config", task: Task, check: Optional[RowCheck] = None,
               stats: Optional[dict[str, BadRows]] = None) -> list[dict[str, Any]]:
    """Eval items from ``data.eval_source``: a file, or a generator drawn with ``run.seed + 1``."""
    d = cfg.data
    assert d.eval_source is not None
    if is_file_source(d.eval_source):
        bad = BadRows(d.eval_source)
        if stats is not None:
            stats["data.eval_source"] = bad
        return _read_file(cfg, d.eval_source, check, bad)
    other = task if d.eval_source == task.name else make_task(d.eval_source, **d.task_kwargs)
    return other.generate(d.num_eval, seed=cfg.run.seed + 1)


# ------------------------------------------------------------------------------------------------------------
# On the login node: the same reader, its errors as one config-error line
# ------------------------------------------------------------------------------------------------------------

class DataConfigError(ConfigError):
    """A bad data file found on the login node: ``str()`` is ``config error: <field>: FILE:LINE: <what>; <fix>``
    (the field's value is the file, named once in ``FILE``)."""

    def __str__(self) -> str:
        return f"config error: {self.field}: {self.problem}; {self.fix}".replace("\n", " ")


_checked: dict[tuple, list[str]] = {}
"""Notes of data checks that passed, by what they depend on (a sweep's points share their data)."""


def _data_error_as_config_error(field_name: str, e: DataError) -> "ConfigError":
    return DataConfigError(field_name, e.path, f"{e.where}: {e.what}", e.fix)


def _file_stamp(path: str) -> tuple:
    try:
        st = os.stat(path)
        return (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    except OSError:
        return (path,)


def check_data(cfg: "Config", report: Optional[Callable[[str], None]] = None) -> list[str]:
    """Read every row of the run's data files (``data.source``, ``data.eval_source``,
    ``eval.sets[i].source``) with the reader the run uses at start (:func:`load_datasets`), on the login node
    before anything is queued; and, when the run trains with the SFT recipe, its demonstrations' rows
    (:func:`check_demonstrations`).

    Returns notes, each also passed to ``report`` (default: printed on stderr): with
    ``data.on_bad_row: skip``, ``data.source: skipped 3 bad rows of FILE (first: FILE:2: ...)``; when
    ``model.path`` does not exist yet, that prompt lengths are checked at the start of the run. Generator
    sources are not read (nothing to check). A check that passed is remembered for the same files, keys and
    model (a sweep's points).

    Raises:
        ConfigError: ``config error: data.source: FILE:LINE: <problem>; <fix>`` (or ``data.eval_source``;
            ``FILE`` alone for whole-file problems) at the first bad row with ``data.on_bad_row: error``.
    """
    check_demonstrations(cfg)  # the SFT recipe's rows (sft.data or data): a label or assistant turns each
    d = cfg.data
    files = [(f, p) for f, p in _sources(cfg).items() if p and is_file_source(p)]
    if not files:
        return []
    model = Path(cfg.model.path) if cfg.model.path else None
    key = (tuple((f, _file_stamp(p)) for f, p in files), d.prompt_key, d.label_key, d.on_bad_row,
           d.num_eval, d.apply_chat_template, d.system_key, d.tools_key, cfg.rollout.reward_function,
           tuple((s.num, s.source) for s in cfg.eval.sets),
           _file_stamp(str(model / "config.json")) if model else None)
    if key in _checked:
        return list(_checked[key])
    stats: dict[str, BadRows] = {}
    try:
        load_datasets(cfg, stats)
    except DataError as e:
        field_name = next((f for f, p in files if os.fspath(p) == e.path), "data.source")
        raise _data_error_as_config_error(field_name, e) from None
    notes = []
    for field_name, bad in stats.items():
        if bad.skipped:
            notes.append(f"{field_name}: skipped {bad.skipped} bad rows of {bad.path} ({bad.total} rows; "
                         f"first: {bad.first.where}: {bad.first.what})")
    if model is None or not (model / "config.json").is_file():
        notes.append(f"{files[0][0]}: prompt lengths not checked against the model's context: {model} does "
                     "not exist yet (they are checked at the start of the run)")
    _checked[key] = notes
    say = report or (lambda line: print(line, file=sys.stderr, flush=True))
    for line in notes:
        say(line)
    return list(notes)


def check_demonstrations(cfg: Any) -> None:
    """On the login node, when the run trains with the ``sft`` recipe (``run.mode: sft``, a warm start, an
    SFT teacher): every train row of the demonstrations' data file (``sft.data.source``, else
    ``data.source``) is read with the run's reader and must be a demonstration
    (:func:`hpcrl.data.demonstrations.demonstration_problem`). Generated sources (``addition``,
    reasoning-gym) carry labels and are not read. Raises ConfigError naming the field, the file and the row."""
    from hpcrl.config.run import uses_sft
    from hpcrl.data.demonstrations import demonstration_problem

    if not uses_sft(cfg):
        return
    d = cfg.sft.data if cfg.sft.data is not None else cfg.data
    field = "sft.data.source" if cfg.sft.data is not None else "data.source"
    if not is_file_source(d.source):
        return
    try:
        items = read_items(d.source, d.prompt_key, d.label_key, d.on_bad_row)
    except DataError as e:
        raise _data_error_as_config_error(field, e) from None
    for i, it in enumerate(items):
        problem = demonstration_problem(it)
        if problem is not None:
            raise ConfigError(field, d.source, f"train row {i + 1} {problem} (the SFT recipe trains on it)",
                              f"give every row a {d.label_key!r} column, or assistant turns in its "
                              f"{d.prompt_key!r} messages")
