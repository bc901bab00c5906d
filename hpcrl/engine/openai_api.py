"""OpenAI-compatible endpoints of the CPU engine, shaped as SGLang 0.5.23 serves them.

``/v1/completions`` and ``/v1/chat/completions`` (``n``, ``temperature``/``top_p``/``max_tokens``/``stop``/
``seed``, ``logprobs``/``top_logprobs``, ``usage``, streaming as OpenAI's server-sent events, SGLang's extra
sampling fields ``top_k``/``min_p``/``min_tokens``/``stop_token_ids``/``ignore_eos``/``no_stop_trim``/
``skip_special_tokens``, and ``return_token_ids`` for token-exact clients), ``/tokenize`` and ``/detokenize``
(also under ``/v1/``). Each request becomes a native ``/generate`` body checked by
:func:`hpcrl.engine.protocol.parse_generate`, so both APIs refuse and accept alike (context overflow is
SGLang's 400 there too). Requests are validated with pydantic models whose field names, types and defaults are
SGLang's (``srt/entrypoints/openai/protocol.py``); keys SGLang does not know are ignored as SGLang ignores them;
SGLang fields this engine does not implement (:data:`COMPLETION_UNSUPPORTED`, :data:`CHAT_UNSUPPORTED`) are a
400 unless off. Errors use SGLang's OpenAI error body ``{"object": "error", "message", "type", "param",
"code"}``.

The chat template is the tokenizer's own, or the engine's ``--chat-template`` file (SGLang's flag); a model
with neither answers chat requests with 400. ``tools`` are passed to the template; no tool-call parser runs
(``tool_call_parser`` is null in ``/model_info``), so tool calls come back as text.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Literal, Optional, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hpcrl.engine.protocol import is_off


class OpenAIError(Exception):
    """A refused OpenAI-style request: ``status`` (HTTP), ``err_type`` (``BadRequestError``...), ``param``."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError",
                 param: Optional[str] = None):
        super().__init__(message)
        self.status, self.err_type, self.param = status, err_type, param

    def body(self) -> dict:
        """SGLang's ``ErrorResponse`` JSON."""
        return {"object": "error", "message": str(self), "type": self.err_type, "param": self.param,
                "code": self.status}

    def response(self) -> web.Response:
        """The HTTP answer: :meth:`body` with :attr:`status`."""
        return web.json_response(self.body(), status=self.status)


# SGLang fields not implemented here, with the values that mean "off" (anything else is a 400).
_COMMON_UNSUPPORTED: dict[str, tuple] = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "repetition_penalty": (None, 1, 1.0), "response_format": (None,), "regex": (None,), "ebnf": (None,),
    "stop_regex": (None, [], ""), "lora_path": (None,), "session_params": (None,), "custom_params": (None,),
    "custom_logit_processor": (None,), "return_hidden_states": (None, False), "watermark": (None,),
    "return_routed_experts": (None, False), "images_config": (None,), "mm_processor_kwargs": (None,),
}
COMPLETION_UNSUPPORTED: dict[str, tuple] = {
    **_COMMON_UNSUPPORTED, "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
    "json_schema": (None,),
}
"""``/v1/completions`` fields of SGLang that this engine refuses unless off."""
CHAT_UNSUPPORTED: dict[str, tuple] = {
    **_COMMON_UNSUPPORTED, "return_sampling_mask": (None, False), "sampling_logprobs_mode": (None,),
    "input_ids": (None,), "reasoning_effort": (None,), "thinking": (None,), "video_config": (None,),
}
"""``/v1/chat/completions`` fields of SGLang that this engine refuses unless off."""


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: a last chunk with ``usage`` when ``include_usage``."""

    model_config = ConfigDict(extra="ignore")
    include_usage: Optional[bool] = False


class _Sampling(BaseModel):
    """Fields both OpenAI requests share (SGLang's names and defaults)."""

    model_config = ConfigDict(extra="ignore")
    model: str = "default"
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    rid: Optional[Union[str, list[str]]] = None
    return_token_ids: bool = False

    def sampling_params(self, temperature: Optional[float], top_p: Optional[float],
                        max_tokens: Optional[int]) -> dict:
        """The native ``sampling_params`` (``max_new_tokens`` only when the request bounds it)."""
        sp: dict[str, Any] = {"n": self.n, "min_new_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
                              "skip_special_tokens": self.skip_special_tokens, "no_stop_trim": self.no_stop_trim}
        for key, value in (("temperature", temperature), ("top_p", top_p), ("top_k", self.top_k),
                           ("min_p", self.min_p), ("stop", self.stop), ("stop_token_ids", self.stop_token_ids),
                           ("sampling_seed", self.seed), ("max_new_tokens", max_tokens)):
            if value is not None:
                sp[key] = value
        return sp


class CompletionRequest(_Sampling):
    """``/v1/completions`` (SGLang's ``CompletionRequest``): ``prompt`` text, texts, token ids or lists of
    them; ``max_tokens`` defaults to 16 as in OpenAI; ``logprobs`` is the number of top log-probs (0-20)."""

    top_k: Optional[int] = -1
    min_p: Optional[float] = 0.0
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be positive")
        return v


class ChatCompletionRequest(_Sampling):
    """``/v1/chat/completions`` (SGLang's ``ChatCompletionRequest``): ``messages`` rendered by the chat
    template; ``max_tokens`` / ``max_completion_tokens`` default to the rest of the context."""

    messages: list[dict]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict]] = None
    tool_choice: Union[Literal["auto", "none", "required"], dict] = "auto"
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict] = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(v):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}].role must be a string")
        return v


