"""Pipeline parallelism (issue #55 point 1; the ``parallel`` tier of .ci/budgets.json): the actor at PP=2 on 2
real processes (torchrun, gloo on loopback) equals the same actor at PP=1.

One torchrun job (this file run as a script, see ``worker``) trains an :class:`~hpcrl.train.actor.Actor` on
the same 16 samples with each layout of :data:`LAYOUTS`: the decoder split over two stages (the embedding and
the first layers on rank 0, the rest, the final norm and the tied output layer on rank 1), 1F1B through
megatron-core's schedule, activations of each micro-batch's own shape sent between the stages, the log-prob
recompute and the reference pass through its forward-only schedule, the losses and metrics made on the last
stage and sent to the first. This process trains the same at world size 1. Each layout must give the same
per-step losses, grad norms and metrics (rel 1e-5), the same weights after the first AdamW step and after 2
rollouts of 2 steps each (1e-6; exported to HF from both stages: every stage yields the whole model; AdamW as
:data:`STEP`/:data:`ADAM` say; measured 7e-9 to 1.3e-7); the exports before training are the HF folder bitwise
(the tied embedding's copy on the last stage equal to the first's). Not bitwise: the stages sum gradients in
another order (the tied embedding's two parts over the pipeline group).

Families and layouts: the tiny Qwen2 (dense, tied embeddings) padded and packed with shared group prompts, at
even stages and at uneven ones (``num_layers_in_first_pipeline_stage`` 1: slime's
``--decoder-first-pipeline-num-layers``); the tiny GLM-4.5 (MoE with a dense first layer and an expert bias,
so the stages hold different layer kinds) padded. Samples and configs come from tests/unit/test_actor.py
(KL loss with the reference swapped in, TIS, an entropy bonus).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # not a package: its helpers
from megatron_utils import dirs_args, run_two_ranks, worker_main  # noqa: E402
from test_actor_tp2 import CHANGES, GAE, PACKED, _unit_helpers, make_reward_model  # noqa: E402

ROLLOUTS = 2
STEP, ADAM = {"train.lr": 1.0}, {"adam_eps": 1.0}
"""AdamW as the bridge tests run it (tests/unit/test_megatron_bridge.py ``TRAIN``): with eps 1 a step is the
clipped gradient itself, so the weights after it compare the layouts' gradients; with eps 1e-8 Adam divides each
coordinate by its gradient's size and a rounding difference in a near-zero gradient becomes a full step."""
REPLAY = {"algorithm.routing_replay": True}
"""Routing replay of the samples' (random) routed experts: a wrong slice of them per stage or CP rank routes
tokens elsewhere than the one-rank run."""
PP2, CP2, TP2, EP2 = ({f"train.{k}_parallel_size": 2} for k in ("pipeline", "context", "tensor", "expert"))
REFERENCES = {"qwen2": ("qwen2", {}), "qwen2-packed": ("qwen2", PACKED), "glm4_moe": ("glm4_moe", {}),
              "glm4_moe-packed": ("glm4_moe", PACKED), "deepseek_v3-packed": ("deepseek_v3", PACKED),
              "mistral-packed": ("mistral", PACKED), "glm4_moe-replay": ("glm4_moe", REPLAY),
              "glm4_moe-packed-replay": ("glm4_moe", {**PACKED, **REPLAY}), "qwen2-gae": ("qwen2", GAE),
              "qwen2-packed-gae": ("qwen2", {**GAE, **PACKED})}
