"""Delta weight sync (``weights.delta``, hpcrl.weights.delta) from a real megatron-core trainer to real CPU
engines over HTTP, on every method (issue #39 point 1).

Two engines serve the tiny Qwen2: one gets delta syncs (started with ``--custom-weight-loader
hpcrl.weights.delta.load_delta``, as hpcrl starts engines of a delta run), the other full syncs of the same
trainer weights. Between syncs the trainer changes 2% of the words of every tensor (what a small optimizer
step leaves of a bf16 model). After every sync the two engines' ``/weights_checker`` checksums (a hash of
every parameter's bytes) are equal: the delta-synced engine is bitwise what a full sync makes it, through
deltas, the periodic full syncs (``full_every``), a replaced engine (a new URL: full sync), a failed sync
(the next is full) and a new sender (a resumed trainer: full sync).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_utils import EngineProcess, http_json  # noqa: E402

from tests.integration.test_weight_sync import KEY, key_file, renamed, trainer  # noqa: E402,F401 (fixtures)

pytestmark = pytest.mark.integration

DELTA_ARGS = ["--custom-weight-loader", "hpcrl.weights.delta.load_delta"]


def checksum(url: str) -> str:
    """The engine's ``per_engine_checksum`` of all its weights (``/weights_checker``)."""
    status, body = http_json("POST", url + "/weights_checker", {"action": "checksum"},
                             headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["success"], body
    return body["per_engine_checksum"]


def sparse_step(model, seed: int, frac: float = 0.02) -> None:
    """Change ``frac`` of the words of every parameter (seeded, the same on every call with ``seed``)."""
    from hpcrl.train.bridge import unwrap_model

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in unwrap_model(model).parameters():
            flat = p.data.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, int(frac * flat.numel()))]
            flat[idx] += torch.randn(idx.numel(), generator=g) * 0.01


@pytest.fixture(scope="module")
def engines(tiny_model_dir, key_file, tmp_path_factory):  # noqa: F811
    """``(delta engine, full engine)``, both on the tiny Qwen2."""
    logs = tmp_path_factory.mktemp("delta-logs")
    common = ["--api-key-file", str(key_file), "--dist-timeout", "60"]
    with EngineProcess(tiny_model_dir, common + DELTA_ARGS, log_path=logs / "delta.log") as a, \
            EngineProcess(tiny_model_dir, common, log_path=logs / "full.log") as b:
        yield a, b


