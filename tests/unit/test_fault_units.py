"""The pieces of engine replacement (issue #12) on their own: the client's rotation (a request taken out of
rotation goes elsewhere for free, waits while nothing serves, and fails with EnginesLost once the monitor gives
up) against a real aiohttp engine stand-in, and the weight snapshot a restarted engine starts from."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch
from aiohttp import web

from hpcrl.rollout.client import EnginesLost, RolloutClient


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _serve() -> tuple[web.AppRunner, str, list]:
    """A minimal /generate server (answers at once) and the list of requests it saw."""
    seen: list = []

    async def generate(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"text": "4", "output_ids": [4], "meta_info": {"weight_version": "3"}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", seen


def test_a_request_to_an_engine_taken_out_goes_elsewhere_without_using_a_retry():
    async def run():
        runner, live, seen = await _serve()
        dead = _closed_port_url()
        failures = []
        client = RolloutClient(None, [dead, live], max_retries=0, backoff_s=0.0)

        def on_failure(url, error):  # what the health monitor does on a connection error
            failures.append(url)
            client.set_engine_urls([u for u in client.engine_urls if u != url])

        client.on_failure = on_failure
        async with client:
            out = await client.generate([1, 2], {"max_new_tokens": 1})  # first to the dead one, round robin
        await runner.cleanup()
        return out, failures, seen, client.retried_requests

    out, failures, seen, retried = asyncio.run(run())
    assert out["text"] == "4" and len(seen) == 1 and retried == 1
    assert len(failures) == 1  # max_retries=0, yet it went on: the failed engine was out of rotation


def test_requests_wait_while_no_engine_serves_and_go_on_when_one_is_back():
    async def run():
        runner, live, seen = await _serve()
        client = RolloutClient(None, [live], timeout_s=30)
        client.on_failure = lambda url, error: None
        async with client:
            client.set_engine_urls([])  # being replaced
            task = asyncio.create_task(client.generate([1], {}))
            await asyncio.sleep(0.3)
            assert not task.done() and not seen
            client.set_engine_urls([live])  # the new engine joins
            out = await asyncio.wait_for(task, 10)
        await runner.cleanup()
        return out

    assert asyncio.run(run())["meta_info"]["weight_version"] == "3"


def test_waiting_requests_fail_with_engines_lost_when_none_will_come():
    async def run():
        client = RolloutClient(None, [_closed_port_url()], timeout_s=30)
        async with client:
            client.set_engine_urls([])
            task = asyncio.create_task(client.generate([1], {}))
            await asyncio.sleep(0.2)
            client.set_lost("engine 0 died and rollout.max_engine_restarts=0 used up")
            with pytest.raises(EnginesLost, match="max_engine_restarts=0"):
                await asyncio.wait_for(task, 10)
            client.on_failure = lambda url, error: None  # with a monitor: control calls skip the missing
            assert await client.abort_all() == []

    asyncio.run(run())


class _ExitedEngine:
    """The handle of an engine whose real process has exited (what the monitor reads of an engine)."""

    def __init__(self, url: str):
        import subprocess
        import sys

        self.url = url
        self.process = subprocess.Popen([sys.executable, "-c", "pass"])
        self.process.wait()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 2.0) -> None:
        pass


def test_no_engine_is_restarted_while_the_job_is_ending():
    """Slurm is ending the job (SIGTERM: :meth:`hpcrl.preempt.PreemptionWatch.job_ending`): a dead engine is
    not restarted, and with none left the waiting request fails with EnginesLost at once (the loop then
    checkpoints its last finished step), instead of waiting out restarts that cannot succeed."""
    from hpcrl.rollout.health import LOST, HealthMonitor

    restarts = []

    async def run():
        url = _closed_port_url()
        client = RolloutClient(None, [url], timeout_s=30)
        async with client:
            monitor = HealthMonitor(client, [_ExitedEngine(url)], lambda *a: restarts.append(a), snapshot=None,
                                    interval_s=0.1, timeout_s=1.0, max_restarts=5, job_ending=lambda: True)
            await monitor.start()
            try:
                with pytest.raises(EnginesLost, match="the job is ending"):
                    await asyncio.wait_for(client.generate([1], {}), 10)
            finally:
                await monitor.stop()
            return monitor.slots[0].state

    assert asyncio.run(run()) == LOST and restarts == []


def test_quiesce_waits_for_the_generate_probe_in_flight():
    """When the engines stop generating, the manager waits for a ``/health_generate`` probe still in flight
    (SGLang's is a one-token generation: one answered while the engine's memory was released preceded a sync
    whose ``/flush_cache`` SGLang never answered), so no probe runs into the release and the pause."""
    from hpcrl.rollout.health import HealthMonitor

    async def run():
        answered = []

        async def slow(request: web.Request) -> web.Response:
            await asyncio.sleep(0.5)  # a probe the engine answers late
            answered.append(asyncio.get_running_loop().time())
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health_generate", slow)
        app.router.add_get("/health", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        client = RolloutClient(None, [url], timeout_s=30)

        class Engine:
            def __init__(self, u):
                self.url = u

        async with client:
            monitor = HealthMonitor(client, [Engine(url)], None, snapshot=None, interval_s=2.0, timeout_s=5.0,
                                    max_restarts=0)
            monitor.generating = True
            await monitor.start()
            try:
                await asyncio.sleep(0.1)  # the first probe is on its way
                monitor.generating = False
                await monitor.quiesce()
                done = asyncio.get_running_loop().time()
                in_flight = monitor._generate_probes
            finally:
                await monitor.stop()
        await runner.cleanup()
        return answered, done, in_flight

    answered, done, in_flight = asyncio.run(run())
    assert answered and answered[0] <= done and in_flight == 0


def test_weight_snapshot_is_the_model_folder_until_a_whole_sync_then_its_version(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    from hpcrl.weights.snapshot import WeightSnapshot

    snap = WeightSnapshot(tmp_path / "rejoin", tiny_model_dir, bucket_bytes=1 << 20)
    assert snap.folder() == (tiny_model_dir, None)
    w = {"model.embed_tokens.weight": torch.arange(6.0).reshape(2, 3), "lm_head.weight": torch.ones(2, 3)}
    sent = dict(snap.tee(iter(w.items()), 4))
    w["lm_head.weight"].add_(1)  # the trainer goes on training: the snapshot keeps what was sent
    folder, version = snap.folder()
    assert version == "4" and folder == tmp_path / "rejoin" / "v4"
    got = {}
    for f in folder.glob("*.safetensors"):
        got.update(load_file(f))
    assert got["lm_head.weight"].equal(torch.ones(2, 3)) and sent.keys() == got.keys()
    assert (folder / "config.json").exists()  # config and tokenizer files come from the model folder
    stream = snap.tee(iter(w.items()), 5)
    next(stream)  # a sync that stopped after one tensor leaves version 4 in place
    assert snap.folder() == (folder, "4")
    for _ in snap.tee(iter(w.items()), 5):
        pass
    assert snap.folder()[1] == "5" and not folder.exists()  # the older folder is removed
