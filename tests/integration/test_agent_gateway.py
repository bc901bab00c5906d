"""Agent sessions over real HTTP (issue #17): a real engine, hpcrl's rollout client, the gateway, agents that
use the real ``openai`` package, and an external command written without hpcrl imports.

Token-exactness is checked against the engine itself: the sample's trainable log-probs equal what the engine
computes for the sample's tokens in one prefill (``max_new_tokens: 0`` with input log-probs), which only holds
when the ids trained on are the ids the engine saw and produced.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap

import pytest

try:
    from tests.integration.engine_utils import EngineProcess, http_json
except ImportError:  # tests/integration is not a package
    from engine_utils import EngineProcess, http_json

pytestmark = pytest.mark.integration

# The tiny tokenizer knows digits, + - * = ( ), space, newline and </s>. Like a real chat template, an assistant
# turn renders as the generation prompt ("=") + the reply + the end of turn (</s>, the eos the policy generates);
# user turns as their content; one turn per line ({{ '\n' }}: transformers renders with trim_blocks).
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}={{ m['content'] }}</s>"
            "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}={% endif %}")
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "no_stop_trim": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    with EngineProcess(tiny_model_dir, log_path=tmp_path_factory.mktemp("agent") / "engine.log") as eng:
        yield eng


def run(coro):
    return asyncio.run(coro)


def _auth(engine) -> dict:
    key = getattr(engine, "api_key", None)  # real SGLang (tests/sglang) is started with one
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _with_gateway(engine, body, tool_parser=None):
    """Run ``body(gateway, client)`` with a gateway in front of the engine through a RolloutClient
    (``engine``: ``url``, ``model_path`` and, where it has one, ``api_key``)."""
    from transformers import AutoTokenizer

    from hpcrl.agent.gateway import AgentGateway
    from hpcrl.rollout.client import RolloutClient

    tok = AutoTokenizer.from_pretrained(engine.model_path)
    async with RolloutClient(None, [engine.url], api_key=getattr(engine, "api_key", None),
                             timeout_s=60) as client:
        async def generate(ids, sp):
            return await client.generate(ids, sp, return_logprob=True)

        gateway = AgentGateway(generate, tok, SAMPLING, 256, chat_template=TEMPLATE, tool_parser=tool_parser)
        await gateway.start()
        try:
            return await body(gateway, client, tok)
        finally:
            await gateway.stop()


async def chat_agent(item, *, base_url, api_key, session_id):
    """Three turns, resending the whole history each time (as OpenAI agents do)."""
    import openai

    c = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["prompt"]}]
    for follow_up in ("1+2", "3*4", None):
        r = await c.chat.completions.create(model="policy", messages=messages, max_tokens=5,
                                            extra_body={"ignore_eos": False})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        if follow_up is None:
            return r.choices[0].message.content
        messages.append({"role": "user", "content": follow_up})


def _prefill_log_probs(engine, tokens, start):
    status, out = http_json("POST", engine.url + "/generate", {
        "input_ids": tokens, "return_logprob": True, "logprob_start_len": start,
        "sampling_params": {"max_new_tokens": 0}}, headers=_auth(engine), timeout=120)
    assert status == 200, out
    return [t[0] for t in out["meta_info"]["input_token_logprobs"]]


def test_an_episode_is_one_token_exact_sample(engine):
    from hpcrl.agent.runner import agent_generate
    from hpcrl.data.sample import Sample, Status

    async def body(gateway, client, tok):
        gen = agent_generate(gateway, chat_agent, [], timeout_s=60, failure_reward=0.0, eos_id=2)
        return await gen(client, Sample(prompt="12+3", index=5), {"sampling_seed": 11})

    s = run(_with_gateway(engine, body))
    assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.metadata["agent_calls"] == 3
    assert s.metadata["agent_chains"] == 1 and "agent_failure" not in s.metadata
    assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs)
    trained = [i for i, m in enumerate(s.loss_mask) if m]
    masked = [i for i, m in enumerate(s.loss_mask) if not m]
    assert trained and masked  # generated turns trained; user turns and template glue masked out
    # the engine, fed the sample's tokens in one prefill, gives the recorded log-probs of every trained token
    prompt_len = s.prompt_length
    recomputed = _prefill_log_probs(engine, s.tokens, prompt_len - 1)[1:]
    assert len(recomputed) == s.response_length
    for i in trained:
        assert abs(recomputed[i] - s.rollout_log_probs[i]) < 1e-4, i
    assert all(s.rollout_log_probs[i] == 0.0 for i in masked)
    status, info = http_json("GET", engine.url + "/get_model_info", headers=_auth(engine))
    assert status == 200 and s.weight_versions == [info["weight_version"]] * 3  # "default" if never synced


def test_sessions_are_isolated_and_closed_keys_refused(engine):
    import openai

    async def body(gateway, client, tok):
        a, b = gateway.open({"prompt": "1"}), gateway.open({"prompt": "2"})
        ca = openai.AsyncOpenAI(base_url=gateway.url, api_key=a.key, max_retries=0)
        await ca.completions.create(model="policy", prompt="1+1=", max_tokens=2)
        assert len(a.calls) == 1 and b.calls == []  # the call went to its own session only
        base = gateway.url.rsplit("/v1", 1)[0]
        # a session's key cannot post another session's reward; its own works
        status, _ = await asyncio.to_thread(http_json, "POST", f"{base}/v1/sessions/{b.session_id}/reward",
                                            {"reward": 1.0}, {"Authorization": f"Bearer {a.key}"})
        assert status == 401 and b.reward is None
        status, out = await asyncio.to_thread(http_json, "POST", f"{base}/v1/sessions/{a.session_id}/reward",
                                              {"reward": 0.5}, {"Authorization": f"Bearer {a.key}"})
        assert status == 200 and a.reward == 0.5
        status, _ = await asyncio.to_thread(http_json, "POST", f"{base}/v1/sessions/{a.session_id}/reward",
                                            {"reward": "high"}, {"Authorization": f"Bearer {a.key}"})
        assert status == 400
        gateway.close(a)
        with pytest.raises(openai.AuthenticationError):
            await ca.completions.create(model="policy", prompt="1", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=gateway.url, api_key="guess", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError):  # one episode per session
            await openai.AsyncOpenAI(base_url=gateway.url, api_key=b.key, max_retries=0).completions.create(
                model="policy", prompt="1", max_tokens=2, n=2)

    run(_with_gateway(engine, body))


def test_failed_episodes_have_a_reason_and_never_hang(engine, tmp_path):
    from hpcrl.agent.runner import agent_generate
    from hpcrl.data.sample import Sample, Status

    async def sleeper(item, **kw):
        await asyncio.sleep(60)

    async def silent(item, **kw):
        return "42"

    async def rewriter(item, *, base_url, api_key, session_id):
        import openai

        c = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = [{"role": "user", "content": "1+1"}]
        await c.chat.completions.create(model="p", messages=msgs, max_tokens=3)
        msgs += [{"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2"}]  # not what it said
        r = await c.chat.completions.create(model="p", messages=msgs, max_tokens=3)
        return r.choices[0].message.content

    # a shell (ready in milliseconds) writes its pid and becomes `sleep`: a Python child took over the agent's
    # 1 s timeout to start on a loaded machine, killed before it wrote the file (CI, 2026-12-07)
    sleep_cmd = ["sh", "-c", 'echo $$ > "$0"; exec sleep 60', str(tmp_path / "sleeper.pid")]
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nsys.stderr.write('tool server unreachable\\n')\nsys.exit(3)\n")

    async def body(gateway, client, tok):
        out = {}
        for name, fn, cmd, timeout in (("timeout", sleeper, [], 1.0), ("no_calls", silent, [], 30),
                                       ("crash", None, [sys.executable, str(crash)], 30),
                                       ("rewrite", rewriter, [], 30),
                                       ("cmd_timeout", None, sleep_cmd, 1.0)):
            gen = agent_generate(gateway, fn, cmd, timeout_s=timeout, failure_reward=-1.0, eos_id=2)
            t0 = asyncio.get_running_loop().time()
            out[name] = (await gen(client, Sample(prompt="1"), {}), asyncio.get_running_loop().time() - t0)
        from hpcrl.rollout.teacher import score_sample  # OPD's teacher scoring, one prefill per chain

        out["teacher"] = await score_sample(client, out["rewrite"][0], SAMPLING["temperature"])
        return out

    out = run(_with_gateway(engine, body))
    s, secs = out["timeout"]  # the agent is given timeout_s=1: 5 s leaves 4x for a loaded machine
    assert s.status == Status.FAILED and "timeout_s=1" in s.metadata["agent_failure"] and secs < 5
    assert s.reward == -1.0 and s.response_length == 1 and s.loss_mask == [0]
    s, _ = out["no_calls"]
    assert s.status == Status.FAILED and "no call" in s.metadata["agent_failure"]
    s, _ = out["crash"]
    assert s.status == Status.FAILED and "status 3" in s.metadata["agent_failure"]
    assert "tool server unreachable" in s.metadata["agent_failure"]
    s, secs = out["cmd_timeout"]  # the command is ended with its process group, not waited for
    assert s.status == Status.FAILED and "timeout_s=1" in s.metadata["agent_failure"] and secs < 5
    pid = int((tmp_path / "sleeper.pid").read_text())
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    s, _ = out["rewrite"]  # the rewritten history split the episode: one segment per chain, both trained
    assert s.status != Status.FAILED and s.metadata["agent_chains"] == 2 and len(s.segments) == 2
    (a0, b0), (a1, b1) = s.segment_bounds()
    assert (a0, b1) == (0, len(s.tokens)) and b0 == a1 > s.prompt_length
    mask = [0] * s.prompt_length + s.loss_mask  # per token of the sample
    assert any(mask[a0:b0]) and any(mask[a1:b1]) and not mask[a1]  # the second chain's prompt is masked
    assert len(s.weight_versions) == 2
    # each chain, prefilled on its own by the engine, gives the recorded log-probs of its trained tokens
    lp = [0.0] * s.prompt_length + s.rollout_log_probs
    for a, b in s.segment_bounds():
        recomputed = [0.0] + _prefill_log_probs(engine, s.tokens[a:b], 0)[1:]
        for j in range(a, b):
            if mask[j]:
                assert abs(recomputed[j - a] - lp[j]) < 1e-4, j
    teacher = out["teacher"]  # the policy's own engine as the teacher: its log-probs are the rollout's
    assert len(teacher) == s.response_length
    assert all(abs(t - r) < 1e-4 for t, r, m in zip(teacher, s.rollout_log_probs, s.loss_mask) if m)


AGENT_SCRIPT = textwrap.dedent('''
    """An agent in plain Python (no hpcrl import): reads the task from stdin, asks the policy twice through
    OPENAI_BASE_URL with urllib, posts a reward, prints its answer."""
    import json, os, sys, urllib.request

    item = json.loads(sys.stdin.read())
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]

    def post(path, body):
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())

    messages = [{"role": "user", "content": item["prompt"]}]
    for _ in range(2):
        reply = post("/chat/completions", {"model": "policy", "messages": messages, "max_tokens": 4})
        messages += [reply["choices"][0]["message"], {"role": "user", "content": "1"}]
    post("/sessions/" + os.environ["HPCRL_SESSION_ID"] + "/reward", {"reward": 0.25})
    print(messages[-2]["content"])
''')


def test_an_external_command_agent(engine, tmp_path):
    from hpcrl.agent.runner import agent_generate
    from hpcrl.data.sample import Sample, Status

    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)

    async def body(gateway, client, tok):
        gen = agent_generate(gateway, None, [sys.executable, str(script)], timeout_s=60, failure_reward=0.0,
                             eos_id=2)
        return await gen(client, Sample(prompt="2*3"), {"sampling_seed": 5})

    s = run(_with_gateway(engine, body))
    assert s.status != Status.FAILED, s.metadata
    assert s.metadata["agent_calls"] == 2 and s.metadata["agent_chains"] == 1 and s.reward == 0.25
    assert sum(s.loss_mask) > 0 and 0 in s.loss_mask

