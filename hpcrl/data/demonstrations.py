"""Supervised demonstrations: data items as token sequences with the loss on the assistant's tokens only, and
the seeded, resumable order SFT takes them in (:class:`DemonstrationSource`).

A demonstration is a :class:`~hpcrl.data.sample.Sample` (so the trainer's micro-batching, packing and
log-prob code serve SFT as they serve RL): ``tokens`` the whole sequence, the "response" from the first
trained token on, ``loss_mask`` 1 on the tokens the model learns to produce. Two row shapes
(:func:`demonstration`):

- **prompt + response**: a row with a ``label`` (``data.label_key``): the prompt's tokens as the rollout sends
  them to the engines (:func:`hpcrl.data.chat.prompt_token_ids`: a string, or a message list through the chat
  template with the generation prompt, ``data.apply_chat_template``; tools from ``data.tools_key``), then
  the label's tokens (no special tokens) and eos, which are trained;
- **conversation**: a row whose prompt (``data.prompt_key``) is a message list with assistant turns and no
  label: the whole conversation rendered by the chat template (tools too); every assistant turn's tokens are
  trained (its content, tool calls and end-of-turn marker), every other token (system, user, tool results,
  the generation prompts) is not. A turn's tokens are those the template adds when the conversation grows by
  that turn: ``render(messages[:k+1])`` minus ``render(messages[:k], add_generation_prompt=True)``, which
  must be prefixes of the whole rendering (a template that rewrites earlier turns, e.g. one that drops old
  reasoning, is refused with :class:`DemonstrationError`).

Sources: veRL's ``MultiTurnSFTDataset`` (the same incremental rendering), TRL's ``assistant_only_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hpcrl.data.chat import TOOLS_KEY, prompt_token_ids
from hpcrl.data.sample import Sample


class DemonstrationError(ValueError):
    """A data item that is no demonstration (no label and no assistant turn, a template that is not
    incremental, nothing to train)."""


def _render(tokenizer: Any, messages: Sequence[dict], tools: Optional[list], generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(list(messages), tools=tools or None,
                                              add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=False))


def conversation_tokens(tokenizer: Any, messages: Sequence[dict], tools: Optional[list] = None
                        ) -> tuple[list[int], list[int]]:
    """``(tokens, mask)`` of a conversation: the chat template's rendering of ``messages`` (with ``tools``)
    and 1 on the tokens of each assistant turn (module doc). Raises DemonstrationError when the template is
    not incremental or there is no assistant turn."""
    full = _render(tokenizer, messages, tools, False)
    mask = [0] * len(full)
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:k], tools, True) if k else []
        upto = _render(tokenizer, messages[: k + 1], tools, False)
        if upto[: len(before)] != before or full[: len(upto)] != upto:
            raise DemonstrationError(f"the chat template renders assistant turn {k} so that the conversation "
                                     "up to it is not a prefix of the whole (a template that rewrites earlier "
                                     "turns): its tokens cannot be told apart")
        for i in range(len(before), len(upto)):
            mask[i] = 1
    if not any(mask):
        raise DemonstrationError("the conversation has no assistant turn to train on")
    return full, mask


def demonstration(tokenizer: Any, item: dict[str, Any], apply_chat_template: bool, index: int = 0) -> Sample:
    """The :class:`~hpcrl.data.sample.Sample` of one data item (``{"prompt", "label", "metadata"}``): a
    prompt + response or a conversation (module doc). Raises DemonstrationError (no label and no assistant
    turn, a non-incremental template, no eos token) and what the tokenizer raises."""
    prompt, label = item["prompt"], item.get("label")
    tools = (item.get("metadata") or {}).get(TOOLS_KEY)
    if label is None and isinstance(prompt, list) and any(m.get("role") == "assistant" for m in prompt):
        tokens, mask = conversation_tokens(tokenizer, prompt, tools)
        first = mask.index(1)
        return Sample(index=index, tokens=tokens, response_length=len(tokens) - first, loss_mask=mask[first:])
    if label is None:
        raise DemonstrationError("no label to train on (and the prompt is no conversation with assistant turns)")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DemonstrationError("the tokenizer has no eos token; a demonstration ends with eos")
    p = prompt_token_ids(tokenizer, prompt, apply_chat_template, tools)
    a = list(tokenizer(str(label), add_special_tokens=False)["input_ids"]) + [eos]
    return Sample(index=index, tokens=p + a, response_length=len(a), loss_mask=[1] * len(a))


@dataclass
class DemonstrationSource:
    """The order SFT takes demonstrations in: a fresh seeded permutation of all of them each epoch, batches
    of ``batch_size`` that may span two epochs (the HF loop's order before it); a stateful object of the
    checkpoint (``state.json`` ``demonstrations``: epoch and offset), so a resumed run takes the same next
    batch."""

    samples: list[Sample]
    batch_size: int
    seed: int
    epoch: int = 0
    offset: int = 0
    """Demonstrations of the current epoch's permutation taken so far."""

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("no demonstrations")
        self._order = None

    def _permutation(self, epoch: int) -> list[int]:
        import torch

        g = torch.Generator().manual_seed(self.seed + 1_000_003 * epoch)
        return torch.randperm(len(self.samples), generator=g).tolist()

    def next_batch(self) -> list[Sample]:
        """The next ``batch_size`` demonstrations (their ``index`` is their position in the data)."""
        out: list[Sample] = []
        while len(out) < self.batch_size:
            if self._order is None:
                self._order = self._permutation(self.epoch)
            take = self._order[self.offset: self.offset + self.batch_size - len(out)]
            out += [self.samples[i] for i in take]
            self.offset += len(take)
            if self.offset >= len(self.samples):
                self.epoch, self.offset, self._order = self.epoch + 1, 0, None
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num": len(self.samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("num", len(self.samples))) != len(self.samples):
            raise ValueError(f"the checkpoint was taken over {state['num']} demonstrations, the data now has "
                             f"{len(self.samples)}: the data changed since")
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), None


def demonstration_problem(item: dict[str, Any]) -> Optional[str]:
    """Why a data item (``{"prompt", "label"}``) is no demonstration, without a tokenizer (the login node's
    check; :func:`demonstration` refuses the same), or None when it is one."""
    prompt, label = item.get("prompt"), item.get("label")
    if label is not None:
        return None
    if isinstance(prompt, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in prompt):
        return None
    return "has no label and its prompt is no conversation with an assistant turn: nothing to train on"
