"""The CPU engine serving a GLM-4.5-style model (issue #35 point 3, ``glm4_moe``), against real processes.

The tiny GLM (:func:`hpcrl.models.tiny.create_tiny_glm4_moe`: first layer dense, shared expert, sigmoid router
with a non-zero ``e_score_correction_bias`` and group-limited top-2, partial RoPE, q/k/v bias) served by
``python -m hpcrl.engine.server``:

- a sampled group's ``return_routed_experts`` equals the experts HF transformers' own routers choose (bias
  included) and its output log-probs equal HF's forward;
- weight sync with each method (``tensor``, ``distributed``, ``disk``) carries every checkpoint name, the
  router's ``e_score_correction_bias`` (a buffer in HF, not a parameter) and the shared experts included:
  afterwards the engine's log-probs and routing equal the sender's;
- a sender that changes only the expert bias moves the engine's routing with it, and a sync that leaves the
  bias out leaves the engine routing differently from the sender (what a trainer that did not sync its bias
  would cause; the check that can fail).

The sender is first an HF model (its per-expert checkpoint names, :func:`hpcrl.models.moe.unfuse_experts`),
then the megatron-core trainer (:func:`hpcrl.weights.iterate_for_sync`, the router's ``expert_bias`` buffer
exported as ``e_score_correction_bias``) at EP=1 in this process and at EP=2 (two torchrun processes, experts
gathered across the expert-parallel group, rank 0 sends): after a sync the engine's log-probs equal the
trainer's (the run's ``train_rollout_logprob_abs_diff``, fp32) and its routing equals the experts the
trainer's megatron-core routers chose (their ``routing_map``), also after the trainer's bias alone changed.
This file is the EP=2 torchrun worker when run as a script.
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
                                                perturb, run_two_rank_sync, sync_trainer, sync_weights,
                                                sync_worker_main, trainer_model)
except ImportError:  # tests/integration is not a package (also when run by torchrun)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_utils import (http_json, key_file, keyed_engine, local_trainer, max_diff, perturb,
                              run_two_rank_sync, sync_trainer, sync_weights, sync_worker_main, trainer_model)

KEY = "glm-engine-test-key"
TOL = 1e-5
SEQS = [[1, 5, 9, 12, 3, 7, 18, 4, 11, 6, 13, 8], [1, 14, 8, 20, 10, 2, 17, 5, 5, 9]]
"""Token ids (tiny vocab of 21) of sequences whose log-probs and routing are compared."""
MOE_LAYERS, EXPERTS, TOP_K = 2, 8, 2
BIAS = "e_score_correction_bias"

pytestmark = pytest.mark.integration


def make_glm(path):
    """The tiny GLM of these tests: 3 layers (the first dense, two MoE), hidden 64, 8 experts top-2."""
    from hpcrl.models.tiny import create_tiny_glm4_moe

    return create_tiny_glm4_moe(path, hidden_size=64, num_layers=MOE_LAYERS + 1, num_heads=4, num_kv_heads=2,
                                head_dim=16, num_experts=EXPERTS, top_k=TOP_K, moe_intermediate_size=32,
                                intermediate_size=96, seed=5)


def hf_view(model, seqs=SEQS) -> tuple[list[list[float]], list]:
    """HF's log-probs of tokens 1..n-1 of each sequence, and its routers' experts for tokens 0..n-2
    (``[n - 1, moe layers, top_k]``, sorted within top-k)."""
    from hpcrl.engine.routing import RoutedExperts

    recorder = getattr(model, "_recorder", None) or RoutedExperts(model)
    model._recorder = recorder
    lps, routes = [], []
    for seq in seqs:
        with torch.no_grad(), recorder.recording():
            logits = model(torch.tensor([seq])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        lps.append(lp.tolist())
        routes.append(recorder.take(1, len(seq))[0, :-1].sort(dim=-1).values.tolist())
    return lps, routes


def engine_view(url: str) -> tuple[list[list[float]], list, str]:
    """The engine's input log-probs (tokens 1..n-1) of each sequence, its routed experts ``[n - 1, moe
    layers, top_k]`` (sorted within top-k), and its weight_version."""
    from hpcrl.engine.routing import decode

    lps, routes, version = [], [], None
    for seq in SEQS:
        status, body = http_json("POST", url + "/generate", {
            "input_ids": seq, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0, "return_routed_experts": True},
            headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert status == 200, body
        lps.append([t[0] for t in body["meta_info"]["input_token_logprobs"][1:]])
        routed = decode(body["meta_info"]["routed_experts"], len(seq), MOE_LAYERS, TOP_K)
        routes.append(torch.from_numpy(routed.copy()).sort(dim=-1).values.tolist())
        version = body["meta_info"]["weight_version"]
    return lps, routes, version


def routes_differ(a, b) -> float:
    """Fraction of (token, layer) pairs whose expert sets differ between two route lists."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for ta, tb in zip(ra, rb, strict=True)
             for x, y in zip(ta, tb, strict=True)]
    return sum(x != y for x, y in pairs) / len(pairs)


