"""SGLang's ``/generate`` protocol: request parsing and validation, response and meta_info building.

The JSON fields and their meaning follow SGLang 0.5.23's ``GenerateReqInput`` (``srt/managers/io_struct.py``)
and its HTTP contract (``sglang/api/v1/api_types.py``), strictly, so a pipeline that works against this engine
works unchanged against real SGLang:

- an unknown key in ``sampling_params`` is a 400 with SGLang's own text (``unknown field `max_tokens`,
  expected one of ...``), in SGLang's contract-error body ``{"error": "<text>"}``;
- a field SGLang knows but this engine does not implement (penalties, grammars, LoRA, hidden states,
  ``token_ids_logprob``, multimodal inputs, sessions, PD disaggregation...) is a 400 when set to anything but
  its "off" value, never silently ignored;
- a prompt plus an explicit ``max_new_tokens`` over the context is a 400 with SGLang's message unless the
  engine runs with ``--allow-auto-truncate`` (then ``max_new_tokens`` is shortened, as SGLang does); without
  an explicit ``max_new_tokens`` the default is shortened silently, as in SGLang;
- top-level keys SGLang does not know are ignored, as SGLang's dataclass parse ignores them.

:data:`GENERATE_FIELDS_IMPLEMENTED`, :data:`GENERATE_FIELDS_NO_EFFECT`, :data:`GENERATE_FIELDS_UNSUPPORTED`
and :data:`SGLANG_SAMPLING_FIELDS` name every field; ``tests/unit/test_sglang_conformance.py`` checks them
against SGLang's own schema.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

TOP_K_OFF = 1 << 30
"""SGLang's ``top_k`` default, meaning no top-k filtering (as does -1)."""

SGLANG_SAMPLING_FIELDS: tuple[str, ...] = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)
"""Every key of SGLang 0.5.23's ``sampling_params`` contract (``api_types.SamplingParams``), in its order: the
list SGLang's "unknown field" error names."""

SAMPLING_FIELDS_UNSUPPORTED: dict[str, tuple] = {
    "stop_regex": (None, "", []), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "json_schema": (None,), "regex": (None,), "ebnf": (None,),
    "structural_tag": (None,), "spaces_between_special_tokens": (None, True), "stream_interval": (None, 1),
    "logit_bias": (None, {}), "custom_params": (None, {}), "beam_width": (None, 0, 1), "watermark": (None,),
    "choice": (None, []),
}
"""SGLang sampling parameters this engine does not implement, with the values that mean "off" (accepted);
any other value is a 400."""

GENERATE_FIELDS_IMPLEMENTED = frozenset({
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "stream", "return_routed_experts", "routed_experts_start_len",
    "return_prompt_token_ids", "lora_path",
})
"""``/generate`` fields with SGLang's meaning."""

GENERATE_FIELDS_NO_EFFECT = frozenset({
    "log_metrics", "custom_labels", "extra_key", "cache_salt", "routing_key", "conversation_id",
    "external_trace_header", "received_time", "http_worker_ipc", "routed_dp_rank", "data_parallel_rank",
    "disagg_prefill_dp_rank", "no_logs",
})
"""Fields accepted with any value because their meaning holds trivially on one engine without a prefix cache,
data parallelism or metrics labels: cache-isolation keys (nothing is shared), routing hints (one rank),
tracing and metrics labels, ``no_logs`` (this engine never logs request contents)."""

GENERATE_FIELDS_UNSUPPORTED = frozenset({
    "session_id", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
    "use_audio_in_video", "video_config", "watermark", "token_ids_logprob", "return_sampling_mask",
    "sampling_logprobs_mode", "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "return_hidden_states", "return_indexer_topk", "modalities",
    "session_params", "lora_id", "custom_logit_processor", "positional_embed_overrides",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
    "background", "require_reasoning", "max_thinking_tokens", "priority", "return_bytes", "return_entropy",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "kv_hints",
})
"""SGLang ``/generate`` fields this engine does not implement: a 400 unless off (null, false, 0 or empty)."""


class RequestError(ValueError):
    """A bad request (HTTP 400 with ``{"error": {"message": ...}}``, SGLang's body for a refused request)."""


class ContractError(RequestError):
    """A request that breaks SGLang's JSON contract (an unknown sampling field): HTTP 400 with SGLang's
    contract-error body ``{"error": "<text>"}``."""


def unknown_field(key: str, fields: tuple[str, ...]) -> ContractError:
    """SGLang's (serde's) ``unknown field`` error text for ``key`` given the known ``fields``."""
    listed = ", ".join(f"`{f}`" for f in fields)
    return ContractError(f"unknown field `{key}`, expected one of {listed}")


def is_off(value: Any, offs: tuple) -> bool:
    """Whether ``value`` is one of ``offs``, the values that mean an unimplemented field is off (a bool never
    equals an int here)."""
    return any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in offs)


