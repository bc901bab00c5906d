"""Weight sync from a real megatron-core trainer to a real hpcrl engine over HTTP (hpcrl.weights).

The trainer is built in this process (gloo world of 1, TP=1) from the tiny Qwen2; its weights are perturbed so
that they differ from the engine's, then synced with each method (``tensor`` with several buckets in both
payload formats, ``distributed`` over a gloo group reused by two syncs, ``disk``). Proof of each sync: the
engine's ``input_token_logprobs`` for fixed token sequences equal the trainer's log-probs
(``response_log_probs``) to 1e-5 in fp32, and the engine reports the new ``weight_version``.
Failures: a renamed tensor is refused with the engine's message naming it (every method); an engine that does
not answer (SIGSTOP) makes the sync fail within its timeout, also in the middle of a broadcast.
A TP=2 trainer (two torchrun processes, rank 0 sends, both export) is checked the same way; this file is the
torchrun worker when run as a script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

try:
    from tests.integration.engine_utils import (EngineProcess, check_across_update, generate_across_update,
                                                hf_tensors, http_json, max_diff, perturb, prefill_logprobs,
                                                run_ranks, stream_labels, two_policies)
except ImportError:  # tests/integration is not a package (also when run by torchrun)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_utils import (EngineProcess, check_across_update, generate_across_update, hf_tensors,
                              http_json, max_diff, perturb, prefill_logprobs, run_ranks, stream_labels,
                              two_policies)

KEY = "weight-sync-test-key"
TOL = 1e-5
SEQS = [[1, 5, 9, 12, 3, 7, 18, 4, 11, 6], [1, 14, 8, 20, 10, 2, 17]]
"""Token ids (tiny vocab of 21) of prompt+response sequences whose log-probs are compared."""
RENAMED = "model.layers.1.mlp.up_proj.weight"


# --- helpers used by the tests and by the torchrun worker ---------------------------------------------------

def trainer_logprobs(model) -> list[list[float]]:
    """The trainer's log-prob of tokens 1..n-1 of each sequence of SEQS (TP collective: every rank calls)."""
    from hpcrl.train.logprobs import response_log_probs

    out = []
    with torch.no_grad():
        for seq in SEQS:
            res = response_log_probs(model, torch.tensor([seq]), [len(seq)], [len(seq) - 1])
            out.append(res.log_probs[0].tolist())
    return out


def engine_logprobs(url: str, key: str | None = KEY) -> tuple[list[list[float]], str]:
    """The engine's ``input_token_logprobs`` (entries 1..n-1) of each sequence, and its weight_version."""
    return prefill_logprobs(url, SEQS, key)


def renamed(stream, old: str = RENAMED, new: str = RENAMED.replace("weight", "wrong")):
    for name, t in stream:
        yield (new if name == old else name), t


class Counted:
    """An iterator over ``stream`` that counts the items taken (a failed sync must still drain it)."""

    def __init__(self, stream):
        self.stream, self.taken = iter(stream), 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.stream)
        self.taken += 1
        return item


# --- the TP=2 worker: `torchrun --nproc_per_node=2 test_weight_sync.py --model DIR --url URL ...` ----------

def worker(model_dir: str, url: str, key_file: str, out: Path) -> None:
    """Each of 2 ranks (TP=2) exports; rank 0 syncs with tensor then distributed and records log-probs."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from hpcrl.config import TrainSection
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.train import parallel, model as tmodel
    from hpcrl.weights import WeightSyncer, iterate_for_sync

    env = parallel.init_distributed()
    parallel.initialize_model_parallel(tp=2)
    parallel.model_parallel_cuda_manual_seed(1234)
    model, _ = tmodel.setup_model_and_optimizer(model_dir, TrainSection())
    key = Path(key_file).read_text().strip()
    sender = env.rank == 0
    results = {}

    async def run() -> None:
        client = RolloutClient(engine_urls=[url], api_key=key) if sender else None
        syncers = {m: WeightSyncer(client, m, bucket_bytes=300_000, timeout_s=60, is_sender=sender)
                   for m in ("tensor", "distributed")}
        try:
            for i, (method, syncer) in enumerate(syncers.items()):
                perturb(model, seed=100 + i)
                metrics = await syncer.sync(iterate_for_sync(model), f"tp2-{method}")
                mine = trainer_logprobs(model)
                if sender:
                    theirs, version = engine_logprobs(url, key)
                    results[method] = dict(metrics=metrics, trainer=mine, engine=theirs, version=version)
                else:
                    results[method] = dict(metrics=metrics, trainer=mine)
        finally:
            for syncer in syncers.values():
                await syncer.close()
            if client is not None:
                await client.close()

    asyncio.run(run())
    (out / f"rank{env.rank}.json").write_text(json.dumps(results))
    dist.barrier()
    parallel.destroy()


# --- fixtures -----------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    """The engines' API key in a 0600 file (as the launcher writes the run secret)."""
    path = tmp_path_factory.mktemp("wsync-key") / "key"
    path.write_text(KEY + "\n")
    os.chmod(path, 0o600)
    return path


