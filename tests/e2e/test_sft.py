"""The SFT warm start: demonstrations, the lr schedule, determinism, the cache, and the quickstart accuracy."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from hpcrl.config import Config
from hpcrl.sft import IGNORE_INDEX, METRICS_FILENAME, build_demonstrations, lr_at, run_sft


def _cfg(tmp_path: Path, output: str, steps: int, seed: int = 1234, num_eval: int = 500) -> Config:
    cfg = Config()
    cfg.data.num_eval = num_eval
    cfg.run.seed = seed
    cfg.model.path = str(tmp_path / "base")
    cfg.model.create = "tiny-qwen2"
    cfg.sft.output = str(tmp_path / output)
    cfg.sft.steps = steps
    cfg.sft.batch_size = 256
    cfg.sft.lr = 3e-3
    return cfg


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / METRICS_FILENAME).read_text().splitlines()]


def test_demonstrations_mask_everything_but_label_and_eos():
    from hpcrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    items = [{"prompt": "12+34=", "label": "46"}, {"prompt": "999+1=", "label": 1000}]
    d = build_demonstrations(tok, items)
    assert d.input_ids.shape == d.labels.shape == d.attention_mask.shape == (2, 11)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert d.input_ids[0].tolist() == tok("12+34=46")["input_ids"] + [eos] + [pad] * 2
    assert d.labels[0].tolist() == [IGNORE_INDEX] * 6 + tok("46")["input_ids"] + [eos] + [IGNORE_INDEX] * 2
    assert d.labels[1].tolist() == [IGNORE_INDEX] * 6 + tok("1000")["input_ids"] + [eos]
    assert d.attention_mask.sum(1).tolist() == [9, 11]
    with pytest.raises(ValueError, match="labels"):
        build_demonstrations(tok, [{"prompt": "1+1=", "label": None}])


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 600, 3e-3) for s in range(600)]
    peak = max(range(600), key=lambda s: lrs[s])
    assert 0 < lrs[0] < lrs[peak] == pytest.approx(3e-3)
    assert peak <= 50
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:]))
    assert lrs[-1] >= 0.1 * 3e-3 * 0.999
    assert lr_at(0, 1, 1e-3) == pytest.approx(1e-3)


def test_empty_output_is_an_error():
    cfg = Config()
    with pytest.raises(ValueError, match="sft.output"):
        run_sft(cfg)


@pytest.mark.slow
def test_sft_is_deterministic_and_cached(tmp_path):
    from safetensors.torch import load_file

    torch.set_num_threads(min(2, torch.get_num_threads()))

    def cfg(folder: Path, output: str, seed: int = 1234) -> Config:
        # 10 steps of 64 demonstrations from 1,000 problems: determinism and the cache do not need the
        # quickstart's batch (256) or data (10,000): 26 -> 7.5 s alone
        c = _cfg(folder, output, steps=10, seed=seed, num_eval=64)
        c.sft.batch_size, c.data.num_train = 64, 1000
        return c

    a = run_sft(cfg(tmp_path, "a"))
    b = run_sft(cfg(tmp_path, "b"))
    c = run_sft(cfg(tmp_path / "other-seed", "c", seed=7))
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "same seed, different weights"
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)

    base = load_file(tmp_path / "base" / "model.safetensors")
    assert not all(torch.equal(wa[k], base[k]) for k in wa), "training changed nothing"
    rows = _metrics(a)
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 10]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "base", "other-seed"]  # no temp folders

    # A second call returns the cached folder without training (or touching it).
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert run_sft(cfg(tmp_path, "a")) == a
    assert time.perf_counter() - t0 < 1.0
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert _metrics(a) == rows


# The quickstart's own SFT numbers (600 steps to about 39% greedy) are asserted by tests/e2e/test_quickstart.py,
# which runs it from a fresh folder through the README command.


def test_sft_stops_at_the_first_eval_that_meets_the_target(tmp_path):
    """``sft.target_accuracy``: training stops at the first eval at or above it (evals every ``eval_interval``
    steps), whatever step that is; ``sft.steps`` is only the cap. ``evaluate`` replays a scripted curve so the
    stopping rule is checked without depending on where a CPU's rounding puts the real curve."""
    from hpcrl.models.hf import ensure_model, load_hf_model
    from hpcrl.sft import _train

    cfg = _cfg(tmp_path, "unused", steps=1000)
    cfg.sft.target_accuracy, cfg.sft.eval_interval = 0.35, 3
    model, tok = load_hf_model(ensure_model(cfg.model, seed=1), dtype="float32")
    demos = build_demonstrations(tok, [{"prompt": f"{a}+1=", "label": a + 1} for a in range(100, 140)])
    curve = iter([0.0, 0.05, 0.2, 0.349, 0.36, 0.9])
    rows: list[dict] = []
    cfg.sft.batch_size = 8
    _train(model, demos, cfg.sft, lambda: next(curve), rows.append, seed=1)
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    assert evals == [(0, 0.0), (3, 0.05), (6, 0.2), (9, 0.349), (12, 0.36)]
    assert max(r["step"] for r in rows) == 12