class TokenizeRequest(BaseModel):
    """``/tokenize``: ``prompt`` (text or texts) or ``messages`` (rendered by the chat template)."""

    model_config = ConfigDict(extra="ignore")
    model: str = "default"
    prompt: Optional[Union[str, list[str]]] = None
    messages: Optional[list[dict]] = None
    add_special_tokens: bool = True
    add_generation_prompt: Optional[bool] = None
    tools: Optional[list[dict]] = None
    chat_template_kwargs: Optional[dict] = None


class DetokenizeRequest(BaseModel):
    """``/detokenize``: ``tokens`` (ids or lists of ids)."""

    model_config = ConfigDict(extra="ignore")
    model: str = "default"
    tokens: Union[list[int], list[list[int]]]
    skip_special_tokens: bool = True


def parse(model: type[BaseModel], body: Any, unsupported: dict[str, tuple] | None = None) -> Any:
    """Validate ``body`` into ``model``. Raises :class:`OpenAIError` (400) naming the bad field."""
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object")
    for key, offs in (unsupported or {}).items():
        if key in body and not is_off(body[key], offs):
            raise OpenAIError(f"{key}={body[key]!r:.80} is not supported by the hpcrl CPU engine; leave it "
                              "unset", param=key)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())) or "body"
        raise OpenAIError(f"{where}: {first.get('msg')}", param=where.split(".")[0]) from None


def message_text(content: Any, where: str) -> Optional[str]:
    """A message's ``content`` as text: a string, null, or OpenAI content parts of ``type: text`` joined.
    Raises OpenAIError for other parts (images, audio: not served here)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(f"{where}.content[{j}]: only text parts are supported by the hpcrl CPU engine",
                                  param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise OpenAIError(f"{where}.content must be a string or a list of text parts", param="messages")


def render_chat_text(tokenizer, template: str, messages: list[dict], tools: Optional[list[dict]] = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     kwargs: Optional[dict] = None) -> str:
    """``messages`` (contents as :func:`message_text` reads them) rendered by the jinja chat ``template`` as
    transformers renders it, with ``tools`` and the template's ``kwargs``. Raises OpenAIError for bad contents or
    when the template fails."""
    msgs = []
    for i, m in enumerate(messages):
        m = dict(m)
        m["content"] = message_text(m.get("content"), f"messages[{i}]")
        msgs.append(m)
    try:
        return tokenizer.apply_chat_template(
            msgs, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **(kwargs or {}))
    except Exception as e:  # noqa: BLE001 - a template error is the request's (jinja, bad roles...)
        raise OpenAIError(f"chat template failed: {type(e).__name__}: {e}", param="messages") from None


def render_chat(tokenizer, template: Optional[str], messages: list[dict], tools: Optional[list[dict]] = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                kwargs: Optional[dict] = None) -> list[int]:
    """Token ids ``[tokens]`` of :func:`render_chat_text`, encoded without extra special tokens (the template
    writes its own). Raises OpenAIError when there is no template or rendering fails."""
    if not template:
        raise OpenAIError("the served model has no chat template; start the engine with --chat-template FILE "
                          "or use /v1/completions", param="messages")
    text = render_chat_text(tokenizer, template, messages, tools, add_generation_prompt, continue_final_message,
                            kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def finish_reason(reason: Optional[dict]) -> tuple[Optional[str], Any]:
    """OpenAI ``finish_reason`` and SGLang's ``matched_stop`` from a native finish reason."""
    if not reason:
        return None, None
    kind = reason.get("type")
    if kind == "stop":
        return "stop", reason.get("matched")
    return ("length" if kind == "length" else "abort"), None


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, meta: dict, start: int, text_offset0: int) -> dict:
    """OpenAI's legacy completion ``logprobs`` for output tokens ``start:`` of a native ``meta_info``."""
    triples = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:] if "output_top_logprobs" in meta else None
    tokens = [_token_text(tokenizer, t[1]) for t in triples]
    offsets, pos = [], text_offset0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = ([None] * len(triples) if tops is None
           else [{_token_text(tokenizer, x[1]): x[0] for x in (row or [])} for row in tops])
    return {"text_offset": offsets, "token_logprobs": [t[0] for t in triples], "tokens": tokens,
            "top_logprobs": top}


