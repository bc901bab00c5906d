"""Write the SFT warm start's tool-use demonstrations (``demos.jsonl``) for the calculator agent.

Two kinds per problem, rendered with this folder's chat template exactly as the agent gateway renders the
agent's requests: (a) the question -> ``<tool_call>{"name": "calculator", "arguments": {"expression": E}}
</tool_call>`` and (b) the question, that call and the tool's result -> the result. Problems come from the same
reasoning-gym task as ``configs/smollm2-agent.yaml`` with another seed than the RL prompts.

    python examples/agent_calculator/make_demos.py [--n 64] [--out examples/agent_calculator/demos.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from calculator import TOOL, calculator  # noqa: E402

TASK_KWARGS = {"min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3, "operators": ["+", "-", "*"],
               "allow_parentheses": False, "allow_negation": False}
"""The task of ``configs/smollm2-agent.yaml`` (keep the two in step)."""
DEMO_SEED = 424242


def tool_call_text(expression: str) -> str:
    """What the policy is taught to write (and the gateway parses back into ``tool_calls``)."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "</tool_call>"


def demos(tokenizer, n: int) -> list[dict]:
    from hpcrl.data.tasks import make_task

    template = (HERE / "chat_template.jinja").read_text()
    task = make_task("reasoning_gym:basic_arithmetic", **TASK_KWARGS)
    rows = []
    for item in task.generate(n, seed=DEMO_SEED):
        expression = item["metadata"]["reasoning_gym"]["metadata"]["expression"]
        call = tool_call_text(expression)
        user = [{"role": "user", "content": item["prompt"]}]
        turn2 = user + [{"role": "assistant", "content": call},
                        {"role": "tool", "content": calculator(expression)}]
        for messages, label in ((user, call), (turn2, calculator(expression))):
            prompt = tokenizer.apply_chat_template(messages, tools=[TOOL], chat_template=template, tokenize=False,
                                                   add_generation_prompt=True)
            rows.append({"prompt": prompt, "label": label})
    return rows


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="problems (two demonstrations each)")
    ap.add_argument("--model", default=".cache/models/smollm2-135m-instruct", help="tokenizer folder")
    ap.add_argument("--out", default=str(HERE / "demos.jsonl"))
    args = ap.parse_args()
    rows = demos(AutoTokenizer.from_pretrained(args.model), args.n)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {len(rows)} demonstrations to {args.out}")


if __name__ == "__main__":
    main()