def test_sft_evals_more_often_near_the_target(tmp_path):
    """``sft.eval_interval_near_target``: once an eval reaches a quarter of the target, evals come every that
    many steps, so a steep rise (seed 1 on an Intel Xeon went 31.4% -> 50.6% in the 10 steps past a 35%
    target) stops near the target. The weights at the stop equal those of the same step under evals every 2
    steps throughout: evals do not change the batches or the updates, only where training stops."""
    import torch

    from hpcrl.models.hf import ensure_model, load_hf_model
    from hpcrl.sft import _train

    cfg = _cfg(tmp_path, "unused", steps=1000)
    cfg.sft.target_accuracy, cfg.sft.eval_interval, cfg.sft.eval_interval_near_target = 0.35, 10, 2
    cfg.sft.batch_size = 8
    base = ensure_model(cfg.model, seed=1)

    def train(curve: dict[int, float], interval: int, near: int | None) -> tuple[list, dict]:
        model, tok = load_hf_model(base, dtype="float32")
        demos = build_demonstrations(tok, [{"prompt": f"{a}+1=", "label": a + 1} for a in range(100, 140)])
        trained = [0]  # optimizer steps so far: one training-mode forward each
        model.register_forward_pre_hook(lambda m, args: trained.__setitem__(0, trained[0] + m.training))
        rows: list[dict] = []
        cfg.sft.eval_interval, cfg.sft.eval_interval_near_target = interval, near
        with torch.random.fork_rng():
            torch.manual_seed(1)
            _train(model, demos, cfg.sft, lambda: max(a for s, a in curve.items() if s <= trained[0]),
                   rows.append, seed=1)
        return [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r], model.state_dict()

    # accuracy as a function of the step: 0 until 20, 0.09 (just over a quarter of 0.35) from 20, 0.30 from
    # 24, 0.36 from 27 on
    curve = {0: 0.0, 20: 0.09, 24: 0.30, 27: 0.36}
    fine, fine_weights = train(curve, 10, near=2)
    assert fine == [(0, 0.0), (10, 0.0), (20, 0.09), (22, 0.09), (24, 0.30), (26, 0.30), (28, 0.36)]
    coarse, _ = train(curve, 10, near=None)
    assert coarse == [(0, 0.0), (10, 0.0), (20, 0.09), (30, 0.36)]
    # the same weights as evals every 2 steps throughout: the schedule only decides where training stops
    every2, every2_weights = train(curve, 2, near=None)
    assert every2[-1] == (28, 0.36)
    assert all(torch.equal(fine_weights[k], every2_weights[k]) for k in every2_weights)


@pytest.mark.slow
def test_sft_cache_key_retrains_when_the_inputs_change(tmp_path):
    """The cached SFT folder is reused only for the same base model, data, seed and recipe (``sft_key.json``);
    another seed or target trains again into the same folder and the key follows."""
    from hpcrl.sft import KEY_FILENAME, cache_key

    torch.set_num_threads(min(2, torch.get_num_threads()))
    cfg = _cfg(tmp_path, "sft", steps=4, num_eval=16)
    out = run_sft(cfg)
    key = json.loads((out / KEY_FILENAME).read_text())
    assert key == json.loads(json.dumps(cache_key(cfg, tmp_path / "base")))
    first = _metrics(out)

    assert run_sft(_cfg(tmp_path, "sft", steps=4, num_eval=16)) == out and _metrics(out) == first  # cache hit

    other = _cfg(tmp_path, "sft", steps=4, num_eval=16, seed=99)  # same base folder, another seed
    run_sft(other)
    assert json.loads((out / KEY_FILENAME).read_text())["seed"] == 99
    assert _metrics(out) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "sft"]  # no temp or stale folders left

    changed = _cfg(tmp_path, "sft", steps=4, num_eval=16, seed=99)
    changed.sft.target_accuracy = 0.5
    assert cache_key(changed, tmp_path / "base") != cache_key(other, tmp_path / "base")
    (tmp_path / "base" / "config.json").write_text((tmp_path / "base" / "config.json").read_text() + " ")
    assert cache_key(other, tmp_path / "base") != json.loads((out / KEY_FILENAME).read_text())
