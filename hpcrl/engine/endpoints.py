"""SGLang 0.5.23's HTTP endpoints that hpcrl's CPU engine does not serve, each with why, and the engine's own
aliases that SGLang does not have.

Every other endpoint of SGLang's ``srt/entrypoints/http_server.py`` is served by
:class:`hpcrl.engine.native_server.NativeServer` with SGLang's fields and answers;
``tests/unit/test_sglang_conformance.py`` reads the route list from the installed wheel and fails when SGLang
adds an endpoint that is in neither place, so an SGLang bump shows up in CI. A client of hpcrl (rollout,
weight sync, health) calls none of these.
"""

from __future__ import annotations

_EMBED = "embedding, classification and scoring models: hpcrl serves generation only"
_OTHER_API = "another vendor's API (hpcrl serves SGLang's native one and OpenAI's)"
_GPU_CACHE = "hierarchical / external KV cache storage, which this engine has none of (no prefix cache)"
_REMOTE = "instance-to-instance weight transfer and checkpoint engines (GPU RDMA paths)"
_DEBUG = "GPU profiling and debugging of SGLang's own runtime"
_EXPERTS = "expert-load recording of SGLang's MoE runtime (EPLB)"
_DECISIONS = "structured decision decoding (grammar-constrained), not implemented"
_RESPONSES = "OpenAI's Responses API (stateful, tool-running), not implemented"
_SESSIONS = "SGLang's stateful sessions (refused in /generate too)"
_CORPUS = "n-gram speculative decoding corpora (no speculative decoding here)"
_ELASTIC = "elastic expert parallelism across GPU ranks (one process here)"

NOT_SERVED: dict[str, str] = {
    "/": "a banner ('SGLang is running'); probes use /health",
    "/encode": _EMBED, "/classify": _EMBED, "/v1/embeddings": _EMBED, "/v1/classify": _EMBED,
    "/v1/rerank": _EMBED, "/v1/score": _EMBED,
    "/v1/decisions": _DECISIONS, "/v1/systemone": _DECISIONS,
    "/v1/responses": _RESPONSES, "/v1/responses/{response_id}": _RESPONSES,
    "/v1/responses/{response_id}/cancel": _RESPONSES,
    "/v1/audio/transcriptions": "audio models", "/v1/realtime": "audio models (websocket)",
    "/v1/models/{model:path}": "one model card by name: /v1/models lists the one model served",
    "/v1/messages": _OTHER_API, "/v1/messages/count_tokens": _OTHER_API,
    "/api/chat": _OTHER_API, "/api/generate": _OTHER_API, "/api/show": _OTHER_API, "/api/tags": _OTHER_API,
    "/invocations": _OTHER_API, "/vertex_generate": _OTHER_API,
    "/parse_function_call": "tool-call parsers (the engine runs none; the agent gateway parses tool calls)",
    "/separate_reasoning": "reasoning parsers (none in this engine)",
    "/open_session": _SESSIONS, "/close_session": _SESSIONS,
    "/update_weights_from_ipc": _REMOTE, "/init_weights_send_group_for_remote_instance": _REMOTE,
    "/send_weights_to_remote_instance": _REMOTE, "/get_remote_instance_transfer_engine_info": _REMOTE,
    "/remote_instance_transfer_engine_info": _REMOTE,
    "/get_weights_by_name": ("reading one weight back; hpcrl checks a sync by the weight version and "
                             "log-probs"),
    "/hicache/storage-backend": _GPU_CACHE, "/hicache/storage-backend/clear": _GPU_CACHE,
    "/get_hicache_l3_cache_layout": _GPU_CACHE,
    "/add_external_corpus": _CORPUS, "/remove_external_corpus": _CORPUS, "/list_external_corpora": _CORPUS,
    "/start_profile": _DEBUG, "/stop_profile": _DEBUG, "/set_trace_level": _DEBUG, "/freeze_gc": _DEBUG,
    "/slow_down": _DEBUG, "/configure_logging": _DEBUG, "/set_internal_state": _DEBUG,
    "/dumper/{method}": _DEBUG,
    "/start_expert_distribution_record": _EXPERTS, "/stop_expert_distribution_record": _EXPERTS,
    "/dump_expert_distribution_record": _EXPERTS,
    "/pd_role_switch": "prefill/decode disaggregation roles (one engine does both here)",
    "/scale_elastic_ep": _ELASTIC, "/is_scaling_elastic_ep": _ELASTIC,
}
"""``{path: why}``: SGLang endpoints the CPU engine answers with 404."""

HPCRL_ONLY: dict[str, str] = {
    "/get_weight_version": "older clients; SGLang 0.5 has the weight version in /model_info",
    "/get_load": "older clients; SGLang 0.5 serves /v1/loads",
}
"""``{path: why}``: the CPU engine's aliases that SGLang does not have (hpcrl's own client calls neither)."""