def checkpoint_stream(model) -> list[tuple[str, torch.Tensor]]:
    """The HF model's tensors by checkpoint name (per-expert, no tied ``lm_head``): what a trainer sends."""
    from hpcrl.models.moe import unfuse_experts

    state = unfuse_experts(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return [(name, t.detach().clone()) for name, t in state.items()]


async def sync(url: str, stream, version: str, method: str, **kwargs) -> dict:
    return await sync_weights(url, KEY, stream, version, method, **kwargs)


def new_bias(model, seed: int) -> None:
    """A new random expert bias in every MoE layer of ``model`` (HF), of the scale that decides routing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(BIAS):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.05)


# --- the megatron-core trainer as the sender -------------------------------------------------------------

def trainer_view(model) -> tuple[list[list[float]], list]:
    """The trainer's log-probs of tokens 1..n-1 of each sequence and the experts its routers chose for tokens
    0..n-2 (from their ``routing_map``; sorted within top-k). A collective on every rank at EP > 1."""
    from hpcrl.train.bridge import unwrap_model
    from hpcrl.train.logprobs import response_log_probs

    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append(out[1].detach()))
             for name, m in unwrap_model(model).named_modules() if name.endswith("mlp.router")]
    assert len(hooks) == MOE_LAYERS
    lps, routes = [], []
    try:
        with torch.no_grad():
            for seq in SEQS:
                seen.clear()
                res = response_log_probs(model, torch.tensor([seq]), [len(seq)], [len(seq) - 1])
                lps.append(res.log_probs[0].tolist())
                chosen = [m.nonzero()[:, 1].view(len(seq), TOP_K) for m in seen]  # [tokens, top_k] per layer
                routes.append(torch.stack(chosen, dim=1)[:-1].tolist())
    finally:
        for h in hooks:
            h.remove()
    return lps, routes


def trainer_new_bias(model, seed: int) -> None:
    """A new random expert bias (megatron's ``router.expert_bias`` buffers), the same on every rank."""
    from hpcrl.train.bridge import unwrap_model

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in unwrap_model(model).named_buffers():
            if name.endswith("mlp.router.expert_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.05)


async def trainer_sync(url: str, model, version: str, sender: bool = True, drop_bias: bool = False,
                       method: str = "tensor", **kwargs) -> dict:
    """Sync the trainer's weights (``iterate_for_sync``) with ``method``; ``drop_bias``: leave the expert bias
    out of the stream (a trainer that does not sync it); ``kwargs``: more WeightSyncer fields
    (``disk_dir``)."""
    return await sync_trainer(url, KEY, model, version, method, sender=sender,
                              drop_suffix=BIAS if drop_bias else None, **kwargs)


def worker(model_dir: str, url: str, out: Path) -> None:
    """``torchrun --nproc_per_node=2 test_glm4_moe_engine.py --model DIR --url URL --out DIR``: EP=2 (experts
    0-3 on rank 0, 4-7 on rank 1); both ranks perturb alike and set a new bias, export; rank 0 syncs."""
    with trainer_model(model_dir, ep=2) as (model, rank):
        perturb(model, seed=200)
        trainer_new_bias(model, seed=201)
        metrics = asyncio.run(trainer_sync(url, model, "glm-ep2", sender=rank == 0))
        mine, routes = trainer_view(model)
        (out / f"rank{rank}.json").write_text(json.dumps(dict(metrics=metrics, trainer=mine, routes=routes)))


# --- fixtures -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    return make_glm(tmp_path_factory.mktemp("glm") / "tiny-glm4-moe")


@pytest.fixture(scope="module")
def engine(glm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("glm-engine")
    with keyed_engine(glm_dir, key_file(root, KEY), root / "engine.log") as eng:
        yield eng


@pytest.fixture()
def sender(glm_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(glm_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trainer(glm_dir):
    pytest.importorskip("megatron.core")
    yield from local_trainer(glm_dir)


# --- tests --------------------------------------------------------------------------------------------------

def test_a_sampled_group_routes_and_scores_like_hf(engine, sender):
    from hpcrl.engine.routing import decode

    prompt = [1, 5, 9, 12, 3]
    status, body = http_json("POST", engine.url + "/generate", {
        "input_ids": prompt, "return_routed_experts": True, "return_logprob": True,
        "sampling_params": {"n": 3, "max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}},
        headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert status == 200, body
    assert len(body) == 3
    seqs = [prompt + out["output_ids"] for out in body]
    assert len({tuple(s) for s in seqs}) > 1  # sampled (no seed: one seed gives the n copies one answer)
    hf_lps, hf_routes = hf_view(sender, seqs)
    for out, seq, lps, ref in zip(body, seqs, hf_lps, hf_routes, strict=True):
        assert len(out["output_ids"]) == 6
        routed = decode(out["meta_info"]["routed_experts"], len(seq), MOE_LAYERS, TOP_K)
        assert ((0 <= routed) & (routed < EXPERTS)).all()
        assert torch.from_numpy(routed.copy()).sort(dim=-1).values.tolist() == ref
        engine_lps = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(engine_lps, lps[len(prompt) - 1:], strict=True)) < TOL
    # both experts of a token lie in one group of 4 (n_group=2, topk_group=1), as the router demands
    for out, seq in zip(body, seqs):
        routed = decode(out["meta_info"]["routed_experts"], len(seq), MOE_LAYERS, TOP_K)
        assert ((routed // (EXPERTS // 2)).min(-1) == (routed // (EXPERTS // 2)).max(-1)).all()


@pytest.mark.parametrize("method", ["tensor", "distributed", "disk"])
def test_every_method_carries_every_name_and_the_expert_bias(engine, sender, glm_dir, method, tmp_path):
    from safetensors import safe_open

    perturb(sender, seed={"tensor": 1, "distributed": 2, "disk": 3}[method])
    new_bias(sender, seed=10 + len(method))
    mine, my_routes = hf_view(sender)
    before, before_routes, _ = engine_view(engine.url)
    assert max_diff(before, mine) > 1e-3 and routes_differ(before_routes, my_routes) > 0.1
    stream = checkpoint_stream(sender)
    with safe_open(str(glm_dir / "model.safetensors"), "pt") as f:
        assert {name for name, _ in stream} == set(f.keys())  # every checkpoint name, bias and shared experts
    assert sum(name.endswith(BIAS) for name, _ in stream) == MOE_LAYERS
    kwargs = dict(disk_dir=str(tmp_path), hf_checkpoint=str(glm_dir)) if method == "disk" else {}
    metrics = asyncio.run(sync(engine.url, stream, f"glm-{method}", method, **kwargs))
    assert metrics["tensors"] == len(stream)
    theirs, routes, version = engine_view(engine.url)
    assert version == f"glm-{method}"
    assert max_diff(theirs, mine) < TOL
    assert routes == my_routes


def test_routing_follows_the_synced_expert_bias_and_drifts_without_it(engine, sender):
    base = checkpoint_stream(sender)
    asyncio.run(sync(engine.url, base, "glm-base", "tensor"))
    new_bias(sender, seed=99)  # only the bias changes on the sending side
    mine, my_routes = hf_view(sender)
    stream = checkpoint_stream(sender)
    changed = [name for (name, t), (_, u) in zip(stream, base, strict=True) if not torch.equal(t, u)]
    assert changed and all(name.endswith(BIAS) for name in changed)

    without_bias = [(name, t) for name, t in stream if not name.endswith(BIAS)]
    asyncio.run(sync(engine.url, without_bias, "glm-no-bias", "tensor"))
    theirs, routes, _ = engine_view(engine.url)
    drift = routes_differ(routes, my_routes)
    assert drift > 0.1, f"an unsynced bias moved only {drift:.0%} of the routing: this check could not fail"
    assert max_diff(theirs, mine) > 1e-3

    asyncio.run(sync(engine.url, stream, "glm-bias", "tensor"))
    theirs, routes, version = engine_view(engine.url)
    assert version == "glm-bias"
    assert routes == my_routes and max_diff(theirs, mine) < TOL


@pytest.mark.parametrize("method", ["tensor", "distributed", "disk"])
def test_trainer_sync_gives_the_trainers_log_probs_and_routing(engine, trainer, glm_dir, method, tmp_path):
    seed = {"tensor": 31, "distributed": 33, "disk": 35}[method]
    perturb(trainer, seed=seed)
    trainer_new_bias(trainer, seed=seed + 1)
    mine, my_routes = trainer_view(trainer)
    before, before_routes, _ = engine_view(engine.url)
    assert max_diff(before, mine) > 1e-3 and routes_differ(before_routes, my_routes) > 0.1
    kwargs = dict(disk_dir=str(tmp_path), hf_checkpoint=str(glm_dir)) if method == "disk" else {}
    metrics = asyncio.run(trainer_sync(engine.url, trainer, f"glm-trainer-{method}", method=method, **kwargs))
    theirs, routes, version = engine_view(engine.url)
    assert version == f"glm-trainer-{method}"
    diff = max_diff(theirs, mine)
    print(f"train_rollout_logprob_abs_diff max {diff:.2e} over {sum(map(len, mine))} tokens, "
          f"{metrics['tensors']} tensors")
    assert diff < TOL
    assert routes == my_routes


def test_the_engine_routes_like_the_trainer_only_when_the_bias_is_synced(engine, trainer):
    asyncio.run(trainer_sync(engine.url, trainer, "glm-trainer-base"))
    trainer_new_bias(trainer, seed=41)  # e.g. megatron's aux-loss-free bias update after a step
    mine, my_routes = trainer_view(trainer)
    asyncio.run(trainer_sync(engine.url, trainer, "glm-trainer-no-bias", drop_bias=True))
    _, routes, _ = engine_view(engine.url)
    drift = routes_differ(routes, my_routes)
    assert drift > 0.1, f"an unsynced bias moved only {drift:.0%} of the routing: this check could not fail"
    asyncio.run(trainer_sync(engine.url, trainer, "glm-trainer-bias"))
    theirs, routes, _ = engine_view(engine.url)
    assert routes == my_routes and max_diff(theirs, mine) < TOL


def test_ep2_trainer_syncs_every_expert_and_the_bias(engine, glm_dir, tmp_path):
    ranks = run_two_rank_sync(__file__, ["--model", str(glm_dir), "--url", engine.url], tmp_path / "out")
    assert max_diff(ranks[0]["trainer"], ranks[1]["trainer"]) < 1e-6  # one model across the ranks
    assert ranks[0]["routes"] == ranks[1]["routes"]
    theirs, routes, version = engine_view(engine.url)
    assert version == "glm-ep2"
    assert max_diff(theirs, ranks[0]["trainer"]) < TOL
    assert routes == ranks[0]["routes"]


if __name__ == "__main__":
    sync_worker_main(worker)
