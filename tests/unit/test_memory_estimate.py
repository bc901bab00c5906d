"""Issue #35 point 6: the cluster configs (``configs/cluster/``) and the per-GPU memory estimate of ``hpcrl
validate`` / ``submit`` (:mod:`hpcrl.config.memory`, :mod:`hpcrl.models.params`).

* the torch-free parameter count equals transformers 5's count of the model built on the meta device, for tiny
  models of every family and for the three published configs the cluster configs use;
* the trainer estimate follows megatron's rules (bf16 + distributed optimizer = 6 + 12/DP bytes per dense
  parameter; experts sharded over expert-DP; the CPU optimizer offload moves its fraction of Adam to the
  host), and the offload keys reach megatron-core's ``OptimizerConfig`` (the offload itself needs CUDA: only
  the wiring is tested here);
* ``hpcrl submit --dry-run`` renders each cluster config, the GPUs of the rendered job are what the parallel
  sizes multiply to, the estimate is printed, and a layout that cannot fit is refused in one line;
* MoE models train at ``train.tensor_parallel_size=1`` (``hpcrl.config.train.check_moe``): every cluster
  config does, and DeepSeek-V3, whose non-expert parameters alone overflow an H100 at TP=1, is refused there
  in one line saying that no layout of hpcrl's trainer fits.

The model folders are temporary copies of the published ``config.json`` (``configs/cluster/models/``) with a
one-tensor safetensors file next to it: ``hpcrl validate`` refuses a folder without weights (issue #35 point
4), and the estimate needs only the config. The GLM-4.5-Air and DeepSeek-V3 submit tests are skipped where
the trainer does not build ``glm4_moe`` / ``deepseek_v3``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpcrl.config import ConfigError, load_config
from hpcrl.config.memory import GB, RESERVED_GB, check_memory, engine_memory, read_model_config, trainer_memory
from hpcrl.config.train import sequence_parallel
from hpcrl.models.params import count_parameters
from hpcrl.models.support import SUPPORTED_MODEL_TYPES
from hpcrl.validate import ENVIRONMENT, load_and_check, memory_lines

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "configs" / "cluster"
MODELS = CLUSTER / "models"

CONFIGS = {  # cluster config -> (model folder, model_type)
    "qwen3-30b-a3b": ("qwen3-30b-a3b", "qwen3_moe"),
    "qwen3-30b-a3b-disaggregate": ("qwen3-30b-a3b", "qwen3_moe"),
    "glm-4.5-air": ("glm-4.5-air", "glm4_moe"),
    "glm-4.5-air-disaggregate": ("glm-4.5-air", "glm4_moe"),
    "glm-4.5": ("glm-4.5", "glm4_moe"),
    "deepseek-v3": ("deepseek-v3", "deepseek_v3"),
    "deepseek-v3-disaggregate": ("deepseek-v3", "deepseek_v3"),
    "glm-4.5-disaggregate": ("glm-4.5", "glm4_moe"),
    "qwen3-235b-a22b": ("qwen3-235b-a22b", "qwen3_moe"),
    "kimi-k2": ("kimi-k2", "deepseek_v3"),
    "glm-4.7-flash": ("glm-4.7-flash", "glm4_moe_lite"),
    "qwen3-32b-lora": ("qwen3-32b", "qwen3"),
}


def _skip_unsupported(model_type: str):
    """Skip while the trainer does not build ``model_type`` (hpcrl validate refuses it on the login node)."""
    return pytest.mark.skipif(model_type not in SUPPORTED_MODEL_TYPES,
                              reason=f"{model_type} is not in hpcrl.models.support.SUPPORTED_MODEL_TYPES yet")


def model_folder(dst: Path, name: str) -> Path:
    """A copy of the published ``config.json`` of ``name`` with a valid one-tensor ``model.safetensors``."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(MODELS / name / "config.json", dst / "config.json")
    header = json.dumps({"lm_head.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    return dst


# ------------------------------------------------------------------------------------------------------------
# Parameter counts against transformers on the meta device
# ------------------------------------------------------------------------------------------------------------

TINY = {  # hidden 32-64, 2-3 layers, a few experts; the options each family's count must follow
    "qwen2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=100),
    "qwen3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=100, head_dim=24, attention_bias=True),
    "llama": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=100, attention_bias=True, mlp_bias=True,
                  tie_word_embeddings=True),
    "mistral": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=128, vocab_size=100, head_dim=8),
    "qwen3_moe": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=100, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, mlp_only_layers=[0]),
    "mixtral": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=96, vocab_size=100, num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=100, head_dim=16, n_routed_experts=4,
                     n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                     attention_bias=True, use_qk_norm=True, num_experts_per_tok=2),
    "deepseek_v3": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                        intermediate_size=128, vocab_size=100, n_routed_experts=4, n_shared_experts=1,
                        moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, num_experts_per_tok=2,
                        n_group=2, topk_group=1),
    "deepseek_v3_no_q_lora": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, intermediate_size=128, vocab_size=100,
                                  n_routed_experts=4, n_shared_experts=2, moe_intermediate_size=32,
                                  first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                                  num_experts_per_tok=2, attention_bias=True, n_group=1, topk_group=1),
    "glm4_moe_lite": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                          intermediate_size=128, vocab_size=100, n_routed_experts=4, n_shared_experts=1,
                          moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, num_experts_per_tok=2),
}


