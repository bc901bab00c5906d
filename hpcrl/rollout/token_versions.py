"""Per-token weight versions of a generated response: which engine weights sampled each output token.

SGLang's ``/generate`` answer names one ``meta_info.weight_version``: the engine's version when the answer (or
a streamed chunk) was built. Under an in-flight weight update (``/pause_generation`` in mode ``retract`` or
``in_place``, then the update, then ``/continue_generation``) one request's tokens come from two versions, and
a single answer cannot say where the switch is: it names the newer one. A *streamed* answer can: its SSE
chunks are cumulative (each holds every output token so far) and each names the version when it was built, so
the tokens a chunk adds are labelled with that chunk's version (:class:`ChunkLabeller`, used by
:class:`hpcrl.rollout.client.RolloutClient` when it streams).

Exactness. On hpcrl's CPU engine a streamed row gets one chunk per sampled token, built in the scheduler
thread right after the token is sampled, and weight updates run in that thread between steps; with generation
paused over the update (as :class:`hpcrl.weights.sync.WeightSyncer` always does) the version is changed before
any token of the new weights is sampled, so every chunk's one new token carries the version that sampled it.
On SGLang, chunks go out every ``stream_interval`` tokens, so one chunk may hold tokens from both sides of an
update: such a chunk (more than one new token and a version other than the previous chunk's) is labelled with
the *older* version, so staleness is over-, never under-estimated. (SGLang attaches the version after the
scheduler, in its tokenizer manager; a token sampled just before a pause may come back with the new version -
unverified here.)

The label of a token never changes the loss's behaviour log-prob: that is the engine's sampled log-prob of the
token (``output_token_logprobs``), whatever version produced it (see ``docs/algorithms.md``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

UNKNOWN_VERSION = -1
"""The integer label of a token whose weight version is unknown (or not an integer)."""


def version_number(version: Any) -> int:
    """The integer weight version of an engine version name: ``"12"`` -> 12, ``7`` -> 7; None, ``"default"``
    (an engine's version before its first sync) or any other non-integer name -> :data:`UNKNOWN_VERSION`."""
    if isinstance(version, bool) or version is None:
        return UNKNOWN_VERSION
    if isinstance(version, int):
        return version
    text = str(version).strip()
    digits = text[1:] if text[:1] in "+-" else text
    return int(text) if digits.isdigit() else UNKNOWN_VERSION


class ChunkLabeller:
    """Labels the output tokens of one streamed ``/generate`` attempt from its cumulative chunks.

    ``previous_version``: the version of the chunk before the first one (a continued response's last known
    version), for the straddle rule. After each :meth:`add`, :attr:`labels` holds one version (as the engine
    names it) per output token of the last chunk.
    """

    def __init__(self, previous_version: Optional[Any] = None):
        self.ids: list[int] = []
        self.labels: list[Any] = []
        self.previous_version = previous_version

    def add(self, ids: Sequence[int], version: Any) -> None:
        """Take the next chunk: ``ids`` its (cumulative) output token ids, ``version`` its
        ``meta_info.weight_version``.

        Tokens the previous chunk had at the same positions keep their labels; the new ones get ``version``,
        or the previous chunk's version when the chunk adds more than one token and the version changed in
        between (the chunk may straddle an update). A chunk that does not extend the previous one (a router
        that restarted the request elsewhere) keeps only the labels of the common prefix.
        """
        ids = list(ids)
        common = 0
        for mine, theirs in zip(self.ids, ids):
            if mine != theirs:
                break
            common += 1
        new = len(ids) - common
        label = version
        if new > 1 and self.previous_version is not None and version != self.previous_version:
            label = self.previous_version
        self.labels = self.labels[:common] + [label] * new
        self.ids = ids
        if version is not None:
            self.previous_version = version
