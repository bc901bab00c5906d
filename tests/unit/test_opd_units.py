"""On-policy distillation (issue #14 point 1) without engines: the advantage by hand, the teacher answer's
parsing, the micro-batch column, the buffer column, and the config's one-line refusals on the login node."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from hpcrl.config import ConfigError
from hpcrl.data.buffer import read_buffer, write_buffer
from hpcrl.data.sample import Sample, Status
from hpcrl.rollout.teacher import opd_metrics, response_log_probs
from hpcrl.train import algorithms as alg
from hpcrl.train.actor import build_micro_batch
from hpcrl.validate import load_and_check

M = ["model.create=tiny-qwen2"]


def test_opd_advantage_by_hand():
    # A = 0.5 (a rule advantage), teacher (-1, -2, -9), student (-1.5, -1, -1), mask (1, 1, 0), coef 2:
    # A + 2 * (0.5, -1, 0) = (1.5, -1.5, 0.5)
    adv = torch.tensor([[0.5, 0.5, 0.5]])
    out = alg.opd_advantages(adv, torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.5, -1.0, -1.0]]),
                             torch.tensor([[1.0, 1.0, 0.0]]), coef=2.0)
    assert torch.equal(out, torch.tensor([[1.5, -1.5, 0.5]]))


def test_teacher_answer_gives_the_response_tail():
    out = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-0.5, 6, None], [-0.25, 7, None]]}}
    assert response_log_probs(out, 2) == [-0.5, -0.25]
    assert response_log_probs({"meta_info": {"input_token_logprobs": [None, -1.0]}}, 1) == [-1.0]
    with pytest.raises(ValueError, match="2 input log-probs for a response of 3 tokens"):
        response_log_probs(out | {"meta_info": {"input_token_logprobs": [[-1.0, 5], [-2.0, 6]]}}, 3)
    with pytest.raises(ValueError):
        response_log_probs(out, 3)  # the first entry is null: the prompt token has no log-prob


def _sample(index: int, teacher: list[float]) -> Sample:
    return Sample(group_index=index, index=index, tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1],
                  rollout_log_probs=[-0.5, -1.0], teacher_log_probs=teacher, reward=1.0,
                  status=Status.COMPLETED)


def test_micro_batch_carries_teacher_log_probs_and_checks_their_length():
    samples = [_sample(0, [-0.25, -2.0]), _sample(1, [-1.0, -1.0])]
    adv = [torch.zeros(2), torch.zeros(2)]
    mb = build_micro_batch(samples, [0, 1], adv, with_teacher_log_probs=True)
    assert torch.equal(mb.teacher_log_probs, torch.tensor([[-0.25, -2.0], [-1.0, -1.0]]))
    assert build_micro_batch(samples, [0, 1], adv).teacher_log_probs is None
    with pytest.raises(ValueError, match="teacher_log_probs has 0 entries for response_length 2"):
        build_micro_batch([_sample(0, [])], [0], adv, with_teacher_log_probs=True)
    # reverse KL estimate: mean of rollout - teacher over response tokens: (-0.25 + 1 + 0.5 + 0) / 4
    assert opd_metrics(samples)["rollout/opd_reverse_kl"] == pytest.approx(0.3125)


def test_reverse_kl_is_a_per_sample_token_mean_like_the_trainers():
    """Samples of different response lengths weigh equally, as in the trainer's ``train/opd_reverse_kl``
    (a batch-wide token mean gave the 3-token sample 3/4 of the weight); a sample without loss tokens counts
    as 0, as in the trainer's reducer: (1 + 0 + 0) / 3."""
    long = Sample(group_index=0, index=0, tokens=[1, 2, 3, 4, 5], response_length=3, loss_mask=[1, 1, 1],
                  rollout_log_probs=[-1.0, -1.0, -1.0], teacher_log_probs=[-2.0, -2.0, -2.0], reward=1.0,
                  status=Status.COMPLETED)
    short = Sample(group_index=1, index=1, tokens=[1, 2, 3], response_length=1, loss_mask=[1],
                   rollout_log_probs=[-1.0], teacher_log_probs=[-1.0], reward=1.0, status=Status.COMPLETED)
    empty = Sample(group_index=2, index=2, tokens=[1, 2, 3], response_length=1, loss_mask=[0],
                   rollout_log_probs=[-1.0], teacher_log_probs=[-5.0], reward=1.0, status=Status.COMPLETED)
    assert opd_metrics([long, short])["rollout/opd_reverse_kl"] == pytest.approx(0.5)
    assert opd_metrics([long, short, empty])["rollout/opd_reverse_kl"] == pytest.approx(1 / 3)
    assert opd_metrics([empty]) == {}