def meta_count(config) -> int:
    """``sum(p.numel())`` of the HF model built from ``config`` on the meta device (no memory, no init)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_count_equals_transformers(name):
    from transformers import AutoConfig

    config = AutoConfig.for_model(name.replace("_no_q_lora", ""), **TINY[name])
    count = count_parameters(config.to_dict())
    assert count.total == meta_count(config)
    assert (count.expert > 0) == (name in ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3",
                                           "deepseek_v3_no_q_lora", "glm4_moe_lite"))
    assert count.output == (0 if TINY[name].get("tie_word_embeddings") else count.embedding)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "glm-4.5-air", "glm-4.5", "deepseek-v3", "qwen3-235b-a22b",
                                  "kimi-k2", "glm-4.7-flash"])
def test_published_count_equals_transformers(name):
    """The published config.json as the hub has it (top-level ``partial_rotary_factor``, ``rope_scaling``,
    DeepSeek's fp8 ``quantization_config``, which transformers would act on and the count ignores)."""
    from transformers import AutoConfig

    hub = json.loads((MODELS / name / "config.json").read_text())
    skip = ("quantization_config", "auto_map", "architectures", "model_type")
    fields = {k: v for k, v in hub.items() if k not in skip}
    config = AutoConfig.for_model(hub["model_type"], **fields)
    count = count_parameters(hub)
    assert count.total == meta_count(config)
    assert count.expert > 0.9 * count.total  # these are MoE models: most parameters are routed experts
    assert 0 < count.attention <= count.dense  # Qwen3-MoE: no dense MLP at all


def test_count_refuses_unknown_family():
    with pytest.raises(ValueError, match="gpt2"):
        count_parameters({"model_type": "gpt2", "hidden_size": 8})


# ------------------------------------------------------------------------------------------------------------
# The trainer estimate follows megatron's rules
# ------------------------------------------------------------------------------------------------------------

def _cfg(tmp_path, name="qwen3-30b-a3b", *overrides):
    folder, _ = CONFIGS[name]
    path = model_folder(tmp_path / folder, folder)
    return load_config(CLUSTER / f"{name}.yaml", [f"model.path={path}", *overrides], check_files=False)


def _count(name="qwen3-30b-a3b"):
    return count_parameters(json.loads((MODELS / name / "config.json").read_text()))


def test_dense_model_bytes_per_parameter_are_megatrons():
    """A dense model, bf16, distributed optimizer: 2 (weights) + 4 (fp32 grads) + 12/DP (Adam) bytes per
    parameter, Megatron-LM's ``theoretical_memory_usage`` (6 + 12/DP with fp32 gradient accumulation)."""
    from hpcrl.config import Config

    p = count_parameters(dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36,  # Qwen3-8B's shape
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              intermediate_size=12288, vocab_size=151936))
    for tp, world in ((1, 8), (2, 16), (4, 8)):
        cfg = Config()
        cfg.slurm.nodes, cfg.slurm.gpus_per_node = world // 8, 8
        cfg.train.tensor_parallel_size, cfg.train.bf16, cfg.train.use_distributed_optimizer = tp, True, True
        m = trainer_memory(cfg, p)
        dp = world // tp
        per_gpu = (p.embedding + p.output + p.dense) / tp + p.replicated
        assert m.params == pytest.approx(per_gpu)
        assert m.total / m.params == pytest.approx(6 + 12 / dp)
        cfg.train.use_distributed_optimizer = False  # Adam whole on every rank: 18 bytes per parameter
        assert trainer_memory(cfg, p).total / m.params == pytest.approx(18)
        cfg.train.bf16 = False  # fp32 weights are Adam's main copy: 4 + 4 + 8
        assert trainer_memory(cfg, p).total / m.params == pytest.approx(16)


