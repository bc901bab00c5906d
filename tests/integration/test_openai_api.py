"""The OpenAI-compatible endpoints with the real ``openai`` package as the client, against one hpcrl engine and
through the real sglang-router in front of two (issue #16 point 1).

Reference values come from the same engine's native ``/generate`` (greedy, so both APIs must produce the same
tokens, text and log-probs) and from transformers' ``apply_chat_template`` with the same template.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

try:
    from tests.integration.engine_utils import EngineProcess, http_json
except ImportError:  # tests/integration is not a package
    from engine_utils import EngineProcess, http_json

pytestmark = pytest.mark.integration

KEY = "oa-key"
# The tiny model's character tokenizer knows digits, + - * = ( ), space and newline only: the template uses
# just the contents, one per line, and "=" as the generation prompt.
TEMPLATE = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}={% endif %}")
MESSAGES = [{"role": "system", "content": "1+1=2"}, {"role": "user", "content": "2+3"}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def engines(tiny_model_dir, template_file, tmp_path_factory):
    """Two engines with the key and the chat template (the first is also used alone)."""
    tmp = tmp_path_factory.mktemp("oa")
    procs = [EngineProcess(tiny_model_dir, ["--api-key", KEY, "--chat-template", str(template_file)],
                           log_path=tmp / f"engine{i}.log") for i in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.start(start_timeout=120), procs))
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def router(engines, tmp_path_factory):
    from hpcrl.rollout.router import start_router

    r = start_router([e.url for e in engines], api_key=KEY, log_path=tmp_path_factory.mktemp("r") / "router.log")
    try:
        yield r
    finally:
        r.stop()


def client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def native(eng, body):
    status, out = http_json("POST", eng.url + "/generate", body, headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, out
    return out


def test_completions_equal_native_generate(engines):
    eng = engines[0]
    c = client(eng.url)
    r = c.completions.create(model="tiny", prompt="12+3=", max_tokens=6, temperature=0, logprobs=2,
                             extra_body={"return_token_ids": True, "ignore_eos": True})
    ref = native(eng, {"text": "12+3=", "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                              "ignore_eos": True},
                       "return_logprob": True, "top_logprobs_num": 2, "return_prompt_token_ids": True})
    choice = r.choices[0]
    assert choice.text == ref["text"] and choice.finish_reason == "length"
    extra = choice.model_extra
    assert extra["token_ids"] == ref["output_ids"] and extra["prompt_token_ids"] == ref["prompt_token_ids"]
    assert len(ref["prompt_token_ids"]) == 5  # one token per character
    assert choice.logprobs.token_logprobs == pytest.approx([t[0] for t in ref["meta_info"]["output_token_logprobs"]])
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6 and r.usage.total_tokens == 11
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    # n samples of two prompts: input-major choices, each prompt counted once in usage
    r = c.completions.create(model="tiny", prompt=["1+", "2+2="], max_tokens=3, n=3, temperature=1.0,
                             extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == list(range(6))
    assert r.usage.prompt_tokens == 2 + 4 and r.usage.completion_tokens == 18
    # stop strings end the text as in /generate (matched string trimmed, finish "stop")
    r = c.completions.create(model="tiny", prompt="1", max_tokens=40, temperature=0, stop=["2"],
                             extra_body={"ignore_eos": True})
    ref = native(eng, {"text": "1", "sampling_params": {"max_new_tokens": 40, "temperature": 0, "stop": ["2"],
                                                          "ignore_eos": True}})
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == {"stop": "stop", "length": "length"}[ref["meta_info"]["finish_reason"]["type"]]


def test_chat_renders_the_template_and_streams(engines, tiny_model_dir):
    from transformers import AutoTokenizer

    eng = engines[0]
    c = client(eng.url)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = tok(tok.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    ch = r.choices[0]
    assert ch.model_extra["prompt_token_ids"] == expected
    ref = native(eng, {"input_ids": expected, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert ch.message.role == "assistant" and ch.message.content == ref["text"]
    assert ch.model_extra["response_token_ids"] == ref["output_ids"]
    assert [t.logprob for t in ch.logprobs.content] == pytest.approx(
        [t[0] for t in ref["meta_info"]["output_token_logprobs"]])
    assert all(len(t.top_logprobs) == 3 for t in ch.logprobs.content)
    assert r.usage.prompt_tokens == len(expected) and r.usage.completion_tokens == 5
    # /tokenize renders the same ids; /detokenize inverts it
    status, body = http_json("POST", eng.url + "/tokenize", {"messages": MESSAGES},
                             headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["tokens"] == expected and body["count"] == len(expected)
    status, body = http_json("POST", eng.url + "/v1/detokenize", {"tokens": [expected, [4, 5]]},
                             headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["text"] == [tok.decode(expected, skip_special_tokens=True), "12"]
    # streaming: the deltas add up to the same greedy text; the role comes first; usage comes last
    chunks = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(k.choices[0].delta.content or "" for k in chunks if k.choices) == ref["text"]
    assert [k.choices[0].finish_reason for k in chunks if k.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    # a streamed completion with a stop string never sends the trimmed part
    text = "".join(k.choices[0].text for k in c.completions.create(
        model="tiny", prompt="1", max_tokens=40, temperature=0, stop=["2"], stream=True,
        extra_body={"ignore_eos": True}) if k.choices)
    assert text == c.completions.create(model="tiny", prompt="1", max_tokens=40, temperature=0, stop=["2"],
                                        extra_body={"ignore_eos": True}).choices[0].text


def test_bad_requests_get_openai_error_bodies(engines):
    eng = engines[0]
    c = client(eng.url)
    with pytest.raises(openai.AuthenticationError) as e:
        client(eng.url, key="wrong").models.list()
    assert e.value.status_code == 401
    cases = [
        dict(prompt="1", max_tokens=-1),                        # validation: max_tokens must be positive
        dict(prompt="1", max_tokens=4, frequency_penalty=0.5),  # an SGLang field this engine does not implement
        dict(prompt="1", max_tokens=4, echo=True),
        dict(prompt="1", max_tokens=500),                       # prompt + max_tokens over the 256-token context
        dict(prompt="1", max_tokens=4, logprobs=50),
    ]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", **kw)
        body = e.value.body
        assert e.value.status_code == 400 and body["object"] == "error" and body["code"] == 400, (kw, body)
        assert body["message"] and body["type"] == "BadRequestError", body
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="1", max_tokens=500)
    assert "maximum context length of 256 tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"content": "no role"}], max_tokens=2)
    assert "role" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, tool_choice="required",
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert e.value.body["param"] == "tool_choice"
    models = c.models.list()
    assert [m.id for m in models.data] == [str(eng.model_path)]


def test_openai_client_through_sglang_router(engines, router):
    c = client(router.url)
    direct = client(engines[0].url)
    want = direct.completions.create(model="tiny", prompt="3*3=", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    for _ in range(4):  # round robin: both engines answer, with the same weights the same text
        r = c.completions.create(model="tiny", prompt="3*3=", max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
    chat = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == direct.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].message.content
    streamed = "".join(k.choices[0].delta.content or "" for k in c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if k.choices)
    assert streamed == chat.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        client(router.url, key="wrong").completions.create(model="tiny", prompt="1", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:  # the engine's 400 passes through the router
        c.completions.create(model="tiny", prompt="1", max_tokens=4, frequency_penalty=0.5)
    assert "frequency_penalty" in str(e.value)