def test_buffer_keeps_teacher_log_probs_and_reads_files_without_them(tmp_path):
    group = [_sample(0, [-0.125, -3.5]), _sample(1, [])]
    write_buffer(tmp_path / "b.h5", [group], [])
    (back,), _ = read_buffer(tmp_path / "b.h5")
    assert [s.teacher_log_probs for s in back] == [[-0.125, -3.5], []]
    import h5py

    with h5py.File(tmp_path / "b.h5", "a") as f:  # a file written before the column existed
        del f["groups/teacher_log_probs"], f["groups/teacher_log_probs_len"]
    (back,), _ = read_buffer(tmp_path / "b.h5")
    assert [s.teacher_log_probs for s in back] == [[], []]


@pytest.mark.parametrize("overrides,field,words", [
    (["algorithm.opd.coef=0.5"], "algorithm.opd.teachers", ["no teacher", "algorithm.opd.teachers=[{path"]),
    (["algorithm.opd.teachers=[{path: /no/such/teacher}]"], "algorithm.opd.teachers[0].path",
     ["no config.json", "sft_target_accuracy"]),
    (["algorithm.opd.teachers=[{path: t, sft_target_accuracy: 0.5}]", "algorithm.opd.coef=-1"],
     "algorithm.opd.coef", ["must be > 0"]),
    (["algorithm.opd.teachers=[{path: t, sft_target_accuracy: 0.5}, {path: u, name: t0, sft_target_accuracy: 0.6}]"],
     "algorithm.opd.teachers[1].name", ["another teacher"]),
    (["algorithm.opd.teachers=[{path: t, sft_target_accuracy: 1.5}]"], "algorithm.opd.teachers[0].sft_target_accuracy",
     ["(0, 1]"]),
    (["algorithm.opd.teachers=[{path: t, num_engines: 0, sft_target_accuracy: 0.5}]"],
     "algorithm.opd.teachers[0].num_engines", [">= 1"]),
])
def test_opd_config_refusals(overrides, field, words):
    with pytest.raises(ConfigError) as info:
        load_and_check(None, M + overrides)
    assert info.value.field == field
    for w in words:
        assert w in str(info.value), str(info.value)


def test_group_of_one_is_allowed_only_with_a_teacher():
    with pytest.raises(ConfigError, match="algorithm.opd.teachers"):
        load_and_check(None, M + ["rollout.n_samples_per_prompt=1", "rollout.dynamic_filter=null", "train.micro_batch_size=8"])
    cfg = load_and_check(None, M + ["rollout.n_samples_per_prompt=1", "rollout.dynamic_filter=null", "train.micro_batch_size=8",
                                    "algorithm.opd.teachers=[{path: t, sft_target_accuracy: 0.5}]"])
    assert cfg.algorithm.opd.teachers[0].path == "t"


def test_teacher_with_another_tokenizer_is_refused_before_anything_runs(tmp_path, tiny_model_dir):
    """The CLI's validate prints one line naming the teacher and exits 2; the same folder with the same
    tokenizer passes."""
    same = shutil.copytree(tiny_model_dir, tmp_path / "same")
    other = shutil.copytree(tiny_model_dir, tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]  # ids of two digits swapped: same size, other meaning
    (other / "tokenizer.json").write_text(json.dumps(tok))
    base = [f"model.path={tiny_model_dir}"]
    cfg = load_and_check(None, base + [f"algorithm.opd.teachers=[{{path: {same}}}]"])
    assert cfg.algorithm.opd.teachers[0].path == str(same)
    (tmp_path / "run.yaml").write_text(f"model: {{path: {tiny_model_dir}}}\n")
    cmd = [sys.executable, "-m", "hpcrl", "validate", str(tmp_path / "run.yaml"),
           f"algorithm.opd.teachers=[{{path: {other}}}]"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "algorithm.opd.teachers[0].path" in lines[0] and "tokenizer" in lines[0], \
        res.stderr
    assert "Traceback" not in res.stderr