def test_a_critic_adds_the_actors_states_less_its_output_layer():
    """PPO (advantage_estimator gae) holds a critic of the actor's layout in the trainer: its weights, fp32
    gradients and Adam again, without the vocab output layer (a value head instead), on top of the actor's."""
    from hpcrl.config import Config

    p = count_parameters(dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36,  # untied output
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False))
    assert p.output > 0
    cfg = Config()
    cfg.slurm.nodes, cfg.slurm.gpus_per_node = 1, 8
    cfg.train.tensor_parallel_size, cfg.train.bf16, cfg.train.use_distributed_optimizer = 2, True, True
    actor = trainer_memory(cfg, p)
    cfg.algorithm.advantage_estimator = "gae"
    both = trainer_memory(cfg, p)
    critic_params = (p.embedding + p.dense) / 2 + p.replicated
    assert actor.critic == 0 and both.params == actor.params
    assert both.critic == pytest.approx(critic_params * (6 + 12 / 4))  # bf16 + fp32 grads + Adam over DP 4
    assert both.total == pytest.approx(actor.total + both.critic)
    assert both.weights - actor.weights == pytest.approx(2 * critic_params)


def test_a_critic_on_its_own_ranks_is_counted_on_its_own_gpus(tmp_path):
    """A critic with ranks of its own (``critic.nprocs``, het group ``slurm.critic``) leaves the trainer's
    GPUs alone and is estimated at its own layout on its own GPUs, refused in one line when it cannot fit."""
    from hpcrl.config import Config, SlurmGroup
    from hpcrl.config.memory import critic_memory

    hf = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
              num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
              tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    p = count_parameters(hf)
    cfg = Config()
    cfg.model.path = str(tmp_path)
    cfg.slurm.nodes, cfg.slurm.gpus_per_node = 1, 8
    cfg.train.tensor_parallel_size, cfg.train.bf16, cfg.train.use_distributed_optimizer = 2, True, True
    actor = trainer_memory(cfg, p)
    cfg.algorithm.advantage_estimator = "gae"
    assert critic_memory(cfg, p) is None  # on the trainer's ranks: counted there
    cfg.slurm.critic, cfg.critic.nprocs, cfg.critic.tensor_parallel_size = SlurmGroup(gpus_per_node=4), 4, 4
    assert trainer_memory(cfg, p).total == pytest.approx(actor.total)
    own = critic_memory(cfg, p)
    critic_params = (p.embedding + p.dense) / 4 + p.replicated  # TP 4 over 4 GPUs: DP 1
    assert own.params == pytest.approx(critic_params) and own.layout.startswith("tp4 ")
    assert own.total == pytest.approx(critic_params * (6 + 12)) and "over 4 GPUs" in own.layout
    cfg.sglang = {"tp_size": 8}  # (an engine takes every GPU of a node)
    cfg.slurm.gpu_memory_gb, cfg.slurm.critic.gpu_memory_gb = 141, 24  # the critic's GPUs are too small
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, True, ENVIRONMENT)
    assert e.value.field == "slurm.critic.gpu_memory_gb" and "critic on its own ranks" in str(e.value)
    cfg.slurm.critic.gpu_memory_gb = 80
    check_memory(cfg, True, ENVIRONMENT)
    assert any(line.startswith("  critic:    its own ranks, tp4") for line in memory_lines(cfg))


