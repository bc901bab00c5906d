"""The calculator tool of the example: exact integer and decimal arithmetic on a parsed expression (never eval).

``calculator("90 * 63 - 77")`` -> ``"5593"``. Numbers, ``+ - * /``, parentheses and unary minus; anything else
(names, calls, powers) is refused with an error string the agent hands back to the model.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

TOOL = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
"""The OpenAI tool schema the agent sends."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculator(expression: str) -> str:
    """The value of ``expression`` as text (an integer when exact, else up to 6 decimals), or ``error: ...``."""
    try:
        value = _eval(ast.parse(str(expression).replace("×", "*").replace("÷", "/"), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as e:
        return f"error: {e}"
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")