@pytest.fixture(scope="module")
def engine(tiny_model_dir, key_file, tmp_path_factory):
    log = tmp_path_factory.mktemp("wsync-logs") / "engine.log"
    with EngineProcess(tiny_model_dir, ["--api-key-file", str(key_file), "--dist-timeout", "60"],
                       log_path=log) as eng:
        yield eng


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    """The megatron-core model (DDP-wrapped) at TP=1 in this process, torn down after the module."""
    pytest.importorskip("megatron.core")
    torch.set_num_threads(1)
    from hpcrl.config import TrainSection
    from hpcrl.train import parallel, model as tmodel

    parallel.init_distributed()
    parallel.initialize_model_parallel(tp=1)
    parallel.model_parallel_cuda_manual_seed(1234)
    model, _ = tmodel.setup_model_and_optimizer(tiny_model_dir, TrainSection())
    yield model
    parallel.destroy()


def _resume(url: str, key: str | None = KEY) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    status, body = http_json("POST", url + "/continue_generation", {}, headers=headers)
    assert status == 200, body


async def _syncs(url: str, method: str, steps, key: str | None = KEY, **kwargs):
    """Run ``steps`` (a list of ``(stream_factory, version)``) with one WeightSyncer; returns the metrics and
    the syncer (closed)."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer

    metrics = []
    async with RolloutClient(engine_urls=[url], api_key=key) as client:
        syncer = WeightSyncer(client, method, **kwargs)
        try:
            for make_stream, version in steps:
                metrics.append(await syncer.sync(make_stream(), version))
        finally:
            await syncer.close()
    return metrics, syncer


def engine_logprobs_after_resume(engine):
    """A failed sync leaves the engine paused (by design): resume it, then read log-probs."""
    _resume(engine.url)
    return engine_logprobs(engine.url)


def sessions(url: str) -> dict:
    """The engine's weight-update session counters (``/get_server_info``): opened, closed, open now."""
    return sessions_of(url, KEY)


def sessions_of(url: str, key: str | None) -> dict:
    status, info = http_json("GET", url + "/get_server_info",
                             headers={"Authorization": f"Bearer {key}"} if key else None)
    assert status == 200, info
    state = info["internal_states"][0]
    return {k: state[f"weight_update_{k}"] for k in ("sessions_opened", "sessions_closed", "session_open")}


def _assert_synced(engine, trainer, version: str) -> None:
    theirs, served = engine_logprobs(engine.url)
    assert served == version
    assert max_diff(theirs, trainer_logprobs(trainer)) < TOL


@pytest.fixture(scope="module")
def hf_size(tiny_model_dir):
    """``(tensors, bytes)`` of the tiny model's HF checkpoint: what every sync must carry."""
    from hpcrl.train.bridge import read_hf_state_dict

    state = read_hf_state_dict(tiny_model_dir)
    return len(state), sum(t.numel() * t.element_size() for t in state.values())


