"""Mistral and Mixtral served by the CPU engine (issue #35 point 3), against real processes.

The tiny models of tests/unit/test_mistral_bridge.py (sliding windows of 5 and 6 tokens) served by
``python -m hpcrl.engine.server`` and trained by a megatron-core model in this process (gloo world of 1):

- Generation past the window (prompts of two lengths, so left-padded in one batch, several samples each):
  the engine's ``output_token_logprobs`` of what it sampled equal the trainer's log-probs of the same tokens
  (fp32, 1e-5; measured of the order of 1e-6) - prefill and decode both apply the window as the trainer does.
- Weight sync with each method (tensor, disk, distributed) of perturbed trainer weights carries every HF
  name (Mixtral's ``block_sparse_moe.*`` included: as many tensors and bytes as the checkpoint) and the
  engine's log-probs then equal the trainer's.
- Mixtral: ``return_routed_experts`` equals HF's routers' choice; rollout routing replay (R3) makes the
  routing of the fp32 trainer equal that of a bf16 engine (which differs without replay: the gate can fail);
  an EP=2 trainer (two torchrun processes, experts gathered over the expert-parallel group, rank 0 sends)
  syncs every expert. This file is that torchrun worker when run as a script.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch

try:
    from tests.integration.engine_utils import (http_json, key_file, keyed_engine, local_trainer, max_diff,
                                                perturb, prefill_logprobs, run_two_rank_sync, sync_trainer,
                                                sync_worker_main, trainer_model)
except ImportError:  # tests/integration is not a package (also when run by torchrun)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_utils import (http_json, key_file, keyed_engine, local_trainer, max_diff, perturb,
                              prefill_logprobs, run_two_rank_sync, sync_trainer, sync_worker_main,
                              trainer_model)

KEY = "mistral-engine-test-key"
TOL = 1e-5
FAMILIES = ("mistral", "mixtral")
SEQS = [[1, 5, 9, 12, 3, 7, 18, 4, 11, 6, 13, 8], [1, 14, 8, 20, 10, 2, 17, 9, 4]]
"""Token ids (vocab of 21), longer than the windows, whose prefill log-probs are compared after a sync."""
HEADERS = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.integration


def _unit():
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    import tests.unit.test_mistral_bridge as helpers

    return helpers


def trainer_logprobs(model, tokens: list[int], response: int) -> list[float]:
    """The trainer's log-probs of the last ``response`` tokens of ``tokens`` (temperature 1)."""
    from hpcrl.train.logprobs import response_log_probs

    with torch.no_grad():
        out = response_log_probs(model, torch.tensor([tokens]), [len(tokens)], [response])
    return out.log_probs[0].tolist()


def engine_logprobs(url: str) -> tuple[list[list[float]], str]:
    """The engine's prefill log-probs of tokens 1..n-1 of each of :data:`SEQS`, and its weight_version."""
    return prefill_logprobs(url, SEQS, KEY)


async def tensor_sync(url: str, model, version: str, sender: bool = True) -> dict:
    """One ``tensor`` weight sync of ``model`` (every rank iterates the export; ``sender`` posts it)."""
    return await sync_trainer(url, KEY, model, version, sender=sender)


# --- the EP=2 worker: `torchrun --nproc_per_node=2 test_mistral_engine.py --model DIR --url URL --out DIR` --

def worker(model_dir: str, url: str, out: Path) -> None:
    """Each of 2 ranks (EP=2: Mixtral's experts 0-1 on rank 0, 2-3 on rank 1) exports; rank 0 syncs."""
    with trainer_model(model_dir, ep=2) as (model, rank):
        perturb(model, seed=200)  # the same noise on both ranks: the replicated weights stay replicas
        metrics = asyncio.run(tensor_sync(url, model, "ep2", sender=rank == 0))
        mine = [trainer_logprobs(model, seq, len(seq) - 1) for seq in SEQS]
        (out / f"rank{rank}.json").write_text(json.dumps(dict(metrics=metrics, trainer=mine)))


# --- fixtures -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp("mistral-engine")
    return {kind: _unit().make_tiny(kind, root / kind) for kind in FAMILIES}


@pytest.fixture(scope="module")
def api_key_file(tmp_path_factory):
    return key_file(tmp_path_factory.mktemp("mistral-key"), KEY)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, dirs, api_key_file, tmp_path_factory):
    """``(kind, HF folder, engine, trainer)``: an engine serving the family, a megatron model of it."""
    kind = request.param
    log = tmp_path_factory.mktemp(f"{kind}-logs") / "engine.log"
    trainer = local_trainer(dirs[kind])
    model = next(trainer)
    try:
        with keyed_engine(dirs[kind], api_key_file, log) as eng:
            yield kind, dirs[kind], eng, model
    finally:
        trainer.close()  # the model-parallel state torn down