def test_a_smaller_critic_is_counted_from_its_own_config(tmp_path):
    """A critic.path of another size (a 1.7B-like critic for an 8B-like actor) is counted from its own
    config.json, not as a copy of the actor."""
    from hpcrl.config import Config
    from hpcrl.config.memory import critic_parameters

    big = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
               tie_word_embeddings=False)
    small = dict(big, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, intermediate_size=6144)
    (tmp_path / "critic").mkdir()
    (tmp_path / "critic" / "config.json").write_text(json.dumps(small))
    cfg = Config()
    cfg.slurm.nodes, cfg.slurm.gpus_per_node = 1, 8
    cfg.train.bf16, cfg.train.use_distributed_optimizer = True, True
    cfg.algorithm.advantage_estimator = "gae"
    p, c = count_parameters(big), count_parameters(small)
    assert critic_parameters(cfg, p, ENVIRONMENT) == p  # critic.path null: the actor's model
    cfg.critic.path = str(tmp_path / "critic")
    assert critic_parameters(cfg, p, ENVIRONMENT) == c
    own, as_actor = trainer_memory(cfg, p, critic=c), trainer_memory(cfg, p)
    assert own.critic == pytest.approx(trainer_memory(cfg, c).critic)  # depends only on the critic's counts
    assert 0 < own.critic < as_actor.critic / 2


def test_experts_shard_over_ep_and_expert_dp(tmp_path):
    """TP4 (SP) x EP16 with whole experts (ETP 1) over 16 GPUs: the non-expert matrices over TP 4 (norms and
    routers whole), data parallelism 4 for them; each expert once (expert data parallelism 1)."""
    cfg = _cfg(tmp_path, "qwen3-30b-a3b-disaggregate")
    p = _count()
    m = trainer_memory(cfg, p)
    dense, expert = (p.embedding + p.output + p.dense) / 4 + p.replicated, p.expert / 16
    assert m.params == pytest.approx(dense + expert)
    assert m.adam == pytest.approx(12 * (dense / 4 + expert / 1))
    cfg.slurm.nodes = 4  # 32 GPUs at EP16: every expert has 2 data-parallel replicas, Adam sharded over them
    assert trainer_memory(cfg, p).adam == pytest.approx(12 * (dense / 8 + expert / 2))
    cfg.train.expert_tensor_parallel_size = 2  # each expert split over 2 GPUs: one replica left, half of it
    assert trainer_memory(cfg, p).adam == pytest.approx(12 * (dense / 8 + expert / 2 / 1))
    assert trainer_memory(cfg, p).params == pytest.approx(dense + expert / 2)


def test_cpu_offload_moves_its_fraction_of_adam_to_the_host(tmp_path):
    cfg = _cfg(tmp_path)  # megatron.optimizer_cpu_offload: true, optimizer_offload_fraction: 1.0
    p = _count()
    on = trainer_memory(cfg, p)
    assert on.adam == 0 and on.adam_no_offload > 0
    assert on.adam_host == pytest.approx(on.adam_no_offload * 16 / 12)  # states + their fp32 gradient copy
    cfg.megatron["optimizer_offload_fraction"] = 0.25
    quarter = trainer_memory(cfg, p)
    assert quarter.adam == pytest.approx(0.75 * on.adam_no_offload)
    del cfg.megatron["optimizer_offload_fraction"]  # megatron-core 0.16.1's default fraction 0.0: no offload
    assert trainer_memory(cfg, p).adam == pytest.approx(on.adam_no_offload)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cpu_offload_keys_reach_megatron_optimizer_config(name):
    """Every cluster config's ``megatron:`` keys are fields of megatron-core 0.16.1's dataclasses, and the
    offload keys land in ``OptimizerConfig`` as the estimate reads them (the offload needs CUDA: wiring
    only)."""
    from hpcrl.train.model import optimizer_config, split_megatron_kwargs

    cfg = load_config(CLUSTER / f"{name}.yaml", check_files=False)
    split = split_megatron_kwargs(cfg.megatron)
    opt = optimizer_config(cfg.train, **split["optimizer"])
    assert opt.optimizer_cpu_offload == bool(cfg.megatron.get("optimizer_cpu_offload", False))
    assert opt.use_distributed_optimizer and opt.bf16
    if opt.optimizer_cpu_offload:
        assert opt.optimizer_offload_fraction == 1.0 and opt.overlap_cpu_optimizer_d2h_h2d
        assert opt.decoupled_weight_decay  # get_megatron_optimizer asserts it for the CPU offload (AdamW)
    p = _count(CONFIGS[name][0])
    all_offloaded = opt.optimizer_cpu_offload and opt.optimizer_offload_fraction == 1
    assert (trainer_memory(cfg, p).adam == 0) == all_offloaded


