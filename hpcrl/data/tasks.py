"""Built-in task generators with their own scorers.

A task turns a seed into prompts with labels, and scores a response against a label. ``make_task`` resolves a
data-source name (``addition``, ``repeat``, ``reasoning_gym:<task>``) to a task. Items are plain dicts
``{"prompt": str, "label": Any, "metadata": dict}`` (``metadata`` optional).

Reasoning-gym tasks (``reasoning_gym:<name>``, any of reasoning-gym's ~100 registered datasets, e.g.
``basic_arithmetic``, ``chain_sum``, ``countdown``, ``gsm_symbolic``): the prompt is the dataset's question,
the label its answer, and ``metadata["reasoning_gym"]`` holds the whole reasoning-gym entry (``question``,
``answer``, ``metadata``) so that the dataset's own ``score_answer`` can score a response later, in any
process. With ``few_shot: k`` the prompt is a raw few-shot block that small base models can continue::

    Q: Calculate 5 - 3 - 6.
    A: -4
    Q: Calculate 2 + 9.
    A: 11
    Q: <the question>
    A:

(``k`` solved examples, one ``Q: question`` and one ``A: answer`` line each, then the question and ``A:``
with no trailing space; questions are stripped, and those that span lines keep their inner newlines). Stop
generation at ``\\n``. With ``few_shot: 0`` (the default) the prompt is the bare question.

Seeds: reasoning-gym derives item ``i`` from ``seed + i``, so its seeds 5 and 6 share all but one item. hpcrl
therefore hashes its seed into reasoning-gym's (:func:`reasoning_gym_seed`), so train (``run.seed``) and eval
(``run.seed + 1``) are independent draws.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import random
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Optional, Protocol

from hpcrl import names
from hpcrl.rewards import verifiers


class Task(Protocol):
    """A prompt generator with a verifier."""

    name: str

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        """Return ``n`` items ``{"prompt": str, "label": Any}``, deterministic in ``seed``."""

    def score(self, response: str, item: dict[str, Any]) -> float:
        """Reward in [0, 1] for ``response`` to ``item`` (1.0 = correct)."""


@dataclass
class AdditionTask:
    """``a+b=`` -> ``c`` with ``digits``-digit operands: the CI task (prompt ``123+456=``, label ``579``).

    The response is the digits the model generated before its end-of-sequence token; exact match scores 1.0.
    """

    digits: int = 3
    name: str = "addition"

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        items = []
        for _ in range(n):
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            items.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
        return items

    def score(self, response: str, item: dict[str, Any]) -> float:
        return 1.0 if response.strip() == str(item["label"]) else 0.0


@dataclass
class RepeatTask:
    """``40213=`` -> ``40213``: repeat a digit string: the long-tailed CI task (issue #37's workload).

    The string's length is drawn log-uniformly from ``min_digits`` to ``max_digits`` (default 2..40, a 20x
    spread): half the answers have at most ~9 digits, one in ten has more than ~30, so a rollout step's
    slowest sample takes several times its median one, as with chain-of-thought responses - the workload where
    the one-step-off loop waits for its tail and the fully asynchronous loop does not. With the tiny model's
    character tokenizer the answer is one token per digit (plus eos); ``rollout.max_new_tokens`` must be at
    least ``max_digits + 1``. The response's stripped text must equal the label (exact match scores 1.0).

    Raises ValueError when ``min_digits < 1`` or ``max_digits < min_digits``.
    """

    min_digits: int = 2
    max_digits: int = 40
    name: str = "repeat"

    def __post_init__(self) -> None:
        if self.min_digits < 1 or self.max_digits < self.min_digits:
            raise ValueError(f"repeat task: need 1 <= min_digits <= max_digits, got min_digits="
                             f"{self.min_digits}, max_digits={self.max_digits}")

    def length(self, rng: random.Random) -> int:
        """One answer length (digits), log-uniform in [``min_digits``, ``max_digits``] (rounded)."""
        lo, hi = math.log(self.min_digits), math.log(self.max_digits + 1)
        return min(self.max_digits, int(math.exp(rng.uniform(lo, hi))))

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        items = []
        for _ in range(n):
            digits = "".join(rng.choice("0123456789") for _ in range(self.length(rng)))
            items.append({"prompt": f"{digits}=", "label": digits})
        return items

    def score(self, response: str, item: dict[str, Any]) -> float:
        return 1.0 if response.strip() == str(item["label"]) else 0.0


@dataclass
class VerifierTask:
    """Items from a file, scored by a rule-based verifier: ``exact_match``, ``math_answer`` or ``countdown``
    (:mod:`hpcrl.rewards.verifiers`).

    There is no generator: :meth:`generate` raises TypeError.
    """

    verifier: str = "exact_match"
    name: str = "file"

    def __post_init__(self) -> None:
        if self.verifier not in names.VERIFIER_REWARDS:
            raise ValueError(f"unknown verifier {self.verifier!r}; known: {', '.join(names.VERIFIER_REWARDS)}")

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        raise TypeError(f"task {self.name!r} reads its items from a file; it has no generator")

    def score(self, response: str, item: dict[str, Any]) -> float:
        """Verifier score of ``response`` against ``item["label"]`` (countdown: ``numbers``/``target`` in the
        label or the item's metadata)."""
        if self.verifier == "exact_match":
            return verifiers.exact_match(response, item.get("label"))
        if self.verifier == "math_answer":
            return verifiers.math_answer(response, item.get("label"))
        label, meta = item.get("label"), item.get("metadata") or {}
        src = label if isinstance(label, dict) and "numbers" in label else meta
        if "numbers" not in src or "target" not in src:
            raise ValueError("countdown verifier: the item has no 'numbers' and 'target' "
                             "in label or metadata")
        return verifiers.countdown(response, src["numbers"], src["target"])


_RG_SEED_SPACE = 2**31
"""reasoning-gym seeds its item ``i`` with ``seed + i`` (numpy needs < 2**32): hpcrl seeds are hashed into
[0, 2**31) so that ``seed`` and ``seed + 1`` give disjoint windows instead of overlapping ones."""


def reasoning_gym_seed(name: str, seed: int) -> int:
    """The reasoning-gym ``seed`` used for hpcrl ``seed`` of dataset ``name`` (sha256 of both, mod 2**31).

    reasoning-gym derives item ``i`` from ``seed + i``, so raw seeds 5 and 6 share all but one item; hashing
    makes train (``run.seed``) and eval (``run.seed + 1``) draws independent.
    """
    digest = hashlib.sha256(f"hpcrl:{name}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % _RG_SEED_SPACE


def jsonable(value: Any) -> Any:
    """``value`` with every part made plain JSON: dicts (string keys), lists (from tuples, sets sorted by
    repr, numpy arrays), str/int/float/bool/None; numpy scalars become Python numbers, anything else
    (``Fraction``, ``Decimal``, ...) its ``str``."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return [jsonable(v) for v in sorted(value, key=repr)]
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays and scalars
        return jsonable(value.tolist())
    return str(value)


def _few_shot_block(shots: list[dict[str, Any]]) -> str:
    return "".join(f"Q: {s['question'].strip()}\nA: {s['answer']}\n" for s in shots)


@dataclass
class ReasoningGymTask:
    """A reasoning-gym procedural dataset as an hpcrl task (``reasoning_gym:<name>``).

    ``config`` is passed to ``reasoning_gym.create_dataset(name, size=n, seed=..., **config)`` (the dataset's
    own config fields, e.g. ``min_numbers`` for countdown). ``few_shot`` solved examples (drawn once with
    ``few_shot_seed``, the same for every prompt) prefix each prompt in the raw ``Q:``/``A:`` format of the
    module docstring. ``binary`` (default True): score 1.0 for a full-credit answer and 0.0 otherwise;
    ``binary: false`` keeps reasoning-gym's partial credit (Countdown gives 0.01 for an unparsable and 0.05
    for a wrong expression, GSM-Symbolic 0.01 for a wrong number), which also counts towards mean reward.

    ``metadata["reasoning_gym"]`` is made JSON-safe (:func:`jsonable`: e.g. GSM-Symbolic's ``Fraction``
    variables become strings) so that samples survive the buffer and checkpoints unchanged; scoring always
    uses that JSON-safe entry, before and after a round trip.

    The response's answer is its last ``<answer>...</answer>`` block or else its first non-empty line
    (:func:`hpcrl.rewards.verifiers.extract_answer_text`).
    """

    dataset: str
    config: dict[str, Any] = field(default_factory=dict)
    few_shot: int = 0
    few_shot_seed: int = 987654321
    binary: bool = True
    name: str = ""
    _scorer: Any = field(default=None, init=False, repr=False, compare=False)
    _prefix: Optional[str] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if self.dataset not in DATASETS:
            close = difflib.get_close_matches(self.dataset, list(DATASETS), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ValueError(f"unknown task 'reasoning_gym:{self.dataset}'; {hint}known: {_known_tasks()}")
        if self.few_shot < 0:
            raise ValueError(f"few_shot must be >= 0, got {self.few_shot}")
        self.name = self.name or f"reasoning_gym:{self.dataset}"
        try:
            # The scorer instance also validates ``config`` now rather than at the first generate().
            self._scorer = reasoning_gym.create_dataset(self.dataset, size=max(1, self.few_shot),
                                                        seed=self.few_shot_seed, **self.config)
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(f"task reasoning_gym:{self.dataset}: "
                             f"bad dataset config {self.config}: {e}") from e
        self._prefix = _few_shot_block([self._scorer[i] for i in range(self.few_shot)])

    def generate(self, n: int, seed: int) -> list[dict[str, Any]]:
        """``n`` items drawn from the dataset with reasoning-gym seed :func:`reasoning_gym_seed` (``seed``).

        Each item: ``prompt`` (few-shot block + question, or the bare question), ``label`` (the answer string)
        and ``metadata = {"reasoning_gym": entry}``.
        """
        import reasoning_gym

        if n <= 0:
            return []
        ds = reasoning_gym.create_dataset(self.dataset, size=n, seed=reasoning_gym_seed(self.dataset, seed),
                                          **self.config)
        items = []
        for i in range(n):
            entry = ds[i]
            question = entry["question"]
            prompt = f"{self._prefix}Q: {question.strip()}\nA:" if self.few_shot else question
            rg_entry = jsonable({"question": entry["question"], "answer": entry["answer"],
                                 "metadata": entry["metadata"]})
            items.append({"prompt": prompt, "label": rg_entry["answer"],
                          "metadata": {"reasoning_gym": rg_entry}})
        return items

    def score(self, response: str, item: dict[str, Any]) -> float:
        """reasoning-gym ``score_answer(answer, entry)`` of the answer extracted from ``response``; the entry
        is ``item["metadata"]["reasoning_gym"]`` (or built from ``item["label"]`` when absent). Raises
        ValueError when neither exists."""
        entry = (item.get("metadata") or {}).get("reasoning_gym")
        if entry is None:
            if item.get("label") is None:
                raise ValueError(f"{self.name}: item has neither metadata['reasoning_gym'] "
                                 "nor a label to score")
            entry = {"question": item.get("prompt"), "answer": item["label"], "metadata": {}}
        answer = verifiers.extract_answer_text(response)
        value = float(self._scorer.score_answer(answer, entry))
        if self.binary:
            return 1.0 if value >= 1.0 - 1e-9 else 0.0
        return value


BUILTIN_TASKS = MappingProxyType({"addition": AdditionTask, "repeat": RepeatTask})
"""Built-in task generators by ``data.source`` name (read-only), besides ``reasoning_gym:<name>``."""
assert tuple(BUILTIN_TASKS) == names.TASKS, \
    "hpcrl.names.TASKS must list BUILTIN_TASKS (config validates by it)"
_EXAMPLES = ("basic_arithmetic", "chain_sum", "countdown", "gsm_symbolic")


def _known_tasks() -> str:
    return (", ".join(BUILTIN_TASKS) + ", reasoning_gym:<name> for any reasoning-gym dataset (e.g. "
            + ", ".join(f"reasoning_gym:{n}" for n in _EXAMPLES) + ")")


def make_task(name: str, **kwargs: Any) -> Task:
    """Resolve a data-source name to a task. Raises ValueError naming the unknown task and the known ones.

    ``addition`` takes ``digits``; ``repeat`` takes ``min_digits`` and ``max_digits``.
    ``reasoning_gym:<name>`` takes ``few_shot``, ``few_shot_seed`` and ``binary`` (see
    :class:`ReasoningGymTask`); every other keyword is the reasoning-gym dataset's config.
    """
    if name in BUILTIN_TASKS:
        try:
            return BUILTIN_TASKS[name](**kwargs)
        except TypeError as e:
            raise ValueError(f"task {name!r}: bad task_kwargs {kwargs}: {e}") from e
    if name.startswith("reasoning_gym:"):
        own = {k: kwargs.pop(k) for k in ("few_shot", "few_shot_seed", "binary") if k in kwargs}
        return ReasoningGymTask(dataset=name.partition(":")[2].strip(), config=kwargs, **own)
    raise ValueError(f"unknown task {name!r}; known: {_known_tasks()}")
