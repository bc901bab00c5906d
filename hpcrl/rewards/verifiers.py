"""Rule-based verifiers: pure functions ``(response, label, ...) -> float`` in [0, 1].

- :func:`exact_match`: stripped string equality (the CI addition task).
- :func:`math_answer`: final-answer extraction (``\\boxed{}``, ``#### x``, ``answer is x``, last number) and a
  numeric comparison with tolerance (slime ``--rm-type math`` / ``deepscaler`` in spirit; GSM8K's ``####``).
- :func:`countdown`: the Countdown game check by reasoning-gym's own scorer (TinyZero's Countdown task).
- :func:`extract_answer_text`: the answer part of a response: the last ``<answer>...</answer>`` block
  (reasoning-gym's convention) or else the first non-empty line (the raw few-shot ``Q:/A:`` format).

Nothing here imports torch, aiohttp or reasoning-gym at module import time.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Callable, Optional, Sequence

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:\s*/\s*\d+)?")
_NUMBER_FIND = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")


def extract_answer_text(response: str) -> str:
    """The answer part of ``response``: the last ``<answer>...</answer>`` content if there is one, else the
    first non-empty line, stripped (``" -4\\nQ: next"`` -> ``"-4"``). Returns ``""`` for an empty response."""
    tags = _ANSWER_TAG.findall(response)
    if tags:
        return tags[-1].strip()
    for line in response.splitlines():
        if line.strip():
            return line.strip()
    return ""


def exact_match(response: str, label: Any) -> float:
    """1.0 if ``response.strip() == str(label).strip()`` else 0.0 (a None label never matches)."""
    if label is None:
        return 0.0
    return 1.0 if response.strip() == str(label).strip() else 0.0


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_math_answer(text: str) -> Optional[str]:
    """Final answer of a math solution, or None if there is none.

    Tried in order: the last ``\\boxed{...}``, the last ``#### x`` (GSM8K), the last ``answer is x`` /
    ``answer: x``, the last number in the text.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    answer_is = _ANSWER_IS.findall(text)
    if answer_is and answer_is[-1].strip():
        return answer_is[-1].strip().rstrip(".").strip()
    numbers = _NUMBER_FIND.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: Any) -> Optional[float]:
    """``text`` as a number, or None: ints, decimals, ``1,234``, ``3/4``, ``\\frac{3}{4}``, ``$5``, ``50%``
    (read as 50, the way GSM8K labels percentages); surrounding ``$``, ``**`` and a trailing period are
    ignored. A short phrase with exactly one number in it (``x = 5``, ``5 apples``) gives that number."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    if not isinstance(text, str):
        return None
    s = text.strip().replace("\\!", "").replace("\\,", "").replace("\\$", "").replace("\\%", "%")
    s = s.strip("*$ ").rstrip(".").strip()
    s = _FRAC.sub(lambda m: f"({m.group(1)})/({m.group(2)})", s)
    s = s.replace("(", "").replace(")", "").replace(" ", "")
    s = s.rstrip("%")
    m = _NUMBER.fullmatch(s)
    if not m or not any(c.isdigit() for c in s):
        found = _NUMBER_FIND.findall(text)
        if len(found) != 1:
            return None
        s = found[0]
    try:
        s = s.replace(",", "")
        value = float(Fraction(s)) if "/" in s else float(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _normalise(text: str) -> str:
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    for junk in ("\\left", "\\right", "\\!", "\\,", "$", " "):
        s = s.replace(junk, "")
    return s.rstrip(".").lower()


def math_answer(response: str, label: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> float:
    """1.0 if the final answer of ``response`` equals ``label``, else 0.0.

    The response's answer comes from :func:`extract_math_answer`. ``label`` may be a number, a bare answer
    string, or a full solution (then its own final answer is extracted, e.g. GSM8K ``... #### 72``). When
    both parse as numbers (:func:`parse_number`) they are compared with ``math.isclose(rel_tol, abs_tol)``;
    otherwise as normalised strings (spaces, ``$``, ``\\left/\\right``, ``\\text{}`` and case ignored).
    """
    if label is None:
        return 0.0
    got = extract_math_answer(response)
    if got is None:
        return 0.0
    want: Any = label
    if isinstance(label, str) and parse_number(label) is None:
        extracted = extract_math_answer(label) if ("\\boxed" in label or "####" in label) else None
        want = extracted if extracted is not None else label
    a, b = parse_number(got), parse_number(want)
    if a is not None and b is not None:
        return 1.0 if math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0
    return 1.0 if _normalise(str(got)) == _normalise(str(want)) else 0.0


def countdown(response: str, numbers: Sequence[int], target: float,
              scorer: Optional[Callable[[Optional[str], dict[str, Any]], float]] = None) -> float:
    """Countdown: does the expression in ``response`` use exactly ``numbers`` and evaluate to ``target``?

    The expression is :func:`extract_answer_text` of the response (an ``<answer>`` block or the first line; a
    trailing ``= target`` is dropped). Scored by reasoning-gym's ``CountdownDataset.score_answer`` (or
    ``scorer`` if given): 1.0 correct, 0.05 valid numbers but wrong value or wrong numbers used, 0.01
    unparsable / empty (reasoning-gym's shaping).
    """
    if scorer is None:
        from reasoning_gym.factory import get_score_answer_fn

        scorer = get_score_answer_fn("countdown")
    expr = extract_answer_text(response)
    if "=" in expr:
        expr = expr.split("=", 1)[0].strip()
    entry = {"answer": None, "metadata": {"numbers": list(numbers), "target": target}}
    return float(scorer(expr, entry))
