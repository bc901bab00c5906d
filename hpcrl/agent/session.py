"""Agent sessions: every call an agent makes, recorded token-exact, and the trajectories built from them.

A session is one episode of one agent on one task item (one sample slot of a group). Each OpenAI call of the
agent through the gateway (:mod:`hpcrl.agent.gateway`) becomes a :class:`Call`: the text the template rendered,
the ids the engine saw (``prompt_ids``), the ids it produced (``output_ids``) with their log-probs, the text the
agent got back, the weight version, the finish reason. When a call's rendered prompt starts with an earlier
call's rendered prompt plus the reply text the agent got (the agent resent its history with that reply
unchanged), the earlier call's ids are reused as they are - special tokens the reply's text hides included -
and only the text after them is tokenised (without the end-of-turn text the template writes after the reply when
the policy already generated it as its stop token): the call *extends* the earlier one (``parent``). Generated
ids are never re-tokenised.

:func:`build_trajectories` turns the calls into samples: one per chain (a call that no later call extends,
with its ancestors). The sample's prompt is the chain's first prompt; its response is everything after,
with the tokens the policy generated trainable (mask 1, their rollout log-probs) and everything else (user
and tool messages, template glue between turns) masked out (mask 0). An agent that rewrites or drops its
history starts a new chain, so its episode gives several samples (documented in ``docs/agents.md``).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Optional


@dataclasses.dataclass
class Call:
    """One generation of a session: token ids ``[prompt]`` and ``[output]``, log-probs ``[output]``."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float]
    weight_version: Optional[str]
    finish_reason: Optional[str]
    """OpenAI's: ``stop``, ``length`` or ``abort``."""
    text: str
    """The reply text the agent got (special tokens skipped, a matched stop trimmed)."""
    rendered: str = ""
    """The prompt text this call's request rendered to (chat template output, or the completion prompt)."""
    end_text: str = ""
    """Text of the stop token the output ended on (the template writes it again after the reply), else ""."""
    tool_call_ids: list[str] = dataclasses.field(default_factory=list)
    """Ids of the OpenAI ``tool_calls`` parsed from this call's reply (the gateway renders a resent reply with
    these ids as the policy wrote it)."""
    parent: Optional[int] = None
    """Index of the call this one extends (its prompt starts with that call's prompt + output), or None."""

    @property
    def ids(self) -> list[int]:
        """``prompt_ids + output_ids``: the sequence after this call."""
        return self.prompt_ids + self.output_ids


@dataclasses.dataclass
class Session:
    """One agent episode: its key (``Authorization: Bearer``), its calls, an optional posted reward and the
    final answer. ``closed`` sessions refuse their key (401)."""

    session_id: str
    key: str
    item: dict[str, Any]
    calls: list[Call] = dataclasses.field(default_factory=list)
    reward: Optional[float] = None
    seed: Optional[int] = None
    """Sampling seed of the episode's first call (call ``k`` uses ``seed + k``); None: unseeded."""
    sampling: Optional[dict[str, Any]] = None
    """The episode's native sampling params (the rollout's, or an eval set's); None: the gateway's."""
    closed: bool = False

    @staticmethod
    def new(item: dict[str, Any], seed: Optional[int] = None,
            sampling: Optional[dict[str, Any]] = None) -> "Session":
        """A session with a fresh id and a fresh 256-bit key."""
        return Session(session_id=secrets.token_hex(8), key=secrets.token_urlsafe(32), item=dict(item),
                       seed=seed, sampling=dict(sampling) if sampling is not None else None)


def extend_prompt(calls: list[Call], rendered_text: str, encode) -> tuple[list[int], Optional[int]]:
    """The prompt ids of a new call whose request rendered to ``rendered_text``, reusing recorded ids.

    Finds the earlier call whose ``rendered + text`` is the longest prefix of ``rendered_text``; returns its ids
    followed by ``encode(rest)`` (``encode(str) -> ids``, no special tokens added; ``rest`` without a leading
    ``end_text`` of that call) and its index. With no such call the whole text is encoded: ``(ids, None)``.
    """
    best, best_len = None, -1
    for i, call in enumerate(calls):
        seen = call.rendered + call.text
        if len(seen) > best_len and rendered_text.startswith(seen):
            best, best_len = i, len(seen)
    if best is None:
        return list(encode(rendered_text)), None
    rest = rendered_text[best_len:]
    end = calls[best].end_text
    if end and rest.startswith(end):
        rest = rest[len(end):]
    return calls[best].ids + (list(encode(rest)) if rest else []), best


@dataclasses.dataclass
class Trajectory:
    """One chain of calls as a training sample: ``tokens`` ``[prompt + response]``, ``loss_mask`` and
    ``log_probs`` ``[response]`` (mask 1 and the rollout log-prob on generated tokens, 0 and 0.0 elsewhere)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    calls: list[int]
    weight_versions: list[str]
    finish_reason: Optional[str]
    text: str


def build_trajectories(calls: list[Call]) -> list[Trajectory]:
    """One :class:`Trajectory` per chain (a call no later call extends, with its ancestors), in the order of
    the chains' last calls. Raises ValueError when a call does not start with its parent's ids (a broken
    record)."""
    extended = {c.parent for c in calls if c.parent is not None}
    out = []
    for leaf in (i for i in range(len(calls)) if i not in extended):
        chain = [leaf]
        while calls[chain[-1]].parent is not None:
            chain.append(calls[chain[-1]].parent)
        chain.reverse()
        root = calls[chain[0]]
        seq = list(root.prompt_ids)
        response: list[int] = []
        mask: list[int] = []
        log_probs: list[float] = []
        for i in chain:
            call = calls[i]
            if call.prompt_ids[:len(seq)] != seq:
                raise ValueError(f"call {i} does not extend the ids of call {call.parent}")
            glue = call.prompt_ids[len(seq):]
            response += glue + call.output_ids
            mask += [0] * len(glue) + [1] * len(call.output_ids)
            log_probs += [0.0] * len(glue) + list(call.output_log_probs)
            seq = call.ids
        out.append(Trajectory(prompt_ids=list(root.prompt_ids), response_ids=response, loss_mask=mask,
                              log_probs=log_probs, calls=chain,
                              weight_versions=[calls[i].weight_version or "" for i in chain],
                              finish_reason=calls[leaf].finish_reason, text=calls[leaf].text))
    return out
