"""Tool calls in generated text (Hermes / Qwen style) as OpenAI ``tool_calls``.

A model trained on the Hermes format answers a tool call as ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (one block per call; Qwen2.5 and SmolLM2 tool-use data use it). :func:`parse_tool_calls` splits a
reply into its plain text and OpenAI's ``tool_calls`` objects; a block that is not valid JSON with a ``name``
stays text (the agent then sees what the model wrote).
"""

from __future__ import annotations

import json
import re
import uuid

TOOL_PARSERS = ("hermes",)
"""Supported ``rollout.agent.tool_parser`` values."""

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str, list[dict]]:
    """``(content, tool_calls)`` of a generated reply: ``content`` is ``text`` without the parsed blocks
    (stripped), ``tool_calls`` OpenAI's ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
    with ``arguments`` a JSON string. Raises ValueError for an unknown ``parser``."""
    if parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {parser!r}; use one of {TOOL_PARSERS}")
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    kept.append(text[pos:])
    return "".join(kept).strip(), calls
