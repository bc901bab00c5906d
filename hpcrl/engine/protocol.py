"""SGLang's ``/generate`` protocol: request parsing and validation, response and meta_info building.

The JSON fields and their meaning follow SGLang's ``GenerateReqInput`` and ``SamplingParams`` (see
``/work/shared/reference/cpu-stack.md`` section 3). Unknown keys are ignored, as in SGLang. Parameters that
would change the sampled distribution but that this engine does not implement (penalties, logit bias,
grammars) are rejected with a clear error instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

TOP_K_OFF = 1 << 30
"""SGLang's ``top_k`` default, meaning no top-k filtering (as does -1)."""

# Unsupported sampling parameters and the value that means "off" (accepted).
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "stop_regex": None,
}


class RequestError(ValueError):
    """A bad request (HTTP 400 with ``{"error": {"message": ...}}``)."""


def _num(d: dict, key: str, default, kind):
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"sampling_params.{key} must be a number, got {v!r}")
    if kind is int:
        if float(v) != int(v):
            raise RequestError(f"sampling_params.{key} must be an integer, got {v!r}")
        return int(v)
    return float(v)


@dataclasses.dataclass
class SamplingParams:
    """One input's sampling parameters (SGLang's names and defaults).

    ``max_new_tokens`` counts tokens. ``temperature`` 0 means greedy. ``top_k`` -1 or ``>= 2**30`` is off.
    ``stop``: strings that end generation when the decoded output contains one; ``stop_token_ids``: extra stop
    ids (eos ids always stop unless ``ignore_eos``). ``n``: samples per input. ``sampling_seed``: seeds this
    sequence's own generator (the same seed gives the same tokens, as SGLang's seeded sampling does, also for
    the n copies).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @classmethod
    def from_json(cls, d: dict | None) -> "SamplingParams":
        """Validate a ``sampling_params`` dict. Raises :class:`RequestError` on bad or unsupported values."""
        d = d or {}
        if not isinstance(d, dict):
            raise RequestError("sampling_params must be an object or a list of objects")
        for key, off in _UNSUPPORTED_DEFAULTS.items():
            if d.get(key, off) not in (off, None):
                raise RequestError(f"sampling_params.{key}={d[key]!r} is not supported by the hpcrl CPU "
                                   "engine")
        stop = d.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("sampling_params.stop must be a non-empty string or a list of them")
        stop_ids = d.get("stop_token_ids") or []
        if isinstance(stop_ids, int) and not isinstance(stop_ids, bool):
            stop_ids = [stop_ids]
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in stop_ids):
            raise RequestError("sampling_params.stop_token_ids must be a list of integers")
        seed = d.get("sampling_seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError("sampling_params.sampling_seed must be an integer")
        p = cls(
            max_new_tokens=_num(d, "max_new_tokens", 128, int),
            min_new_tokens=_num(d, "min_new_tokens", 0, int),
            temperature=_num(d, "temperature", 1.0, float), top_p=_num(d, "top_p", 1.0, float),
            top_k=_num(d, "top_k", -1, int), min_p=_num(d, "min_p", 0.0, float), stop=list(stop),
            stop_token_ids=list(stop_ids), ignore_eos=bool(d.get("ignore_eos", False)),
            n=_num(d, "n", 1, int),
            sampling_seed=seed, skip_special_tokens=bool(d.get("skip_special_tokens", True)),
            no_stop_trim=bool(d.get("no_stop_trim", False)),
        )
        if p.max_new_tokens < 0:
            raise RequestError("sampling_params.max_new_tokens must be >= 0")
        if p.min_new_tokens < 0 or p.min_new_tokens > p.max_new_tokens:
            raise RequestError("sampling_params.min_new_tokens must be in [0, max_new_tokens]")
        if p.temperature < 0:
            raise RequestError("sampling_params.temperature must be >= 0")
        if not 0 < p.top_p <= 1:
            raise RequestError("sampling_params.top_p must be in (0, 1]")
        if p.top_k < 1 and p.top_k != -1:
            raise RequestError("sampling_params.top_k must be -1 (off) or >= 1")
        if p.top_k >= TOP_K_OFF:
            p.top_k = -1
        if not 0 <= p.min_p <= 1:
            raise RequestError("sampling_params.min_p must be in [0, 1]")
        if p.n < 1:
            raise RequestError("sampling_params.n must be >= 1")
        return p


@dataclasses.dataclass
class GenerateOptions:
    """Per-request output options shared by all rows of one ``/generate`` call."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False


