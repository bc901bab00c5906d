"""hpcrl's CPU engine over real HTTP: SGLang's protocol, batching, log-probs, weight updates, memory, auth.

One engine subprocess (with an API key and an admin key) serves all tests; weight-changing tests restore the
original weights. Reference values come from a plain transformers forward pass in this process.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import urllib.request

import pytest
import torch

from hpcrl.engine import state
from hpcrl.engine.server import ADMIN_PATHS

try:
    from tests.integration.engine_utils import EngineProcess, free_port, http_json
except ImportError:  # tests/integration is not a package
    from engine_utils import EngineProcess, free_port, http_json

pytestmark = pytest.mark.integration

torch.set_num_threads(1)
EOS = 2
TOL = 1e-5
API_KEY, ADMIN_KEY = "s3cret-key", "adm1n-key"


# -------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory):
    """The tiny Qwen2 with different random weights (seed 1): the target of weight updates."""
    from hpcrl.models.tiny import create_tiny_qwen2

    return create_tiny_qwen2(tmp_path_factory.mktemp("models2") / "tiny-qwen2-b", seed=1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    """One engine for the whole module, with an API key and an admin key (both from 0600 files)."""
    tmp = tmp_path_factory.mktemp("engine")
    for name, key in (("key", API_KEY), ("admin-key", ADMIN_KEY)):
        (tmp / name).write_text(key + "\n")
        os.chmod(tmp / name, 0o600)
    args = ["--max-running-requests", "64", "--random-seed", "7", "--api-key-file", str(tmp / "key"),
            "--admin-api-key-file", str(tmp / "admin-key")]
    with EngineProcess(tiny_model_dir, args, log_path=tmp / "engine.log") as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir, second_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(second_model_dir, dtype=torch.float32).eval()
    return {"a": a, "b": b, "tok": AutoTokenizer.from_pretrained(tiny_model_dir)}


def auth(path: str) -> dict:
    """The right key for ``path``: the admin key for admin endpoints, else the API key."""
    return {"Authorization": f"Bearer {ADMIN_KEY if path in ADMIN_PATHS else API_KEY}"}


def post(eng, path, body=None, headers=None, timeout=60.0):
    return http_json("POST", eng.url + path, body, headers=auth(path) if headers is None else headers,
                     timeout=timeout)


def get(eng, path, headers=None):
    return http_json("GET", eng.url + path, headers=auth(path) if headers is None else headers)


def gen(eng, body, timeout=60.0):
    status, out = post(eng, "/generate", body, timeout=timeout)
    assert status == 200, out
    return out


def server_state(eng) -> dict:
    status, info = get(eng, "/get_server_info")
    assert status == 200
    return info["internal_states"][0]


def restore(eng, model_dir) -> None:
    status, out = post(eng, "/update_weights_from_disk", {"model_path": str(model_dir),
                                                          "weight_version": "default"})
    assert status == 200 and out["success"], out


def ids_of(tok, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


def hf_logprobs(model, prompts: list[list[int]], outputs: list[list[int]], temperatures: list[float]):
    """Per-token log-probs of ``prompt + output`` from one left-padded batched forward (mask + position ids).

    Returns, per row, (input log-probs for prompt tokens 1.., output log-probs), each
    ``log_softmax(logits / T)``.
    """
    seqs = [p + o for p, o in zip(prompts, outputs)]
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    result = []
    for i, s in enumerate(seqs):
        off = width - len(s)
        lp = torch.log_softmax(logits[i] / temperatures[i], dim=-1)
        per_token = [lp[off + j - 1, s[j]].item() for j in range(1, len(s))]  # token j given its prefix
        n_in = len(prompts[i])
        result.append((per_token[: n_in - 1], per_token[n_in - 1:]))
    return result


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def run_in_thread(fn, *args):
    pool = concurrent.futures.ThreadPoolExecutor(1)
    fut = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return fut


def wait_running(eng, at_least: int = 1, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server_state(eng)["num_running_reqs"] >= at_least:
            return
        time.sleep(0.02)
    raise AssertionError("requests did not start running")


PROMPTS = ["1+2=", "12*(3+4)=", "7", "100-99=1\n2+"]


# -------------------------------------------------------------------------------- health, info
def test_health_and_info(engine, tiny_model_dir):
    for path in ("/health", "/health_generate", "/ping", "/ready"):
        status, _ = get(engine, path)
        assert status == 200, path
    status, info = get(engine, "/get_model_info")
    assert status == 200
    assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
    assert info["model_type"] == "qwen2" and info["architectures"] == ["Qwen2ForCausalLM"]
    for key in ("served_model_name", "tokenizer_path", "weight_version"):
        assert key in info
    assert get(engine, "/model_info")[1]["model_path"] == info["model_path"]
    status, sinfo = get(engine, "/get_server_info")
    assert status == 200 and sinfo["dp_size"] == 1 and sinfo["tp_size"] == 1
    assert sinfo["model_path"] == str(tiny_model_dir) and sinfo["port"] == engine.port
    assert isinstance(sinfo["internal_states"], list) and "max_batch_rows" in sinfo["internal_states"][0]
    assert sinfo["version"] and sinfo["api_key"] == "<redacted>"
    assert get(engine, "/server_info")[1]["dp_size"] == 1
    status, models = get(engine, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == info["served_model_name"]


# -------------------------------------------------------------------------------- generation
def test_greedy_matches_hf(engine, hf_models):
    tok, model = hf_models["tok"], hf_models["a"]
    prompts = [ids_of(tok, p) for p in PROMPTS]
    out = gen(engine, {"input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 10,
                                                                  "ignore_eos": True}})
    assert len(out) == len(prompts)
    for p, o in zip(prompts, out):
        assert o["output_ids"] == hf_greedy(model, p, 10)
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        assert o["meta_info"]["prompt_tokens"] == len(p) and o["meta_info"]["completion_tokens"] == 10
        assert o["meta_info"]["cached_tokens"] == 0 and o["meta_info"]["e2e_latency"] >= 0
        assert o["text"] == tok.decode(o["output_ids"], skip_special_tokens=True)
    single = gen(engine, {"text": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 10,
                                                                   "ignore_eos": True}})
    assert isinstance(single, dict) and single["output_ids"] == out[0]["output_ids"]


def test_logprobs_match_transformers_forward(engine, hf_models):
    tok, model = hf_models["tok"], hf_models["a"]
    prompts = [ids_of(tok, p) for p in PROMPTS]
    temps = [0.7, 1.0, 0.0, 1.3]
    body = {"input_ids": prompts, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": [{"temperature": t, "max_new_tokens": 12, "ignore_eos": True, "top_k": 8}
                                for t in temps]}
    out = gen(engine, body)
    ref = hf_logprobs(model, prompts, [o["output_ids"] for o in out], [t if t > 0 else 1.0 for t in temps])
    for p, o, (ref_in, ref_out) in zip(prompts, out, ref):
        meta = o["meta_info"]
        outs = meta["output_token_logprobs"]
        assert meta["output_token_logprobs_length"] == len(outs) == 12
        assert [t for _, t, _ in outs] == o["output_ids"]
        assert max(abs(a[0] - b) for a, b in zip(outs, ref_out, strict=True)) < TOL
        ins = meta["input_token_logprobs"]
        assert [t for _, t, _ in ins] == p and ins[0][0] is None and len(ins) == len(p)
        if len(p) > 1:
            assert max(abs(a[0] - b) for a, b in zip(ins[1:], ref_in, strict=True)) < TOL
        assert len(meta["output_top_logprobs"]) == 12 and len(meta["output_top_logprobs"][0]) == 2
        assert meta["output_top_logprobs"][0][0][0] >= outs[0][0] - TOL
    # default logprob_start_len: one null entry for the last prompt token; text in logprobs on request
    o = gen(engine, {"text": PROMPTS[1], "return_logprob": True, "return_text_in_logprobs": True,
                     "sampling_params": {"max_new_tokens": 3}})
    assert o["meta_info"]["input_token_logprobs"] == [[None, ids_of(tok, PROMPTS[1])[-1], "="]]
    assert all(isinstance(x[2], str) for x in o["meta_info"]["output_token_logprobs"])


def test_sampling_seed_reproducible(engine):
    body = {"text": "3*3=", "sampling_params": {"temperature": 1.0, "max_new_tokens": 16,
                                                  "sampling_seed": 1234, "ignore_eos": True}}
    alone = gen(engine, body)["output_ids"]
    noise = {"input_ids": [[3, 4, 5, 6, 7, 8][: 1 + i % 6] for i in range(12)],
             "sampling_params": {"temperature": 1.0, "max_new_tokens": 20}}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        f1 = pool.submit(gen, engine, noise)
        f2 = pool.submit(gen, engine, body)
        f3 = pool.submit(gen, engine, noise)
        together = f2.result()["output_ids"]
        f1.result(), f3.result()
    assert together == alone
    other = gen(engine, {**body, "sampling_params": {**body["sampling_params"],
                                                     "sampling_seed": 99}})["output_ids"]
    assert other != alone


def test_n_samples_and_batch_order(engine):
    out = gen(engine, {"text": "5+5=", "sampling_params": {"n": 3, "max_new_tokens": 6, "temperature": 1.0}})
    assert isinstance(out, list) and len(out) == 3
    assert len({o["meta_info"]["id"] for o in out}) == 3
    out = gen(engine, {"input_ids": [[3, 4], [5, 6, 7, 8]],
                       "sampling_params": {"n": 2, "max_new_tokens": 4, "temperature": 1.0}})
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 2, 4, 4]
    two_n = [{"n": 2}, {"n": 1}]
    status, err = post(engine, "/generate", {"input_ids": [[3], [4]], "sampling_params": two_n})
    assert status == 400 and "n must be the same" in err["error"]["message"]
    status, err = post(engine, "/generate", {"input_ids": [[3], [4]], "sampling_params": [{"n": 2}]})
    assert status == 400 and "entries" in err["error"]["message"]


def test_stop_strings_tokens_and_finish_reasons(engine, hf_models):
    tok = hf_models["tok"]
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

    def run(**extra):
        return gen(engine, {"text": "12+", "sampling_params": {**greedy, **extra}})

    ids = run()["output_ids"]
    stop_char = tok.decode([ids[4]])
    first = next(j for j in range(len(ids)) if tok.decode([ids[j]]) == stop_char)
    o = run(stop=stop_char)
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_char}
    assert o["output_ids"] == ids[: first + 1]
    assert o["text"] == tok.decode(ids[:first], skip_special_tokens=True)
    assert run(stop=[stop_char], no_stop_trim=True)["text"].endswith(stop_char)
    o = run(stop_token_ids=[ids[first]])
    assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[first]}
    assert o["output_ids"][-1] == ids[first] and len(o["output_ids"]) == first + 1
    o = run(max_new_tokens=0)
    assert o["output_ids"] == [] and o["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_stream(engine):
    body = {"text": "9-", "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 5,
                                                                "ignore_eos": True}}
    req = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers=auth("/generate"))
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 5 and [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == gen(engine, {**body, "stream": False})["output_ids"]


def test_concurrent_requests_are_batched(engine):
    bodies = [{"input_ids": [3 + i % 10, 4, 5 + i % 7][: 1 + i % 3], "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 24}} for i in range(32)]
    # 32 requests in flight at once, all answered, in very few forward passes
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda b: gen(engine, b), bodies))
    assert len(outs) == 32
    for o in outs:
        fr = o["meta_info"]["finish_reason"]
        if fr["type"] == "stop":  # eos: a stop with the eos id, which ends output_ids and is not in the text
            assert fr["matched"] == EOS and o["output_ids"][-1] == EOS
        else:
            assert fr == {"type": "length", "length": 24} and len(o["output_ids"]) == 24
    # deterministic batching: queue 32 requests while paused, then let them run together
    before = server_state(engine)
    assert post(engine, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        pool = concurrent.futures.ThreadPoolExecutor(32)
        futs = [pool.submit(gen, engine, b) for b in bodies]
        deadline = time.monotonic() + 30
        while server_state(engine)["num_waiting_reqs"] < 32 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server_state(engine)["num_waiting_reqs"] == 32
    finally:
        post(engine, "/continue_generation")
    outs = [f.result(timeout=60) for f in futs]
    pool.shutdown()
    after = server_state(engine)
    assert after["requests_served"] - before["requests_served"] == 32
    assert after["max_prefill_rows"] >= 32 and after["max_batch_rows"] >= 2
    passes = after["batches_run"] - before["batches_run"]
    tokens = after["tokens_generated"] - before["tokens_generated"]
    assert tokens == sum(len(o["output_ids"]) for o in outs)
    assert passes <= 24 < tokens  # one prefill for all 32 rows, then at most 23 decode steps


def test_sglang_strict_protocol(engine):
    """What SGLang 0.5.23 refuses is refused here, with SGLang's bodies (issue #16 point 2)."""
    # an unknown sampling key: SGLang's contract error, a plain string body
    status, err = post(engine, "/generate", {"text": "1", "sampling_params": {"max_tokens": 8}})
    assert status == 400 and err["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`")
    # prompt + explicit max_new_tokens over the 256-token context: SGLang's message; the default is shortened
    status, err = post(engine, "/generate", {"input_ids": [3] * 200, "sampling_params": {"max_new_tokens": 100}})
    assert status == 400 and "maximum context length of 256 tokens" in err["error"]["message"]
    status, err = post(engine, "/generate", {"input_ids": [3] * 256})
    assert status == 400 and "longer than the model's context length" in err["error"]["message"]
    out = gen(engine, {"input_ids": [3] * 200, "sampling_params": {"temperature": 0, "ignore_eos": True}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 56}
    # SGLang fields this engine does not implement are refused when set, accepted when off
    for field, value in (("token_ids_logprob", [3, 4]), ("return_hidden_states", True), ("lora_id", "a"),
                         ("session_params", {"id": "s"}), ("image_data", "x.png")):
        status, err = post(engine, "/generate", {"text": "1", field: value})
        assert status == 400 and field in err["error"]["message"], (field, err)
        assert post(engine, "/generate", {"text": "1", field: None,
                                          "sampling_params": {"max_new_tokens": 1}})[0] == 200
    # an adapter asked of an engine started without --enable-lora: SGLang's message
    status, err = post(engine, "/generate", {"text": "1", "lora_path": ["a"]})
    assert status == 400 and err["error"]["message"].startswith("LoRA adapter 'a' was requested, but LoRA is not "
                                                                "enabled. Please launch the server with --enable-lora")
    # per-input log-prob options and a batch rid prefix
    outs = gen(engine, {"input_ids": [[3, 4, 5], [6, 7]], "rid": "b", "return_logprob": [True, False],
                        "logprob_start_len": [0, -1], "top_logprobs_num": [2, 0],
                        "sampling_params": {"max_new_tokens": 2}})
    assert [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1"]
    assert len(outs[0]["meta_info"]["input_token_logprobs"]) == 3 and len(outs[0]["meta_info"]["output_top_logprobs"][0]) == 2
    assert "input_token_logprobs" not in outs[1]["meta_info"]
    status, err = post(engine, "/generate", {"input_ids": [3], "return_logprob": [True],
                                             "sampling_params": {"n": 2}})
    assert status == 400 and "parallel_sample_num" in err["error"]["message"]
    assert gen(engine, {"input_ids": [3, 4], "return_prompt_token_ids": True,
                        "sampling_params": {"max_new_tokens": 1}})["prompt_token_ids"] == [3, 4]
    # the hpcrl-only aliases still answer (documented as such)
    assert get(engine, "/get_weight_version")[0] == 200 and get(engine, "/get_load")[0] == 200
    # no chat template on this engine: chat is a 400 that says how to give one
    status, err = post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}]})
    assert status == 400 and "--chat-template" in err["message"] and err["object"] == "error"