"""The world-size-1 runs (this process): name -> (family, config changes beyond :data:`test_actor_tp2.CHANGES`)."""
LAYOUTS = {
    "qwen2-pp2": ("qwen2", PP2),
    "qwen2-pp2-packed": ("qwen2-packed", {**PP2, **PACKED}),
    "qwen2-pp2-uneven": ("qwen2", {**PP2, "megatron": {"num_layers_in_first_pipeline_stage": 1}}),
    "glm4_moe-pp2": ("glm4_moe", PP2),
    "qwen2-cp2": ("qwen2-packed", {**CP2, **PACKED}),
    "glm4_moe-cp2": ("glm4_moe-packed", {**CP2, **PACKED}),
    "deepseek_v3-cp2": ("deepseek_v3-packed", {**CP2, **PACKED}),
    "mistral-cp2": ("mistral-packed", {**CP2, **PACKED}),
    "glm4_moe-pp2-replay": ("glm4_moe-replay", {**PP2, **REPLAY}),
    "glm4_moe-cp2-replay": ("glm4_moe-packed-replay", {**CP2, **PACKED, **REPLAY}),
    "qwen2-pp2-gae": ("qwen2-gae", {**PP2, **GAE}),
    "qwen2-cp2-gae": ("qwen2-packed-gae", {**CP2, **GAE, **PACKED}),
}
"""The 2-rank job: name -> (its reference in :data:`REFERENCES`, config changes)."""
LAYOUTS4 = {
    "qwen2-tp2-pp2": ("qwen2", {**TP2, **PP2}),
    "glm4_moe-pp2-ep2": ("glm4_moe", {**PP2, **EP2}),
    "qwen2-tp2-cp2": ("qwen2-packed", {**TP2, **CP2, **PACKED}),
    "glm4_moe-tp2-cp2": ("glm4_moe-packed", {**TP2, **CP2, **PACKED}),
    "deepseek_v3-tp2-cp2": ("deepseek_v3-packed", {**TP2, **CP2, **PACKED}),
}
"""The 4-rank job: TP=2 x PP=2 (sequence-parallel), PP=2 x EP=2 (DP=2, experts dispatched all-to-all) and
TP=2 x CP=2 (sequence-parallel inside each CP rank's part of the pack)."""