# ------------------------------------------------------------------------------------------------------------
# Each cluster config fits, its arithmetic adds up, and what cannot fit is refused in one line
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cluster_config_fits_and_tiles_its_gpus(tmp_path, name):
    """Every cluster config: the estimate and layout checks, at slime's kind of layout (issue #54: TP within a
    node with sequence parallelism, whole experts over EP)."""
    cfg = _cfg(tmp_path, name)
    check_memory(cfg, check_files=True, env=ENVIRONMENT)  # raises if a layout does not fit
    s, t, sg = cfg.slurm, cfg.train, cfg.sglang
    world = s.nodes * s.gpus_per_node
    assert t.nprocs == world  # what hpcrl submit sets from the allocation
    assert t.tensor_parallel_size > 1 and sequence_parallel(t)  # megatron trains MoE at TP > 1 only with SP
    assert s.gpus_per_node % t.tensor_parallel_size == 0  # TP within a node (NVLink)
    assert t.expert_tensor_parallel_size == 1  # whole experts, as slime's scripts
    assert world % (t.expert_tensor_parallel_size * t.expert_parallel_size) == 0  # ETP x EP x EDP = world
    engine_gpus = s.rollout.gpus_per_node if cfg.run.placement == "disaggregate" else s.gpus_per_node
    assert sg["tp_size"] == engine_gpus and sg["tp_size"] % sg.get("ep_size", 1) == 0
    if cfg.run.placement == "colocate":
        assert cfg.rollout.num_engines == s.nodes
    p = _count(CONFIGS[name][0])
    m = trainer_memory(cfg, p, hf=read_model_config(cfg))
    assert m.activations > 0  # packed micro-batches: their activations are in the estimate
    assert m.total + RESERVED_GB * GB <= s.gpu_memory_gb * GB
    engine_gb = (s.rollout.gpu_memory_gb or s.gpu_memory_gb) if cfg.run.placement == "disaggregate" else \
        s.gpu_memory_gb
    e = engine_memory(cfg, p, engine_gb * GB)
    assert 0 < e.weights < e.pool
    lines = memory_lines(cfg)
    assert any(line.lstrip().startswith("trainer:") and f"{m.total / GB:.1f} GB" in line for line in lines)
    assert any(line.lstrip().startswith("engine:") and "KV cache" in line for line in lines)


@pytest.mark.parametrize("override,field", [
    ("megatron.optimizer_cpu_offload=false", "slurm.gpu_memory_gb"),  # Adam back on the GPU: 77 GB > 76
    ("slurm.gpu_memory_gb=34", "slurm.gpu_memory_gb"),  # 31 GB with the offload + 4 GB reserved
    ("sglang.mem_fraction_static=0.09", "sglang.mem_fraction_static"),  # 7.2 GB pool < 7.7 GB of weights
    ("sglang.mem_fraction_static=0.1", "sglang.mem_fraction_static"),  # 0.3 GB of KV cache: 12k tokens < 16k
    ("sglang.tp_size=4", "sglang.tp_size"),  # 4 of the node's 8 GPUs
    ("sglang.ep_size=3", "sglang.ep_size"),
    ("rollout.num_engines=2", "rollout.num_engines"),  # colocated: one engine per node
])
def test_layout_that_cannot_fit_is_refused_in_one_line(tmp_path, override, field):
    """At TP=1 (every GPU holds all non-expert parameters: the numbers in the comments); the shipped TP4 layout
    fits even with Adam on the GPU."""
    folder = model_folder(tmp_path / "m", "qwen3-30b-a3b")
    with pytest.raises(ConfigError) as e:
        load_and_check(CLUSTER / "qwen3-30b-a3b.yaml", [f"model.path={folder}", "train.tensor_parallel_size=1",
                                                        override, "rollout.max_new_tokens=16000"])
    assert e.value.field == field
    assert "\n" not in str(e.value) and "; " in str(e.value)  # one line: field=value: problem; fix


def test_refusal_names_the_offload_that_would_fit(tmp_path):
    folder = model_folder(tmp_path / "m", "qwen3-30b-a3b")
    with pytest.raises(ConfigError) as e:
        load_and_check(CLUSTER / "qwen3-30b-a3b.yaml",
                       [f"model.path={folder}", "megatron.optimizer_cpu_offload=false",
                        "train.tensor_parallel_size=1"])
    assert "megatron.optimizer_cpu_offload=true" in e.value.fix and "fits" in e.value.fix


