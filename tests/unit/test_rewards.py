"""Rewards: verifiers, the reward-function resolver (task, built-ins, custom dotted rm), a remote reward model
against a live local aiohttp server, batched scoring, and the dynamic filter."""

from __future__ import annotations

import asyncio
import contextlib
import textwrap

import pytest
from aiohttp import web

from hpcrl.config import Config
from hpcrl.data.sample import Sample
from hpcrl.data.tasks import make_task
from hpcrl.plugin_loader import PluginError
from hpcrl.rewards import (
    RemoteRewardError,
    countdown,
    exact_match,
    extract_answer_text,
    extract_math_answer,
    get_reward_function,
    math_answer,
    remote_rm,
)
from hpcrl.rollout.filters import get_dynamic_filter, nonzero_std

# ---------------------------------------------------------------------------------------------- verifiers


def test_exact_match():
    assert exact_match(" 579\n", "579") == 1.0
    assert exact_match("578", "579") == 0.0
    assert exact_match("5", 5) == 1.0
    assert exact_match("None", None) == 0.0


@pytest.mark.parametrize("response,label,expected", [
    ("so \\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\frac{1}{\\sqrt{2}}} and more", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("The answer is 42.", 42, 1.0),
    ("The answer is $5.00", "5", 1.0),
    ("first 3 then 7", "7", 1.0),
    ("first 7 then 3", "7", 0.0),
    ("x = 0.3333333", "1/3", 1.0),
    ("x = 0.33", "1/3", 0.0),
    ("\\boxed{x^2+1}", "x^2 + 1", 1.0),
    ("Answer: 50%", "50", 1.0),
    ("72", "She sold 48/2 = 24 clips in May. #### 72", 1.0),
    ("24", "She sold 48/2 = 24 clips in May. #### 72", 0.0),
    ("the answer is -4", "-4.0", 1.0),
    ("no number here", "3", 0.0),
    ("", "3", 0.0),
    ("3", None, 0.0),
])
def test_math_answer(response, label, expected):
    assert math_answer(response, label) == expected


def test_extractors():
    assert extract_math_answer("a \\boxed{1} b \\boxed{2{3}} c") == "2{3}"
    assert extract_math_answer("nothing") is None
    assert extract_answer_text("  \n -4 \nQ: next") == "-4"
    assert extract_answer_text("think <answer>1</answer> more <answer> 2 </answer>") == "2"
    assert extract_answer_text("") == ""


def test_countdown_verifier():
    numbers, target = [6, 61, 94, 4], 309
    assert countdown("94*4 - 61 - 6", numbers, target) == 1.0
    assert countdown("<answer>94*4 - 61 - 6 = 309</answer>", numbers, target) == 1.0
    assert countdown("6 + 61", numbers, target) < 0.1  # wrong numbers: reasoning-gym gives 0.05
    assert countdown("94*4 - 61 + 6", numbers, target) < 0.1  # wrong value
    assert countdown("", numbers, target) < 0.1


# ---------------------------------------------------------------------------------------------- resolver


def cfg_reward(name):
    cfg = Config()
    cfg.rollout.reward_function = name
    return cfg


def run(coro):
    return asyncio.run(coro)


def test_task_and_builtin_rewards():
    task = make_task("reasoning_gym:countdown")
    item = task.generate(1, seed=0)[0]
    s = Sample(prompt=item["prompt"], label=item["label"], metadata=item["metadata"], response=item["label"])
    assert run(get_reward_function(cfg_reward("task"), task)(s)) == 1.0
    assert run(get_reward_function(cfg_reward("countdown"))(s)) == 1.0
    s.response = "1 + 2"
    assert run(get_reward_function(cfg_reward("task"), task)(s)) == 0.0
    assert run(get_reward_function(cfg_reward("countdown"))(s)) == pytest.approx(0.05)

    add = make_task("addition")
    s = Sample(prompt="1+2=", label="3", response="3")
    assert run(get_reward_function(cfg_reward("task"), add)(s)) == 1.0
    assert run(get_reward_function(cfg_reward("exact_match"))(s)) == 1.0
    s.response = "so the answer is 3."
    assert run(get_reward_function(cfg_reward("exact_match"))(s)) == 0.0
    assert run(get_reward_function(cfg_reward("math_answer"))(s)) == 1.0
    with pytest.raises(ValueError, match="no 'numbers' and 'target'"):
        run(get_reward_function(cfg_reward("countdown"))(s))


@pytest.mark.parametrize("name,match", [
    ("task", "needs the data source's task"),
    ("bleu", "unknown reward 'bleu'; known: task, exact_match, math_answer, countdown, remote_rm:<url>"),
    ("remote_rm", "needs the server URL"),
])
def test_reward_resolver_errors(name, match):
    with pytest.raises(ValueError, match=match):
        get_reward_function(cfg_reward(name), None)


@pytest.fixture
def rm_module(tmp_path, monkeypatch):
    """A module ``hpcrl_test_rm`` with slime-style custom rms (async, sync, dict-valued, wrong type)."""
    (tmp_path / "hpcrl_test_rm.py").write_text(textwrap.dedent("""
        import asyncio

        async def async_rm(args, sample):
            await asyncio.sleep(0)
            return 1.0 if sample.response.strip() == str(sample.label) else 0.0

        def sync_rm(args, sample):
            return len(sample.response) + args.run.seed

        async def dict_rm(args, sample):
            return {"reward": 0.5, "format": 1}

        def bad_rm(args, sample):
            return "high"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "hpcrl_test_rm"


def test_custom_dotted_rm(rm_module):
    s = Sample(prompt="1+2=", label="3", response="3")
    assert run(get_reward_function(cfg_reward(f"{rm_module}.async_rm"))(s)) == 1.0
    cfg = cfg_reward(f"{rm_module}.sync_rm")
    cfg.run.seed = 10
    assert run(get_reward_function(cfg)(s)) == 11.0  # ``args`` is the Config
    assert run(get_reward_function(cfg_reward(f"{rm_module}.dict_rm"))(s)) == {"reward": 0.5, "format": 1.0}
    with pytest.raises(TypeError, match=f"reward function {rm_module}.bad_rm returned str"):
        run(get_reward_function(cfg_reward(f"{rm_module}.bad_rm"))(s))
    with pytest.raises(PluginError, match="has no attribute 'nope'"):
        get_reward_function(cfg_reward(f"{rm_module}.nope"))


# ---------------------------------------------------------------------------------------------- remote rm


@contextlib.asynccontextmanager
async def reward_server(handler):
    """A real aiohttp server on 127.0.0.1 (random port) with ``POST /reward``; yields its URL."""
    app = web.Application()
    app.router.add_post("/reward", handler)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/reward"
    finally:
        await runner.cleanup()


def test_remote_rm_retries_after_500_via_config():
    seen = []

    async def handler(request):
        body = await request.json()
        seen.append(body)
        if len(seen) == 1:
            return web.Response(status=500, text="warming up")
        return web.json_response({"reward": 1.0 if body["response"] == body["label"] else 0.0})

    async def main():
        async with reward_server(handler) as url:
            fn = get_reward_function(cfg_reward(f"remote_rm:{url}"))
            samples = [Sample(prompt="1+2=", label="3", response="3"),
                       Sample(prompt="1+1=", label="2", response="3")]
            return [await fn(s) for s in samples]

    assert run(main()) == [1.0, 0.0]
    assert len(seen) == 3  # one 500, its retry, the second sample
    assert seen[0] == {"prompt": "1+2=", "response": "3", "label": "3"} == seen[1]


def test_remote_rm_replies_timeouts_and_failures():
    calls = {"slow": 0}

    async def handler(request):
        body = await request.json()
        kind = body["response"]
        if kind == "slow":
            calls["slow"] += 1
            if calls["slow"] == 1:
                await asyncio.sleep(0.5)  # longer than the client's timeout: retried
            return web.json_response(0.25)
        if kind == "dict":
            return web.json_response({"acc": 1, "fmt": 0.5})
        if kind == "bad":
            return web.json_response({"verdict": "yes"})
        if kind == "400":
            return web.Response(status=400, text="bad request")
        return web.Response(status=503, text="overloaded")

    async def main():
        async with reward_server(handler) as url:
            kw = dict(timeout_s=0.2, max_retries=2, backoff_s=0.01)
            assert await remote_rm(url, "p", "slow", None, **kw) == 0.25
            assert await remote_rm(url, "p", "dict", None, **kw) == {"acc": 1.0, "fmt": 0.5}
            with pytest.raises(RemoteRewardError, match="expected a number"):
                await remote_rm(url, "p", "bad", None, **kw)
            with pytest.raises(RemoteRewardError, match="HTTP 400"):
                await remote_rm(url, "p", "400", None, **kw)
            with pytest.raises(RemoteRewardError, match="failed after 3 attempts; last error: HTTP 503"):
                await remote_rm(url, "p", "down", None, **kw)
        # the server is gone: connection refused, retried, then a clear error
        with pytest.raises(RemoteRewardError, match="failed after 2 attempts; last error: Client"):
            await remote_rm(url, "p", "x", None, timeout_s=0.5, max_retries=1, backoff_s=0.01)

    run(main())
    assert calls["slow"] == 2


# ---------------------------------------------------------------------------------------------- filters


def group(*rewards):
    return [Sample(index=i, reward=r) for i, r in enumerate(rewards)]


def test_scalar_reward_is_one_definition_for_filter_metrics_and_advantages():
    """``Sample.scalar_reward`` is what the filter, the loop's reward metrics and the advantages read."""
    from hpcrl.train.actor import sample_rewards

    samples = [Sample(index=0, reward=1), Sample(index=1, reward={"reward": 0.25, "format": 1.0})]
    assert [s.scalar_reward() for s in samples] == [1.0, 0.25]
    assert sample_rewards(samples).tolist() == [1.0, 0.25]
    with pytest.raises(TypeError, match="sample 7 has a dict reward without a 'reward' key: \\['format'\\]"):
        Sample(index=7, reward={"format": 1.0}).scalar_reward()
    with pytest.raises(ValueError, match="sample 3 has no reward yet"):
        sample_rewards([Sample(index=3)])


def test_nonzero_std_filter(tmp_path, monkeypatch):
    assert nonzero_std(group(0.0, 1.0, 0.0)) is True
    assert nonzero_std(group(1.0, 1.0, 1.0)) is False
    assert nonzero_std(group(0.5, 0.5 + 1e-9)) is False
    assert nonzero_std(group({"reward": 0.0}, {"reward": 1.0})) is True
    with pytest.raises(ValueError, match="no reward yet"):
        nonzero_std(group(1.0, None))
    assert get_dynamic_filter("nonzero_std") is nonzero_std
    assert get_dynamic_filter(None) is None and get_dynamic_filter("") is None
    with pytest.raises(PluginError, match="unknown dynamic filter"):
        get_dynamic_filter("nonzero")
    (tmp_path / "hpcrl_test_filter.py").write_text("def keep_any_correct(group):\n"
                                                    "    return any(s.reward == 1.0 for s in group)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    f = get_dynamic_filter("hpcrl_test_filter.keep_any_correct")
    assert f(group(0.0, 1.0)) and not f(group(0.0, 0.0))