# --- the three methods --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["flattened_bucket", "direct"])
def test_tensor_sync_in_several_buckets(engine, trainer, hf_size, fmt):
    from hpcrl.weights import iterate_for_sync

    perturb(trainer, seed=1 if fmt == "direct" else 2)
    before, _ = engine_logprobs(engine.url)
    assert max_diff(before, trainer_logprobs(trainer)) > 1e-3  # the engine serves other weights
    opened = sessions(engine.url)
    (m,), _ = asyncio.run(_syncs(engine.url, "tensor", [(lambda: iterate_for_sync(trainer), f"tensor-{fmt}")],
                                 bucket_bytes=256 * 1024, timeout_s=60, tensor_format=fmt))
    # every bucket went inside one weight-update session, closed at the end (SGLang refuses them outside one)
    assert sessions(engine.url) == {"sessions_opened": opened["sessions_opened"] + 1,
                                    "sessions_closed": opened["sessions_closed"] + 1, "session_open": False}
    assert m["buckets"] >= 10 and (m["tensors"], m["bytes"]) == hf_size
    assert m["weight_version"] == f"tensor-{fmt}" and m["seconds"] >= m["transfer_seconds"] > 0
    assert m["gb_per_s"] > 0
    _assert_synced(engine, trainer, f"tensor-{fmt}")


def test_distributed_sync_reuses_its_group(engine, trainer, hf_size):
    from hpcrl.weights import iterate_for_sync

    def step(seed, previous=None):
        def make():
            if previous is not None:  # the previous sync landed before this one starts
                _assert_synced(engine, trainer, previous)
            perturb(trainer, seed)
            return iterate_for_sync(trainer)
        return make

    opened = sessions(engine.url)
    metrics, syncer = asyncio.run(_syncs(engine.url, "distributed",
                                         [(step(3), "dist-1"), (step(4, previous="dist-1"), "dist-2")],
                                         bucket_bytes=1024 * 1024, timeout_s=60))
    _assert_synced(engine, trainer, "dist-2")
    assert sessions(engine.url) == {"sessions_opened": opened["sessions_opened"] + 2,
                                    "sessions_closed": opened["sessions_closed"] + 2, "session_open": False}
    assert syncer._groups_created == 1 and syncer._group is None  # one group for both syncs, closed
    assert all(m["buckets"] >= 3 and (m["tensors"], m["bytes"]) == hf_size for m in metrics)
    # close() destroyed the group on the engine too (asked inside a session, which the update needs)
    key = {"Authorization": f"Bearer {KEY}"}
    assert http_json("POST", engine.url + "/begin_weight_update", {}, headers=key)[0] == 200
    status, body = http_json("POST", engine.url + "/update_weights_from_distributed",
                             {"names": [], "dtypes": [], "shapes": [], "group_name": "hpcrl_weight_update_0"},
                             headers=key)
    assert http_json("POST", engine.url + "/end_weight_update", {}, headers=key)[0] == 200
    assert status == 400 and "unknown weight update group" in body["message"]


