"""Prompts as the model sees them: a string, or a chat message list rendered with the tokenizer's chat
template.

One function, :func:`prompt_token_ids`, is used by the rollout
(:func:`hpcrl.rollout.rollout.tokenize_prompt`), by evaluation (which goes through the rollout) and by the
login-node prompt-length check (:class:`hpcrl.data.datasets.PromptLengthCheck`), so all three count the same
tokens.

With ``data.apply_chat_template`` a prompt is rendered with ``tokenizer.apply_chat_template(messages,
tools=..., add_generation_prompt=True)``: a message list as it is, a string as one user message (as SFT
renders a demonstration's prompt, :func:`hpcrl.data.demonstrations.demonstration`). Without it a prompt must be a string, tokenised with
the tokenizer's defaults (``add_special_tokens=True``). Tools (slime ``--tool-key``) ride in the item's
``metadata[TOOLS_KEY]``: a list of JSON tool schemas handed to the template.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

TOOLS_KEY = "tools"
"""Where an item's tool schemas live in its ``metadata`` (from the row's ``data.tools_key`` column)."""


def chat_messages(prompt: Any, system: Optional[str] = None) -> list[dict[str, Any]]:
    """``prompt`` as a message list: a string becomes one user message; ``system`` (when given and the list
    has no system message yet) is put first as a system message. Lists are copied, not changed."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system is not None and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def prompt_token_ids(tokenizer: Any, prompt: Any, apply_chat_template: bool,
                     tools: Optional[Sequence[dict]] = None) -> list[int]:
    """Token ids of ``prompt`` (``[prompt_tokens]``) as the engines are sent them.

    Raises:
        TypeError: a message-list prompt without ``apply_chat_template`` (the data check refuses such rows
            on the login node).
        ValueError: ``apply_chat_template`` with a tokenizer that has no chat template (transformers' error).
    """
    if apply_chat_template:
        ids = tokenizer.apply_chat_template(chat_messages(prompt), tools=list(tools) if tools else None,
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)  # transformers 5 returns a dict by default
        return list(ids)
    if not isinstance(prompt, str):
        raise TypeError("a chat message-list prompt needs data.apply_chat_template=true")
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
