"""The Megatron model layer across 2 real processes (torchrun, gloo on loopback): TP=2, and TP=1 x DP=2.

One torchrun job (this file run as a script, see ``worker``) does everything distributed and saves what it
computed per rank; the tests compare that with HF transformers in this process:
- TP=2, tiny Qwen2 / Qwen3 / Llama, without and with sequence parallelism: HF -> megatron -> HF export is
  bitwise equal on both ranks; gathered logits, vocab-parallel log-probs and entropy equal HF's (1e-5); the
  entropy gradient reaches both vocab shards.
- One optimizer step (megatron DDP + optimizer) at TP=2 (with and without sequence parallelism), and at
  TP=1 x DP=2 with the distributed optimizer,
  on the same data: grad norms equal each other and HF's (rel 1e-5), weights after the step equal HF AdamW's;
  one SFT step (:class:`hpcrl.train.supervised.SupervisedTrainer`) at TP=2 and at TP=1 x DP=2 equals HF +
  AdamW on the same demonstrations to 1e-6 (issue #40 point 3);
  Qwen3 at TP=2: its per-head q/k norms stay equal on both ranks and step like HF's.
Helpers (tiny models, batch, loss, HF references) come from tests/unit/test_megatron_bridge.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/integration is not a package
from megatron_utils import (  # noqa: E402
    assert_export_bitwise, dirs_args, helpers_fixture, model_parallel_at, run_two_ranks, unit_helpers, worker_main)


# --- the distributed side: `torchrun --nproc_per_node=2 test_megatron_tp2.py --dirs JSON --out DIR` --------


def worker(dirs: dict[str, str], out: Path) -> None:
    """Run on each of 2 ranks; writes ``out/rank{r}.pt``."""
    torch.set_num_threads(1)
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from hpcrl.train import bridge, logprobs, parallel, model as tmodel

    h = unit_helpers()
    env = parallel.init_distributed()
    model_parallel_at(tp=2)
    res: dict = {"tp_rank": parallel_state.get_tensor_model_parallel_rank()}

    for (kind, path), sp in ((kp, sp) for kp in dirs.items() for sp in (False, True)):
        model = h.build_loaded(path, sequence_parallel=sp)
        vocab = model.hf_config.vocab_size
        tokens = h.sample_batch(vocab)[0]
        with torch.no_grad():
            logits = model(input_ids=tokens, position_ids=torch.arange(h.SEQ).expand(3, -1), attention_mask=None)
            res[kind + ("_sp" if sp else "")] = dict(
                export=dict(bridge.export_hf_weights(model)),
                shard_shape=tuple(logits.shape),
                logits=gather_from_tensor_model_parallel_region(logits)[..., :vocab].clone(),
                log_probs=logprobs.compute_log_probs(logits[:, :-1], tokens[:, 1:], 0.7, vocab_size=vocab),
                entropy=logprobs.compute_entropy(logits[:, :-1], 0.7, vocab_size=vocab),
            )

    # Entropy gradient over the sharded vocab: full logits [2, 4, 16] (valid vocab 11), 8 columns per rank.
    full = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(7))
    shard = full.chunk(2, dim=-1)[res["tp_rank"]].clone().requires_grad_(True)
    weights = torch.randn(2, 4, generator=torch.Generator().manual_seed(8))
    ent = logprobs.compute_entropy(shard, 0.9, vocab_size=11)
    (ent * weights).sum().backward()
    res["entropy_grad"] = dict(full=full, weights=weights, entropy=ent.detach(),
                               grad=gather_from_tensor_model_parallel_region(shard.grad))

    batch = h.sample_batch(21, seed=5)
    sp = dataclasses.replace(h.TRAIN, tensor_parallel_size=2, sequence_parallel=True)
    for name, tp, train, kind in (
            ("tp2", 2, h.TRAIN, "qwen2"), ("tp2_qwen3", 2, h.TRAIN, "qwen3"),
            ("tp2_sp", 2, sp, "qwen2"), ("tp2_sp_qwen3", 2, sp, "qwen3"),
            ("tp1_dp2_distopt", 1, dataclasses.replace(h.TRAIN, use_distributed_optimizer=True), "qwen2")):
        model_parallel_at(tp=tp)
        ddp_model, optimizer = tmodel.setup_model_and_optimizer(dirs[kind], train, h.MEGATRON)
        step = tmodel.train_step(ddp_model, optimizer, h.megatron_loss_fn(batch), [None])
        res[name] = dict(step=step, dp=parallel_state.get_data_parallel_world_size(),
                         sp=bridge.unwrap_model(ddp_model).config.sequence_parallel,
                         after=dict(bridge.export_hf_weights(ddp_model)))

    # One SFT step (hpcrl.train.supervised) at TP=2 and at TP=1 x DP=2, on 12 addition demonstrations
    from hpcrl.train.supervised import SupervisedTrainer

    sup = unit_helpers("test_supervised")
    samples = sup.demos(dirs["qwen2"])
    for name, tp, layout in (("sft_tp1_dp2", 1, {}), ("sft_tp2", 2, {}),
                             ("sft_tp2_no_sp", 2, {"train.sequence_parallel": False})):
        model_parallel_at(tp=tp)
        cfg = sup.sft_config(len(samples), tp=tp, nprocs=2, **layout)
        trainer = SupervisedTrainer(cfg, dirs["qwen2"])
        res[name] = dict(metrics=trainer.train(7, samples), dp=trainer.dp_size,
                         sp=trainer.model.config.sequence_parallel,
                         after=dict(bridge.export_hf_weights(trainer.ddp_model)))

    torch.save(res, out / f"rank{env.rank}.pt")
    parallel.destroy()


# --- the test side ------------------------------------------------------------------------------------------

pytestmark = pytest.mark.integration


h = helpers_fixture()


@pytest.fixture(scope="module")
def dirs(h, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-tp2")
    return {"qwen2": tiny_model_dir, "qwen3": h.make_tiny_hf("qwen3", root / "qwen3"),
            "llama": h.make_tiny_hf("llama", root / "llama")}


@pytest.fixture(scope="module")
def ranks(dirs, tmp_path_factory):
    """Run the torchrun job once; the per-rank results, rank 0 first."""
    return run_two_ranks(__file__, dirs_args(dirs),
                         tmp_path_factory.mktemp("tp2-out"))


SP = pytest.mark.parametrize("sp", (False, True), ids=("tp2", "tp2-sp"))


@SP
@pytest.mark.parametrize("kind", ("qwen2", "qwen3", "llama"))
def test_tp2_export_is_bitwise_identical_on_both_ranks(h, dirs, ranks, kind, sp):
    from hpcrl.train import bridge

    hf = bridge.read_hf_state_dict(dirs[kind])
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    for res in ranks:
        assert_export_bitwise(res[kind + ("_sp" if sp else "")]["export"], hf)


@SP
@pytest.mark.parametrize("kind", ("qwen2", "qwen3", "llama"))
def test_tp2_logits_log_probs_entropy_match_hf(h, dirs, ranks, kind, sp):
    """Sequence parallelism (``sp``) splits the norms' tokens over the two ranks; the gathered logits are the
    same as without it."""
    from hpcrl.train import bridge

    hf_model = h.load_hf(dirs[kind])
    vocab = hf_model.config.vocab_size
    tokens = h.sample_batch(vocab)[0]
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    _, ref_lp, ref_ent = h.hf_reference(hf_model, tokens, 0.7)
    for res in ranks:
        r = res[kind + ("_sp" if sp else "")]
        assert r["shard_shape"] == (3, h.SEQ, bridge.padded_vocab_size(vocab, tp=2) // 2)
        assert (r["logits"] - hf_logits).abs().max() < 1e-5
        assert (r["log_probs"] - ref_lp).abs().max() < 1e-5
        assert (r["entropy"] - ref_ent).abs().max() < 1e-5


def test_tp2_entropy_gradient_reaches_both_shards(ranks):
    e = ranks[0]["entropy_grad"]
    full = e["full"].clone().requires_grad_(True)
    logp = torch.log_softmax(full[..., :11] / 0.9, -1)
    ent = -(logp.exp() * logp).sum(-1)
    (ent * e["weights"]).sum().backward()
    for res in ranks:
        assert torch.allclose(res["entropy_grad"]["entropy"], ent.detach(), atol=1e-6)
        assert torch.allclose(res["entropy_grad"]["grad"], full.grad, atol=1e-6)
    assert full.grad[..., 8:11].abs().sum() > 0  # columns of rank 1 get gradient


def test_grad_norm_tp2_equals_tp1_dp2_and_hf(h, dirs, ranks):
    """One optimizer step at TP=2 (without and with sequence parallelism: the norms' weight gradients are then
    each rank's tokens' part, summed over TP by megatron's finalize step) and at TP=1 x DP=2 equals HF."""
    batch = h.sample_batch(21, seed=5)
    ref_loss, ref_norm, ref_state = h.hf_train_step(h.load_hf(dirs["qwen2"]).train(), *batch)
    tp2, sp, dp2 = ranks[0]["tp2"], ranks[0]["tp2_sp"], ranks[0]["tp1_dp2_distopt"]
    assert dp2["dp"] == 2 and tp2["dp"] == 1 and sp["dp"] == 1
    assert sp["sp"] and not tp2["sp"]
    if "lm_head.weight" not in tp2["after"]:  # a tied model exports no lm_head (HF saves it the same way)
        assert torch.equal(ref_state.pop("lm_head.weight"), ref_state["model.embed_tokens.weight"])
    assert tp2["step"]["grad_norm"] == pytest.approx(dp2["step"]["grad_norm"], rel=1e-5)
    for run in (tp2, sp, dp2):
        assert run["step"]["update_successful"]
        assert run["step"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
        assert run["step"]["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert max((run["after"][k] - ref_state[k]).abs().max().item() for k in ref_state) < 1e-6
    for name in ("tp2", "tp2_sp", "tp1_dp2_distopt"):  # both ranks hold the same full weights after the step
        assert all(torch.equal(ranks[0][name]["after"][k], ranks[1][name]["after"][k]) for k in ref_state)


@pytest.mark.parametrize("name", ("tp2_qwen3", "tp2_sp_qwen3"))
def test_qk_norm_stays_replicated_at_tp2_and_steps_like_hf(h, dirs, ranks, name):
    """Qwen3's per-head q/k norms are replicated over TP ranks while each rank holds half the heads: their
    gradients must be summed over TP (megatron's ``finalize_model_grads`` does; hpcrl's ``train_step`` does
    too since issue #38's review), or the two ranks' copies drift apart after one step. With sequence
    parallelism the layer norms are summed over TP as well, and the q/k norms once, not twice."""
    batch = h.sample_batch(21, seed=5)
    ref_loss, ref_norm, ref_state = h.hf_train_step(h.load_hf(dirs["qwen3"]).train(), *batch)
    run = ranks[0][name]
    norms = [k for k in run["after"] if k.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight",
                                                     "model.norm.weight"))]
    assert len(norms) > 2
    for k in norms:
        assert torch.equal(run["after"][k], ranks[1][name]["after"][k]), k
    assert run["step"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert max((run["after"][k] - ref_state[k]).abs().max().item() for k in run["after"]) < 1e-6


@pytest.mark.parametrize("name", ["sft_tp2", "sft_tp2_no_sp", "sft_tp1_dp2"])
def test_one_sft_step_at_tp2_and_dp2_equals_hf_adamw(dirs, ranks, name):
    """The SFT step of tests/unit/test_supervised.py across two ranks: the weights are split over TP (each
    rank holds half of every layer and its gradient; sequence-parallel by default, and with
    ``train.sequence_parallel=false``) or the batch over DP (each rank half of the demonstrations; the loss
    is the batch's mean over every trained token either way)."""
    from hpcrl import sft_recipe as sft
    from tests.unit import test_supervised as sup

    samples = sup.demos(dirs["qwen2"])
    loss, norm, want = sup.hf_step(dirs["qwen2"], samples, sft.lr_at(7, 100, 1.0))
    for res in ranks:
        run = res[name]
        assert run["dp"] == (2 if name == "sft_tp1_dp2" else 1)
        assert run["sp"] == (name == "sft_tp2")
        assert run["metrics"]["train/loss"] == pytest.approx(loss, rel=1e-5)
        assert run["metrics"]["train/grad_norm"] == pytest.approx(norm, rel=1e-5)
        worst = max(float((run["after"][n] - want[n]).abs().max()) for n in run["after"])
        assert worst < 1e-6, worst
    assert all(torch.equal(ranks[0][name]["after"][k], ranks[1][name]["after"][k]) for k in ranks[0][name]["after"])


if __name__ == "__main__":
    worker_main(worker, "--dirs", "JSON {family: HF folder}")