def test_bad_requests_are_400(engine):
    cases = [
        {"sampling_params": {"max_new_tokens": 2}},
        {"text": "1", "input_ids": [3]},
        {"input_ids": [3, 999]},
        {"input_ids": []},
        {"text": "1", "sampling_params": {"top_p": 0}},
        {"text": "1", "sampling_params": {"frequency_penalty": 0.5}},
        {"input_ids": [[3], [4]], "rid": ["only-one"]},
        {"input_ids": [3, 4], "return_routed_experts": True},  # a dense model routes nothing
    ]
    for body in cases:
        status, err = post(engine, "/generate", body)
        assert status == 400 and err["error"]["message"], body
    assert "no routed experts" in post(engine, "/generate", cases[-1])[1]["error"]["message"]
    req = urllib.request.Request(engine.url + "/generate", data=b"{not json", method="POST",
                                 headers=auth("/generate"))
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("expected 400")
    except urllib.error.HTTPError as e:
        assert e.code == 400


# -------------------------------------------------------------------------------- control
def test_abort_all_returns_partial_outputs(engine):
    long = {"sampling_params": {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}}
    futs = [run_in_thread(gen, engine, {"input_ids": [3, 4 + i], **long}) for i in range(3)]
    futs.append(run_in_thread(gen, engine, {"input_ids": [5, 6], "rid": "victim", **long}))
    wait_running(engine, 4)
    # freeze the batch mid-generation so the aborts below hit running requests whatever the machine's speed
    assert post(engine, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        assert post(engine, "/abort_request", {"rid": "victim"})[0] == 200
        victim = futs[-1].result(timeout=30)
        assert victim["meta_info"]["id"] == "victim"
        assert victim["meta_info"]["finish_reason"]["type"] == "abort"
        assert not any(f.done() for f in futs[:-1])
        assert post(engine, "/abort_request", {"abort_all": True})[0] == 200
        for f in futs[:-1]:
            o = f.result(timeout=30)
            assert o["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < len(o["output_ids"]) == o["meta_info"]["completion_tokens"] < 200
    finally:
        post(engine, "/continue_generation")
    assert server_state(engine)["num_running_reqs"] == 0


def test_pause_continue_and_flush(engine):
    long = {"input_ids": [3, 4, 5], "sampling_params": {"temperature": 1.0, "max_new_tokens": 200,
                                                          "ignore_eos": True}}
    # in_place: running rows keep their cache; flush refuses; new requests wait until continue
    fut = run_in_thread(gen, engine, long)
    wait_running(engine)
    status, body = post(engine, "/pause_generation", {"mode": "in_place"})
    assert status == 200 and body["status"] == "ok"
    assert post(engine, "/flush_cache")[0] == 400
    newcomer = run_in_thread(gen, engine, {"input_ids": [7], "sampling_params": {"max_new_tokens": 2}})
    time.sleep(0.5)
    assert not fut.done() and not newcomer.done()
    # paused: SGLang's /health_generate answers 503 (its probe waits unanswered); /health stays 200
    assert get(engine, "/health_generate")[0] == 503 and get(engine, "/health")[0] == 200
    assert post(engine, "/continue_generation")[1]["status"] == "ok"
    assert fut.result(timeout=60)["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert newcomer.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "length"
    # retract: the cache is dropped (flush succeeds), the request finishes after continue
    fut = run_in_thread(gen, engine, long)
    wait_running(engine)
    assert post(engine, "/pause_generation", {"mode": "retract"})[0] == 200
    status, text = post(engine, "/flush_cache")
    assert status == 200 and text.startswith("Cache flushed")
    assert not fut.done()
    post(engine, "/continue_generation")
    o = fut.result(timeout=60)
    assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert len(o["output_ids"]) == 200
    # abort (the default mode): running requests come back aborted
    fut = run_in_thread(gen, engine, long)
    wait_running(engine)
    assert post(engine, "/pause_generation", {})[0] == 200
    assert fut.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"
    post(engine, "/continue_generation")
    assert post(engine, "/pause_generation", {"mode": "sideways"})[0] == 400


def test_busy_seconds_count_generation_only(engine):
    """``busy_seconds`` in ``internal_states`` (issue #37: the engines' busy share): the wall seconds of steps
    that prefilled or decoded a row; idle time and a pause with a row held in place (KV cache kept, nothing
    computed) do not count."""
    long = {"input_ids": [3, 4, 5], "sampling_params": {"temperature": 1.0, "max_new_tokens": 200,
                                                          "ignore_eos": True}}
    time.sleep(0.1)  # the last step of an earlier test is counted just after its answer went out
    b0 = server_state(engine)["busy_seconds"]
    t0 = time.monotonic()
    gen(engine, {**long, "sampling_params": {**long["sampling_params"], "max_new_tokens": 60}})
    wall = time.monotonic() - t0
    time.sleep(0.3)
    b1 = server_state(engine)["busy_seconds"]
    assert 0.5 * wall < b1 - b0 <= wall + 0.05  # the HTTP round trips are not generation
    time.sleep(0.3)
    assert server_state(engine)["busy_seconds"] == b1  # idle
    fut = run_in_thread(gen, engine, long)
    wait_running(engine)
    assert post(engine, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        held = server_state(engine)["busy_seconds"]
        time.sleep(0.3)
        assert server_state(engine)["busy_seconds"] == held and server_state(engine)["num_running_reqs"] == 1
    finally:
        post(engine, "/continue_generation")
    fut.result(timeout=60)
    assert server_state(engine)["busy_seconds"] > held


def test_release_and_resume_memory(engine):
    assert post(engine, "/release_memory_occupation", {"tags": None}) == (200, None)
    assert get(engine, "/health_generate")[0] == 503  # released: no generation, as SGLang
    status, err = post(engine, "/generate", {"text": "1", "sampling_params": {"max_new_tokens": 1}})
    assert status == 503 and "kv_cache" in err["error"]["message"] and "weights" in err["error"]["message"]
    assert get(engine, "/health")[0] == 200
    assert post(engine, "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
    status, err = post(engine, "/generate", {"text": "1", "sampling_params": {"max_new_tokens": 1}})
    message = err["error"]["message"]
    assert status == 503 and "kv_cache" in message and "weights" not in message
    # all tags (null or []): "weights" is resumed already, which SGLang's scheduler would die of (KeyError)
    status, err = post(engine, "/resume_memory_occupation", {})
    assert status == 400 and err["error"]["message"] == state.resume_not_released(["weights"])
    assert post(engine, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) == (200, None)
    gen(engine, {"text": "1", "sampling_params": {"max_new_tokens": 1}})
    assert post(engine, "/release_memory_occupation", {"tags": ["gpu_stuff"]})[0] == 400
    assert post(engine, "/release_memory_occupation", {"tags": []}) == (200, None)  # [] is every tag
    assert post(engine, "/resume_memory_occupation", {"tags": None}) == (200, None)


# -------------------------------------------------------------------------------- SGLang's state rules
def session(eng, step: str, body=None) -> tuple[int, dict]:
    return post(eng, f"/{step}_weight_update", {} if body is None else body)


def test_tensor_and_distributed_updates_need_a_session(engine, hf_models, tiny_model_dir):
    """Rule 1 of hpcrl.engine.state: outside a session the gated updates are refused with SGLang's body and
    change nothing (the distributed one refuses without waiting for a broadcast); disk is not gated; begin
    and end pair up (no nested session, no end without begin)."""
    from hpcrl.engine.serialize import serialize_named_tensors

    before = server_state(engine)
    new = [(n, t.clone()) for n, t in hf_models["b"].state_dict().items()]
    status, body = post(engine, "/update_weights_from_tensor",
                        {"serialized_named_tensors": [serialize_named_tensors(new)], "weight_version": "x"})
    assert (status, body) == (400, {"success": False,
                                    "message": state.outside_session("update_weights_from_tensor")})
    status, body = post(engine, "/update_weights_from_distributed",
                        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]],
                         "group_name": "never-created"}, timeout=10)
    assert (status, body) == (400, {"success": False,
                                    "message": state.outside_session("update_weights_from_distributed")})
    _check_model_served(engine, hf_models, "a", "default")
    assert session(engine, "end") == (400, {"success": False, "message": state.END_WITHOUT_BEGIN})
    assert session(engine, "begin", {"selector": "drafts"})[0] == 400
    assert session(engine, "begin") == (200, {"success": True, "message": "Success"})
    try:
        assert session(engine, "begin") == (400, {"success": False, "message": state.NESTED_BEGIN})
        assert server_state(engine)["weight_update_session_open"] is True
        status, body = post(engine, "/update_weights_from_tensor",
                            {"serialized_named_tensors": [serialize_named_tensors(new)],
                             "weight_version": "s-1"})
        assert status == 200 and body["success"], body
        _check_model_served(engine, hf_models, "b", "s-1")
    finally:
        assert session(engine, "end") == (200, {"success": True, "message": "Success"})
        restore(engine, tiny_model_dir)  # disk: not gated, outside the session
    after = server_state(engine)
    assert after["weight_update_session_open"] is False
    assert after["weight_update_sessions_opened"] - before["weight_update_sessions_opened"] == 1
    assert after["weight_update_sessions_closed"] - before["weight_update_sessions_closed"] == 1
    del new


def test_release_only_when_idle(engine):
    """Rule 2: release needs a fully idle engine (SGLang asserts it): refused while a request runs, also when
    it is paused in place; allowed once a retract pause has taken the running rows back to the queue."""
    long = {"input_ids": [3, 4, 5], "sampling_params": {"temperature": 1.0, "max_new_tokens": 200,
                                                          "ignore_eos": True}}
    fut = run_in_thread(gen, engine, long)
    wait_running(engine)
    try:
        status, err = post(engine, "/release_memory_occupation", {"tags": None})
        assert (status, err) == (400, {"error": {"message": state.RELEASE_NOT_IDLE}})
        assert post(engine, "/pause_generation", {"mode": "in_place"})[0] == 200
        assert post(engine, "/release_memory_occupation", {"tags": None})[0] == 400
        assert post(engine, "/pause_generation", {"mode": "retract"})[0] == 200
        assert post(engine, "/release_memory_occupation", {"tags": None}) == (200, None)
        assert post(engine, "/resume_memory_occupation", {"tags": None}) == (200, None)
    finally:
        post(engine, "/continue_generation")
    assert fut.result(timeout=60)["meta_info"]["finish_reason"] == {"type": "length", "length": 200}


def test_flush_rule_under_in_place_pause(engine, hf_models, tiny_model_dir):
    """Rule 3: paused in place, the running rows keep their KV cache: /flush_cache answers SGLang's 400 text
    (after waiting with ?timeout=), and an update that asks for the flush loads the weights but answers 400
    and keeps the old version; with flush_cache false it succeeds."""
    from hpcrl.engine.serialize import serialize_named_tensors

    long = {"input_ids": [3, 4, 5], "sampling_params": {"temperature": 1.0, "max_new_tokens": 200,
                                                          "ignore_eos": True}}
    fut = run_in_thread(gen, engine, long)
    wait_running(engine)
    new = [(n, t.clone()) for n, t in hf_models["b"].state_dict().items()]
    assert post(engine, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        assert post(engine, "/flush_cache") == (400, state.FLUSH_FAILED)
        t0 = time.monotonic()
        assert post(engine, "/flush_cache?timeout=0.3",
                    headers=auth("/flush_cache")) == (400, state.FLUSH_TIMED_OUT)
        assert time.monotonic() - t0 >= 0.3  # a lower bound: it did wait its timeout, on any machine
        assert session(engine, "begin")[0] == 200
        body = {"serialized_named_tensors": [serialize_named_tensors(new)], "weight_version": "flush-1"}
        assert post(engine, "/update_weights_from_tensor", body) == (
            400, {"success": False, "message": state.UPDATE_NOT_FLUSHED})
        assert get(engine, "/get_model_info")[1]["weight_version"] == "default"
        body = {"serialized_named_tensors": [serialize_named_tensors(new)], "weight_version": "flush-2",
                "flush_cache": False}
        status, out = post(engine, "/update_weights_from_tensor", body)
        assert status == 200 and out["success"], out
        assert session(engine, "end")[0] == 200
    finally:
        post(engine, "/continue_generation")
        fut.result(timeout=60)
    _check_model_served(engine, hf_models, "b", "flush-2")
    restore(engine, tiny_model_dir)
    del new


def test_update_weight_version(engine):
    status, body = post(engine, "/update_weight_version", {"new_version": "step-7"})
    assert status == 200 and body == {"success": True, "message": "Weight version updated to step-7",
                                      "new_version": "step-7"}
    o = gen(engine, {"text": "1", "sampling_params": {"max_new_tokens": 1}})
    assert o["meta_info"]["weight_version"] == "step-7"
    assert get(engine, "/get_model_info")[1]["weight_version"] == "step-7"
    post(engine, "/update_weight_version", {"new_version": "default"})


# -------------------------------------------------------------------------------- weights
def _check_model_served(engine, hf_models, which: str, version: str) -> None:
    tok, model = hf_models["tok"], hf_models[which]
    prompts = [ids_of(tok, p) for p in PROMPTS[:3]]
    out = gen(engine, {"input_ids": prompts, "return_logprob": True, "logprob_start_len": 0,
                       "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}})
    ref = hf_logprobs(model, prompts, [o["output_ids"] for o in out], [1.0] * 3)
    for p, o, (ref_in, ref_out) in zip(prompts, out, ref, strict=True):
        meta = o["meta_info"]
        assert o["output_ids"] == hf_greedy(model, p, 6)
        assert max(abs(a[0] - b) for a, b in zip(meta["output_token_logprobs"], ref_out, strict=True)) < TOL
        assert all(abs(a[0] - b) < TOL for a, b in zip(meta["input_token_logprobs"][1:], ref_in, strict=True))
        assert meta["weight_version"] == version


def test_update_weights_from_disk(engine, hf_models, tiny_model_dir, second_model_dir):
    try:
        status, body = post(engine, "/update_weights_from_disk", {"model_path": str(second_model_dir),
                                                                   "weight_version": "disk-1"})
        assert status == 200 and body["success"] and "num_paused_requests" in body, body
        _check_model_served(engine, hf_models, "b", "disk-1")
        assert get(engine, "/get_model_info")[1]["weight_version"] == "disk-1"
        status, body = post(engine, "/update_weights_from_disk", {"model_path": "/nonexistent/model"})
        assert status == 400 and body["success"] is False and body["message"]
    finally:
        restore(engine, tiny_model_dir)
    _check_model_served(engine, hf_models, "a", "default")


def test_update_weights_from_tensor(engine, hf_models, tiny_model_dir):
    from hpcrl.engine.serialize import serialize_flattened_bucket, serialize_named_tensors

    new = {k: v.clone() for k, v in hf_models["b"].state_dict().items()}
    names = list(new)
    half = len(names) // 2
    assert session(engine, "begin")[0] == 200
    try:
        keep_alive = [(n, new[n]) for n in names[:half]]
        status, body = post(engine, "/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize_named_tensors(keep_alive)], "weight_version": "tensor-1"})
        assert status == 200 and body["success"], body
        bucket = [(n, new[n]) for n in names[half:]]
        status, body = post(engine, "/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize_flattened_bucket(bucket)],
            "load_format": "flattened_bucket",
            "weight_version": "tensor-2"})
        assert status == 200 and body["success"], body
        _check_model_served(engine, hf_models, "b", "tensor-2")
        # failures change nothing: unknown name, shape mismatch, unsupported format
        for bad in ([("model.nope.weight", torch.zeros(2))],
                    [("model.embed_tokens.weight", torch.zeros(3, 3)),
                     (names[0], torch.zeros_like(new[names[0]]))]):
            status, body = post(engine, "/update_weights_from_tensor",
                                {"serialized_named_tensors": [serialize_named_tensors(bad)]})
            assert status == 400 and body["success"] is False and body["message"], body
        status, body = post(engine, "/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize_named_tensors(keep_alive)], "load_format": "weird"})
        assert status == 400 and "weird" in body["message"]
        _check_model_served(engine, hf_models, "b", "tensor-2")
        del keep_alive, bucket
    finally:
        assert session(engine, "end")[0] == 200
        restore(engine, tiny_model_dir)


def test_update_weights_from_distributed(engine, hf_models, tiny_model_dir):
    import datetime

    from hpcrl.engine.weights import init_custom_process_group

    port = free_port()
    group = "hpcrl-test-group"
    init = run_in_thread(post, engine, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": group,
        "backend": "gloo" if torch.cuda.is_available() else "nccl"})  # nccl -> gloo on CPU
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group,
                                   datetime.timedelta(seconds=60))
    status, body = init.result(timeout=60)
    assert status == 200 and body["success"], body
    assert session(engine, "begin")[0] == 200
    try:
        new = hf_models["b"].state_dict()
        names = list(new)
        call = run_in_thread(post, engine, "/update_weights_from_distributed", {
            "names": names, "dtypes": [str(new[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(new[n].shape) for n in names], "group_name": group, "weight_version": "dist-1"})
        for n in names:
            torch.distributed.broadcast(new[n].contiguous(), src=0, group=pg)
        status, body = call.result(timeout=60)
        assert status == 200 and body["success"], body
        _check_model_served(engine, hf_models, "b", "dist-1")
        # an unknown name is refused after the broadcast is received, and nothing changes
        call = run_in_thread(post, engine, "/update_weights_from_distributed", {
            "names": ["model.nope"], "dtypes": ["float32"], "shapes": [[2]], "group_name": group})
        torch.distributed.broadcast(torch.zeros(2), src=0, group=pg)
        status, body = call.result(timeout=60)
        assert status == 400 and body["success"] is False and "model.nope" in body["message"]
        _check_model_served(engine, hf_models, "b", "dist-1")
    finally:
        assert session(engine, "end")[0] == 200
        status, body = post(engine, "/destroy_weights_update_group", {"group_name": group})
        torch.distributed.destroy_process_group(pg)
        restore(engine, tiny_model_dir)
    assert status == 200 and body["success"]


# -------------------------------------------------------------------------------- auth
def test_api_key_required(engine, tiny_model_dir, tmp_path):
    gen_body = {"text": "1", "sampling_params": {"max_new_tokens": 2}}
    user = {"Authorization": f"Bearer {API_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"x-api-key": API_KEY}):
        assert post(engine, "/generate", gen_body, headers=headers) == (401, {"error": "Unauthorized"})
        assert get(engine, "/get_model_info", headers=headers)[0] == 401
        assert get(engine, "/get_server_info", headers=headers)[0] == 401
        assert get(engine, "/v1/models", headers=headers)[0] == 401
        assert post(engine, "/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]},
                    headers=headers)[0] == 401
        assert post(engine, "/abort_request", {"abort_all": True}, headers=headers)[0] == 401
    assert post(engine, "/generate", gen_body, headers=user)[0] == 200
    assert get(engine, "/get_model_info", headers=user)[0] == 200
    status, info = get(engine, "/get_server_info", headers=user)
    assert status == 200 and info["api_key"] == "<redacted>" and info["admin_api_key"] == "<redacted>"
    assert API_KEY not in json.dumps(info) and ADMIN_KEY not in json.dumps(info)
    # admin endpoints take the admin key, not the API key
    assert post(engine, "/pause_generation", {"mode": "in_place"}, headers=user)[0] == 401
    assert post(engine, "/abort_request", {"abort_all": True}, headers=user)[0] == 401  # SGLang: admin only
    assert post(engine, "/abort_request", {"abort_all": True}, headers=admin)[0] == 200
    assert post(engine, "/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]},
                headers=user)[0] == 401
    assert post(engine, "/pause_generation", {"mode": "in_place"}, headers=admin)[0] == 200
    assert post(engine, "/continue_generation", {}, headers=admin)[0] == 200
    assert post(engine, "/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]},
                headers=admin)[0] == 400
    # health and readiness stay open for probes (as in SGLang; sglang-router's first probe has no key)
    for path in ("/health", "/health_generate", "/ready"):
        assert get(engine, path, headers={})[0] == 200
    # a key file that others can read is refused before anything is loaded
    bad_file = tmp_path / "open-key"
    bad_file.write_text("k")
    os.chmod(bad_file, 0o644)
    from hpcrl.engine.server import main

    assert main(["--model-path", str(tiny_model_dir), "--api-key-file", str(bad_file)]) == 2


def test_v1_loads_counts_running_and_waiting_rows(engine):
    """``/v1/loads`` in SGLang 0.5's shape: one load per data-parallel rank with the row counts."""
    status, idle = get(engine, "/v1/loads")
    assert status == 200 and idle["loads"][0]["num_running_reqs"] == 0, idle
    assert {"timestamp", "version", "loads"} <= set(idle)
    assert idle["loads"][0]["dp_rank"] == 0 and idle["loads"][0]["num_waiting_reqs"] == 0
    long = {"input_ids": [3, 4, 5], "sampling_params": {"temperature": 1.0, "max_new_tokens": 253,
                                                          "ignore_eos": True}}
    post(engine, "/pause_generation", {"mode": "in_place"})
    futs = [run_in_thread(gen, engine, long) for _ in range(3)]
    deadline = time.monotonic() + 20
    while get(engine, "/v1/loads")[1]["loads"][0]["num_waiting_reqs"] < 3:
        assert time.monotonic() < deadline, get(engine, "/v1/loads")
        time.sleep(0.05)
    post(engine, "/continue_generation")
    wait_running(engine, at_least=3)
    assert get(engine, "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 3
    post(engine, "/abort_request", {"abort_all": True})
    for f in futs:
        assert f.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "abort"  # asked for: a 200


def test_engine_failure_is_an_http_error_not_an_abort(tiny_model_dir, tmp_path):
    """A request the engine cannot finish because it fails (here: it is shutting down) is answered with HTTP
    503, as SGLang does, so a client or router retries it elsewhere instead of recording an aborted sample."""
    with EngineProcess(tiny_model_dir, log_path=tmp_path / "engine.log") as eng:
        long = {"input_ids": [3, 4, 5], "sampling_params": {"temperature": 1.0, "max_new_tokens": 253,
                                                              "ignore_eos": True}}
        fut = run_in_thread(http_json, "POST", eng.url + "/generate", long, None, 60.0)
        deadline = time.monotonic() + 20
        while http_json("GET", eng.url + "/get_load")[1][0]["num_running_reqs"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        eng.proc.terminate()
        status, body = fut.result(timeout=30)
        assert status == 503, (status, body)
        assert "stopped" in body["error"]["message"]