def test_moe_refusal_names_tensor_and_expert_parallelism(tmp_path):
    """A MoE model that does not fit is pointed at the offload, and at sequence-parallel TP (up to a node's
    GPUs) with more expert parallelism."""
    folder = model_folder(tmp_path / "m", "glm-4.5-air")
    with pytest.raises(ConfigError) as e:
        load_and_check(CLUSTER / "glm-4.5-air.yaml",
                       [f"model.path={folder}", "megatron.optimizer_cpu_offload=false"])
    assert e.value.field == "slurm.gpu_memory_gb"
    assert ("train.tensor_parallel_size (up to 8, sequence-parallel) and train.expert_parallel_size (up to 128)"
            in e.value.fix)


FLAT_DEEPSEEK = ["slurm.nodes=32", "train.nprocs=256", "rollout.num_engines=32", "rollout.batch_size=256",
                 "train.pipeline_parallel_size=1", "train.context_parallel_size=1",
                 "megatron.num_layers_in_first_pipeline_stage=null"]
"""configs/cluster/deepseek-v3.yaml without pipeline and context parallelism, on 256 GPUs (its layout before
issue #55)."""


def test_moe_at_tensor_parallelism_counts_experts_by_etp_times_ep(tmp_path):
    """DeepSeek-V3 at TP8 (sequence-parallel) x EP32 is a layout now (issue #54): attention and the dense
    layers are split over TP, each routed expert over ``train.expert_tensor_parallel_size`` x EP. With ETP 1
    (slime's) each GPU holds 1/32 of the experts; with ETP 2 half of that, and megatron's expert groups
    (ETP x EP x PP) must tile the ranks."""
    folder = model_folder(tmp_path / "m", "deepseek-v3")
    base = [f"model.path={folder}", *FLAT_DEEPSEEK, "train.tensor_parallel_size=8", "train.expert_parallel_size=32",
            "slurm.gpu_memory_gb=400"]  # room for both, to compare their estimates
    p = _count("deepseek-v3")
    etp1 = trainer_memory(load_and_check(CLUSTER / "deepseek-v3.yaml", base), p)
    etp2 = trainer_memory(load_and_check(CLUSTER / "deepseek-v3.yaml",
                                         [*base, "train.expert_tensor_parallel_size=2"]), p)
    assert etp1.layout == "tp8 sp pp1 cp1 ep32 etp1 dp32 edp8 over 256 GPUs"
    assert etp2.layout == "tp8 sp pp1 cp1 ep32 etp2 dp32 edp4 over 256 GPUs"
    assert etp1.params - etp2.params == pytest.approx(p.expert / 64)
    with pytest.raises(ConfigError) as e:
        load_and_check(CLUSTER / "deepseek-v3.yaml", [*base, "train.expert_tensor_parallel_size=16"])
    assert e.value.field == "train.expert_parallel_size" and "must divide train.nprocs=256" in str(e.value)


