"""The calculator agent (``rollout.agent.function: examples/agent_calculator/agent.py:solve``, or
``agent_calculator.agent.solve`` with ``PYTHONPATH=examples``) and its no-tool baseline
(``examples/agent_calculator/agent.py:answer_directly``): OpenAI clients of hpcrl's agent gateway, nothing
hpcrl-specific.

``solve`` offers the calculator tool, runs each tool call the policy makes and hands back the result, for at
most ``MAX_CALLS`` policy calls, and returns the last reply as the final answer (scored by the task).
"""

from __future__ import annotations

import json

import openai

from .calculator import TOOL, calculator

MAX_CALLS = 3
MAX_TOKENS = 48


async def solve(item, *, base_url, api_key, session_id):
    """One episode with the calculator tool; the final answer (the last reply's text)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["prompt"]}]
    reply = None
    for _ in range(MAX_CALLS):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=[TOOL],
                                                 max_tokens=MAX_TOKENS)
        reply = r.choices[0].message
        if not reply.tool_calls:
            return reply.content or ""
        messages.append({"role": "assistant", "content": reply.content,
                         "tool_calls": [tc.model_dump() for tc in reply.tool_calls]})
        for tc in reply.tool_calls:
            try:
                args = json.loads(tc.function.arguments or "{}")
                result = calculator(args.get("expression", "")) if tc.function.name == "calculator" else \
                    f"error: unknown tool {tc.function.name}"
            except (ValueError, AttributeError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
    return ""  # still calling tools after MAX_CALLS: no answer


async def answer_directly(item, *, base_url, api_key, session_id):
    """The no-tool baseline: one call with the same template and no tools; its reply is the answer."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    r = await client.chat.completions.create(model="policy", max_tokens=MAX_TOKENS,
                                             messages=[{"role": "user", "content": item["prompt"]}])
    return r.choices[0].message.content or ""