def test_disk_sync_keeps_the_last_folder(engine, trainer, tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from hpcrl.weights import iterate_for_sync

    def make(seed):
        def f():
            perturb(trainer, seed)
            return iterate_for_sync(trainer)
        return f

    (tmp_path / "unrelated").mkdir()
    opened = sessions(engine.url)
    metrics, _ = asyncio.run(_syncs(engine.url, "disk", [(make(5), "1"), (make(6), "2")],
                                    disk_dir=str(tmp_path), hf_checkpoint=str(tiny_model_dir),
                                    bucket_bytes=1024 * 1024, timeout_s=60))
    _assert_synced(engine, trainer, "2")
    assert sessions(engine.url) == opened  # SGLang does not gate updates from disk: no session
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated", "weight_v000002"]
    folder = tmp_path / "weight_v000002"
    n = metrics[1]["buckets"]
    assert n >= 3 and len(list(folder.glob(f"model-0000?-of-{n:05d}.safetensors"))) == n
    assert AutoConfig.from_pretrained(folder).model_type == "qwen2" and AutoTokenizer.from_pretrained(folder)


def test_two_engines_get_the_same_weights(engine, trainer, tiny_model_dir, key_file, hf_size, tmp_path):
    """Rank offsets 1 and 2 in a world of 3 (distributed), one payload per engine (tensor), disk."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer, iterate_for_sync

    with EngineProcess(tiny_model_dir, ["--api-key-file", str(key_file)], log_path=tmp_path / "e2.log") as e2:
        async def go():
            out = []
            async with RolloutClient(engine_urls=[engine.url, e2.url], api_key=KEY) as client:
                for i, method in enumerate(("distributed", "tensor", "disk")):
                    syncer = WeightSyncer(client, method, bucket_bytes=1024 * 1024, timeout_s=60,
                                          disk_dir=str(tmp_path / "disk"))
                    try:
                        perturb(trainer, seed=20 + i)
                        m = await syncer.sync(iterate_for_sync(trainer), f"two-{method}")
                    finally:
                        await syncer.close()
                    served = [engine_logprobs(u) for u in (engine.url, e2.url)]
                    out.append((m, served, trainer_logprobs(trainer)))
            return out

        for m, per_engine, mine in asyncio.run(go()):
            assert (m["tensors"], m["bytes"]) == hf_size
            for logprobs, version in per_engine:
                assert version == f"two-{m['method']}" and max_diff(logprobs, mine) < TOL


# --- failures -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["tensor", "distributed", "disk"])
def test_renamed_tensor_is_refused_loudly(engine, trainer, hf_size, method, tmp_path):
    from hpcrl.weights import WeightSyncError, iterate_for_sync

    bad = RENAMED.replace("weight", "wrong")
    stream = Counted(renamed(iterate_for_sync(trainer)))
    with pytest.raises(WeightSyncError) as info:
        asyncio.run(_syncs(engine.url, method, [(lambda: stream, "bad")],
                           bucket_bytes=1024 * 1024, timeout_s=60, disk_dir=str(tmp_path)))
    assert stream.taken == hf_size[0]  # drained: TP peers of the sender are not left in a collective
    err = info.value
    endpoint = {"tensor": "/update_weights_from_tensor", "distributed": "/update_weights_from_distributed",
                "disk": "/update_weights_from_disk"}[method]
    assert err.url == engine.url and err.endpoint == endpoint
    assert f"unknown parameter '{bad}'" in err.message and bad in str(err) and engine.url in str(err)
    assert "\n" not in str(err)  # one line, naming the engine
    if method != "disk":  # the failure came inside the session, which the sync still closed
        assert "the weight-update session was closed on 1 engine(s)" in str(err)
    assert sessions(engine.url)["session_open"] is False
    _, served = engine_logprobs_after_resume(engine)
    assert served != "bad"


def test_a_session_left_open_is_closed_by_the_next_sync(engine, trainer, caplog):
    """A session that a failed sync could not close (the engine was unreachable then) stays open on the
    engine; the next sync closes it, with a warning, instead of failing on SGLang's "already open"."""
    from hpcrl.weights import iterate_for_sync

    key = {"Authorization": f"Bearer {KEY}"}
    assert http_json("POST", engine.url + "/begin_weight_update", {}, headers=key)[0] == 200
    perturb(trainer, seed=8)
    with caplog.at_level("WARNING", logger="hpcrl.weights.common"):
        asyncio.run(_syncs(engine.url, "tensor", [(lambda: iterate_for_sync(trainer), "reopened")],
                           bucket_bytes=1024 * 1024, timeout_s=60))
    _assert_synced(engine, trainer, "reopened")
    assert sessions(engine.url)["session_open"] is False
    assert any("still had a weight-update session open" in r.getMessage() for r in caplog.records)


def test_sync_paused_in_place_keeps_the_running_request(engine, trainer):
    """``pause_mode="in_place"``: the running request keeps its KV cache through the sync (SGLang refuses a
    flush then, so the sync asks for none) and finishes after it, not aborted, on the new weights."""
    from concurrent.futures import ThreadPoolExecutor

    from hpcrl.weights import iterate_for_sync

    long = {"input_ids": [1, 5, 9], "sampling_params": {"temperature": 1.0, "max_new_tokens": 240,
                                                         "ignore_eos": True}}
    key = {"Authorization": f"Bearer {KEY}"}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http_json, "POST", engine.url + "/generate", long, key, 120.0)
        deadline = time.monotonic() + 20
        while http_json("GET", engine.url + "/v1/loads", headers=key)[1]["loads"][0]["num_running_reqs"] < 1:
            assert time.monotonic() < deadline, "the request did not start"
            time.sleep(0.02)
        # frozen mid-generation whatever the machine's speed; the sync pauses in place again and continues
        assert http_json("POST", engine.url + "/pause_generation", {"mode": "in_place"},
                         headers=key)[0] == 200
        perturb(trainer, seed=9)
        asyncio.run(_syncs(engine.url, "tensor", [(lambda: iterate_for_sync(trainer), "in-place")],
                           bucket_bytes=1024 * 1024, timeout_s=60, pause_mode="in_place"))
        status, out = fut.result(timeout=120)
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 240}
    assert out["meta_info"]["weight_version"] == "in-place"
    _assert_synced(engine, trainer, "in-place")