def test_deepseek_v3_on_h100_is_refused_in_one_line(tmp_path):
    """At TP=1 each GPU holds DeepSeek-V3's 17.1B non-expert parameters: 6 bytes each (bf16 weights +
    fp32 gradients) is 103 GB before any expert, so no EP and no offload fits 80 GB at the shipped TP=1
    layout; validate says so in one line and names TP with sequence parallelism (which fits: ~28 GB at TP8
    x EP256)."""
    p = _count("deepseek-v3")
    assert 6 * (p.total - p.expert) > (80 - RESERVED_GB) * GB
    folder = model_folder(tmp_path / "m", "deepseek-v3")
    bad = hpcrl(["validate", str(CLUSTER / "deepseek-v3.yaml"), f"model.path={folder}", *FLAT_DEEPSEEK,
                 "train.expert_parallel_size=256", "slurm.gpu_memory_gb=80", "train.tensor_parallel_size=1"],
                tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("config error: slurm.gpu_memory_gb=80.0: the trainer needs")
    assert ("train.tensor_parallel_size (up to 8, sequence-parallel) and train.expert_parallel_size (up to 256)"
            in lines[0])
    tp8 = load_and_check(CLUSTER / "deepseek-v3.yaml", [f"model.path={folder}", *FLAT_DEEPSEEK,
                                                        "train.expert_parallel_size=256"])
    assert trainer_memory(tp8, p).total < (80 - RESERVED_GB) * GB  # the trainer fits an H100 (engines: fp8)
    ok = hpcrl(["validate", str(CLUSTER / "deepseek-v3.yaml"), f"model.path={folder}"], tmp_path)  # H200s
    assert ok.returncode == 0, ok.stderr
    assert "tp8 sp pp4 cp4 ep32 etp1 dp1 edp1 over 128 GPUs, stage 0 of 4 (16 layers)" in ok.stdout
    assert "of 141 GB" in ok.stdout


@pytest.mark.parametrize("name,overrides,field", [
    ("qwen3-30b-a3b", ["slurm.gpu_memory_gb=-1"], "slurm.gpu_memory_gb"),
    ("qwen3-30b-a3b", ["slurm.gpus_per_node=0", "rollout.engine=cpu"], "slurm.gpu_memory_gb"),
    ("qwen3-30b-a3b-disaggregate", ["slurm.rollout.gpus_per_node=0", "slurm.rollout.gpu_memory_gb=80"],
     "slurm.rollout.gpu_memory_gb"),
    ("qwen3-30b-a3b-disaggregate", ["slurm.rollout.gpu_memory_gb=8"], "sglang.mem_fraction_static"),
])
def test_gpu_memory_key_is_checked(tmp_path, name, overrides, field):
    folder = model_folder(tmp_path / "m", "qwen3-30b-a3b")
    with pytest.raises(ConfigError) as e:
        load_and_check(CLUSTER / f"{name}.yaml", [f"model.path={folder}", *overrides])
    assert e.value.field == field


# ------------------------------------------------------------------------------------------------------------
# hpcrl validate / submit --dry-run on the cluster configs (nothing is submitted)
# ------------------------------------------------------------------------------------------------------------

def hpcrl(args, cwd):
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]))
    env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env, check=False)


def sbatch_options(script: str) -> list[dict[str, str]]:
    """``#SBATCH --key=value`` options per het component of a rendered script (split at ``#SBATCH
    hetjob``)."""
    groups: list[dict[str, str]] = [{}]
    for line in script.splitlines():
        if line.strip() == "#SBATCH hetjob":
            groups.append({})
        m = re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line.strip())
        if m:
            groups[-1][m.group(1)] = m.group(2) or ""
    return groups


def _submit_dry_run(tmp_path, name):
    folder = model_folder(tmp_path / "models" / CONFIGS[name][0], CONFIGS[name][0])
    out = hpcrl(["submit", str(CLUSTER / f"{name}.yaml"), f"model.path={folder}",
                 f"run.output_dir={tmp_path}", "slurm.partition=gpu", "--dry-run"], tmp_path)
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / name
    script = (run_dir / "submission.sbatch").read_text()
    assert out.stdout == script and "nothing was submitted" in out.stderr
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text().split("\n", 1)[1])
    groups = sbatch_options(script)
    t, s, sg = resolved["train"], resolved["slurm"], resolved["sglang"]
    trainer = groups[0]
    world = int(trainer["nodes"]) * int(trainer["gpus-per-node"])
    assert int(trainer["ntasks-per-node"]) == int(trainer["gpus-per-node"])  # one trainer rank per GPU
    assert world == t["nprocs"] == s["nodes"] * s["gpus_per_node"]
    assert world % (t["tensor_parallel_size"] * t["pipeline_parallel_size"] * t["context_parallel_size"]) == 0
    assert world % (t["expert_tensor_parallel_size"] * t["expert_parallel_size"]) == 0
    if resolved["run"]["placement"] == "disaggregate":
        assert len(groups) == 2  # het group 1: the engines, one task per node, all its GPUs for one engine
        rollout = groups[1]
        assert int(rollout["ntasks-per-node"]) == 1 and int(rollout["gpus-per-node"]) == sg["tp_size"]
        assert int(rollout["nodes"]) == s["rollout"]["nodes"]
    else:
        assert len(groups) == 1 and resolved["rollout"]["num_engines"] * sg["tp_size"] == world
    assert "  trainer:" in out.stderr and f"of {s['gpu_memory_gb']:g} GB" in out.stderr
    assert "  engine:" in out.stderr and "KV cache" in out.stderr
    return out


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-30b-a3b-disaggregate"])
def test_submit_dry_run_qwen3(tmp_path, name):
    _submit_dry_run(tmp_path, name)


