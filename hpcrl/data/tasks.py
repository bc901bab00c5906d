"""Built-in task generators with their own scorers.

A task turns a seed into prompts with labels, and scores a response against a label. ``make_task`` resolves a
data-source name (``addition``, ``reasoning_gym:<task>``) to a task.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol


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


def make_task(name: str, **kwargs: Any) -> Task:
    """Resolve a data-source name to a task. Raises ValueError naming the unknown task and the known ones."""
    if name == "addition":
        return AdditionTask(**kwargs)
    raise ValueError(f"unknown task {name!r}; known: addition, reasoning_gym:<task>")