def chat_logprobs(tokenizer, meta: dict, start: int) -> dict:
    """OpenAI's chat ``logprobs`` (``content``: token, logprob, bytes, top_logprobs) for output tokens
    ``start:``."""
    triples = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:] if "output_top_logprobs" in meta else [None] * len(triples)
    content = []
    for (lp, tid, _), row in zip(triples, tops):
        tok = _token_text(tokenizer, tid)
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": [{"token": _token_text(tokenizer, x[1]), "logprob": x[0],
                                          "bytes": list(_token_text(tokenizer, x[1]).encode("utf-8"))}
                                         for x in (row or [])]})
    return {"content": content, "refusal": None}


def usage(results: list[dict], n: int) -> dict:
    """OpenAI ``usage``: each prompt counted once (``n`` samples per prompt), every completion counted."""
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results[::max(1, n)])
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": None}


def completion_response(tokenizer, req: CompletionRequest, results: list[dict], rid: str) -> dict:
    """The ``text_completion`` object for finished native ``results`` (response order)."""
    choices = []
    for i, r in enumerate(results):
        reason, matched = finish_reason(r["meta_info"]["finish_reason"])
        choice = {"index": i, "text": r["text"], "logprobs": None, "finish_reason": reason,
                  "matched_stop": matched}
        if req.logprobs is not None:
            choice["logprobs"] = completion_logprobs(tokenizer, r["meta_info"], 0, 0)
        if req.return_token_ids:
            choice["token_ids"] = list(r["output_ids"])
            choice["prompt_token_ids"] = list(r.get("prompt_token_ids") or [])
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
            "choices": choices, "usage": usage(results, req.n)}


def chat_response(tokenizer, req: ChatCompletionRequest, results: list[dict], rid: str) -> dict:
    """The ``chat.completion`` object for finished native ``results`` (``n`` choices)."""
    choices = []
    for i, r in enumerate(results):
        reason, matched = finish_reason(r["meta_info"]["finish_reason"])
        choice = {"index": i, "message": {"role": "assistant", "content": r["text"], "reasoning_content": None,
                                          "tool_calls": None},
                  "logprobs": chat_logprobs(tokenizer, r["meta_info"], 0) if req.logprobs else None,
                  "finish_reason": reason, "matched_stop": matched}
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(r.get("prompt_token_ids") or [])
            choice["response_token_ids"] = list(r["output_ids"])
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
            "choices": choices, "usage": usage(results, req.n)}


def native_body(req: _Sampling, prompts: list[list[int]], temperature, top_p, max_tokens: Optional[int],
                top_logprobs: Optional[int], context_len: int) -> dict:
    """The ``/generate`` body for ``prompts`` (token ids): one sampling-params entry per prompt; without
    ``max_tokens`` each may run to the end of the context (as SGLang's chat does)."""
    sps = []
    for p in prompts:
        bound = max_tokens if max_tokens is not None else max(0, context_len - len(p))
        sps.append(req.sampling_params(temperature, top_p, bound))
    body: dict[str, Any] = {"input_ids": prompts, "sampling_params": sps, "stream": req.stream,
                            "return_prompt_token_ids": req.return_token_ids}
    if req.rid is not None:
        body["rid"] = req.rid
    if top_logprobs is not None:
        body.update(return_logprob=True, top_logprobs_num=top_logprobs)
    return body


def completion_prompts(tokenizer, prompt) -> list[list[int]]:
    """``prompt`` of a completion request as token-id lists (text is encoded as ``/generate`` encodes it)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    return [list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p) for p in prompt]


class StreamState:
    """What one choice has sent so far: text characters and tokens (for deltas)."""

    def __init__(self, stops: list[str]):
        self.sent_text = ""
        self.sent_tokens = 0
        self.started = False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def delta(self, text: str, finished: bool) -> str:
        """New text to send; unfinished text keeps back a possible incomplete character (``\\ufffd``) and
        the last ``len(stop) - 1`` characters, which a stop string may still trim."""
        if not finished:
            text = text.rstrip("\ufffd")
            if self.hold:
                text = text[:max(len(self.sent_text), len(text) - self.hold)]
        # normally ``text`` extends what was sent; if decoding more tokens changed earlier characters, what
        # differs after the common prefix is sent
        out = text[len(os.path.commonprefix([text, self.sent_text])):]
        if len(text) >= len(self.sent_text):
            self.sent_text = text
        return out


def new_id(prefix: str) -> str:
    """``{prefix}-<32 hex>`` (OpenAI's ``cmpl-`` / ``chatcmpl-`` ids)."""
    return f"{prefix}-{uuid.uuid4().hex}"