def parse_json_body(raw: bytes) -> dict:
    """A request body as a JSON object (``{}`` when empty or null). Raises :class:`RequestError` on invalid
    JSON or another JSON type."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RequestError(f"invalid JSON body: {e}") from e
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
"""Headers of a streamed (server-sent events) response, as SGLang sends them."""


def sse_event(payload: Any) -> bytes:
    """One server-sent event ``data: <json>\n\n`` (``[DONE]`` is sent as ``sse_event("[DONE]")``: a plain
    string is written as it is)."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return b"data: " + data.encode() + b"\n\n"


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
    explicit_max_new_tokens: bool = False
    """Whether the request gave ``max_new_tokens`` (SGLang checks only an explicit one against the context)."""

    @classmethod
    def from_json(cls, d: dict | None) -> "SamplingParams":
        """Validate a ``sampling_params`` dict. Raises :class:`RequestError` on bad or unsupported values."""
        d = d or {}
        if not isinstance(d, dict):
            raise RequestError("sampling_params must be an object or a list of objects")
        for key in d:
            if key not in SGLANG_SAMPLING_FIELDS:
                raise unknown_field(key, SGLANG_SAMPLING_FIELDS)
        for key, offs in SAMPLING_FIELDS_UNSUPPORTED.items():
            if key in d and not is_off(d[key], offs):
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
            explicit_max_new_tokens=d.get("max_new_tokens") is not None,
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

    return_text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_prompt_token_ids: bool = False


@dataclasses.dataclass
class RowSpec:
    """One sequence to generate: the prompt token ids, its sampling parameters, its id and response
    position, and its input's log-prob options (SGLang accepts them per input)."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str
    base_rid: str
    index: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    lora: str | None = None
    """The LoRA adapter's name (``lora_path``; None: the base model)."""


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


def _per_input(body: dict, key: str, batch: int, n: int, default, check) -> list:
    """``body[key]`` as one value per input: a scalar for all, or a list of ``batch`` values (SGLang's
    ``normalize_param``; a list with ``n > 1`` is refused as SGLang refuses it). ``check(value)`` returns the
    validated value or raises RequestError."""
    v = body.get(key)
    if v is None:
        return [default] * batch
    if isinstance(v, list):
        if n > 1:
            raise RequestError(f"Cannot use list {key} with parallel_sample_num > 1")
        if len(v) != batch:
            raise RequestError(f"{key} has {len(v)} entries for {batch} inputs")
        return [default if x is None else check(x) for x in v]
    return [check(v)] * batch


def _check_bool(key: str):
    def check(x):
        if not isinstance(x, bool):
            raise RequestError(f"{key} must be a boolean or a list of booleans")
        return x
    return check


def _check_int(key: str, low: int):
    def check(x):
        if isinstance(x, bool) or not isinstance(x, int) or x < low:
            raise RequestError(f"{key} must be an integer >= {low} (or a list of them)")
        return x
    return check


def _lora_paths(value: Any, batch: int) -> list:
    """``lora_path`` as one adapter name (or None: the base model) per input: SGLang's normalisation (a string
    for every input, a list per input; null, "" and [] the base model). A list of another length than the batch
    is refused here (SGLang does not check it and fails later)."""
    if not value:
        return [None] * batch
    if isinstance(value, str):
        return [value] * batch
    if not isinstance(value, list):  # SGLang's contract text
        raise ContractError(f"invalid type: {type(value).__name__} `{value}`, expected a value or an array of "
                            "values for OptionalStringOrList")
    if any(v is not None and not isinstance(v, str) for v in value):
        raise ContractError("invalid type: expected a string")
    if len(value) != batch:
        raise RequestError(f"lora_path list length ({len(value)}) must match batch size ({batch})")
    return [v or None for v in value]