@pytest.mark.parametrize("method", ["tensor", "distributed", "disk"])
def test_delta_syncs_leave_the_engine_bitwise_as_full_syncs(engines, trainer, tmp_path, method):  # noqa: F811
    """Six syncs (``full_every=4``): the first and the fifth full, the others deltas of 2% of the words, each
    a fifth of the bytes or less; after each, the delta-synced engine's checksums are the full-synced one's."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer, iterate_for_sync

    a, b = engines

    async def run():
        out = []
        async with RolloutClient(engine_urls=[a.url], api_key=KEY) as ca, \
                RolloutClient(engine_urls=[b.url], api_key=KEY) as cb:
            kw = dict(bucket_bytes=1024 * 1024, timeout_s=60)
            delta = WeightSyncer(ca, method, delta=True, full_every=4, disk_dir=str(tmp_path / "a"), **kw)
            full = WeightSyncer(cb, method, disk_dir=str(tmp_path / "b"), group_name="full_sync", **kw)
            try:
                for i in range(6):
                    if i:
                        sparse_step(trainer, seed=100 * len(method) + i)
                    m = await delta.sync(iterate_for_sync(trainer), f"{method}-{i}")
                    await full.sync(iterate_for_sync(trainer), f"{method}-{i}")
                    out.append((m, checksum(a.url), checksum(b.url)))
            finally:
                await delta.close()
                await full.close()
        return out

    results = asyncio.run(run())
    assert [m["full"] for m, _, _ in results] == [1, 0, 0, 0, 1, 0]  # the first, then every 4th sync
    assert all(ca == cb for _, ca, cb in results), "a delta-synced engine differs from the full-synced one"
    assert len({ca for _, ca, _ in results}) == len(results)  # every step changed the weights
    for m, _, _ in results:
        if m["full"]:
            assert m["delta_density"] == 1.0 and m["bytes"] == m["model_bytes"]
        else:  # 2% of the words changed: indices + values, a fifth of the bytes or less
            assert 0.015 < m["delta_density"] < 0.03 and m["bytes"] < m["model_bytes"] / 5


def test_replaced_engine_failed_sync_and_new_sender_get_full_syncs(engines, trainer, tiny_model_dir,  # noqa: F811
                                                                   key_file, tmp_path):  # noqa: F811
    """After a replaced engine (another URL), a failed sync and with a new sender the next sync is full, and
    the engine ends bitwise as the full-synced one each time."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer, WeightSyncError, iterate_for_sync

    a, b = engines
    common = ["--api-key-file", str(key_file), "--dist-timeout", "60"]

    async def run(fresh_url: str):
        flags = []
        async with RolloutClient(engine_urls=[a.url], api_key=KEY) as ca, \
                RolloutClient(engine_urls=[b.url], api_key=KEY) as cb:
            full = WeightSyncer(cb, "tensor", timeout_s=60)

            async def both(syncer, version, stream=None):
                m = await syncer.sync(stream if stream is not None else iterate_for_sync(trainer), version)
                await full.sync(iterate_for_sync(trainer), version)
                assert checksum(ca.engine_urls[0]) == checksum(b.url), version
                flags.append(m["full"])

            delta = WeightSyncer(ca, "tensor", delta=True, full_every=0, timeout_s=60)
            await both(delta, "r0")
            sparse_step(trainer, seed=7)
            await both(delta, "r1")
            ca.set_engine_urls([fresh_url])  # the engine was replaced: the new one holds no base
            sparse_step(trainer, seed=8)
            await both(delta, "r2")
            sparse_step(trainer, seed=9)
            await both(delta, "r3")
            with pytest.raises(WeightSyncError):  # refused halfway: the engine may hold part of it
                await delta.sync(renamed(iterate_for_sync(trainer)), "bad")
            http_json("POST", fresh_url + "/continue_generation", {}, headers={"Authorization": f"Bearer {KEY}"})
            await both(delta, "r4")
            sparse_step(trainer, seed=10)
            await both(WeightSyncer(ca, "tensor", delta=True, timeout_s=60), "r5")  # a resumed trainer's sender
        return flags

    with EngineProcess(tiny_model_dir, common + DELTA_ARGS, log_path=tmp_path / "fresh.log") as fresh:
        assert asyncio.run(run(fresh.url)) == [1, 0, 1, 0, 1, 1]


# --- fp8 rollout weights (issue #39 point 2) ----------------------------------------------------------------

@pytest.mark.parametrize("method", ["tensor", "distributed"])  # (disk: the engine's start loads one)
def test_fp8_weights_sync_as_an_fp8_checkpoint_loads(trainer, tiny_model_dir, key_file, tmp_path,  # noqa: F811
                                                     method):
    """An engine started from a block-fp8 checkpoint (the tiny Qwen2's, hpcrl.weights.fp8) and synced with the
    trainer's weights quantised on the way (weights + scales, split over small buckets; delta on top) holds
    bitwise what an engine started from an fp8 checkpoint of those same weights holds: both dequantise."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer, iterate_for_sync
    from hpcrl.weights.fp8 import quantize_stream, write_fp8_checkpoint

    common = ["--api-key-file", str(key_file), "--dist-timeout", "60"]
    start = write_fp8_checkpoint(tiny_model_dir, tmp_path / "start-fp8")
    sparse_step(trainer, seed=99)
    expected = write_fp8_checkpoint(tiny_model_dir, tmp_path / "expected-fp8", iterate_for_sync(trainer))

    async def sync(url):
        async with RolloutClient(engine_urls=[url], api_key=KEY) as client:
            syncer = WeightSyncer(client, method, delta=True, bucket_bytes=64 * 1024, timeout_s=60,
                                  disk_dir=str(tmp_path / "disk"), hf_checkpoint=str(start))
            try:
                return await syncer.sync(quantize_stream(iterate_for_sync(trainer)), "fp8")
            finally:
                await syncer.close()

    with EngineProcess(start, common + DELTA_ARGS, log_path=tmp_path / "e.log") as e, \
            EngineProcess(expected, common, log_path=tmp_path / "x.log") as x:
        before = checksum(e.url)
        m = asyncio.run(sync(e.url))
        assert m["buckets"] > 1 and checksum(e.url) == checksum(x.url) != before
