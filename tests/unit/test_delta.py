"""Delta weight sync's encoding (hpcrl.weights.delta) in one process: each form round-trips bitwise (NaN, -0.0
and all), the smallest form is chosen from the count of changed words, the loader rebuilds the tensors a
full sync would send, and a delta it cannot apply changes nothing."""

from __future__ import annotations

import pytest
import torch

from hpcrl.weights.delta import (INDEX, MASK, VALUES, DeltaError, DeltaSender, encode_tensor, load_delta,
                                 split_pieces)


W = "model.layers.0.mlp.down_proj.weight"
"""The parameter of the tiny Qwen2 the tests change."""


@pytest.fixture
def loader(tiny_model_dir):
    """The CPU engine's weight loader over the tiny Qwen2 (fp32): what ``load_delta`` hands rebuilt tensors
    to (SGLang's model plays that part on GPUs)."""
    from transformers import AutoModelForCausalLM

    from hpcrl.engine.weights import WeightLoader

    return WeightLoader(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))


def param(loader, name: str = W) -> torch.Tensor:
    return dict(loader.model.named_parameters())[name].detach()


def changed(base: torch.Tensor, frac: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = base.clone()
    flat = new.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: int(frac * flat.numel())]
    flat[idx] += 1.0
    return new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("frac,form", [(0.0, None), (0.01, INDEX), (0.3, MASK), (1.0, "full")])
def test_each_form_round_trips_bitwise(loader, dtype, frac, form):
    base = torch.randn(param(loader).shape).to(dtype)
    new = changed(base, frac)
    new.view(-1)[0] = float("nan") if frac else base.view(-1)[0]
    new.view(-1)[-1] = -0.0 if frac else base.view(-1)[-1]
    word = torch.int16 if dtype == torch.bfloat16 else torch.int32
    expected = int((new.view(word) != base.view(word)).sum())
    old = base.clone()
    pieces, k = encode_tensor("w", new, base)
    assert k == expected and torch.equal(base.view(word), new.view(word))  # the base moved to the new words
    base = old
    if form is None:
        assert pieces == [] and k == 0
        return
    names = [n for n, _ in pieces]
    assert names == (["w"] if form == "full" else ["w" + form, "w" + VALUES])
    pieces = [(W + n[1:], t) for n, t in pieces]
    load_delta(loader, [(W, base)])
    load_delta(loader, pieces)
    rebuilt = loader._hpcrl_delta_base[W]  # the base, in the sync's dtype, and the parameter (fp32) from it
    assert rebuilt.dtype == dtype and torch.equal(rebuilt.view(torch.uint8), new.contiguous().view(torch.uint8))
    assert torch.equal(param(loader), new.float()) or frac and new.isnan().any()
    assert torch.equal(param(loader).nan_to_num(7.0), new.float().nan_to_num(7.0))
    sent = sum(p.numel() * p.element_size() for _, p in pieces)
    assert sent <= new.numel() * new.element_size()


def test_the_sender_keeps_its_base_and_counts():
    model = {"a": torch.randn(100, 10), "b": torch.randn(50)}
    sender = DeltaSender()
    first = list(sender.encode(model.items(), full=False))  # no base yet: full
    assert [n for n, _ in first] == ["a", "b"] and sender.stats.density == 1.0
    model["a"] = changed(model["a"], 0.02, seed=1)
    second = dict(sender.encode(model.items(), full=False))
    assert set(second) == {"a" + INDEX, "a" + VALUES}  # b did not change: not sent
    assert sender.stats.changed == 20 and sender.stats.words == 1050
    assert sender.stats.sent_bytes == 20 * (4 + 4) and sender.stats.full_bytes == 1050 * 4
    assert torch.equal(sender.base["a"], model["a"])
    assert [n for n, _ in sender.encode(model.items(), full=True)] == ["a", "b"]  # forced full
    assert [n for n, _ in sender.encode(model.items(), full=False)] == ["b"]  # nothing changed: one whole
    stream = sender.encode(model.items(), full=False)
    next(stream)  # a sync that stops halfway leaves no base: the next one is full
    assert not sender.ready
    bf16 = DeltaSender(torch.bfloat16)  # compares in the engines' dtype
    list(bf16.encode([("x", torch.ones(8))], full=False))
    assert bf16.stats.changed == 8
    list(bf16.encode([("x", torch.ones(8) + 1e-4)], full=False))
    assert bf16.stats.changed == 0  # absorbed by bf16's rounding


def test_a_delta_that_does_not_fit_changes_nothing(loader):
    base = param(loader).clone()
    one = [(W + INDEX, torch.tensor([1], dtype=torch.int32)), (W + VALUES, torch.ones(1))]
    with pytest.raises(DeltaError, match="no full tensor before it"):
        load_delta(loader, one)
    load_delta(loader, [(W, base + 1)])
    n = base.numel()
    for pieces, match in [
        ([(W + INDEX, torch.tensor([n], dtype=torch.int32)), (W + VALUES, torch.ones(1))], "indices"),
        ([(W + MASK, torch.zeros(1, dtype=torch.uint8)), (W + VALUES, torch.ones(1))], "mask of 1 bytes"),
        ([(W + INDEX, torch.tensor([1], dtype=torch.int32)), (W + VALUES, torch.ones(1, dtype=torch.bfloat16))],
         "bfloat16"),
        ([(W + INDEX, torch.tensor([1], dtype=torch.int32))], "needs one of"),
        ([(W + ":hpcrl_delta_other", torch.ones(1))], "not a delta piece"),
    ]:
        with pytest.raises(DeltaError, match=match):
            load_delta(loader, pieces)
    from hpcrl.engine.weights import WeightUpdateError

    with pytest.raises(WeightUpdateError, match="unknown parameter"):  # the engine's loader refuses a name ...
        load_delta(loader, [*one, ("model.nope.weight", torch.ones(3))])
    assert torch.equal(loader._hpcrl_delta_base[W], base + 1)  # ... first, so neither the base nor the model moved
    assert torch.equal(param(loader), base + 1)
    load_delta(loader, one)
    assert param(loader).view(-1)[1] == 1.0 and split_pieces([("x", base)]) == {"x": {"full": base}}