def parse_generate(body: Any, tokenizer, vocab_size: int, context_len: int,
                   routed_experts: bool = False, allow_auto_truncate: bool = False) -> GenerateSpec:
    """Parse and validate a ``/generate`` body as SGLang 0.5.23 does (see the module docstring).

    ``tokenizer`` encodes ``text`` inputs; token ids must be in ``[0, vocab_size)``. A prompt of
    ``context_len`` tokens or more, or a prompt plus an explicit ``max_new_tokens`` over ``context_len``, is
    refused unless ``allow_auto_truncate`` (then the prompt keeps its first ``context_len - 1`` tokens and
    ``max_new_tokens`` is shortened, as SGLang's ``--allow-auto-truncate``). A ``rid`` string for a batch is a
    prefix: input ``i`` gets ``{rid}_{i}``. Raises :class:`ContractError` for an unknown sampling field and
    :class:`RequestError` (HTTP 400) on any other bad request: neither or both of text/input_ids, empty
    prompts, ids out of range, list lengths that do not match the batch, n differing across a batch, bad
    sampling parameters, an unimplemented SGLang field that is not off, ``return_routed_experts`` when the
    model has no routed experts (``routed_experts`` false).
    """
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    for key in sorted(GENERATE_FIELDS_UNSUPPORTED & body.keys()):
        if body[key]:
            raise RequestError(f"{key} is not supported by the hpcrl CPU engine (got {body[key]!r:.80}); "
                               "leave it unset")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("give exactly one of 'text' or 'input_ids'")
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
            if not allow_auto_truncate:  # SGLang's message
                raise RequestError(f"The input ({len(p)} tokens) is longer than the model's context length "
                                   f"({context_len} tokens).")
            prompts[i] = p = list(p[:context_len - 1])

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
        rids = [rid] if batch == 1 and (is_single or n > 1) else [f"{rid}_{i}" for i in range(batch)]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != batch:
            raise RequestError(f"rid has {len(rid)} entries for {batch} inputs")
        rids = list(rid)
    else:
        raise RequestError("'rid' must be a string or a list of strings")
    if len(set(rids)) != len(rids):
        raise RequestError(f"Duplicate request IDs detected within the request: "
                           f"{sorted({r for r in rids if rids.count(r) > 1})}")

    loras = _lora_paths(body.get("lora_path"), batch)
    want_lp = _per_input(body, "return_logprob", batch, n, False, _check_bool("return_logprob"))
    starts = _per_input(body, "logprob_start_len", batch, n, -1, _check_int("logprob_start_len", -1))
    tops = _per_input(body, "top_logprobs_num", batch, n, 0, _check_int("top_logprobs_num", 0))
    re_start = body.get("routed_experts_start_len") or 0
    if isinstance(re_start, bool) or not isinstance(re_start, int) or re_start < 0:
        raise RequestError("routed_experts_start_len must be an integer >= 0")
    options = GenerateOptions(
        return_text_in_logprobs=_as_bool(body, "return_text_in_logprobs"), stream=_as_bool(body, "stream"),
        return_routed_experts=_as_bool(body, "return_routed_experts"), routed_experts_start_len=re_start,
        return_prompt_token_ids=_as_bool(body, "return_prompt_token_ids"),
    )
    if options.return_routed_experts and not routed_experts:
        raise RequestError("return_routed_experts: the served model has no routed experts (not a MoE model)")
    for i, p in enumerate(prompts):
        if want_lp[i] and starts[i] >= len(p):
            raise RequestError(f"logprob_start_len {starts[i]} must be less than input {i}'s length {len(p)}")
        if options.return_routed_experts and re_start > len(p):
            raise RequestError(f"routed_experts_start_len {re_start} must be in [0, {len(p)}] (input {i}'s "
                               "length)")

    rows: list[RowSpec] = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        room = context_len - len(prompt)
        if p.max_new_tokens > room:
            if p.explicit_max_new_tokens and not allow_auto_truncate:  # SGLang's message
                total = p.max_new_tokens + len(prompt)
                raise RequestError(
                    f"Requested token count exceeds the model's maximum context length of {context_len} "
                    f"tokens. You requested a total of {total} tokens: {len(prompt)} tokens from the input "
                    f"messages and {p.max_new_tokens} tokens for the completion. Please reduce the number of "
                    "tokens in the input messages or the completion to fit within the limit.")
            p.max_new_tokens = room
        p.min_new_tokens = min(p.min_new_tokens, p.max_new_tokens)
        for j in range(n):
            row_rid = rids[i] if n == 1 else f"{rids[i]}-{j}"
            rows.append(RowSpec(prompt_ids=list(prompt), params=p, rid=row_rid, base_rid=rids[i],
                                index=len(rows), return_logprob=want_lp[i], logprob_start_len=starts[i],
                                top_logprobs_num=tops[i], lora=loras[i]))
    return GenerateSpec(rows=rows, options=options, is_single=is_single and n == 1)


def engine_failure(results: list) -> "tuple[str, int] | None":
    """``(message, status)`` of the first row that the engine failed (finish reason ``abort`` with a
    ``status_code`` >= 500: a broken forward pass, the engine stopping), else None. SGLang answers such a
    request with that HTTP status, so clients and the router retry it elsewhere; an abort that was asked for
    (``/abort_request``, a pause) has no status code and stays a 200 with its partial output."""
    for r in results:
        reason = ((r or {}).get("meta_info") or {}).get("finish_reason") or {}
        code = reason.get("status_code") if isinstance(reason, dict) else None
        if reason.get("type") == "abort" and isinstance(code, int) and code >= 500:
            return str(reason.get("message") or "engine error"), code
    return None


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


def weight_version_spans(events: list[tuple[str, int]], current: str, num_output: int) -> list[dict]:
    """SGLang 0.5.23's ``meta_info.weight_versions`` of a finished answer (``srt/utils/weight_versions.py``
    ``compute_weight_version_spans``): ``[{"version", "start", "end"}, ...]``, contiguous over the output
    tokens ``[0, num_output)``, one span per weight version that sampled some of them. ``events``: ``(old
    version, output tokens so far)`` recorded at each version change while the request lived; ``current``: the
    version now. A request with no output has one empty span of ``current``."""
    spans: list[dict] = []
    for version, end in [*events, (current, num_output)]:
        end = min(end, num_output)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans
