"""Per-token weight versions of a generated response: which engine weights sampled each output token.

Under an in-flight weight update (``/pause_generation`` in mode ``retract`` or ``in_place``, the update,
``/continue_generation``) one request's tokens come from two versions, while an answer's
``meta_info.weight_version`` names one (the newer). Sources of per-token labels, best first:

1. A finished answer's ``meta_info.weight_versions`` spans (SGLang 0.5.23, ``srt/utils/weight_versions.py``,
   and hpcrl's CPU engine): the engine's scheduler records, when the version changes, how many output tokens
   each live request had, so the spans are exact, streamed or not (:func:`labels_from_spans`).
2. Streamed chunks (:class:`ChunkLabeller`): SSE chunks are cumulative and each names the version when it was
   built, so the tokens a chunk adds get that chunk's version. Used for tokens kept from an engine that died
   mid-response (it sent no finished answer) and for engines without spans. On the CPU engine each chunk
   brings one token, built in the scheduler thread right after it was sampled, and the version changes in
   the same scheduler command as the weights: exact. On SGLang chunks go out every ``stream_interval`` tokens
   and name the tokenizer manager's version (changed when the update call returns), so one chunk may hold
   tokens from both sides of an update: a chunk with more than one new token and a version other than the
   previous chunk's is labelled with the *older* version (staleness over-, never under-estimated).
3. Else (:func:`hpcrl.rollout.generate.generate`) a non-streamed answer's one version for all its tokens,
   wrong for a response an update landed in: fully asynchronous rollouts stream, or use an engine with spans.

The label of a token never changes the loss's behaviour log-prob: that is the engine's sampled log-prob of the
token (``output_token_logprobs``), whatever version produced it (see ``docs/algorithms.md``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

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


def labels_from_spans(spans: Any, num_output: int, lag: int = 0) -> Optional[list]:
    """One version per output token from a finished answer's ``meta_info.weight_versions`` (SGLang 0.5.23 and
    the CPU engine: ``[{"version", "start", "end"}, ...]``, recorded by the engine's scheduler at each update
    while the request lived). None when absent or not a contiguous cover of the ``num_output`` tokens (older
    SGLang, or a router that dropped the field).

    ``lag``: tokens at the start of each later span that the previous version sampled (:func:`span_lag`):
    they are labelled with it. 0 where the spans are exact (the CPU engine; SGLang but for ``in_place``
    updates under its overlap scheduler)."""
    if not isinstance(spans, list) or not spans:
        return None
    labels: list = []
    for span in spans:
        try:
            version, start, end = span["version"], int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            return None
        if start != len(labels) or end < start:
            return None
        late = min(lag, end - start) if labels else 0
        labels += [labels[-1] if late else version] * late + [version] * (end - start - late)
    return labels if len(labels) == num_output else None


def span_lag(sglang_engines: bool, sglang_args: Mapping[str, Any], pause_mode: str) -> int:
    """How many tokens each ``weight_versions`` span of the run's engines starts too early
    (:func:`labels_from_spans`' ``lag``): 1 for real SGLang paused ``in_place`` with its overlap scheduler on
    (SGLang's default, ``disable_overlap_schedule`` unset), else 0.

    Why (measured on SGLang 0.5.23, tests/sglang): the overlap scheduler has the next decode step launched
    before the last one's token is appended, so when an ``in_place`` update records each running request's
    output length, one token sampled by the old weights is still in flight and is counted in the new
    version's span (its log-prob is the old policy's to 2e-7). ``retract`` and ``abort`` spans were exact.
    Labelling that token with the older version keeps hpcrl's rule: staleness over-, never under-estimated."""
    if not sglang_engines or pause_mode != "in_place":
        return 0
    return 0 if sglang_args.get("disable_overlap_schedule") else 1


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