# --- tests --------------------------------------------------------------------------------------------------


def test_generation_past_the_window_has_the_trainers_log_probs(family):
    kind, _, engine, model = family
    window = _unit().WINDOWS[kind]
    worst = 0.0
    prompts = [[1, 5, 9, 12, 3, 7, 18], [1, 14, 8]]  # one batch: the shorter is left-padded
    status, body = http_json("POST", engine.url + "/generate", {
        "input_ids": prompts, "return_logprob": True,
        "sampling_params": {"n": 2, "max_new_tokens": 9, "temperature": 1.0, "ignore_eos": True,
                            "sampling_seed": 3}}, headers=HEADERS, timeout=120)
    assert status == 200, body
    assert len(body) == 4
    for i, out in enumerate(body):
        prompt = prompts[i // 2]
        tokens = prompt + out["output_ids"]
        assert len(out["output_ids"]) == 9 and len(tokens) > window + 5
        theirs = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        mine = trainer_logprobs(model, tokens, len(out["output_ids"]))
        worst = max(worst, max_diff([theirs], [mine]))
    print(f"{kind}: max |engine - trainer| log-prob over generated tokens {worst:.2e}")
    assert worst < TOL


def test_requests_joining_a_running_batch_past_the_window(family):
    """Continuous batching (whole-length KV layers; transformers' mask applies the window): a request that
    joins a running batch is merged left-padded into its cache, and both keep the trainer's log-probs."""
    import concurrent.futures
    import time

    kind, _, engine, model = family
    status, info = http_json("GET", engine.url + "/get_server_info", headers=HEADERS)
    assert status == 200 and info["internal_states"][0]["continuous_batching"] is True

    def generate(prompt, new, seed):
        return http_json("POST", engine.url + "/generate", {
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True,
                                "sampling_seed": seed}}, headers=HEADERS, timeout=120)

    def stats():
        return http_json("GET", engine.url + "/get_server_info", headers=HEADERS)[1]["internal_states"][0]

    prompts = [[1, 14, 8], [1, 5, 9, 12, 3, 7, 18, 4]]
    steps = stats()["decode_steps"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(generate, prompts[0], 48, 1)
        deadline = time.monotonic() + 30
        while stats()["num_running_reqs"] == 0 and time.monotonic() < deadline:  # the first is decoding ...
            time.sleep(0.002)
        second = pool.submit(generate, prompts[1], 8, 2)  # ... when the second arrives
        results = [first.result(), second.result()]
    after = stats()
    assert after["continuous_batching"] is True
    assert after["decode_steps"] - steps < 47 + 7  # fewer than one after the other: the second joined
    worst = 0.0
    for prompt, (status, out) in zip(prompts, results):
        assert status == 200, out
        tokens = prompt + out["output_ids"]
        theirs = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        worst = max(worst, max_diff([theirs], [trainer_logprobs(model, tokens, len(out["output_ids"]))]))
    print(f"{kind}: joined batch, max |engine - trainer| {worst:.2e}, {after['decode_steps'] - steps} steps")
    assert worst < TOL


@pytest.mark.parametrize("method", ("tensor", "disk", "distributed"))
def test_weight_sync_carries_every_name(family, method, tmp_path):
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.train.bridge import read_hf_state_dict
    from hpcrl.weights import WeightSyncer, iterate_for_sync

    kind, path, engine, model = family
    hf = read_hf_state_dict(path)
    perturb(model, seed={"tensor": 1, "disk": 2, "distributed": 3}[method])
    mine = [trainer_logprobs(model, seq, len(seq) - 1) for seq in SEQS]
    before, _ = engine_logprobs(engine.url)
    assert max_diff(before, mine) > 1e-3  # the engine serves other weights
    names = [name for name, _ in iterate_for_sync(model)]
    assert sorted(names) == sorted(hf)  # every checkpoint name, in the checkpoint's naming

    async def go():
        extra = dict(disk_dir=str(tmp_path), hf_checkpoint=str(path)) if method == "disk" else {}
        async with RolloutClient(engine_urls=[engine.url], api_key=KEY) as client:
            syncer = WeightSyncer(client, method, bucket_bytes=64 * 1024, timeout_s=60, **extra)
            try:
                return await syncer.sync(iterate_for_sync(model), f"{kind}-{method}")
            finally:
                await syncer.close()

    metrics = asyncio.run(go())
    assert (metrics["tensors"], metrics["bytes"]) == (len(hf), sum(t.numel() * t.element_size()
                                                                   for t in hf.values()))
    theirs, version = engine_logprobs(engine.url)
    assert version == f"{kind}-{method}"
    assert max_diff(theirs, mine) < TOL


def test_mixtral_routed_experts_equal_hf_routing(family):
    """The engine serves the trainer's (synced) weights: HF's reference loads them too, from the trainer's
    export in Mixtral's checkpoint names through transformers 5's in-memory ones."""
    kind, path, engine, model = family
    if kind != "mixtral":
        pytest.skip("Mixtral only: Mistral is dense")
    from transformers import AutoModelForCausalLM

    from hpcrl.engine.routing import RoutedExperts, decode
    from hpcrl.models.moe import RenamedWeights, from_mixtral_name, fuse_experts
    from hpcrl.train.bridge import export_hf_weights

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    state = fuse_experts(RenamedWeights(dict(export_hf_weights(model)), from_mixtral_name))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied: not exported
    recorder = RoutedExperts(hf)
    assert recorder.layers == 2 and recorder.top_k == 2
    prompt = [1, 5, 9, 12, 3, 7, 18]
    status, body = http_json("POST", engine.url + "/generate", {
        "input_ids": prompt, "return_routed_experts": True,
        "sampling_params": {"n": 2, "max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True,
                            "sampling_seed": 7}}, headers=HEADERS, timeout=60)
    assert status == 200, body
    for out in body:
        tokens = prompt + out["output_ids"]
        routed = decode(out["meta_info"]["routed_experts"], len(tokens), 2, 2)
        with torch.no_grad(), recorder.recording():
            hf(torch.tensor([tokens[:-1]]))
        assert (routed == recorder.take(1, len(tokens) - 1)[0].numpy()).all()


def test_mixtral_routing_replay_equals_the_bf16_engines_routing(family, tmp_path):
    """A bigger tiny Mixtral (8 experts, 4 layers: near-ties that bf16 breaks differently) sampled by a bf16
    engine, scored by the fp32 trainer with and without replay (benchmarks/routing_replay.py's ``measure``, in
    the fixture's gloo world)."""
    if family[0] != "mixtral":
        pytest.skip("Mixtral only: Mistral is dense")
    import importlib.util

    from transformers import MixtralConfig, MixtralForCausalLM

    from hpcrl.models.tiny import build_char_tokenizer

    bench_dir = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench_dir))
    spec = importlib.util.spec_from_file_location("hpcrl_bench_routing_replay",
                                                  bench_dir / "routing_replay.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tok = build_char_tokenizer()
    config = MixtralConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=128, sliding_window=8,
                           rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        MixtralForCausalLM(config).save_pretrained(tmp_path / "mixtral")
    tok.save_pretrained(tmp_path / "mixtral")
    prompts = [tok(f"{100 + 37 * i}+{250 + 13 * i}=")["input_ids"] for i in range(6)]
    proc, url = bench.start_engine(str(tmp_path / "mixtral"), 1, tmp_path / "engine.log",
                                   ("--dtype", "bfloat16"))
    try:
        free, replay = bench.measure(tmp_path / "mixtral", url, prompts, samples=3, max_new_tokens=16)
    finally:
        bench.stop_engine(proc)
    print(free, replay)
    assert free["tokens"] == replay["tokens"] > 0
    assert free["routing_differs"] > 0, "bf16 and fp32 routed every token alike: the gate shows nothing"
    assert replay["routing_differs"] == 0
    assert replay["logprob_mean"] < free["logprob_mean"]


def test_mixtral_ep2_trainer_syncs_every_expert(family, tmp_path):
    kind, path, engine, _ = family
    if kind != "mixtral":
        pytest.skip("Mixtral only: Mistral has no experts")
    from hpcrl.train.bridge import read_hf_state_dict

    ranks = run_two_rank_sync(__file__, ["--model", str(path), "--url", engine.url], tmp_path / "out")
    assert ranks[0]["metrics"]["tensors"] == len(read_hf_state_dict(path))  # every name, both ranks' experts
    assert max_diff(ranks[0]["trainer"], ranks[1]["trainer"]) < 1e-6  # one model across the ranks
    theirs, version = engine_logprobs(engine.url)
    assert version == "ep2"
    assert max_diff(theirs, ranks[0]["trainer"]) < TOL


if __name__ == "__main__":
    sync_worker_main(worker)
