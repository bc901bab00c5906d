#!/usr/bin/env python3
"""The same calculator episode as an external command (``rollout.agent.command``): no hpcrl import, only the
``openai`` package and this folder's calculator. hpcrl runs it once per episode with ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` set and the task item as JSON on standard input; what it prints is the final answer."""

import json
import os
import sys

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator import TOOL, calculator  # noqa: E402

item = json.loads(sys.stdin.read())
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"],
                       max_retries=0)
messages = [{"role": "user", "content": item["prompt"]}]
answer = ""
for _ in range(3):
    reply = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL],
                                           max_tokens=48).choices[0].message
    if not reply.tool_calls:
        answer = reply.content or ""
        break
    messages.append({"role": "assistant", "content": reply.content,
                     "tool_calls": [tc.model_dump() for tc in reply.tool_calls]})
    for tc in reply.tool_calls:
        try:
            result = calculator(json.loads(tc.function.arguments or "{}").get("expression", ""))
        except ValueError as e:
            result = f"error: {e}"
        messages.append({"role": "tool", "tool_call_id": tc.id, "content": result})
print(answer)