def sizes(changes: dict) -> dict:
    """``initialize_model_parallel``'s sizes of a layout's config changes."""
    return {k: changes.get(f"train.{name}_parallel_size", 1)
            for k, name in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert"))}


def run_actor(model_dir, samples, changes: dict, critic_path: str = "") -> dict:
    """Train :data:`ROLLOUTS` rollouts on ``samples`` with ``changes`` (CI gates on; the parallel sizes
    megatron's groups were made with); the rollouts' metrics, the step metrics, and the HF export before, after
    the first optimizer step and at the end."""
    from hpcrl.train import bridge
    from hpcrl.train import model as tmodel
    from hpcrl.train.actor import Actor

    changes = dict(changes)
    megatron = changes.pop("megatron", {})
    if changes.get("algorithm.advantage_estimator") == "gae":  # PPO: the critic from a reward model's head
        changes["critic.path"] = critic_path
    cfg = _unit_helpers().make_config(**{**CHANGES, **STEP, **changes})
    cfg.megatron = {**megatron, **ADAM}
    actor = Actor(cfg, model_dir, ci_checks=True)
    out: dict = {"first_stage": actor.model.pre_process, "last_stage": actor.model.post_process,
                 "layers": len(actor.model.decoder.layers), "metrics": [], "steps": [],
                 "before": {k: v.clone() for k, v in bridge.export_hf_weights(actor.ddp_model)}}
    train_step = tmodel.train_step

    def first_step_kept(*args, **kwargs):  # the weights after the first optimizer step, once
        result = train_step(*args, **kwargs)
        if "first_step" not in out:
            out["first_step"] = {k: v.clone() for k, v in bridge.export_hf_weights(actor.ddp_model)}
        return result

    tmodel.train_step = first_step_kept
    try:
        for rollout_id in range(ROLLOUTS):
            m = actor.train(rollout_id, samples)
            out["metrics"].append({k: v for k, v in m.items() if not k.endswith(("seconds", "tokens_per_s"))})
            out["steps"].append([dict(s) for s in actor.step_metrics])
    finally:
        tmodel.train_step = train_step
    out["weights"] = {k: v.clone() for k, v in bridge.export_hf_weights(actor.ddp_model)}
    return out


# --- the distributed side: `torchrun --nproc_per_node=2 test_pipeline_parallel.py --dirs JSON --out DIR` ----


def worker(dirs: dict[str, str], out: Path) -> None:
    """Run on each of 2 ranks; writes ``out/rank{r}.pt`` with every layout's results."""
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from hpcrl.data.sample import Sample
    from hpcrl.train import parallel

    samples = {replay: [Sample.from_dict(d) for d in torch.load(dirs[key], weights_only=False)]
               for replay, key in ((False, "samples"), (True, "samples_replay"))}
    env = parallel.init_distributed()
    res = {}
    for name, (ref, changes) in (LAYOUTS if env.world_size == 2 else LAYOUTS4).items():
        parallel.initialize_model_parallel(**sizes(changes))
        parallel.model_parallel_cuda_manual_seed(1234)
        res[name] = run_actor(dirs[REFERENCES[ref][0]], samples[bool(changes.get("algorithm.routing_replay"))],
                              changes, dirs["rm"])
        res[name]["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
        res[name]["cp_rank"] = parallel_state.get_context_parallel_rank()
        parallel_state.destroy_model_parallel()
    torch.save(res, out / f"rank{env.rank}.pt")
    parallel.destroy()


# --- the test side ------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration  # the parallel tier: multi-rank exactness (its own CI budget)


@pytest.fixture(scope="module")
def h():
    pytest.importorskip("megatron.core")
    return _unit_helpers()


@pytest.fixture(scope="module")
def dirs(h, tiny_model_dir, tmp_path_factory):
    from hpcrl.models.tiny import create_tiny_deepseek_v3, create_tiny_glm4_moe
    from tests.unit.test_mistral_bridge import make_tiny  # window 6: past it within the samples

    root = tmp_path_factory.mktemp("parallel")
    samples = h.make_samples(tiny_model_dir, num_groups=4, seed=0, correct_first=True)
    torch.save([s.to_dict() for s in samples], root / "samples.pt")
    glm = create_tiny_glm4_moe(root / "glm4_moe", seed=0)
    torch.save([with_random_routing(s, glm, seed=i).to_dict() for i, s in enumerate(samples)],
               root / "samples_replay.pt")
    return {"qwen2": str(tiny_model_dir), "glm4_moe": str(glm), "samples_replay": str(root / "samples_replay.pt"),
            "deepseek_v3": str(create_tiny_deepseek_v3(root / "deepseek_v3", seed=0)),
            "mistral": str(make_tiny("mistral", root / "mistral")),
            "rm": str(make_reward_model(tiny_model_dir, root / "rm")), "samples": str(root / "samples.pt")}


def with_random_routing(sample, model_dir: Path, seed: int):
    """``sample`` with engine-style routed experts (:func:`hpcrl.engine.routing.encode`) drawn at random: top-k
    distinct experts of every MoE layer for every token but the last."""
    import dataclasses
    import json

    from hpcrl.engine.routing import encode

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    layers = hf["num_hidden_layers"] - hf.get("first_k_dense_replace", 0)
    g = torch.Generator().manual_seed(seed)
    rows = [torch.stack([torch.randperm(hf["n_routed_experts"], generator=g)[: hf["num_experts_per_tok"]]
                         for _ in range(layers)]).to(torch.int32) for _ in range(len(sample.tokens) - 1)]
    return dataclasses.replace(sample, rollout_routed_experts=encode(rows, len(rows)))


@pytest.fixture(scope="module")
def ranks(dirs, tmp_path_factory):
    """Run the 2-rank torchrun job once; the per-rank results, rank 0 first."""
    return run_two_ranks(__file__, dirs_args(dirs), tmp_path_factory.mktemp("ranks2-out"))


@pytest.fixture(scope="module")
def ranks4(dirs, tmp_path_factory):
    """Run the 4-rank torchrun job once (:data:`LAYOUTS4`); the per-rank results, rank 0 first."""
    return run_two_ranks(__file__, dirs_args(dirs), tmp_path_factory.mktemp("ranks4-out"), nprocs=4)


@pytest.fixture(scope="module")
def single(dirs):
    """Every reference (:data:`REFERENCES`) at world size 1, in this process."""
    from hpcrl.data.sample import Sample
    from hpcrl.train import parallel

    samples = {replay: [Sample.from_dict(d) for d in torch.load(dirs[key], weights_only=False)]
               for replay, key in ((False, "samples"), (True, "samples_replay"))}
    parallel.init_distributed()
    res = {}
    for name, (family, changes) in REFERENCES.items():
        parallel.initialize_model_parallel()
        parallel.model_parallel_cuda_manual_seed(1234)
        res[name] = run_actor(dirs[family], samples[bool(changes.get("algorithm.routing_replay"))], changes,
                              dirs["rm"])
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    parallel.destroy()
    return res


LAYOUT_METRICS = ("train/forward_tokens", "train/padded_tokens")
"""Metrics of the micro-batch layout itself (DP=2 splits the samples into other micro-batches)."""


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    """Equal to ``rel``, or both within 1e-6 of each other where they are rounding noise around 0 (GRPO's
    policy loss, the train/rollout log-prob difference of an on-policy step: ~1e-7)."""
    return abs(a - b) <= max(rel * max(abs(a), abs(b)), 1e-6)


@pytest.mark.parametrize("name", LAYOUTS)
def test_actor_on_2_ranks_equals_one_rank(dirs, ranks, single, name):
    assert_equals_one_rank(dirs, ranks, single, name, LAYOUTS[name])


@pytest.mark.parametrize("name", LAYOUTS4)
def test_actor_on_4_ranks_equals_one_rank(dirs, ranks4, single, name):
    assert_equals_one_rank(dirs, ranks4, single, name, LAYOUTS4[name])


def assert_equals_one_rank(dirs: dict, ranks: list[dict], single: dict, name: str, layout: tuple) -> None:
    """Every rank's run of layout ``name`` against its world-size-1 reference (see the module doc)."""
    from hpcrl.train import bridge

    ref_name, changes = layout
    ref, family, n = single[ref_name], REFERENCES[ref_name][0], len(ranks)
    p = sizes(changes)
    stages = [r[name] for r in ranks]
    # megatron's rank order tp-cp-ep-dp-pp: pipeline outermost, then the CP ranks outside TP
    assert [s["pp_rank"] for s in stages] == [r * p["pp"] // n for r in range(n)]
    assert [s["cp_rank"] for s in stages] == [r // p["tp"] % p["cp"] for r in range(n)]
    assert [(s["first_stage"], s["last_stage"]) for s in stages] == \
        [(s["pp_rank"] == 0, s["pp_rank"] == p["pp"] - 1) for s in stages]
    total = ref["layers"]
    per_stage = (1, total - 1) if name.endswith("uneven") else (total // 2,) * 2 if p["pp"] == 2 else (total,)
    assert [s["layers"] for s in stages] == [per_stage[s["pp_rank"]] for s in stages]
    hf = bridge.read_hf_state_dict(dirs[family])
    for stage in stages:  # every stage yields the whole model, the HF folder's tensors bitwise
        assert stage["before"].keys() == ref["before"].keys()
        assert all(stage["before"][k].equal(hf[k]) for k in stage["before"]), name
    for stage in stages:  # the last stage's losses and metrics reach the first
        for got, want in zip(stage["steps"], ref["steps"], strict=True):
            for g, w in zip(got, want, strict=True):
                assert g.keys() == w.keys()
                bad = {k: (g[k], w[k]) for k in w if w[k] is not None and not _close(g[k], w[k])}
                assert not bad, (name, bad)
        for got, want in zip(stage["metrics"], ref["metrics"], strict=True):
            assert got.keys() == want.keys()
            bad = {k: (got[k], want[k]) for k in want
                   if k not in LAYOUT_METRICS and not _close(got[k], want[k], 1e-4)}
            assert not bad, (name, bad)
        for when in ("first_step", "weights"):
            assert stage[when].keys() == ref[when].keys()
            diff = max(float((stage[when][k] - ref[when][k]).abs().max()) for k in ref[when])
            assert diff < 1e-6, (name, when, diff)
    moved = max(float((ref["weights"][k] - ref["before"][k]).abs().max()) for k in ref["weights"])
    assert moved > 1e-4  # it trained


if __name__ == "__main__":
    worker_main(worker, "--dirs", "JSON {family: HF folder, samples: file}")
