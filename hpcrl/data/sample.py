"""The unit of rollout data: one prompt's one response, with everything training needs (slime's ``Sample``)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union


class Status(str, enum.Enum):
    """Where a sample is in its life (slime ``Sample.Status``)."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One prompt + one response of a group.

    ``tokens`` is prompt followed by response, ``[prompt_len + response_length]`` token ids. ``loss_mask`` and
    ``rollout_log_probs`` cover only the response: ``[response_length]`` each (mask 1 for trainable tokens,
    0 for tool/observation tokens that were appended rather than generated; their log-prob is 0.0).
    ``weight_versions`` lists the engine weight version seen for each generate call of this sample.
    """

    group_index: int = 0
    """Index of the group (prompt) in the data source; siblings share it."""
    index: int = 0
    """Globally unique sample id (used to check every group is trained exactly once)."""
    rollout_id: int = -1
    """Rollout step this sample was generated for."""
    prompt: Union[str, list[dict[str, str]]] = ""
    label: Any = None
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    rollout_token_versions: list[int] = field(default_factory=list)
    """The engine weight version that sampled each response token, ``[response_length]`` aligned with
    ``rollout_log_probs`` (-1: not a sampled token, e.g. tool output, or unknown); filled by the generate
    function from the client's ``meta_info["output_token_weight_versions"]`` (else the call's
    ``weight_version``). Staleness (``rollout.max_staleness``) is counted from these."""
    teacher_log_probs: list[float] = field(default_factory=list)
    """On-policy distillation (``algorithm.opd``): the teachers' log-probs of the response tokens,
    ``[response_length]`` (mean over the teachers that scored it); empty without OPD."""
    rollout_routed_experts: str = ""
    """Rollout routing replay (``algorithm.routing_replay``): the engine's ``meta_info.routed_experts`` of the
    last generate call, base64 of int32 ``[len(tokens) - 1, moe_layers, top_k]`` (SGLang's shape; every token
    the engine was fed); empty otherwise."""
    reward: Optional[Union[float, dict[str, float]]] = None
    status: Status = Status.PENDING
    weight_versions: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    segments: list[int] = field(default_factory=list)
    """Token lengths of the independent sequences ``tokens`` is made of, summing to ``len(tokens)``; empty
    (the usual case) means one sequence. An agent episode whose history was rewritten has one segment per
    prefix chain (:mod:`hpcrl.agent.runner`): the trainer attends within each segment only, with positions
    restarting at 0, so every chain is trained exactly as the engine saw it. The prompt lies in the first
    segment; the later ones are part of the response (their policy tokens in ``loss_mask``)."""

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens in ``tokens``."""
        return len(self.tokens) - self.response_length

    def scalar_reward(self) -> float:
        """The reward as one number: ``reward`` itself, or its ``"reward"`` entry when the reward function
        returned a dict (the other entries are logged, not trained on). The one definition the filters, the
        loop's metrics and the advantages use.

        Raises TypeError for a dict reward without a ``"reward"`` key; ValueError when the sample has not been
        scored yet (``reward`` is None).
        """
        r = self.reward
        if isinstance(r, dict):
            if "reward" not in r:
                raise TypeError(f"sample {self.index} has a dict reward without a 'reward' key: {sorted(r)}")
            r = r["reward"]
        if r is None:
            raise ValueError(f"sample {self.index} has no reward yet; score the group before filtering or "
                             "training on it")
        return float(r)

    def segment_bounds(self) -> list[tuple[int, int]]:
        """``(start, end)`` token offsets of each segment in ``tokens`` (one span when ``segments`` is empty).
        Raises ValueError when ``segments`` does not add up to ``len(tokens)``, has an empty segment, or its
        first segment does not hold the whole prompt and a response token."""
        if not self.segments:
            return [(0, len(self.tokens))]
        if sum(self.segments) != len(self.tokens) or min(self.segments) < 1:
            raise ValueError(f"sample {self.index}: segments {self.segments} do not split its "
                             f"{len(self.tokens)} tokens into non-empty sequences")
        if len(self.segments) > 1 and self.segments[0] <= self.prompt_length:
            raise ValueError(f"sample {self.index}: its first segment ({self.segments[0]} tokens) must hold the "
                             f"prompt ({self.prompt_length} tokens) and at least one response token")
        ends = list(itertools.accumulate(self.segments))
        return list(zip([0] + ends[:-1], ends))

    @property
    def weight_version(self) -> Optional[str]:
        """The engine weight version of the last generate call, or None before any."""
        return self.weight_versions[-1] if self.weight_versions else None

    def append_response_tokens(self, tokens: list[int], log_probs: Optional[list[float]] = None,
                               trainable: bool = True, text: str = "",
                               versions: Optional[list[int]] = None) -> None:
        """Append response tokens, keeping ``loss_mask``, ``rollout_log_probs`` and ``rollout_token_versions``
        aligned. ``versions``: the weight version that sampled each token (None: -1, unknown).

        Non-trainable tokens (tool output in multi-turn rollouts) get mask 0, log-prob 0.0 and version -1.
        Raises ValueError if ``log_probs`` or ``versions`` is given with a different length than ``tokens``.
        """
        if log_probs is None:
            log_probs = [0.0] * len(tokens)
        if len(log_probs) != len(tokens):
            raise ValueError(f"log_probs has {len(log_probs)} entries for {len(tokens)} tokens")
        if versions is not None and len(versions) != len(tokens):
            raise ValueError(f"versions has {len(versions)} entries for {len(tokens)} tokens")
        self.rollout_token_versions.extend([int(v) for v in versions] if trainable and versions is not None
                                           else [-1] * len(tokens))
        self.tokens.extend(tokens)
        self.response_length += len(tokens)
        self.loss_mask.extend([1 if trainable else 0] * len(tokens))
        self.rollout_log_probs.extend(log_probs if trainable else [0.0] * len(tokens))
        self.response += text

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (status as its string value)."""
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        """Inverse of :meth:`to_dict`; unknown keys raise TypeError."""
        d = dict(d)
        d["status"] = Status(d.get("status", Status.PENDING.value))
        return cls(**d)