@pytest.fixture(scope="module")
def policies(tiny_model_dir):
    """``(old, new)`` HF models: the weight versions 10 and 11 of the pause-mode tests."""
    return two_policies(tiny_model_dir)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_streamed_response_across_a_weight_update(engine, policies, mode):
    """Issue #37 point 2: a streamed response in flight while the weights go from version 10 to 11 with each
    pause mode, one streamed and one not (labelled from the engine's ``weight_versions`` spans either way).
    ``abort``: the call ends aborted with its tokens so far (all of version 10) and a continued call finishes
    it with version 11; ``retract`` and ``in_place``: the same request finishes, its tokens' versions switch
    once, aligned with the recorded log-probs (each the distribution the token was drawn from; under
    ``in_place`` the new weights over the old KV cache). ``in_place`` syncs without any flush: a
    flush would be refused while the frozen request holds its KV cache, and the sync would fail."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer

    old, new = policies

    async def go():
        async with RolloutClient(engine_urls=[engine.url], api_key=KEY, keep_partial=True) as streamed, \
                RolloutClient(engine_urls=[engine.url], api_key=KEY) as plain:
            await WeightSyncer(plain, "tensor", bucket_bytes=1 << 20, timeout_s=60).sync(
                iter(hf_tensors(old)), "10")
            before = (await plain.request("GET", "/get_server_info"))["internal_states"][0]
            raw = asyncio.create_task(stream_labels(engine.url, KEY))
            result = await generate_across_update([streamed, plain], mode, hf_tensors(new), "11",
                                                  also_running=1)
            after = (await plain.request("GET", "/get_server_info"))["internal_states"][0]
            return result, await raw, {k: after[k] - before[k] for k in ("aborted_rows", "retracted_rows")}

    (results, metrics), (by_chunk, by_span), counts = asyncio.run(go())
    for first, sample in results:
        check_across_update(mode, first, sample, old, new, 10, 11)
    assert metrics["weight_version"] == "11"
    assert counts == {"aborted_rows": 3 * (mode == "abort"), "retracted_rows": 3 * (mode == "retract")}
    # no chunk of the CPU engine mixes versions: its chunks label the tokens as its spans do
    assert by_chunk == by_span and by_span[0] == "10" and (mode == "abort" or by_span[-1] == "11")


def test_version_check_and_empty_stream(engine):
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncer, WeightSyncError
    from hpcrl.weights.common import EngineCalls

    async def go():
        async with RolloutClient(engine_urls=[engine.url], api_key=KEY) as client:
            with pytest.raises(WeightSyncError) as info:
                await EngineCalls(client, 10.0).check_versions("not-served")
            with pytest.raises(ValueError, match="no tensors"):
                await WeightSyncer(client, "tensor").sync(iter(()), "empty")
            return info.value

    err = asyncio.run(go())
    assert err.url == engine.url and err.endpoint == "/get_model_info" and "'not-served'" in err.message
    _, served = engine_logprobs(engine.url)  # not paused by the failed empty sync
    assert served != "empty"


@pytest.fixture()
def hang_engine(tiny_model_dir, tmp_path):
    """An engine (no key) that the test may SIGSTOP; continued and stopped afterwards."""
    eng = EngineProcess(tiny_model_dir, ["--dist-timeout", "10"], log_path=tmp_path / "hang.log").start()
    try:
        yield eng
    finally:
        if eng.proc is not None and eng.proc.poll() is None:
            os.kill(eng.proc.pid, signal.SIGCONT)
        eng.stop(timeout=20)


def test_unresponsive_engine_times_out(hang_engine, trainer, hf_size):
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.weights import WeightSyncError, iterate_for_sync
    from hpcrl.weights.common import EngineCalls
    from hpcrl.weights.distributed import DistributedGroup

    url = hang_engine.url
    # 1. a stopped engine: the sync fails at its first call, after timeout_s
    os.kill(hang_engine.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        stream = Counted(iterate_for_sync(trainer))
        with pytest.raises(WeightSyncError) as info:
            asyncio.run(_syncs(url, "tensor", [(lambda: stream, "never")], key=None,
                               timeout_s=2, engine_tp_sizes=[1]))
        # the pause times out after timeout_s=2: 15 s is 7x that, for a slower or loaded machine, and far
        # below the hang this guards against (none of these calls returns on its own)
        assert time.monotonic() - t0 < 15 and stream.taken == hf_size[0]
        assert info.value.url == url and info.value.endpoint == "/pause_generation"
        assert "timed out" in info.value.message
    finally:
        os.kill(hang_engine.proc.pid, signal.SIGCONT)
    _resume(url, None)

    # 2. an engine that stops in the middle of a transfer: neither the POST nor the broadcast hang
    big = [("model.embed_tokens.weight", torch.zeros(16 * 1024 * 1024))]  # 64 MiB: more than socket buffers

    async def go():
        async with RolloutClient(engine_urls=[url]) as client:
            calls = EngineCalls(client, 3.0)
            group = await DistributedGroup.create(calls, [1], "hang_group")
            await calls.begin_sessions()
            os.kill(hang_engine.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                with pytest.raises(WeightSyncError) as info:
                    await group.send_bucket(big, "never", True)
                elapsed = time.monotonic() - t0
                # 3. the session cannot be closed on a stopped engine: the note names it and why
                note = await EngineCalls(client, 1.0).close_sessions_after()
                return info.value, elapsed, note
            finally:
                from hpcrl.weights.distributed import _destroy_local

                _destroy_local(group.pg)

    err, elapsed, note = asyncio.run(go())
    # the POST times out after 3 s and the broadcast after gloo's timeout (seconds): 20 s holds on a loaded
    # machine and is far below the hang this guards against
    assert elapsed < 20, elapsed
    assert err.url == url and err.endpoint == "/update_weights_from_distributed"
    assert "timed out" in err.message
    assert "the broadcast from rank 0 failed too" in err.message, err.message  # gloo's timeout, not a hang
    assert (note.startswith(f"the weight-update session could not be closed on {url} (")
            and "timed out" in note)
    os.kill(hang_engine.proc.pid, signal.SIGCONT)
    # 4. once it answers again, the next sync closes the session it still has open, and syncs
    _resume(url, None)
    asyncio.run(_syncs(url, "tensor", [(lambda: iterate_for_sync(trainer), "after-hang")], key=None,
                       timeout_s=30, engine_tp_sizes=[1]))
    assert sessions_of(url, None)["session_open"] is False


# --- TP=2 trainer -------------------------------------------------------------------------------------------


def test_tp2_trainer_syncs_from_rank0(engine, tiny_model_dir, key_file, hf_size, tmp_path):
    pytest.importorskip("megatron.core")
    run_ranks(__file__, ["--model", str(tiny_model_dir), "--url", engine.url, "--key-file", str(key_file)],
              tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for method in ("tensor", "distributed"):
        res = r0[method]
        assert res["version"] == f"tp2-{method}" and res["metrics"]["buckets"] >= 10
        assert res["metrics"]["bytes"] == hf_size[1] and r1[method]["metrics"]["bytes"] == hf_size[1]
        assert r1[method]["metrics"]["buckets"] == 0  # rank 1 exported but sent nothing
        assert max_diff(res["engine"], res["trainer"]) < TOL
        assert max_diff(res["trainer"], r1[method]["trainer"]) < 1e-6


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=worker.__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--key-file", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    worker(args.model, args.url, args.key_file, args.out)