@dataclasses.dataclass
class RowSpec:
    """One sequence to generate: the prompt token ids, its sampling parameters, its id and response
    position."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str
    base_rid: str
    index: int


@dataclasses.dataclass
class GenerateSpec:
    """A parsed ``/generate`` call: rows in response order (input-major, n samples per input)."""

    rows: list[RowSpec]
    options: GenerateOptions
    is_single: bool


def _as_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be a boolean")
    return v


def parse_generate(body: Any, tokenizer, vocab_size: int, context_len: int,
                   routed_experts: bool = False) -> GenerateSpec:
    """Parse and validate a ``/generate`` body.

    ``tokenizer`` encodes ``text`` inputs; token ids must be in ``[0, vocab_size)``. ``max_new_tokens`` is
    clamped so prompt plus output fit in ``context_len`` tokens. Raises :class:`RequestError` (HTTP 400) on a
    bad request: neither or both of text/input_ids, empty or too long prompts, ids out of range, list lengths
    that do not match the batch, n differing across a batch, bad sampling parameters, ``return_routed_experts``
    when the model has no routed experts (``routed_experts`` false).
    """
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("give exactly one of 'text' or 'input_ids'")
    if body.get("input_embeds") is not None or body.get("image_data") is not None:
        raise RequestError("input_embeds and image_data are not supported by the hpcrl CPU engine")
    if text is not None:
        if isinstance(text, str):
            is_single, texts = True, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            is_single, texts = False, text
        else:
            raise RequestError("'text' must be a string or a non-empty list of strings")
        prompts = [list(tokenizer(t)["input_ids"]) for t in texts]
    else:
        def _ids(x) -> bool:
            return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
        if _ids(input_ids):
            is_single, prompts = True, [input_ids]
        elif isinstance(input_ids, list) and input_ids and all(_ids(x) for x in input_ids):
            is_single, prompts = False, input_ids
        else:
            raise RequestError("'input_ids' must be a list of integers or a non-empty list of such lists")
    batch = len(prompts)
    for i, p in enumerate(prompts):
        if not p:
            raise RequestError(f"input {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"input {i} has token ids out of range [0, {vocab_size}): {bad[:5]}")
        if len(p) >= context_len:
            raise RequestError(f"input {i} has {len(p)} tokens, not less than the context length "
                               f"{context_len}")

    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != batch:
            raise RequestError(f"sampling_params has {len(sp)} entries for {batch} inputs")
        params = [SamplingParams.from_json(s) for s in sp]
    else:
        one = SamplingParams.from_json(sp)
        params = [dataclasses.replace(one, stop=list(one.stop), stop_token_ids=list(one.stop_token_ids))
                  for _ in range(batch)]
    n = params[0].n
    if any(p.n != n for p in params):
        raise RequestError("sampling_params.n must be the same for all inputs of a batch")

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(batch)]
    elif isinstance(rid, str):
        if batch != 1:
            raise RequestError("a single 'rid' string was given for a batch; give one rid per input")
        rids = [rid]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != batch:
            raise RequestError(f"rid has {len(rid)} entries for {batch} inputs")
        rids = list(rid)
    else:
        raise RequestError("'rid' must be a string or a list of strings")

    start = body.get("logprob_start_len", -1)
    start = -1 if start is None else start
    top_num = body.get("top_logprobs_num", 0) or 0
    if isinstance(start, bool) or not isinstance(start, int) or start < -1:
        raise RequestError("logprob_start_len must be an integer >= -1")
    if isinstance(top_num, bool) or not isinstance(top_num, int) or top_num < 0:
        raise RequestError("top_logprobs_num must be an integer >= 0")
    options = GenerateOptions(
        return_logprob=_as_bool(body, "return_logprob"), logprob_start_len=start, top_logprobs_num=top_num,
        return_text_in_logprobs=_as_bool(body, "return_text_in_logprobs"), stream=_as_bool(body, "stream"),
        return_routed_experts=_as_bool(body, "return_routed_experts"),
    )
    if options.return_routed_experts and not routed_experts:
        raise RequestError("return_routed_experts: the served model has no routed experts (not a MoE model)")
    if options.return_logprob:
        for i, p in enumerate(prompts):
            if start >= len(p):
                raise RequestError(f"logprob_start_len {start} must be less than input {i}'s length {len(p)}")

    rows: list[RowSpec] = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        p.max_new_tokens = min(p.max_new_tokens, context_len - len(prompt))
        p.min_new_tokens = min(p.min_new_tokens, p.max_new_tokens)
        for j in range(n):
            row_rid = rids[i] if n == 1 else f"{rids[i]}-{j}"
            rows.append(RowSpec(prompt_ids=list(prompt), params=p, rid=row_rid, base_rid=rids[i],
                                index=len(rows)))
    return GenerateSpec(rows=rows, options=options, is_single=is_single and n == 1)


def finish_length(length: int) -> dict:
    """SGLang's ``FINISH_LENGTH`` JSON."""
    return {"type": "length", "length": length}


def finish_stop(matched: int | str) -> dict:
    """SGLang's ``FINISH_MATCHED_TOKEN`` / ``FINISH_MATCHED_STR`` JSON."""
    return {"type": "stop", "matched": matched}


def finish_abort(message: str, status_code: int | None = None, err_type: str | None = None) -> dict:
    """SGLang's ``FINISH_ABORT`` JSON."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


def output_text(tokenizer, output_ids: list[int], finish_reason: dict | None, params: SamplingParams) -> str:
    """The response ``text``: decoded output with the matched stop token or stop string trimmed (SGLang's
    rule).

    A matched stop token (eos or ``stop_token_ids``) is left out of the text; a matched stop string and what
    follows it are cut off, unless ``no_stop_trim``.
    """
    ids = output_ids
    matched = finish_reason.get("matched") if finish_reason and finish_reason.get("type") == "stop" else None
    if isinstance(matched, int) and not params.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str) and not params.no_stop_trim:
        pos = text.find(matched)
        if pos != -1:
            text = text[:pos]
    return text


def logprob_triples(tokenizer, values: list, ids: list[int], with_text: bool) -> list[list]:
    """``[[logprob_or_null, token_id, text_or_null], ...]`` as in SGLang's meta_info."""
    texts = [tokenizer.decode([t]) for t in ids] if with_text else [None] * len(ids)
    return [[v, t, s] for v, t, s in zip(values, ids, texts)]


def top_logprob_triples(tokenizer, values: list, ids: list, with_text: bool) -> list:
    """Per position, ``None`` or the list of top ``[logprob, token_id, text_or_null]`` triples."""
    out = []
    for vs, ts in zip(values, ids):
        out.append(None if vs is None else logprob_triples(tokenizer, vs, ts, with_text))
    return out
