"""The agent gateway: an OpenAI-compatible server in the controller, in front of the router, that records
every call of every agent session token-exact (AReaL's proxy, slime's server-based rollouts).

Each session has its own key; a request is matched to its session by ``Authorization: Bearer KEY`` only, so a
session can neither see nor add to another's calls, and a closed session's key is refused (401). Served:

- ``POST /v1/chat/completions``: the messages are rendered with the chat template (the model's, or
  ``rollout.agent.chat_template``), the earlier calls' ids are reused where the rendered text starts with them
  (:func:`hpcrl.agent.session.extend_prompt`), and the engine is called with those ids through the run's
  :class:`~hpcrl.rollout.client.RolloutClient` (router, retries, fault tolerance included). With a tool parser
  (``rollout.agent.tool_parser``) the reply's ``<tool_call>{json}</tool_call>`` text becomes OpenAI
  ``tool_calls``.
- ``POST /v1/completions``: a text ``prompt`` (reusing ids the same way).
- ``GET /v1/models``; ``POST /v1/sessions/{id}/reward`` ``{"reward": float}``.

The behaviour policy is the run's: temperature, top-p, top-k and stop come from the ``rollout`` section (a
request's own values are ignored, so the recorded log-probs are those the trainer expects), ``max_tokens`` is
capped at ``rollout.max_new_tokens``, ``n`` must be 1 (one episode per session) and the seed is derived from
the sample's, so a deterministic run stays deterministic.
"""

from __future__ import annotations

import copy
import hmac
import json
import logging
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from hpcrl.agent.session import Call, Session, extend_prompt
from hpcrl.agent.tools import parse_tool_calls
from hpcrl.engine import openai_api, protocol

logger = logging.getLogger(__name__)

SESSION = web.RequestKey("session", Session)
"""Where the auth middleware leaves the request's session."""

GenerateCall = Callable[[list[int], dict], Awaitable[dict]]
"""``async (input_ids, sampling_params) -> native /generate response`` (with ``return_logprob``)."""


