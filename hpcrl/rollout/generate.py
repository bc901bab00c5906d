"""slime's default per-sample generate: one ``/generate`` call fills a :class:`~hpcrl.data.sample.Sample`.

A custom generate function (multi-turn, tool calls) has the same signature,
``async def generate(client, sample, sampling_params) -> Sample``, and plugs in by dotted path
(``rollout.generate_function``, resolved with :func:`hpcrl.plugin_loader.load_function`); pass the callable to
:func:`get_generate_function`.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

from hpcrl.data.sample import Sample, Status
from hpcrl.rollout.client import RolloutClient, RolloutError
from hpcrl.rollout.token_versions import version_number

GenerateFn = Callable[[RolloutClient, Sample, dict], Awaitable[Sample]]
"""``async (client, sample, sampling_params) -> Sample``."""

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default ``max_new_tokens`` (used when sampling_params does not set it)."""

_FINISH_STATUS = {"length": Status.TRUNCATED, "stop": Status.COMPLETED, "abort": Status.ABORTED}


def finish_status(meta_info: dict) -> Status:
    """Map SGLang's ``meta_info.finish_reason`` to a sample status.

    ``length`` -> TRUNCATED, ``stop`` -> COMPLETED, ``abort`` -> ABORTED; missing or unknown -> FAILED.
    """
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return _FINISH_STATUS.get(kind, Status.FAILED)


async def generate(client: RolloutClient, sample: Sample, sampling_params: dict) -> Sample:
    """Generate (or continue) the response of ``sample`` with one ``/generate`` call, in place; returns it.

    Sends ``sample.tokens`` (the prompt, plus the response so far for a partial sample from an aborted
    rollout) with ``return_logprob=True``; for a partial sample ``max_new_tokens`` is reduced by
    ``response_length`` (a sample that already used its budget is marked TRUNCATED without a request). The
    output tokens and their log-probs (from ``meta_info.output_token_logprobs``, as slime does) are appended
    as trainable tokens, the text to ``response``; ``status`` follows ``finish_reason``
    (:func:`finish_status`); the engine's ``meta_info.weight_version`` is appended to ``weight_versions``;
    each token's version goes to ``rollout_token_versions``
    (:func:`~hpcrl.rollout.token_versions.version_number`: a non-integer name is -1): the client's
    ``meta_info.output_token_weight_versions`` when it could label them (the engine's ``weight_versions``
    spans, or streamed chunks: exact under in-flight updates), else the answer's one ``weight_version`` for
    every token (exact only if no update landed during the call: under ``retract``/``in_place`` pauses such an
    answer names the newer version for all its tokens).
    ``rollout_log_probs`` get the engine's sampled log-probs: the distribution each token was drawn from
    (after an ``in_place`` update, new weights over the old KV cache). An abort/failure message goes to
    ``metadata["finish_message"]``; ``meta_info.routed_experts`` (when the client asks for it,
    :attr:`RolloutClient.generate_fields`) replaces ``rollout_routed_experts``.

    Raises RolloutError if the request fails for good, the response lacks the log-probs of its tokens, or its
    per-token versions are not one per token.
    """
    params = dict(sampling_params)
    if sample.response_length > 0:
        limit = params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
        if limit is not None:  # None: SGLang's "up to the context length", nothing to reduce
            budget = int(limit) - sample.response_length
            if budget <= 0:
                sample.status = Status.TRUNCATED
                return sample
            params["max_new_tokens"] = budget
    if not sample.tokens:
        raise ValueError(f"sample {sample.index} has no prompt tokens; tokenize the prompt first")

    out = await client.generate(sample.tokens, params, return_logprob=True)
    meta: dict[str, Any] = out.get("meta_info") or {}
    triples = meta.get("output_token_logprobs")
    output_ids = out.get("output_ids")
    if triples is None:
        if output_ids:
            raise RolloutError(f"/generate answered {len(output_ids)} tokens without output_token_logprobs "
                               "(return_logprob is needed for training)", client.router_url or "engines")
        triples = []
    tokens = [int(t[1]) for t in triples]
    log_probs = [float(t[0]) for t in triples]
    version = meta.get("weight_version")
    labels = meta.get("output_token_weight_versions")
    if labels is None:  # a non-streamed answer: nothing better known than the version it names
        labels = [version] * len(tokens)
    elif len(labels) != len(tokens):
        raise RolloutError(f"/generate answered {len(labels)} output_token_weight_versions for {len(tokens)} "
                           "tokens", client.router_url or "engines")
    sample.append_response_tokens(tokens, log_probs, trainable=True, text=out.get("text") or "",
                                  versions=[version_number(v) for v in labels])
    sample.status = finish_status(meta)
    reason = meta.get("finish_reason")
    sample.metadata.pop("finish_message", None)  # from an earlier, aborted call of a continued sample
    if isinstance(reason, dict) and reason.get("message"):
        sample.metadata["finish_message"] = str(reason["message"])
    if version is not None:
        sample.weight_versions.append(str(version))
    routed = meta.get("routed_experts")
    if routed is not None:  # asked for by the client (routing replay): covers the whole sample so far
        sample.rollout_routed_experts = str(routed)
    elif getattr(client, "generate_fields", {}).get("return_routed_experts") and tokens:
        raise RolloutError("/generate answered without meta_info.routed_experts although the request asked for "
                           "them (a router that drops the field, or SGLang started without "
                           "--enable-return-routed-experts)", client.router_url or "engines")
    return sample


def get_generate_function(custom: Optional[GenerateFn] = None) -> GenerateFn:
    """The custom generate function if one is given (loaded from its dotted path), else :func:`generate`.

    Raises TypeError if ``custom`` is not callable.
    """
    if custom is None:
        return generate
    if not callable(custom):
        raise TypeError(f"generate function must be callable, got {type(custom).__name__}")
    return custom
