"""``hpcrl validate``'s refusals of a PPO critic's folder (``critic.path``, :func:`hpcrl.config.critic.
check_critic_model`): what the run would fail on, or silently get wrong, said in one line before it starts."""

from __future__ import annotations

import json
import shutil

import pytest

from hpcrl.config import ConfigError
from hpcrl.validate import load_and_check

GAE = ["algorithm.advantage_estimator=gae"]


def _refusal(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_and_check(None, overrides)
    assert "\n" not in str(info.value)
    return info.value


def test_critic_folder_refusals(tmp_path, tiny_model_dir):
    """Missing folder, a folder without config.json, heads TP does not divide, another tokenizer: each refused
    naming critic.path; the actor's own folder as critic passes; without gae a critic.path has no effect."""
    base = [f"model.path={tiny_model_dir}"] + GAE
    err = _refusal(base + [f"critic.path={tmp_path / 'nope'}"])
    assert err.field == "critic.path" and "no such folder" in str(err)
    (tmp_path / "empty").mkdir()
    assert "no config.json" in str(_refusal(base + [f"critic.path={tmp_path / 'empty'}"]))

    same = shutil.copytree(tiny_model_dir, tmp_path / "same")
    assert load_and_check(None, base + [f"critic.path={same}"]).critic.path == str(same)
    odd = shutil.copytree(tiny_model_dir, tmp_path / "odd")
    hf = json.loads((odd / "config.json").read_text())
    hf["num_attention_heads"], hf["num_key_value_heads"] = 4, 1  # TP=2 cannot split one key/value head
    (odd / "config.json").write_text(json.dumps(hf))
    err = _refusal(base + [f"critic.path={odd}", "train.tensor_parallel_size=2",
                            "train.nprocs=2"])
    assert err.field == "critic.path" and "num_key_value_heads=1" in str(err)

    other = shutil.copytree(tiny_model_dir, tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]  # two digits' ids swapped: same size, other tokens
    (other / "tokenizer.json").write_text(json.dumps(tok))
    err = _refusal(base + [f"critic.path={other}"])
    assert err.field == "critic.path" and "tokenizer" in str(err)
    err = _refusal([f"model.path={tiny_model_dir}", f"critic.path={other}"])  # without gae: no critic at all
    assert err.field == "critic.path" and "has no effect" in str(err)


def test_critic_ranks_of_its_own_refusals(tmp_path, tiny_model_dir):
    """``critic.nprocs`` / ``critic.tensor_parallel_size``: a TP of its own needs ranks of its own, the ranks
    must split into its TP x the actor's EP, and its TP must divide the heads of the folder it starts from
    (``critic.path``, or the actor's when null); each in one line naming the field."""
    base = [f"model.path={tiny_model_dir}"] + GAE
    assert load_and_check(None, base + ["critic.nprocs=2", "critic.tensor_parallel_size=2"]).critic.nprocs == 2
    err = _refusal(base + ["critic.tensor_parallel_size=2"])
    assert err.field == "critic.tensor_parallel_size" and "critic.nprocs" in str(err)
    err = _refusal(base + ["critic.nprocs=3", "critic.tensor_parallel_size=2"])
    assert err.field == "critic.nprocs" and "multiple of 2" in str(err)
    assert _refusal(base + ["critic.nprocs=-1"]).field == "critic.nprocs"
    err = _refusal([f"model.path={tiny_model_dir}", "critic.nprocs=1"])  # without gae: no critic at all
    assert err.field == "critic.nprocs" and "has no effect" in str(err)
    odd = shutil.copytree(tiny_model_dir, tmp_path / "odd")
    hf = json.loads((odd / "config.json").read_text())
    hf["num_attention_heads"], hf["num_key_value_heads"] = 4, 1
    (odd / "config.json").write_text(json.dumps(hf))
    own_tp2 = ["critic.nprocs=2", "critic.tensor_parallel_size=2"]
    err = _refusal(base + [f"critic.path={odd}"] + own_tp2)  # the critic's own TP, not the actor's (1)
    assert err.field == "critic.path" and "num_key_value_heads=1" in str(err) and "size 2" in str(err)
    err = _refusal([f"model.path={odd}"] + GAE + own_tp2)  # null: the actor's folder, at the critic's TP
    assert err.field == "critic.tensor_parallel_size" and "num_key_value_heads=1" in str(err)
    assert load_and_check(None, [f"model.path={odd}"] + GAE + ["critic.nprocs=2"]).critic.nprocs == 2


def test_critic_ranks_tile_tensor_and_expert_groups_separately(tmp_path):
    """A MoE critic on ranks of its own: megatron-core needs its ranks to be a multiple of its TP and of the
    expert groups (ETP x EP) apart, not of TP x EP: TP 2 x EP 2 with whole experts (ETP 1) fits 2 ranks; ETP 2 x
    EP 1 does not fit 1 rank; and at its own TP > 1 a MoE critic needs sequence parallelism."""
    moe = ["model.create=tiny-qwen3-moe", f"model.path={tmp_path / 'moe'}", "model.tiny_num_experts=4"] + GAE
    cfg = load_and_check(None, moe + ["train.expert_parallel_size=2", "train.nprocs=2", "critic.nprocs=2",
                                      "critic.tensor_parallel_size=2"])
    assert cfg.critic.nprocs == 2
    err = _refusal(moe + ["train.expert_tensor_parallel_size=2", "train.nprocs=2", "critic.nprocs=1"])
    assert err.field == "critic.nprocs" and "expert groups" in str(err)
    err = _refusal(moe + ["critic.nprocs=2", "critic.tensor_parallel_size=2", "train.sequence_parallel=false"])
    assert err.field == "train.sequence_parallel" and "critic at tensor-parallel size 2" in str(err)