class AgentGateway:
    """The gateway server (see the module docstring).

    ``generate``: how to reach the engines (:meth:`RolloutClient.generate` with ``return_logprob=True``).
    ``tokenizer``: the policy's HF tokenizer. ``chat_template``: jinja text (default the tokenizer's).
    ``sampling``: the rollout's native sampling params (temperature, top_p, top_k, stop, max_new_tokens).
    ``tool_parser``: ``"hermes"`` to turn ``<tool_call>`` text into ``tool_calls``, or None.
    ``context_len``: the model's context in tokens. ``host``/``port``: where to listen (port 0: a free one);
    ``public_host``: the address agents on other nodes use (default: ``host``, or loopback for all interfaces).
    """

    def __init__(self, generate: GenerateCall, tokenizer, sampling: dict, context_len: int,
                 chat_template: Optional[str] = None, tool_parser: Optional[str] = None,
                 served_model_name: str = "policy", host: str = "127.0.0.1", port: int = 0,
                 public_host: Optional[str] = None):
        self.generate = generate
        self.tokenizer = tokenizer
        self.sampling = dict(sampling)
        self.context_len = context_len
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.tool_parser = tool_parser
        self.served_model_name = served_model_name
        self.host, self.port, self.public_host = host, port, public_host
        self.sessions: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._runner: Optional[web.AppRunner] = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        """``http://HOST:PORT/v1``: the ``OPENAI_BASE_URL`` agents get."""
        host = self.public_host or ("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        """Listen on ``host:port`` (a free port when 0); sets :attr:`port`."""
        app = web.Application(middlewares=[self._auth], client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/sessions/{session_id}/reward", self._reward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop serving (sessions still open are closed)."""
        for s in list(self.sessions.values()):
            self.close(s)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, item: dict[str, Any], seed: Optional[int] = None,
             sampling: Optional[dict[str, Any]] = None) -> Session:
        """A new session for task ``item``; ``seed`` seeds its calls (call ``k`` uses ``seed + k``);
        ``sampling``: its native sampling params (default the gateway's, the rollout's)."""
        session = Session.new(item, seed, sampling)
        self.sessions[session.session_id] = session
        self._by_key[session.key] = session
        return session

    def close(self, session: Session) -> None:
        """Close ``session``: its key is refused from now on (401); its calls stay readable here."""
        session.closed = True
        self._by_key.pop(session.key, None)
        self.sessions.pop(session.session_id, None)

    # ------------------------------------------------------------------ HTTP
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        session = None
        if scheme.lower() == "bearer":
            for key, s in list(self._by_key.items()):
                if hmac.compare_digest(key.encode(), token.encode()):
                    session = s
        if session is None or session.closed:
            return web.json_response({"error": "Unauthorized"}, status=401)
        request[SESSION] = session
        return await handler(request)

    @staticmethod
    async def _json(request: web.Request) -> dict:
        """The JSON object body ({} when empty). Raises OpenAIError (400) on anything else."""
        try:
            return protocol.parse_json_body(await request.read())
        except protocol.RequestError as e:
            raise openai_api.OpenAIError(str(e)) from None

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.served_model_name, "object": "model", "created": 0, "owned_by": "hpcrl",
             "max_model_len": self.context_len}]})

    async def _reward(self, request: web.Request) -> web.Response:
        session = request[SESSION]
        if request.match_info["session_id"] != session.session_id:
            return web.json_response({"error": "Unauthorized"}, status=401)  # another session's id
        try:
            body = await self._json(request)
            reward = body.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise openai_api.OpenAIError(f"reward must be a number, got {reward!r}", param="reward")
        except openai_api.OpenAIError as e:
            return e.response()
        session.reward = float(reward)
        return web.json_response({"session_id": session.session_id, "reward": session.reward})

    def _params(self, session: Session, req) -> dict:
        """The run's sampling params for the next call of ``session`` (see the module docstring)."""
        if req.n != 1:
            raise openai_api.OpenAIError("n must be 1: one agent session is one episode", param="n")
        sp = dict(self.sampling if session.sampling is None else session.sampling)
        cap = sp.get("max_new_tokens")
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if asked is not None:
            sp["max_new_tokens"] = min(int(asked), int(cap)) if cap is not None else int(asked)
        sp["no_stop_trim"] = bool(req.no_stop_trim)  # the agent gets SGLang's OpenAI text (stop trimmed)
        stops = list(sp.get("stop") or [])
        if req.stop:
            stops += [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if stops:
            sp["stop"] = stops
        if session.seed is not None:
            sp["sampling_seed"] = (int(session.seed) + len(session.calls)) & 0x7FFFFFFF
        return sp

    async def _call(self, session: Session, text: str, sp: dict) -> tuple[dict, Call]:
        """Generate after ``text`` (reusing recorded ids), record the call; the native response and the call."""
        def encode(t):
            return self.tokenizer(t, add_special_tokens=False)["input_ids"]

        ids, parent = extend_prompt(session.calls, text, encode)
        room = self.context_len - len(ids)
        if room <= 0:
            raise openai_api.OpenAIError(f"the conversation has {len(ids)} tokens, the context is "
                                         f"{self.context_len}", param="messages")
        sp = dict(sp, max_new_tokens=min(int(sp.get("max_new_tokens", room)), room))
        out = await self.generate(ids, sp)
        meta = out.get("meta_info") or {}
        triples = meta.get("output_token_logprobs") or []
        reason, matched = openai_api.finish_reason(meta.get("finish_reason"))
        output_ids = [int(t[1]) for t in triples]
        end_text = (self.tokenizer.decode([matched], skip_special_tokens=False)
                    if isinstance(matched, int) and output_ids and output_ids[-1] == matched else "")
        call = Call(prompt_ids=ids, output_ids=output_ids, output_log_probs=[float(t[0]) for t in triples],
                    weight_version=meta.get("weight_version"), finish_reason=reason,
                    text=out.get("text") or "", rendered=text, end_text=end_text, parent=parent)
        if session.closed:  # the episode ended (timeout) while this call ran: not part of it
            raise openai_api.OpenAIError("the session is closed", 401, "AuthenticationError")
        session.calls.append(call)
        out = dict(out, prompt_token_ids=ids)
        return out, call

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = request[SESSION]
        try:
            req = openai_api.parse(openai_api.ChatCompletionRequest, await self._json(request),
                                   openai_api.CHAT_UNSUPPORTED)
            text = self._render(session, req)
            out, call = await self._call(session, text, self._params(session, req))
        except openai_api.OpenAIError as e:
            return e.response()
        except Exception as e:  # noqa: BLE001 - the engines failed for good (RolloutError): the agent sees 503
            logger.warning("agent session %s: generation failed: %s", session.session_id, e)
            return openai_api.OpenAIError(f"generation failed: {e}", 503, "ServiceUnavailableError").response()
        resp = openai_api.chat_response(self.tokenizer, req, [out], openai_api.new_id("chatcmpl"))
        if self.tool_parser:
            content, calls = parse_tool_calls(resp["choices"][0]["message"]["content"] or "", self.tool_parser)
            if calls:
                call.tool_call_ids = [c["id"] for c in calls]
                resp["choices"][0]["message"].update(content=content or None, tool_calls=calls)
                if resp["choices"][0]["finish_reason"] == "stop":
                    resp["choices"][0]["finish_reason"] = "tool_calls"
        if req.stream:
            return await self._as_stream(request, resp)
        return web.json_response(resp)

    def _render(self, session: Session, req) -> str:
        if not self.chat_template:
            raise openai_api.OpenAIError("the policy has no chat template; set rollout.agent.chat_template",
                                         param="messages")
        by_tool_id = {tid: c for c in session.calls for tid in c.tool_call_ids}
        msgs = []
        for m in req.messages:
            ids = [tc.get("id") for tc in m.get("tool_calls") or [] if isinstance(tc, dict)]
            if m.get("role") == "assistant" and ids and ids[0] in by_tool_id:
                # a reply whose tool calls this gateway parsed: rendered as the policy wrote it
                m = {"role": "assistant", "content": by_tool_id[ids[0]].text}
            elif m.get("tool_calls"):  # arguments as objects, as chat templates (Hermes, Qwen) expect them
                m = dict(m, tool_calls=[_tool_call_for_template(tc) for tc in m["tool_calls"]])
            msgs.append(m)
        tools = None if req.tool_choice == "none" else req.tools
        return openai_api.render_chat_text(self.tokenizer, self.chat_template, msgs, tools,
                                           kwargs=req.chat_template_kwargs)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session = request[SESSION]
        try:
            req = openai_api.parse(openai_api.CompletionRequest, await self._json(request),
                                   openai_api.COMPLETION_UNSUPPORTED)
            if not isinstance(req.prompt, str):
                raise openai_api.OpenAIError("the gateway takes one text prompt per call", param="prompt")
            out, _ = await self._call(session, req.prompt, self._params(session, req))
        except openai_api.OpenAIError as e:
            return e.response()
        except Exception as e:  # noqa: BLE001 - the engines failed for good: the agent sees 503
            return openai_api.OpenAIError(f"generation failed: {e}", 503, "ServiceUnavailableError").response()
        resp = openai_api.completion_response(self.tokenizer, req, [out], openai_api.new_id("cmpl"))
        if req.stream:
            return await self._as_stream(request, resp)
        return web.json_response(resp)

    @staticmethod
    async def _as_stream(request: web.Request, resp: dict) -> web.StreamResponse:
        """A finished response as OpenAI server-sent events (one chunk with everything, then ``[DONE]``)."""
        out = web.StreamResponse(headers=protocol.SSE_HEADERS)
        await out.prepare(request)
        chunk = dict(resp)
        if resp["object"] == "chat.completion":
            chunk["object"] = "chat.completion.chunk"
            chunk["choices"] = [{"index": c["index"], "delta": c["message"], "logprobs": c["logprobs"],
                                 "finish_reason": c["finish_reason"]} for c in resp["choices"]]
        await out.write(protocol.sse_event(chunk))
        await out.write(protocol.sse_event("[DONE]"))
        await out.write_eof()
        return out


def _tool_call_for_template(tc: dict) -> dict:
    tc = copy.deepcopy(tc)
    fn = tc.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass
    return tc

