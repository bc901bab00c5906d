"""The one forward of a micro-batch of the actor and of SFT: its response log-probs (and entropy) over the
layout it was built in (packed, a logits window of the padded rows, or every position), as a
:class:`~hpcrl.train.model.StagedLoss` that megatron-core's schedule can run over pipeline stages."""

from __future__ import annotations

from typing import Any

import torch

from hpcrl.train.logprobs import logits_window_start, staged_response_log_probs, windowed_response_log_probs
from hpcrl.train.packing import packed_response_log_probs


def staged_log_probs(ddp_model: torch.nn.Module, model: torch.nn.Module, mb: Any, temperature: float,
                     with_entropy: bool, vocab_size: int):
    """The one forward of the actor and of SFT (``mb`` a :class:`hpcrl.train.actor.MicroBatch`), as a
    :class:`~hpcrl.train.model.StagedLoss`: the model's output on this pipeline stage and what makes the
    micro-batch's response log-probs (and entropy) ``[b, R]`` from the last stage's logits. Over its pack when
    it has one (:func:`~hpcrl.train.packing.packed_response_log_probs`), over the logits window of its
    responses when the padded layout allows one (:func:`~hpcrl.train.logprobs.windowed_response_log_probs`),
    else over every position (:func:`~hpcrl.train.logprobs.staged_response_log_probs`)."""
    if mb.pack is not None:
        return packed_response_log_probs(ddp_model, mb.pack, mb.response_lengths, temperature, with_entropy,
                                         vocab_size)
    start = logits_window_start(model, mb)
    if start > 0:
        return windowed_response_log_probs(ddp_model, model.output_layer, mb, start, temperature, with_entropy,
                                           vocab_size)
    return staged_response_log_probs(ddp_model, mb.tokens, mb.total_lengths, mb.response_lengths,
                                     temperature=temperature, with_entropy=with_entropy, vocab_size=vocab_size)