@pytest.mark.parametrize("name", [
    pytest.param("glm-4.5-air", marks=_skip_unsupported("glm4_moe")),
    pytest.param("glm-4.5-air-disaggregate", marks=_skip_unsupported("glm4_moe")),
    pytest.param("glm-4.5", marks=_skip_unsupported("glm4_moe")),
    pytest.param("deepseek-v3", marks=_skip_unsupported("deepseek_v3")),
    pytest.param("deepseek-v3-disaggregate", marks=_skip_unsupported("deepseek_v3")),
    pytest.param("glm-4.5-disaggregate", marks=_skip_unsupported("glm4_moe")),
    "qwen3-235b-a22b",
    pytest.param("kimi-k2", marks=_skip_unsupported("deepseek_v3")),
    pytest.param("glm-4.7-flash", marks=_skip_unsupported("glm4_moe_lite")),
])
def test_submit_dry_run_glm_deepseek(tmp_path, name):
    _submit_dry_run(tmp_path, name)


def test_validate_prints_estimate_and_refuses_in_one_line(tmp_path):
    folder = model_folder(tmp_path / "m", "qwen3-30b-a3b")
    ok = hpcrl(["validate", str(CLUSTER / "qwen3-30b-a3b.yaml"), f"model.path={folder}"], tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "memory:    30.53B parameters" in ok.stdout and "Adam without CPU offload" in ok.stdout
    bad = hpcrl(["validate", str(CLUSTER / "qwen3-30b-a3b.yaml"), f"model.path={folder}",
                 "megatron.optimizer_cpu_offload=false", "train.tensor_parallel_size=1"], tmp_path)
    assert bad.returncode == 2 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("config error: slurm.gpu_memory_gb=80.0: the trainer needs")


# ------------------------------------------------------------------------------------------------------------
# pipeline stages, context parallelism and activations (issue #55 point 4)
# ------------------------------------------------------------------------------------------------------------

def test_stage_layer_counts_follow_megatrons_split():
    from hpcrl.config.train import stage_layer_counts

    assert stage_layer_counts(92, 1) == [92]
    assert stage_layer_counts(92, 4) == [23, 23, 23, 23]
    assert stage_layer_counts(61, 4, first=16, last=15) == [16, 15, 15, 15]  # slime's DeepSeek-V3: 61 layers
    assert stage_layer_counts(61, 4, first=16) == [16, 15, 15, 15]
    assert stage_layer_counts(10, 3) is None  # megatron refuses a remainder (hpcrl validate too)
    assert stage_layer_counts(4, 2, first=4) is None  # and a stage without a layer


def test_pipeline_stages_context_parallel_and_recompute_in_the_estimate(tmp_path):
    """configs/cluster/glm-4.5.yaml at slime's TP8 PP4 CP2 EP16: the fullest stage is the estimate (the first: the
    embedding and 4 micro-batches in flight under 1F1B); CP=2 halves the tokens a rank holds activations of;
    full recompute keeps one layer input per layer."""
    from hpcrl.config.memory import activation_bytes

    def memory(*overrides):
        cfg = _cfg(tmp_path, "glm-4.5", *overrides)
        return cfg, trainer_memory(cfg, p, hf=read_model_config(cfg))

    p = _count("glm-4.5")
    cfg, m = memory()
    hf = read_model_config(cfg)
    assert (cfg.train.pipeline_parallel_size, cfg.train.context_parallel_size) == (4, 2)
    assert m.stage == 0 and "stage 0 of 4 (23 layers)" in m.layout
    _, flat = memory("train.pipeline_parallel_size=1")
    assert flat.params > 3.5 * m.params  # a quarter of the layers (and the embedding) a stage
    _, no_cp = memory("train.context_parallel_size=1")
    assert m.activations == pytest.approx(no_cp.activations / 2)
    # 1F1B: stage s of 4 keeps 4 - s micro-batches; the last stage adds the logits (8 bytes a token and vocab/TP)
    tp, tokens = cfg.train.tensor_parallel_size, 16384 / 2
    first, last = activation_bytes(cfg, hf, 23, 0, tp), activation_bytes(cfg, hf, 23, 3, tp)
    assert last - 8 * tokens * hf["vocab_size"] / tp == pytest.approx(first / 4)
    _, no_recompute = memory("megatron.recompute_granularity=null")
    assert no_recompute.activations > 5 * m.activations
    assert trainer_memory(cfg, p).activations == 0  # no config.json given: not estimated
