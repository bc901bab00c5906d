"""The rollout client, the real sglang-router and hpcrl's CPU engine, all as real processes on 127.0.0.1.

One module-wide stack: a run secret, two engines that require it (``--api-key-file``), and sglang-router
started with the same key in front of both. Tests that change the stack (remove a worker, kill an engine)
restore it or use an engine of their own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hpcrl.data.sample import Sample, Status
from hpcrl.engine.httplog import HTTP2_PREFACE
from hpcrl.rollout.client import RolloutClient, RolloutError
from hpcrl.rollout.generate import generate
from hpcrl.rollout.router import start_router
from hpcrl.rollout.secret import create_run_secret, read_secret
from hpcrl.procs import ProcessStartError, find_free_port
from hpcrl.rollout.engines import start_engine
from tests.integration.engine_utils import (EngineProcess, check_across_update, generate_across_update,
                                            hf_tensors, two_policies)

pytestmark = pytest.mark.integration

PROMPT = [1, 5, 6, 15, 7]  # "<s>23+4" in the tiny character tokenizer
LONG = {"max_new_tokens": 240, "ignore_eos": True}  # ~1 s of decoding on the tiny model
SHORT = {"max_new_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    """``(secret_path, key, [engine_a, engine_b], router)``: two authenticated engines behind the router."""
    tmp = tmp_path_factory.mktemp("rollout")
    secret = create_run_secret(tmp / "run")
    engines = [EngineProcess(tiny_model_dir, ["--api-key-file", str(secret)], log_path=tmp / f"engine{i}.log")
               for i in range(2)]
    router = None
    try:
        with ThreadPoolExecutor(2) as pool:  # load both models at once
            list(pool.map(lambda e: e.start(start_timeout=120), engines))
        router = start_router([e.url for e in engines], api_key=read_secret(secret),
                              log_path=tmp / "router.log")
        yield secret, read_secret(secret), engines, router
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()


def _client(stack, **kw) -> RolloutClient:
    _, key, engines, router = stack
    kw.setdefault("api_key", key)
    return RolloutClient(router.url, [e.url for e in engines], timeout_s=60, backoff_s=0.2, **kw)


async def _served(client: RolloutClient) -> list[int]:
    """Per-engine ``requests_served`` counters from ``/get_server_info``."""
    infos = [await client.request("GET", "/get_server_info", base_url=u) for u in client.engine_urls]
    return [i["internal_states"][0]["requests_served"] for i in infos]


async def _served_since(client: RolloutClient, before: list[int], total: int) -> list[int]:
    """Per-engine requests served since ``before``, once they add up to ``total`` (the engine counts a request
    just after sending its response; waits at most 5 s)."""
    deadline = time.monotonic() + 5.0
    while True:
        delta = [a - b for a, b in zip(await _served(client), before)]
        if sum(delta) >= total or time.monotonic() > deadline:
            return delta
        await asyncio.sleep(0.05)


def test_router_balances_authenticated_engines(stack):
    secret, key, engines, router = stack

    async def run():
        async with _client(stack) as c:
            await c.wait_healthy(timeout_s=30)
            before = await _served(c)
            outs = await asyncio.gather(*(c.generate(PROMPT, {"max_new_tokens": 6}) for _ in range(6)))
            served = await _served_since(c, before, 6)
            return outs, served, c.weight_version, await c.get_weight_versions()

    outs, served, version, versions = asyncio.run(run())
    for out in outs:
        meta = out["meta_info"]
        assert len(out["output_ids"]) == meta["completion_tokens"] == len(meta["output_token_logprobs"]) > 0
        assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
        assert all(isinstance(t[0], float) and t[0] <= 0.0 for t in meta["output_token_logprobs"])
    assert served == [3, 3]  # round robin: both engines served
    assert version == "default" and versions == {e.url: "default" for e in engines}
    # the key is on no command line and in no router log
    assert key.encode() not in open(f"/proc/{router.pid}/cmdline", "rb").read()
    assert key not in router.log_path.read_text(errors="replace")


def test_engine_logs_no_error_for_refused_requests(stack):
    """Issue #9 point 11: the router's start-up probes (HTTP/2 prefaces) and a raw HTTP/2 preface sent here are
    refused with 400, and no engine log has an ERROR line or a traceback after them and a few requests."""
    _, _, engines, _ = stack
    with socket.create_connection(("127.0.0.1", engines[0].port), timeout=10) as s:
        s.sendall(HTTP2_PREFACE)
        status_line = s.recv(4096).split(b"\r\n", 1)[0]
    assert status_line.split(b" ")[:2] in ([b"HTTP/1.0", b"400"], [b"HTTP/1.1", b"400"]), status_line

    async def run():
        async with _client(stack) as c:
            return await asyncio.gather(*(c.generate(PROMPT, SHORT) for _ in range(4)))

    assert all(len(out["output_ids"]) == 3 for out in asyncio.run(run()))
    time.sleep(0.2)  # the engines flush their log lines
    for e in engines:
        bad = [line for line in e.log_path.read_text(errors="replace").splitlines()
               if " ERROR " in line or "Traceback" in line]
        assert not bad, f"{e.log_path}: {bad}"


def test_generate_fills_sample_and_continues_partial(stack):
    async def run():
        async with _client(stack) as c:
            full = await generate(c, Sample(tokens=list(PROMPT)), {"max_new_tokens": 8, "ignore_eos": True})
            part = Sample(tokens=list(PROMPT))
            await generate(c, part, {"max_new_tokens": 5, "ignore_eos": True})
            first = list(part.tokens)
            await generate(c, part, {"max_new_tokens": 12, "ignore_eos": True})  # continue: 7 more
            return full, first, part

    full, first, part = asyncio.run(run())
    assert full.tokens[:len(PROMPT)] == PROMPT and full.response_length == 8 == len(full.tokens) - len(PROMPT)
    assert full.loss_mask == [1] * 8 and len(full.rollout_log_probs) == 8
    assert all(lp <= 0.0 for lp in full.rollout_log_probs)
    assert full.status is Status.TRUNCATED and full.weight_versions == ["default"]
    assert part.tokens[:len(first)] == first and part.response_length == 12
    assert part.prompt_length == len(PROMPT)
    assert len(part.loss_mask) == len(part.rollout_log_probs) == 12
    assert part.status is Status.TRUNCATED and part.weight_versions == ["default", "default"]


def test_stop_finish_is_completed(stack):
    async def run():
        async with _client(stack) as c:  # greedy, stopping at any token: finishes with "stop" at once
            every = list(range(3, 21))
            return await generate(c, Sample(tokens=list(PROMPT)),
                                  {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": every})

    s = asyncio.run(run())
    assert s.status is Status.COMPLETED and s.response_length == len(s.rollout_log_probs) >= 1


def test_unauthorized_without_key(stack):
    async def run(key):
        async with _client(stack, api_key=key) as c:
            errors = []
            for target in (None, c.engine_urls[0]):  # through the router, then an engine directly
                with pytest.raises(RolloutError) as e:
                    await c.request("POST", "/generate", {"input_ids": PROMPT}, base_url=target)
                errors.append(e.value)
            return errors

    for key in (None, "wrong-key"):
        for err in asyncio.run(run(key)):
            assert err.status == 401 and "attempt" not in str(err)  # 4xx: no retries


def test_wait_healthy(stack):
    dead = f"http://127.0.0.1:{find_free_port()}"

    async def run():
        async with _client(stack) as c:
            await c.wait_healthy(timeout_s=10)
            c.set_engine_urls(c.engine_urls + [dead])
            t0 = time.monotonic()
            with pytest.raises(RolloutError) as e:
                await c.wait_healthy(timeout_s=1.5, poll_s=0.2)
            return e.value, time.monotonic() - t0

    err, elapsed = asyncio.run(run())
    # the wait gives up after timeout_s=1.5 (polls of 0.2 s): 5 s leaves 3x for a loaded machine
    assert f"{dead}/health" in str(err) and err.url == dead + "/health" and elapsed < 5
    assert stack[2][0].url not in str(err)


async def mid_decode_seconds(c) -> float:
    """A wait after which a LONG request started now is decoding but not done, on this machine: a quarter of the
    faster of two LONG requests here (the first one pays for the connection). Fixed waits failed on faster CPUs,
    where 240 tokens took less than 0.3 s."""
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        await c.generate(PROMPT, dict(LONG))
        times.append(time.perf_counter() - t0)
    return min(times) / 4


def test_abort_all_returns_partial_samples(stack):
    async def run():
        async with _client(stack) as c:
            wait = await mid_decode_seconds(c)
            samples = [Sample(index=i, tokens=list(PROMPT)) for i in range(4)]
            tasks = [asyncio.create_task(generate(c, s, dict(LONG))) for s in samples]
            await asyncio.sleep(wait)
            await c.abort_all()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            aborted = [(s.status, s.response_length, len(s.loss_mask), len(s.rollout_log_probs),
                        s.metadata.get("finish_message")) for s in samples]
            # continue the longest partial sample to the full budget
            part = max(samples, key=lambda s: s.response_length)
            await generate(c, part, dict(LONG))
            return aborted, part

    aborted, part = asyncio.run(run())
    for status, length, n_mask, n_logp, message in aborted:
        assert status is Status.ABORTED and message and n_mask == n_logp == length < 240
    assert max(a[1] for a in aborted) > 0  # partial responses came back
    assert part.status is Status.TRUNCATED and part.response_length == 240 and len(part.tokens) == 245
    assert part.loss_mask == [1] * 240 and len(part.rollout_log_probs) == 240
    assert "finish_message" not in part.metadata


def test_pause_and_continue(stack):
    async def run():
        async with _client(stack) as c:
            wait = await mid_decode_seconds(c)
            running = asyncio.create_task(c.generate(PROMPT, dict(LONG)))
            await asyncio.sleep(wait)
            await c.pause(mode="abort")  # the running request ends, aborted
            aborted = await asyncio.wait_for(running, 30)
            waiting = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 4}))
            await asyncio.sleep(0.8)
            held = not waiting.done()  # new requests wait while paused
            await c.resume()
            resumed = await asyncio.wait_for(waiting, 30)
            return aborted, held, resumed

    aborted, held, resumed = asyncio.run(run())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert held and resumed["meta_info"]["finish_reason"]["type"] == "length"


def test_flush_cache_and_post_all(stack):
    async def run():
        async with _client(stack) as c:
            flushed = await c.flush_cache(wait_s=10)
            released = await c.post_all("/release_memory_occupation", {"tags": ["kv_cache"]})
            resumed = await c.post_all("resume_memory_occupation", {"tags": ["kv_cache"]})
            with pytest.raises(RolloutError) as e:  # the router does not proxy admin endpoints; 404 names it
                await c.request("POST", "/pause_generation", {}, retry=False)
            return flushed, released, resumed, e.value

    flushed, released, resumed, err = asyncio.run(run())
    assert len(flushed) == len(released) == len(resumed) == 2
    assert all("flushed" in f.get("text", "").lower() for f in flushed)
    assert err.status == 404 and stack[3].url in err.url


def test_remove_and_add_worker(stack):
    _, key, engines, router = stack
    b = engines[1].url

    async def burst(c, n=4):
        before = await _served(c)
        await asyncio.gather(*(c.generate(PROMPT, {"max_new_tokens": 2}) for _ in range(n)))
        return await _served_since(c, before, n)

    async def run():
        async with _client(stack) as c:
            router.remove_worker(b)
            only_a = await burst(c)
            router.add_worker(b)
            both = await burst(c)
            return only_a, both

    try:
        only_a, both = asyncio.run(run())
    finally:
        if b not in router.worker_urls():
            router.add_worker(b)
    assert only_a == [4, 0] and router.worker_urls(healthy_only=True).count(b) == 1
    assert both[0] > 0 and both[1] > 0 and sum(both) == 4


def test_engine_killed_mid_run(stack, tiny_model_dir, tmp_path):
    """A third engine joins the router, is SIGKILLed while serving; requests still succeed."""
    secret, key, engines, router = stack
    extra = start_engine(None, {}, tiny_model_dir, api_key_file=secret, engine="cpu",
                         log_path=tmp_path / "extra.log", env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=120)
    try:
        router.add_worker(extra.url)

        async def run():
            async with _client(stack, max_retries=4) as c:
                inflight = [asyncio.create_task(c.generate(PROMPT, dict(LONG))) for _ in range(3)]
                await asyncio.sleep(0.3)
                os.kill(extra.pid, signal.SIGKILL)
                # in flight on the dead engine: sglang-router re-sends them to a live worker itself
                first = await asyncio.wait_for(asyncio.gather(*inflight), 60)
                router.remove_worker(extra.url)
                later = await asyncio.gather(*(c.generate(PROMPT, SHORT) for _ in range(4)))
            # without a router: round robin starts on the dead engine, the retry moves to a live one
            async with RolloutClient(None, [extra.url, engines[0].url], api_key=key, backoff_s=0.1) as d:
                direct = await d.generate(PROMPT, SHORT)
            return first, later, direct

        first, later, direct = asyncio.run(run())
    finally:
        extra.stop()
        if extra.url in router.worker_urls():
            router.remove_worker(extra.url)
    assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "abort") for o in first)
    assert all(len(o["output_ids"]) == 3 for o in later) and len(direct["output_ids"]) == 3


def _running(client: RolloutClient, url: str):
    """``num_running_reqs`` of the engine at ``url`` (``/v1/loads``)."""
    async def get():
        return (await client.request("GET", "/v1/loads", base_url=url))["loads"][0]["num_running_reqs"]
    return get()


def test_partial_response_kept_when_the_engine_dies(stack, tiny_model_dir, tmp_path):
    """``keep_partial`` (``rollout.partial_rollout``): a generation streams; its engine is SIGKILLed mid-way;
    the tokens it had sent are kept and the rest is generated on another engine from prompt + kept. Greedy, so
    exact: the kept part is what the dead engine generated (the same engine type alone from the prompt), the
    rest is what the survivor answers to prompt + kept. Directly (round robin starts on the victim), then
    through the router (whichever engine got it is killed)."""
    secret, key, _, _ = stack
    greedy = {**LONG, "temperature": 0.0}
    start = lambda name: start_engine(None, {}, tiny_model_dir, api_key_file=secret, engine="cpu",  # noqa: E731
                                      log_path=tmp_path / f"{name}.log", env={"OMP_NUM_THREADS": "1"},
                                      startup_timeout_s=120)
    a, b, c = map(start, ["a", "b", "c"])  # (not from a thread pool: an engine dies with the thread that made it)
    router = None

    async def kill_mid_way(client: RolloutClient, candidates, seconds: float):
        task = asyncio.create_task(client.generate(PROMPT, dict(greedy)))
        victim = None
        while victim is None:
            for e in candidates:
                if await _running(client, e.url):
                    victim = e
            await asyncio.sleep(0.01)
        await asyncio.sleep(seconds / 3)
        os.kill(victim.pid, signal.SIGKILL)
        return victim, await asyncio.wait_for(task, 60)

    async def check(client: RolloutClient, out: dict, survivor, reference: list[int]):
        kept = client.kept_partial_tokens
        assert 0 < kept < LONG["max_new_tokens"], kept
        meta = out["meta_info"]
        assert len(out["output_ids"]) == meta["completion_tokens"] == len(meta["output_token_logprobs"]) == 240
        assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
        assert out["output_ids"][:kept] == reference[:kept]
        # the kept tokens' versions come from the dead engine's chunks, the rest from the survivor's spans
        assert meta["output_token_weight_versions"] == ["default"] * 240
        rest = await client.request("POST", "/generate", {
                "input_ids": PROMPT + out["output_ids"][:kept], "return_logprob": True,
                "sampling_params": {**greedy, "max_new_tokens": 240 - kept}}, base_url=survivor.url)
        assert out["output_ids"][kept:] == rest["output_ids"]
        assert meta["finish_reason"]["type"] == "length" and client.retried_requests == 1

    try:
        async def run():
            async with RolloutClient(None, [b.url], api_key=key) as plain:
                t0 = time.monotonic()
                reference = (await plain.generate(PROMPT, dict(greedy)))["output_ids"]
                seconds = time.monotonic() - t0
            async with RolloutClient(None, [a.url, b.url], api_key=key, backoff_s=0.1, keep_partial=True) as d:
                victim, out = await kill_mid_way(d, [a], seconds)
                await check(d, out, b, reference)
            nonlocal router
            router = start_router([b.url, c.url], api_key=key, log_path=tmp_path / "router.log")
            async with RolloutClient(router.url, [b.url, c.url], api_key=key, backoff_s=0.1,
                                     keep_partial=True) as r:
                victim, out = await kill_mid_way(r, [b, c], seconds)
                await check(r, out, c if victim is b else b, reference)

        asyncio.run(run())
    finally:
        if router is not None:
            router.stop()
        for e in (a, b, c):
            e.stop()


def test_start_engine_failure_has_log_tail(tmp_path):
    with pytest.raises(ProcessStartError) as e:
        start_engine(None, {}, tmp_path / "no-such-model", engine="cpu", log_path=tmp_path / "bad.log",
                     env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=60)
    assert "exited with code" in str(e.value) and "no-such-model" in e.value.log_tail


def test_generate_batch_without_router_equals_single_requests(stack):
    """SGLang's batch form of /generate (one request, a list of inputs): answers in input order, each the same
    as that input sent alone; and a group of the default rollout goes out as one batch without a router."""
    from hpcrl.rollout.rollout import _GroupBatcher

    _, key, engines, _ = stack
    other = [1, 9, 9, 14, 2]  # "<s>88+1"
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def run():
        async with RolloutClient(None, [engines[0].url], api_key=key, timeout_s=60) as c:
            batch = await c.generate_batch([PROMPT, other, PROMPT], [greedy] * 3)
            single = [await c.generate(ids, greedy) for ids in (PROMPT, other)]
            with pytest.raises(ValueError, match="as many sampling_params"):
                await c.generate_batch([PROMPT], [greedy, greedy])
            batcher = _GroupBatcher(c)
            group = [Sample(tokens=list(PROMPT)) for _ in range(4)]
            await asyncio.gather(*(generate(batcher, s, dict(greedy)) for s in group))
            return batch, single, group

    batch, single, group = asyncio.run(run())
    ids = [b["output_ids"] for b in batch]
    assert ids == [single[0]["output_ids"], single[1]["output_ids"], single[0]["output_ids"]]
    for b, s in zip(batch, single):
        assert [t[0] for t in b["meta_info"]["output_token_logprobs"]] == \
            pytest.approx([t[0] for t in s["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert all(s.tokens == PROMPT + ids[0] and s.response_length == 6 for s in group)


def test_in_place_update_mid_response_through_the_router(stack, tiny_model_dir):
    """Issue #37 point 2 through sglang-router: a response streamed by the router (``keep_partial``) while
    both engines are paused in place and synced from version 10 to 11 (no flush: it would be refused while
    the response holds its KV cache) finishes as the same request, its tokens labelled 10 then 11 from the
    router's chunks, aligned with their log-probs (the new weights over the old KV cache after the switch).
    The engines get their first weights and version back afterwards."""
    from hpcrl.weights import WeightSyncer

    old, new = two_policies(tiny_model_dir)

    async def sync(client, model, version):
        await WeightSyncer(client, "tensor", bucket_bytes=1 << 20, timeout_s=60).sync(iter(hf_tensors(model)),
                                                                                       version)

    async def run():
        async with _client(stack, keep_partial=True) as c:
            await sync(c, old, "10")
            try:
                return await generate_across_update([c], "in_place", hf_tensors(new), "11")
            finally:
                await sync(c, old, "default")

    [(first, sample)], metrics = asyncio.run(run())
    check_across_update("in_place", first, sample, old, new, 10, 11)
    assert metrics["weight_version"] == "11"


def test_engines_load_while_the_trainer_starts(tmp_path, tiny_model_dir):
    """``RolloutManager.launch(early=True)`` (called before the trainer builds its model) starts the engine
    process and returns before it is up; ``start`` waits for it, then the rollout verbs work. With SGLang
    colocated on the trainer's GPUs the early launch starts nothing: SGLang sizes its memory pool after the
    trainer's model is resident, as before (checked here without a GPU: nothing is spawned)."""
    from hpcrl.config import load_config
    from hpcrl.data.datasets import load_datasets
    from hpcrl.procs import http_status
    from hpcrl.rollout.engines import launch_local_engines
    from hpcrl.rollout.manager import RolloutManager

    def manager(*overrides: str) -> RolloutManager:
        cfg = load_config(None, [f"run.output_dir={tmp_path}", f"model.path={tiny_model_dir}", "data.num_eval=8",
                                 "rollout.router=false", *overrides])
        attempt = tmp_path / f"attempt-{len(list(tmp_path.glob('attempt-*')))}"
        attempt.mkdir()
        return RolloutManager(cfg, tmp_path, attempt, tiny_model_dir, launch_local_engines)

    gpu_colocated = manager("rollout.engine=sglang", "run.placement=colocate")
    gpu_colocated.launch(early=True)
    assert gpu_colocated.fleet.pending is None and gpu_colocated.fleet.secret_path is None  # nothing started
    gpu_colocated.stop()

    m = manager("rollout.engine=cpu")
    t0 = time.monotonic()
    m.launch(early=True)
    try:
        # no health wait: spawning the process takes milliseconds, the engine's health seconds (imports)
        assert time.monotonic() - t0 < 1.0
        [eng] = m.fleet.pending.engines
        key = read_secret(m.fleet.secret_path)
        assert eng.alive() and http_status(eng.url + "/health", key, timeout_s=1.0) != 200
        m.start(load_datasets(m.cfg))
        assert m.fleet.pending is None and m.fleet.engines == [eng]
        assert http_status(eng.url + "/health", key, timeout_s=5.0) == 200
        assert 0.0 <= m.evaluate(-1)["eval/accuracy"] <= 1.0
    finally:
        m.stop()
    assert not eng.alive()

    # with the router: it is spawned beside the engines, with no workers; start() registers them
    m = manager("rollout.engine=cpu", "rollout.router=true")
    t0 = time.monotonic()
    m.launch(early=True)
    try:
        assert time.monotonic() - t0 < 1.0  # no health wait for either (as above: spawns only)
        [eng], router = m.fleet.pending.engines, m.fleet.router
        assert router is not None and router.alive()
        m.start(load_datasets(m.cfg))
        assert m.fleet.router is router and router.worker_urls(healthy_only=True) == [eng.url]
        assert 0.0 <= m.evaluate(-1)["eval/accuracy"] <= 1.0  # through the router
    finally:
        m.stop()
    assert not eng.alive() and not router.alive()
