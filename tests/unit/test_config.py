"""Config loading, type checking, cross-field validation, resolution and the resolved round trip."""

from __future__ import annotations

import json
import dataclasses
import pickle
import sys
from pathlib import Path

import pytest
import yaml

from hpcrl.config import (
    FILE_FIELD,
    MIB,
    OVERRIDE_FIELD,
    Config,
    ConfigError,
    SlurmGroup,
    config_to_dict,
    load_config,
    parse_override,
    resolve,
    slurm_time_seconds,
    validate,
)
from hpcrl.config.train import sequence_parallel
from hpcrl.validate import load_and_check, save_resolved

REPO = Path(__file__).resolve().parents[2]
M = "model: {create: tiny-qwen2}\n"
"""A model section that needs no files, for cases about other sections."""
FILE = object()
"""Marker: the expected value is the config file's path (optionally ``:line``)."""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def assert_one_line(err: ConfigError, field: str) -> str:
    msg = str(err)
    assert "\n" not in msg and "\r" not in msg
    assert msg.startswith(f"config error: {field}=")
    assert err.field == field
    assert f"config error: {field}={err.value!r}: " in msg  # the values of the battery are short
    return msg


# (id, yaml text, overrides, expected field, expected value, substrings of the message)
MOE = "model: {create: tiny-qwen3-moe, tiny_num_experts: 6}\n"
BAD = [
    ("ep-on-a-dense-model", M + "train: {expert_parallel_size: 2, nprocs: 2}\n", [], "train.expert_parallel_size", 2,
     ["is dense (no experts)", "set train.expert_parallel_size=1"]),
    ("ep-not-dividing-experts", MOE + "train: {expert_parallel_size: 4, nprocs: 4}\n", [],
     "train.expert_parallel_size", 4, ["must divide the model's 6 experts", "use a divisor of 6"]),
    ("ep-not-dividing-world", MOE + "train: {expert_parallel_size: 2, nprocs: 3}\n", [],
     "train.expert_parallel_size", 2, ["must divide train.nprocs=3"]),
    ("moe-allgather-with-ep", MOE + "train: {expert_parallel_size: 2, nprocs: 2}\n"
     "megatron: {moe_token_dispatcher_type: allgather}\n", [], "megatron.moe_token_dispatcher_type", "allgather",
     ["same number of tokens on every rank of the expert groups", "use alltoall"]),
    ("moe-allgather-with-etp-above-tp", MOE + "train: {expert_tensor_parallel_size: 2, nprocs: 2}\n"
     "megatron: {moe_token_dispatcher_type: allgather}\n", [], "megatron.moe_token_dispatcher_type", "allgather",
     ["expert-tensor parallelism above the tensor-parallel size", "use alltoall"]),
    ("megatron-etp-override", MOE + "megatron: {expert_tensor_parallel_size: 2}\n", [],
     "megatron.expert_tensor_parallel_size", 2, ["set train.expert_tensor_parallel_size instead"]),
    ("routing-replay-on-a-dense-model", M + "algorithm: {routing_replay: true}\n", [], "algorithm.routing_replay",
     True, ["is dense: it has no routing to replay"]),
    ("routing-replay-through-the-router", MOE + "algorithm: {routing_replay: true}\n", [], "rollout.router", True,
     ["drops the return_routed_experts field", "set rollout.router=false"]),
    ("routing-replay-with-recompute", MOE + "rollout: {router: false}\nalgorithm: {routing_replay: true}\n"
     "megatron: {recompute_granularity: full}\n", [], "megatron.recompute_granularity", "full",
     ["re-runs the routers in backward"]),
    ("moe-top-k-above-experts", MOE + "", ["model.tiny_moe_top_k=8"], "model.tiny_moe_top_k", 8,
     ["is above model.tiny_num_experts=6"]),
    ("cpus-with-colocate", M + "train: {cpus: '0'}\n", [], "train.cpus", "0",
     ["run.placement is colocate", "set run.placement=disaggregate or train.cpus=null"]),
    ("cpus-overlap", M + "run: {placement: disaggregate}\ntrain: {cpus: '0-1'}\nrollout: {cpus: '1-2'}\n", [],
     "rollout.cpus", "1-2", ["overlaps train.cpus='0-1' on CPUs 1", "disjoint"]),
    ("cpus-malformed", M + "run: {placement: disaggregate}\nrollout: {cpus: '3-1'}\n", [], "rollout.cpus", "3-1",
     ["not a range of CPUs", "0-3,8"]),
    ("cpus-not-a-number", M + "run: {placement: disaggregate}\ntrain: {cpus: 'a,b'}\n", [], "train.cpus", "a,b",
     ["'a' is not a CPU number or range"]),
    ("lr-warmup-not-below-decay", M + "run: {num_rollout: 10}\ntrain: {lr_warmup_steps: 10}\n", [],
     "train.lr_warmup_steps", 10, ["must be smaller than train.lr_decay_steps=10"]),
    ("lr-decay-style-unknown", M + "train: {lr_decay_style: exponential}\n", [], "train.lr_decay_style",
     "exponential", ["constant"]),
    ("lr-decay-steps-zero", M, ["train.lr_decay_steps=0"], "train.lr_decay_steps", 0, ["must be > 0"]),
    ("per-token-loss-refused", M + "megatron: {calculate_per_token_loss: true}\n", [],
     "megatron.calculate_per_token_loss", True, ["megatron-core's schedule", "remove megatron.calculate_per"]),
    ("collective-timeout-zero", M, ["train.collective_timeout_s=0"], "train.collective_timeout_s", 0.0,
     ["must be > 0"]),
    ("rollout-wait-timeout-negative", M, ["train.rollout_wait_timeout_s=-1"], "train.rollout_wait_timeout_s", -1.0,
     ["must be > 0"]),
    ("unknown-top-level", M + "rolout: {batch_size: 8}\n", [], "rolout", {"batch_size": 8},
     ["unknown top-level section", "did you mean rollout?"]),
    ("unknown-nested", M + "rollout: {batch_sise: 8}\n", [], "rollout.batch_sise", 8,
     ["did you mean rollout.batch_size?"]),
    ("key-in-wrong-section", M + "max_new_tokens: 8\n", [], "max_new_tokens", 8,
     ["did you mean rollout.max_new_tokens?"]),
    ("unknown-slurm-group-key", M + "run: {placement: disaggregate}\nslurm: {rollout: {gpus: 4}}\n", [],
     "slurm.rollout.gpus", 4, ["unknown key 'gpus'"]),
    ("str-for-int", M + "rollout: {batch_size: '8'}\n", [], "rollout.batch_size", "8",
     ["expected an integer, got a string", "without quotes"]),
    ("bool-for-int", M + "rollout: {n_samples_per_prompt: true}\n", [], "rollout.n_samples_per_prompt", True,
     ["expected an integer, got a boolean"]),
    ("float-for-int", M + "rollout: {max_new_tokens: 8.5}\n", [], "rollout.max_new_tokens", 8.5,
     ["expected an integer"]),
    ("list-for-str", M + "data: {source: [addition]}\n", [], "data.source", ["addition"],
     ["expected a string, got a list"]),
    ("dict-for-list", M + "rollout: {stop: {a: 1}}\n", [], "rollout.stop", {"a": 1},
     ["expected a list of strings, got a mapping"]),
    ("str-for-float", M + "train: {lr: fast}\n", [], "train.lr", "fast", ["expected a number"]),
    ("str-for-bool", M + "run: {deterministic: 'yes'}\n", [], "run.deterministic", "yes",
     ["expected true or false"]),
    ("nan-float", M + "train: {lr: .nan}\n", [], "train.lr", None, ["finite"]),
    ("bad-literal", M + "run: {mode: asynch}\n", [], "run.mode", "asynch",
     ["must be one of 'sync', 'async'", "did you mean 'async'?"]),
    ("bad-optional-literal", "model: {path: m, create: tiny-qwen3}\n", [], "model.create", "tiny-qwen3",
     ["'tiny-qwen2', 'tiny-qwen3-moe', 'tiny-glm4-moe', 'tiny-deepseek-v3', 'gguf'"]),
    ("bad-list-item", M + "rollout: {stop_token_ids: [1, two]}\n", [], "rollout.stop_token_ids[1]", "two",
     ["expected an integer"]),
    ("section-not-mapping", M + "rollout: 5\n", [], "rollout", 5, ["expected a mapping"]),
    ("free-dict-not-mapping", M + "sglang: [a]\n", [], "sglang", ["a"], ["expected a mapping"]),
    ("missing-model-path", "run: {name: x}\n", [], "model.path", "", ["is required"]),
    ("model-path-not-on-disk", "model: {path: /nonexistent/hpcrl-model}\n", [], "model.path",
     "/nonexistent/hpcrl-model", ["no such model folder", "model.create"]),
    ("gguf-without-file", "model: {path: m, create: gguf}\n", [], "model.gguf_file", None, ["needs a GGUF"]),
    ("gguf-file-missing", "model: {create: gguf, gguf_file: /nonexistent/x.gguf}\n", [], "model.gguf_file",
     "/nonexistent/x.gguf", ["no such GGUF file"]),
    ("gguf-file-without-create", "model: {path: m, create: tiny-qwen2, gguf_file: smollm2}\n", [],
     "model.gguf_file", "smollm2", ["only used with model.create: gguf"]),
    ("async-colocate", M + "run: {mode: async, placement: colocate}\n", [], "run.mode", "async",
     ["run.placement: disaggregate"]),
    ("fully-async-colocate", M + "run: {mode: fully_async, placement: colocate}\n", [], "run.mode",
     "fully_async", ["take turns"]),
    ("fully-async-deterministic", M + "run: {mode: fully_async, placement: disaggregate, deterministic: true}\n",
     [], "run.deterministic", True, ["timing decides"]),
    ("offload-without-distributed-optimizer", M + "megatron: {optimizer_cpu_offload: true}\n", [],
     "megatron.optimizer_cpu_offload", True, ["cannot load", "use_distributed_optimizer=true"]),
    ("offload-with-fp32-parameters", M + "train: {use_distributed_optimizer: true}\n"
     "megatron: {optimizer_cpu_offload: true}\n", [], "megatron.optimizer_cpu_offload", True,
     ["non-leaf", "train.bf16=true"]),
    ("fully-async-uncorrected", M + "run: {mode: fully_async, placement: disaggregate}\n", [],
     "algorithm.use_tis", False, ["uncorrected"]),
    ("fully-async-agent", M + "run: {mode: fully_async, placement: disaggregate}\n"
     "algorithm: {use_tis: true}\nrollout: {agent: {function: my_agent.run}}\n", [], "rollout.agent", "my_agent.run", ["continued"]),
    ("fully-async-custom-rollout", M + "run: {mode: fully_async, placement: disaggregate}\n"
     "algorithm: {use_tis: true}\nrollout: {rollout_function: my_rollout.run}\n", [], "rollout.rollout_function", "my_rollout.run",
     ["does not call"]),
    ("run-name-slash", M + "run: {name: a/b}\n", [], "run.name", "a/b", ["no '/'"]),
    ("gbs-not-multiple-of-group", M + "train: {global_batch_size: 60}\n", [], "train.global_batch_size", 60,
     ["n_samples_per_prompt=8"]),
    ("gbs-not-multiple-of-micro", M + "train: {global_batch_size: 64, micro_batch_size: 48}\n", [],
     "train.global_batch_size", 64, ["micro_batch_size=48"]),
    ("gbs-inconsistent-with-steps", M + "train: {global_batch_size: 32}\n", [], "train.global_batch_size", 32,
     ["num_steps_per_rollout=1", "64 samples"]),
    ("derived-gbs-vs-micro", M + "rollout: {batch_size: 4}\n", [], "train.micro_batch_size", 64,
     ["global batch of 32"]),
    ("filter-starved-choice", M + "rollout: {on_filter_starved: stop}\n", [], "rollout.on_filter_starved",
     "stop", ["must be one of 'train', 'error'"]),
    ("over-sampling-too-small", M + "rollout: {over_sampling_batch_size: 4}\n", [],
     "rollout.over_sampling_batch_size", 4, [">= rollout.batch_size=8"]),
    ("zero-batch", M + "rollout: {batch_size: 0}\n", [], "rollout.batch_size", 0, ["must be > 0"]),
    ("negative-max-new-tokens", M + "rollout: {max_new_tokens: -1}\n", [], "rollout.max_new_tokens", -1,
     ["must be > 0"]),
    ("zero-num-rollout", M + "run: {num_rollout: 0}\n", [], "run.num_rollout", 0, ["must be > 0"]),
    ("negative-nodes", M + "slurm: {nodes: -1}\n", [], "slurm.nodes", -1, ["must be > 0"]),
    ("zero-nprocs", M + "train: {nprocs: 0}\n", [], "train.nprocs", 0, ["must be > 0"]),
    ("group-of-one", M + "rollout: {n_samples_per_prompt: 1}\n", [], "rollout.n_samples_per_prompt", 1,
     ["group"]),
    ("top-p-above-1", M + "rollout: {top_p: 1.5}\n", [], "rollout.top_p", 1.5, ["(0, 1]"]),
    ("top-p-zero", M + "rollout: {top_p: 0}\n", [], "rollout.top_p", 0.0, ["(0, 1]"]),
    ("negative-temperature", M + "rollout: {temperature: -0.1}\n", [], "rollout.temperature", -0.1, [">= 0"]),
    ("heartbeat-timeout-below-interval", M + "rollout: {heartbeat_interval_s: 10, heartbeat_timeout_s: 5}\n", [],
     "rollout.heartbeat_timeout_s", 5.0, ["below rollout.heartbeat_interval_s=10", "at least 10"]),
    ("heartbeat-interval-zero", M + "rollout: {heartbeat_interval_s: 0}\n", [], "rollout.heartbeat_interval_s",
     0.0, ["must be > 0"]),
    ("negative-restart-budget", M + "rollout: {max_engine_restarts: -1}\n", [], "rollout.max_engine_restarts",
     -1, [">= 0"]),
    ("eps-clip-1", M + "algorithm: {eps_clip: 1.0}\n", [], "algorithm.eps_clip", 1.0, ["(0, 1)"]),
    ("eps-clip-c-below-1", M + "algorithm: {eps_clip_c: 0.5}\n", [], "algorithm.eps_clip_c", 0.5, ["> 1"]),
    ("cispo-eps-low-above-1", M + "algorithm: {policy_loss: cispo, eps_clip: 1.5}\n", [], "algorithm.eps_clip",
     1.5, ["CISPO's eps_low", "(0, 1]"]),
    ("cispo-with-gspo", M + "algorithm: {policy_loss: cispo, advantage_estimator: gspo}\n", [],
     "algorithm.policy_loss", "cispo", ["GSPO", "advantage_estimator=grpo"]),
    ("cispo-with-dual-clip", M + "algorithm: {policy_loss: cispo, eps_clip_c: 3.0}\n", [],
     "algorithm.eps_clip_c", 3.0, ["dual clip"]),
    ("unknown-policy-loss", M + "algorithm: {policy_loss: dapo}\n", [], "algorithm.policy_loss", "dapo",
     ["ppo_clip", "cispo"]),
    ("kl-coef-without-kl-loss", M + "algorithm: {kl_loss_coef: 0.01}\n", [], "algorithm.kl_loss_coef", 0.01,
     ["use_kl_loss"]),
    # issue #38: PPO with a critic, loss reductions, RLOO
    ("lam-above-1", M + "algorithm: {advantage_estimator: gae, lam: 1.5}\n", [], "algorithm.lam", 1.5,
     ["[0, 1]"]),
    ("lam-without-gae", M + "algorithm: {lam: 0.95}\n", [], "algorithm.lam", 0.95,
     ["has no effect with advantage_estimator=grpo", "advantage_estimator=gae"]),
    ("critic-with-gspo", M + "algorithm: {advantage_estimator: gspo}\ncritic: {path: /tmp/rm}\n", [],
     "critic.path", "/tmp/rm", ["has no effect", "only with algorithm.advantage_estimator=gae (not gspo)"]),
    ("critic-warmup-with-grpo", M + "critic: {warmup_steps: 2}\n", [], "critic.warmup_steps", 2,
     ["has no effect", "(not grpo)"]),
    ("kl-coef-with-kl-loss", M + "algorithm: {advantage_estimator: gae, kl_coef: 0.05, use_kl_loss: true, "
     "kl_loss_coef: 0.1}\n", [], "algorithm.kl_coef", 0.05, ["exclusive", "use_kl_loss=false"]),
    ("kl-coef-with-rloo", M + "algorithm: {advantage_estimator: rloo, kl_coef: 0.05}\n", [], "algorithm.kl_coef",
     0.05, ["has no effect with advantage_estimator=rloo", "use_kl_loss=true"]),
    ("kl-coef-negative", M + "algorithm: {advantage_estimator: gae, kl_coef: -0.1}\n", [], "algorithm.kl_coef",
     -0.1, [">= 0"]),
    ("loss-scale-without-norm", M + "algorithm: {loss_scale_factor: 512}\n", [], "algorithm.loss_scale_factor",
     512, ["has no effect with loss_reduction=rollout_token_mean", "seq_mean_token_sum_norm"]),
    ("loss-scale-zero", M + "algorithm: {loss_reduction: seq_mean_token_sum_norm, loss_scale_factor: 0}\n", [],
     "algorithm.loss_scale_factor", 0, ["> 0"]),
    ("unknown-loss-reduction", M + "algorithm: {loss_reduction: seq_mean_token_mean}\n", [],
     "algorithm.loss_reduction", "seq_mean_token_mean", ["'seq_mean_token_sum'"]),
    ("rloo-one-sample", M + "algorithm: {advantage_estimator: rloo}\nrollout: {n_samples_per_prompt: 1}\n", [],
     "rollout.n_samples_per_prompt", 1, ["rloo", "2 or more"]),
    ("mis-low-at-1", M + "algorithm: {mis_level: token, mis_low: 1.0}\n", [], "algorithm.mis_low", 1.0,
     ["[0, 1)", "on-policy ratio 1"]),
    ("mis-low-negative", M + "algorithm: {mis_low: -0.1}\n", [], "algorithm.mis_low", -0.1, ["[0, 1)"]),
    ("mis-high-below-1", M + "algorithm: {mis_level: sequence, mis_high: 0.9}\n", [], "algorithm.mis_high",
     0.9, ["> 1", "on-policy ratio 1"]),
    ("unknown-mis-level", M + "algorithm: {mis_level: batch}\n", [], "algorithm.mis_level", "batch",
     ["token", "geometric"]),
    # issue #56: LoRA adapters (model.lora)
    ("lora-rank-zero", M, ["model.lora={rank: 0}"], "model.lora.rank", 0, ["> 0"]),
    ("lora-unknown-target", M, ["model.lora={target_modules: [q_proj, qkv]}"], "model.lora.target_modules",
     ["q_proj", "qkv"], ["unknown module(s) qkv", "q_proj, k_proj"]),
    ("lora-target-twice", M, ["model.lora={target_modules: [q_proj, q_proj]}"], "model.lora.target_modules",
     ["q_proj", "q_proj"], ["names a module twice"]),
    ("lora-dropout-1", M, ["model.lora={dropout: 1.0}"], "model.lora.dropout", 1.0, ["[0, 1)"]),
    ("lora-sync-unknown", M, ["model.lora={sync: tensor}"], "model.lora.sync", "tensor",
     ["not a way to sync adapters", "adapter, merged"]),
    ("lora-adapter-sync-delta", M, ["model.lora={rank: 4}", "weights.delta=true"], "weights.delta", True,
     ["sends the adapters alone", "model.lora.sync=merged"]),
    ("lora-adapter-sync-sglang-dp", M, ["model.lora={rank: 4}", "sglang.dp_size=2"], "sglang.dp_size", 2,
     ["data-parallel replicas are not supported for dynamic lora loading", "model.lora.sync=merged"]),
    ("lora-on-experts", MOE, ["model.lora={rank: 4}"], "model.lora", "set",
     ["mixture of experts (6 routed experts", "not implemented yet (issue #56)"]),
    ("lora-on-mla", "model: {create: tiny-deepseek-v3}\n", ["model.lora={rank: 4}"], "model.lora", "set",
     ["multi-latent attention"]),
    ("lora-context-parallel", M + "train: {context_parallel_size: 2, nprocs: 2, max_tokens_per_microbatch: 64}\n",
     ["model.lora={rank: 4}"], "train.context_parallel_size", 2, ["not split over context-parallel ranks"]),
    ("pipeline-parallel-remote-critic", M + "train: {pipeline_parallel_size: 2, nprocs: 2}\n"
     "algorithm: {advantage_estimator: gae}\ncritic: {nprocs: 2}\n", [], "critic.nprocs", 2,
     ["ranks of its own", "pipeline_parallel_size > 1"]),
    ("pipeline-stages-uneven", M + "train: {pipeline_parallel_size: 3, nprocs: 3}\n", [],
     "train.pipeline_parallel_size", 3, ["num_hidden_layers=4", "4 layers over 3 stage(s)",
                                         "num_layers_in_first_pipeline_stage"]),
    ("context-parallel-padded", M + "train: {context_parallel_size: 2, nprocs: 2}\n", [],
     "train.context_parallel_size", 2, ["needs packed micro-batches", "train.max_tokens_per_microbatch"]),
    ("parallel-does-not-divide", M + "train: {tensor_parallel_size: 2, nprocs: 3}\n", [], "train.nprocs", 3,
     ["tensor x pipeline x context parallel size = 2"]),
    ("tensor-weights-disaggregated", M + "run: {placement: disaggregate}\nweights: {method: tensor}\n", [],
     "weights.method", "tensor", ["disaggregate"]),
    ("bucket-too-small", M + "weights: {bucket_bytes: 1000}\n", [], "weights.bucket_bytes", 1000, ["1 MiB"]),
    ("delta-sglang-distributed", M + "run: {placement: disaggregate}\nrollout: {engine: sglang}\n",
     ["weights.delta=true"], "weights.delta", True, ["only on /update_weights_from_tensor", "weights.method=tensor"]),
    ("full-every-without-delta", M, ["weights.full_every=5"], "weights.full_every", 5, ["without weights.delta"]),
    ("fp8-rollout-other-quantization", M, ["weights.rollout_dtype=fp8", "sglang.quantization=awq"],
     "sglang.quantization", "awq", ["block scales", "weights.rollout_dtype=null"]),
    ("full-every-negative", M, ["weights.delta=true", "weights.full_every=-1"], "weights.full_every", -1, [">= 0"]),
    ("fp8-sglang-float32", M + "rollout: {engine: sglang}\n", ["weights.rollout_dtype=fp8", "sglang.dtype=float32"],
     "sglang.dtype", "float32", ["bfloat16 or float16", "sglang.dtype=bfloat16"]),
    ("sft-without-output", M + "sft: {enabled: true}\n", [], "sft.output", "", ["sft.enabled"]),
    ("sft-near-target-interval-zero", M + "sft: {eval_interval_near_target: 0}\n", [],
     "sft.eval_interval_near_target", 0, ["must be > 0"]),
    ("sft-target-window-zero", M + "sft: {target_accuracy: 0.4, target_window: 0}\n", [],
     "sft.target_window", 0, ["must be > 0"]),
    ("sft-target-window-without-target", M + "sft: {target_window: 3}\n", [], "sft.target_window", 3,
     ["sft.target_accuracy, which is not set", "sft.target_window=1"]),
    ("sft-anneal-negative", M + "sft: {target_accuracy: 0.4, anneal_steps: -1}\n", [], "sft.anneal_steps", -1,
     ["must be >= 0"]),
    ("sft-anneal-without-target", M + "sft: {anneal_steps: 16}\n", [], "sft.anneal_steps", 16,
     ["once sft.target_accuracy is met, which is not set", "sft.anneal_steps=0"]),
    ("missing-sft-data-file", M + "sft: {data: {source: /nonexistent/demos.jsonl}}\n", [], "sft.data.source",
     "/nonexistent/demos.jsonl", ["no such data file"]),
    ("sft-data-empty-key", M + "sft: {data: {source: addition}}\n", ["sft.data.label_key="],
     "sft.data.label_key", "", ["set sft.data.label_key to a column name"]),
    ("sft-batch-not-over-dp", M + "run: {mode: sft}\ntrain: {nprocs: 4, tensor_parallel_size: 2}\n",
     ["sft.batch_size=33"], "sft.batch_size", 33, ["2 data-parallel ranks", "sft.batch_size=32"]),
    ("missing-data-file", M + "data: {source: /nonexistent/train.jsonl}\n", [], "data.source",
     "/nonexistent/train.jsonl", ["no such data file"]),
    ("unknown-data-source", M + "data: {source: additon}\n", [], "data.source", "additon",
     ["unknown data source", "did you mean 'addition'?"]),
    ("unknown-reasoning-gym-task", M + "data: {source: 'reasoning_gym:basic_arithmetc'}\n", [], "data.source",
     "reasoning_gym:basic_arithmetc", ["did you mean reasoning_gym:basic_arithmetic?"]),
    ("bad-dotted-reward", M + "rollout: {reward_function: nonexistent_hpcrl_pkg.rewards.score}\n", [],
     "rollout.reward_function", "nonexistent_hpcrl_pkg.rewards.score", ["not found"]),
    ("reward-missing-attr", M + "rollout: {reward_function: hpcrl.config.no_such_reward}\n", [],
     "rollout.reward_function", "hpcrl.config.no_such_reward", ["no attribute 'no_such_reward'"]),
    ("reward-not-a-path", M + "rollout: {reward_function: my_reward}\n", [], "rollout.reward_function",
     "my_reward", ["dotted path"]),
    ("bad-filter", M + "rollout: {dynamic_filter: nonzero-std}\n", [], "rollout.dynamic_filter",
     "nonzero-std", ["did you mean 'nonzero_std'?"]),
    ("bad-slurm-time", M + "slurm: {time: '25:99:00'}\n", [], "slurm.time", "25:99:00", ["< 60"]),
    ("slurm-time-garbage", M + "slurm: {time: 'two hours'}\n", [], "slurm.time", "two hours",
     ["not a Slurm time limit"]),
    ("slurm-time-unquoted-int", M + "slurm: {time: 90}\n", [], "slurm.time", 90, ["quote it"]),
    ("bad-slurm-signal", M + "slurm: {signal: USR2}\n", [], "slurm.signal", "USR2", ["SIGNAME@SECONDS"]),
    ("unknown-signal-name", M + "slurm: {signal: USR3@120}\n", [], "slurm.signal", "USR3@120",
     ["unknown signal name 'USR3'"]),
    ("signal-after-time-limit", M + "slurm: {time: '1', signal: USR2@120}\n", [], "slurm.signal", "USR2@120",
     ["shorter than slurm.time"]),
    ("bad-slurm-mem", M + "slurm: {mem: 64 GB}\n", [], "slurm.mem", "64 GB", ["64G"]),
    ("sbatch-line-not-option", M + "slurm: {extra_sbatch: ['#SBATCH --qos=x']}\n", [],
     "slurm.extra_sbatch[0]", "#SBATCH --qos=x", ["sbatch option"]),
    ("rollout-group-colocated", M + "slurm: {rollout: {nodes: 2}}\n", [], "slurm.rollout",
     {"nodes": 2, "gpus_per_node": 0, "cpus_per_task": 2, "mem": None, "partition": None, "gpu_memory_gb": None},
     ["disaggregate"]),
    ("sweep-unknown-key", M + "sweep: {grid: {train.lrr: [1.0e-5]}}\n", [], "sweep.grid.train.lrr", [1e-5],
     ["did you mean train.lr?"]),
    ("sweep-empty-values", M + "sweep: {grid: {train.lr: []}}\n", [], "sweep.grid.train.lr", [],
     ["non-empty list"]),
    ("sweep-value-type", M + "sweep: {grid: {rollout.batch_size: [8, big]}}\n", [],
     "sweep.grid.rollout.batch_size[1]", "big", ["expected an integer"]),
    ("sweep-a-section", M + "sweep: {grid: {rollout: [{}]}}\n", [], "sweep.grid.rollout", [{}], ["section"]),
    ("yaml-syntax-error", "rollout:\n  batch_size: [8, 16\n  top_p: 1\n", [], FILE_FIELD, FILE,
     ["invalid YAML"]),
    ("yaml-duplicate-key", M + "rollout:\n  batch_size: 8\n  batch_size: 16\n", [], FILE_FIELD, FILE,
     ["duplicate key 'batch_size'"]),
    ("non-mapping-top-level", "- run\n- model\n", [], FILE_FIELD, FILE, ["must be a mapping", "got a list"]),
    ("override-unknown-key", M, ["rollout.batch_sise=16"], "rollout.batch_sise", 16,
     ["did you mean rollout.batch_size?"]),
    ("override-unknown-section", M, ["rolout.batch_size=16"], "rolout.batch_size", 16,
     ["did you mean rollout?"]),
    ("override-bad-syntax", M, ["slurm.extra_sbatch=[--a,--b"], "slurm.extra_sbatch", "[--a,--b",
     ["cannot parse the value"]),
    ("override-without-equals", M, ["rollout.batch_size"], OVERRIDE_FIELD, "rollout.batch_size",
     ["key=value"]),
    ("override-empty-key", M, ["=16"], OVERRIDE_FIELD, "=16", ["no key"]),
    ("override-bad-value", M, ["rollout.batch_size=many"], "rollout.batch_size", "many",
     ["expected an integer"]),
    ("override-below-a-value", M, ["rollout.batch_size.x=1"], "rollout.batch_size.x", 1, ["not a section"]),
    ("override-bad-literal", M, ["algorithm.advantage_estimator=ppo2"], "algorithm.advantage_estimator",
     "ppo2", ["'grpo'"]),
]


@pytest.mark.parametrize("text,overrides,field,value,parts", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_malformed_config_is_one_line_error(tmp_path, text, overrides, field, value, parts):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_and_check(path, overrides)
    err = info.value
    msg = assert_one_line(err, field)
    if value is FILE:
        assert str(err.value).startswith(str(path))
    elif value is not None:
        assert err.value == value and type(err.value) is type(value)
    for part in parts:
        assert part in msg, msg


def test_battery_is_large_and_distinct():
    assert len(BAD) >= 30
    assert len({c[0] for c in BAD}) == len(BAD)
    assert len({(c[1], tuple(c[2])) for c in BAD}) == len(BAD)


def test_ppo_rloo_and_reduction_combinations_that_make_sense_load(tmp_path):
    """gae with its critic fields, lam, the KL in the reward and CISPO; rloo; Dr. GRPO's normaliser."""
    for text in ("algorithm: {advantage_estimator: gae, lam: 0.95, kl_coef: 0.05, policy_loss: cispo, "
                 "eps_clip: 1.0}\ncritic: {lr: 0.00002, warmup_steps: 1, value_clip: null}\n",
                 "algorithm: {advantage_estimator: reinforce_plus_plus, kl_coef: 0.01}\n",
                 "algorithm: {advantage_estimator: rloo, loss_reduction: seq_mean_token_sum_norm, "
                 "loss_scale_factor: 256, normalize_advantages: true}\n"):
        cfg = load_and_check(write(tmp_path, M + text), [])
        assert cfg.algorithm.advantage_estimator in ("gae", "reinforce_plus_plus", "rloo")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, M + "rollout:\n  batch_size: 8\n  stop: [a, b\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    file, line = str(info.value.value).rsplit(":", 1)
    assert file == str(path) and int(line) >= 4
    assert f"line {line}" in str(info.value) and "flow sequence that starts on line 4" in str(info.value)


def test_duplicate_key_names_both_lines(tmp_path):
    path = write(tmp_path, "run:\n  name: a\n  seed: 1\n  name: b\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.value == f"{path}:4"
    assert "first given on line 2" in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert info.value.field == FILE_FIELD and "no such config file" in str(info.value)


def test_config_error_pickles_and_is_a_value_error():
    err = ConfigError("rollout.batch_size", "8", "expected an integer", "remove the quotes")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, ValueError)
    assert (back.field, back.value, back.problem, back.fix) == (
        "rollout.batch_size", "8", "expected an integer", "remove the quotes")
    assert str(back) == str(err)
    assert str(err) == "config error: rollout.batch_size='8': expected an integer; remove the quotes"


def test_problem_text_with_newlines_stays_one_line():
    assert "\n" not in str(ConfigError("a.b", "x\ny", "line one\nline two", "fix\n it"))


# ------------------------------------------------------------------------------------------------------------
# Valid configs, overrides, YAML details
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["quickstart.yaml", "smollm2-arith.yaml", "moe-quickstart.yaml"])
def test_shipped_configs_load(name):
    cfg = load_and_check(REPO / "configs" / name)
    assert cfg.model.create is not None and cfg.model.path.startswith(".cache/models/")
    assert cfg.train.global_batch_size == cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt


def test_sweep_quickstart_warm_starts_like_the_quickstart(tmp_path):
    """Issue #40 point 5: the sweep's points warm-start with the quickstart's recipe, so its seed-1 warm start
    has the quickstart's cache key (one folder for both) and the other seeds keys of their own."""
    from hpcrl.sft import cache_key, key_digest

    quick = load_and_check(REPO / "configs" / "quickstart.yaml")
    sweep = load_and_check(REPO / "configs" / "sweep-quickstart.yaml")
    assert sweep.sft == quick.sft and sweep.data == quick.data and sweep.sweep.seeds == [1, 2]
    sweep.run.seed = 1  # the seed=1 points
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    assert key_digest(cache_key(sweep, base)) == key_digest(cache_key(quick, base))
    sweep.run.seed = 2
    assert key_digest(cache_key(sweep, base)) != key_digest(cache_key(quick, base))


def test_lora_quickstart_warm_starts_like_the_quickstart(tmp_path):
    """Issue #56 point 7: the LoRA quickstart's warm start is the quickstart's (full fine-tuning, one cached
    folder for both; CI's LoRA e2e starts from the shipped one), and its RL trains rank-8 adapters on every
    linear."""
    from hpcrl.sft import cache_key, key_digest

    quick = load_and_check(REPO / "configs" / "quickstart.yaml")
    lora = load_and_check(REPO / "configs" / "lora-quickstart.yaml")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    assert key_digest(cache_key(lora, base)) == key_digest(cache_key(quick, base))
    assert lora.sft.output == quick.sft.output and lora.model.path == quick.model.path
    assert (lora.model.lora.rank, lora.model.lora.alpha, len(lora.model.lora.target_modules)) == (8, 16.0, 7)


def test_quickstart_values():
    cfg = load_and_check(REPO / "configs" / "quickstart.yaml")
    assert (cfg.run.name, cfg.run.num_rollout, cfg.data.source) == ("quickstart", 600, "addition")
    assert (cfg.sft.enabled, cfg.sft.output, cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr) == (
        True, ".cache/models/tiny-qwen2-addition-sft", 3000, 256, 1e-3)
    # SFT ends on accuracy (issue #9), checked every 2 steps near the target, on one eval
    assert (cfg.sft.target_accuracy, cfg.sft.target_window, cfg.sft.eval_interval,
            cfg.sft.eval_interval_near_target) == (0.4, 1, 10, 2)
    assert (cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens) == (16, 8, 8)
    assert cfg.rollout.dynamic_filter == "nonzero_std" and cfg.train.lr == 1.5e-4
    assert (cfg.train.lr_warmup_steps, cfg.train.lr_decay_style, cfg.train.lr_decay_steps) == (50, "cosine", 600)
    assert cfg.algorithm.advantage_estimator == "grpo" and not cfg.algorithm.use_kl_loss


def test_smollm2_agent_config_does_its_warm_start_itself(monkeypatch):
    """Issue #34 point 6: the calculator agent's config holds its SFT warm start (demonstrations in sft.data,
    the RL prompts in data) and names the agent by its file, so it validates with no PYTHONPATH."""
    monkeypatch.chdir(REPO)  # its paths are relative to the working directory
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = load_and_check(REPO / "configs" / "smollm2-agent.yaml")
    assert (cfg.model.create, cfg.model.gguf_file) == ("gguf", "smollm2")
    assert cfg.sft.enabled and cfg.sft.output == ".cache/models/smollm2-agent-sft"
    assert (cfg.sft.data.source, cfg.sft.data.num_eval) == ("examples/agent_calculator/demos.jsonl", 16)
    assert cfg.data.source == "reasoning_gym:basic_arithmetic"
    assert cfg.rollout.agent.function == "examples/agent_calculator/agent.py:solve"


def test_smollm2_values():
    cfg = load_and_check(REPO / "configs" / "smollm2-arith.yaml")
    assert cfg.model.gguf_file == "smollm2" and cfg.data.source == "reasoning_gym:basic_arithmetic"
    assert cfg.rollout.stop == ["\n"] and cfg.rollout.max_new_tokens == 16 and cfg.run.num_rollout == 20
    # packed, and megatron's activation recompute (issue #13: trainer peak below TRL's on the same work)
    assert cfg.train.max_tokens_per_microbatch == 2048 and cfg.weights.bucket_bytes == 64 * 2**20
    assert cfg.megatron["recompute_granularity"] == "full" and cfg.megatron["recompute_num_layers"] == 1


def test_defaults_only_need_a_model():
    cfg = load_and_check(None, ["model.create=tiny-qwen2"])
    assert cfg.model.path == ".cache/models/tiny-qwen2"
    assert cfg.rollout == dataclasses.replace(Config().rollout, over_sampling_batch_size=8)


def test_overrides_apply(tmp_path):
    path = write(tmp_path, M + "rollout: {batch_size: 4}\ntrain: {micro_batch_size: 32}\nsglang:\n")
    cfg = load_and_check(path, [
           "rollout.batch_size=16",
           "slurm.extra_sbatch=[--reservation=foo, --qos=high]",
           "sglang.enable_memory_saver=true",
           "sglang.mem_fraction_static=0.7",
           "megatron.recompute_granularity=full",
           "data.task_kwargs.digits=4",
           "sweep.grid.train.lr=[1e-5, 3e-5]",
           "run.name=2024",
           'rollout.stop=["\\n"]',
           "run.placement=disaggregate",
           "slurm.rollout.nodes=2",
           "train.lr=1e-4",
       ])
    assert cfg.rollout.batch_size == 16 and cfg.train.global_batch_size == 128
    assert cfg.slurm.extra_sbatch == ["--reservation=foo", "--qos=high"]
    assert cfg.sglang == {"enable_memory_saver": True, "mem_fraction_static": 0.7}
    assert cfg.megatron == {"recompute_granularity": "full"}
    assert cfg.data.task_kwargs == {"digits": 4}
    assert cfg.sweep.grid == {"train.lr": [1e-5, 3e-5]}
    assert cfg.run.name == "2024"
    assert cfg.rollout.stop == ["\n"]
    assert cfg.slurm.rollout == SlurmGroup(nodes=2)
    assert cfg.train.lr == 1e-4 and cfg.weights.method == "distributed"


def test_later_override_wins_and_null_clears(tmp_path):
    path = write(tmp_path, M + "rollout: {dynamic_filter: nonzero_std}\n")
    cfg = load_and_check(path, ["rollout.batch_size=2", "rollout.batch_size=4", "rollout.dynamic_filter=null",
                                "train.micro_batch_size=8"])
    assert cfg.rollout.batch_size == 4 and cfg.rollout.dynamic_filter is None


def test_parse_override():
    assert parse_override("a.b=[1, x]") == ("a.b", [1, "x"])
    assert parse_override("a.b = 3e-5") == ("a.b", 3e-5)
    assert parse_override("a.b=") == ("a.b", None)
    assert parse_override("a.b=x=y") == ("a.b", "x=y")


def test_yaml12_numbers_and_times(tmp_path):
    path = write(tmp_path, M + "train: {lr: 3e-5, min_lr: 0}\nslurm: {time: 12:00:00}\n"
                               "run: {name: '010'}\nsft: {output: out, lr: 1e-3}\n")
    cfg = load_and_check(path)
    assert cfg.train.lr == 3e-5 and isinstance(cfg.train.min_lr, float) and cfg.train.min_lr == 0.0
    assert cfg.slurm.time == "12:00:00" and cfg.sft.lr == 1e-3


def test_empty_sections_keep_defaults(tmp_path):
    cfg = load_and_check(write(tmp_path, M + "rollout:\nsglang:\nsweep:\n"))
    assert cfg.rollout.batch_size == 8 and cfg.sglang == {}


def test_empty_file_needs_only_model_path(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "# nothing\n"))
    assert info.value.field == "model.path"


def model_folder(path: Path, config: dict) -> Path:
    """An HF folder as far as the login node can tell: ``config.json`` and one small safetensors file."""
    from safetensors.numpy import save_file
    import numpy as np

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(path / "model.safetensors"))
    return path


def test_existing_files_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_folder(tmp_path / "m", {"model_type": "qwen2"})
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    (tmp_path / "img.sif").write_text("")
    text = ("model: {path: m}\ndata: {source: train.jsonl, eval_source: train.jsonl}\n"
            "rollout: {reward_function: hpcrl.config.validate}\n"
            "slurm: {container: img.sif, time: '2-00:00:00', signal: SIGUSR2@300}\n")
    cfg = load_and_check(write(tmp_path, text))
    assert cfg.model.path == "m" and cfg.data.source == "train.jsonl"


def test_model_folder_without_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.path={tmp_path / 'm'}"])
    assert info.value.field == "model.path" and "config.json" in str(info.value)


def test_check_files_false_skips_environment(tmp_path):
    text = ("model: {path: /nonexistent/m}\ndata: {source: /nonexistent/d.parquet}\n"
            "rollout: {reward_function: nonexistent_pkg.mod.fn}\n")
    cfg = load_config(write(tmp_path, text), check_files=False)
    assert cfg.model.path == "/nonexistent/m"


def test_reward_builtins_match_rewards_module():
    resolve_mod = pytest.importorskip("hpcrl.rewards.resolve")
    for builtin in resolve_mod.BUILTIN_REWARDS:
        name = builtin.replace("<url>", "http://127.0.0.1:8000/reward")
        cfg = load_and_check(None, ["model.create=tiny-qwen2", f"rollout.reward_function={name}"])
        assert cfg.rollout.reward_function == name


@pytest.mark.parametrize("text,seconds", [("90", 5400), ("90:30", 5430), ("01:00:00", 3600), ("2-00", 172800),
                                          ("1-12:30", 131400), ("1-00:00:01", 86401), ("UNLIMITED", None)])
def test_slurm_time_seconds(text, seconds):
    assert slurm_time_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "1:2:3:4", "1-25", "10:60", "abc", "-5"])
def test_slurm_time_seconds_rejects(text):
    with pytest.raises(ValueError):
        slurm_time_seconds(text)


# ------------------------------------------------------------------------------------------------------------
# validate / resolve / save on Config objects
# ------------------------------------------------------------------------------------------------------------

def test_validate_checks_types_of_configs_built_in_code():
    cfg = Config()
    cfg.model.create = "tiny-qwen2"
    validate(cfg)
    cfg.rollout.batch_size = "8"
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert info.value.field == "rollout.batch_size"


def test_int_is_accepted_for_float_and_converted():
    cfg = load_and_check(None, ["model.create=tiny-qwen2", "rollout.temperature=1", "train.lr=1"])
    assert type(cfg.rollout.temperature) is float and type(cfg.train.lr) is float


def test_cispo_takes_eps_low_one_which_ppo_clip_refuses():
    cfg = load_and_check(None, ["model.create=tiny-qwen2", "algorithm.policy_loss=cispo", "algorithm.eps_clip=1.0",
                                "algorithm.eps_clip_high=4.0"])
    assert (cfg.algorithm.policy_loss, cfg.algorithm.eps_clip) == ("cispo", 1.0)
    with pytest.raises(ConfigError, match="algorithm.eps_clip"):
        load_and_check(None, ["model.create=tiny-qwen2", "algorithm.eps_clip=1.0"])


def test_token_budget_micro_batches_need_a_step_that_the_data_parallel_ranks_share():
    """Issue #54 point 1: every rank runs the same number of token-budget micro-batches, which a step of
    samples not a multiple of the data-parallel ranks cannot always give: refused before anything starts."""
    base = ["model.create=tiny-qwen2", "train.max_tokens_per_microbatch=256", "rollout.n_samples_per_prompt=2"]
    with pytest.raises(ConfigError, match=r"rollout.batch_size.*6 samples an optimizer step.*4 data-parallel"):
        load_and_check(None, [*base, "rollout.batch_size=3", "train.nprocs=4"])
    with pytest.raises(ConfigError, match=r"train.global_batch_size.*4 samples.*3 data-parallel"):
        load_and_check(None, [*base, "rollout.batch_size=4", "train.global_batch_size=4",
                              "train.num_steps_per_rollout=2", "train.nprocs=3"])
    assert load_and_check(None, [*base, "rollout.batch_size=4", "train.nprocs=4"]).train.nprocs == 4
    # two TP ranks of 4 processes: 2 data-parallel ranks, 6 samples a step
    load_and_check(None, [*base, "rollout.batch_size=3", "train.nprocs=4", "train.tensor_parallel_size=2"])


def test_resolve_fills_derived_defaults_without_mutating():
    cfg = Config()
    cfg.model.create = "gguf"
    cfg.model.gguf_file = "smollm2"
    cfg.rollout.batch_size = 4
    cfg.train.num_steps_per_rollout = 2
    cfg.train.micro_batch_size = 8
    cfg.algorithm.eps_clip = 0.1
    validate(cfg, check_files=False)
    out = resolve(cfg)
    assert cfg.train.global_batch_size is None and cfg.model.path == ""
    assert out.model.path == ".cache/models/smollm2"
    assert out.rollout.over_sampling_batch_size == 4
    assert out.train.global_batch_size == 16
    assert out.algorithm.eps_clip_high == 0.1
    assert out.weights.method == "tensor"
    assert resolve(out) == out
    validate(out, check_files=False)


def test_explicit_values_survive_resolve():
    cfg = load_and_check(None, ["model.create=tiny-qwen2", "rollout.over_sampling_batch_size=12",
                                "algorithm.eps_clip_high=0.28", "weights.method=disk"])
    assert (cfg.rollout.over_sampling_batch_size, cfg.algorithm.eps_clip_high, cfg.weights.method) == (
        12, 0.28, "disk")


def test_resolved_round_trip(tmp_path):
    cfg = load_and_check(REPO / "configs" / "quickstart.yaml", [
           "sglang.enable_memory_saver=true", "slurm.extra_sbatch=['--comment=a: b #c']", "run.name=1e5",
           "slurm.setup=['module load x']", 'rollout.stop=["\\n", "12:30", "null", "yes"]',
           "data.task_kwargs={digits: 3, few_shot: 2}", "sweep.grid.train.lr=[1.0e-5, 2.0e-5]",
           "sweep.grid.run.mode=[sync]", "sft.target_accuracy=0.95"])
    path = save_resolved(cfg, tmp_path / "runs" / "x")
    assert path == tmp_path / "runs" / "x" / "config.yaml"
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]  # no temp file left behind
    back = load_and_check(path)
    assert back == cfg
    assert yaml.safe_load(path.read_text())["rollout"]["batch_size"] == 16
    assert config_to_dict(back) == config_to_dict(cfg)


def test_save_resolved_resolves_and_overwrites(tmp_path):
    cfg = Config()
    cfg.model.create = "tiny-qwen2"
    save_resolved(cfg, tmp_path)
    cfg.run.name = "second"
    path = save_resolved(cfg, tmp_path)
    back = load_and_check(path)
    assert back.run.name == "second" and back.train.global_batch_size == 64
    assert back == resolve(cfg)


def test_config_to_dict_is_a_deep_copy():
    cfg = Config()
    d = config_to_dict(cfg)
    d["rollout"]["stop"].append("x")
    d["sglang"]["a"] = 1
    assert cfg.rollout.stop == [] and cfg.sglang == {}
    assert d["weights"]["bucket_bytes"] == 512 * MIB


def test_expert_parallel_size_is_checked_against_an_existing_model_folder(tmp_path):
    """The expert count and top-k come from the folder's config.json on the login node (no transformers)."""
    folder = model_folder(tmp_path / "moe", {"model_type": "qwen3_moe", "num_experts": 4,
                                             "num_experts_per_tok": 6})
    with pytest.raises(ConfigError) as e:
        load_and_check(None, [f"model.path={folder}"])
    assert "num_experts_per_tok=6 of only 4 experts" in assert_one_line(e.value, "model.path")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4,
                                                    "num_experts_per_tok": 2}))
    with pytest.raises(ConfigError) as e:
        load_and_check(None, [f"model.path={folder}", "train.expert_parallel_size=3", "train.nprocs=3"])
    assert "must divide the model's 4 experts" in assert_one_line(e.value, "train.expert_parallel_size")
    cfg = load_and_check(None, [f"model.path={folder}", "train.expert_parallel_size=2", "train.nprocs=2"])
    assert cfg.train.expert_parallel_size == 2
    # megatron-core trains MoE under TP only with sequence parallelism: on by default at TP > 1
    cfg = load_and_check(None, [f"model.path={folder}", "train.tensor_parallel_size=2", "train.nprocs=2"])
    assert cfg.train.sequence_parallel is None and sequence_parallel(cfg.train)
    with pytest.raises(ConfigError) as e:
        load_and_check(None, [f"model.path={folder}", "train.tensor_parallel_size=2", "train.nprocs=2",
                              "train.sequence_parallel=false"])
    assert "only with sequence parallelism" in assert_one_line(e.value, "train.sequence_parallel")
    for create in ("tiny-glm4-moe", "tiny-deepseek-v3"):  # known before the folder exists
        with pytest.raises(ConfigError) as e:
            load_and_check(None, [f"model.path={tmp_path / create}", f"model.create={create}",
                                     "train.tensor_parallel_size=2", "train.nprocs=2",
                                     "train.sequence_parallel=false"])
        assert "mixture-of-experts" in assert_one_line(e.value, "train.sequence_parallel")


def test_sequence_parallel_is_on_at_tp_above_1_and_megatron_parallel_keys_are_refused():
    """``train.sequence_parallel`` null means on at TP > 1 (slime's scripts all pass --sequence-parallel with
    TP > 1) and never at TP=1; the ``megatron:`` section cannot set what hpcrl's own parallel keys set."""
    from types import SimpleNamespace as NS

    assert not sequence_parallel(NS(tensor_parallel_size=1, sequence_parallel=None))
    assert not sequence_parallel(NS(tensor_parallel_size=1, sequence_parallel=True))
    assert sequence_parallel(NS(tensor_parallel_size=2, sequence_parallel=None))
    assert not sequence_parallel(NS(tensor_parallel_size=2, sequence_parallel=False))
    assert sequence_parallel(NS(tensor_parallel_size=8))  # a section without the key: the default
    for key, own in (("sequence_parallel", "train.sequence_parallel"),
                     ("tensor_model_parallel_size", "train.tensor_parallel_size"),
                     ("expert_model_parallel_size", "train.expert_parallel_size")):
        with pytest.raises(ConfigError) as e:
            load_and_check(None, ["model.create=tiny-qwen2", f"megatron.{key}=2"])
        assert f"set {own} instead" in assert_one_line(e.value, f"megatron.{key}")


def test_tensor_parallel_size_must_divide_the_heads(tmp_path):
    """Whole heads and query groups per TP rank, read from config.json or the tiny_* keys before creation."""
    folder = model_folder(tmp_path / "dense", {"model_type": "qwen2", "num_attention_heads": 6,
                                               "num_key_value_heads": 2})
    with pytest.raises(ConfigError) as e:
        load_and_check(None, [f"model.path={folder}", "train.tensor_parallel_size=4", "train.nprocs=4"])
    assert "num_attention_heads=6" in assert_one_line(e.value, "train.tensor_parallel_size")
    with pytest.raises(ConfigError) as e:
        load_and_check(None, [f"model.path={folder}", "train.tensor_parallel_size=3", "train.nprocs=3"])
    assert "num_key_value_heads=2" in assert_one_line(e.value, "train.tensor_parallel_size")
    assert load_and_check(None, [f"model.path={folder}", "train.tensor_parallel_size=2",
                                 "train.nprocs=2"]).train.tensor_parallel_size == 2
    with pytest.raises(ConfigError) as e:  # before the tiny model exists
        load_and_check(None, [f"model.path={tmp_path / 'tiny'}", "model.create=tiny-qwen2",
                              "model.tiny_num_heads=4", "model.tiny_num_kv_heads=2",
                              "train.tensor_parallel_size=4", "train.nprocs=4"])
    assert "num_key_value_heads=2" in assert_one_line(e.value, "train.tensor_parallel_size")


def test_moe_quickstart_values():
    """The MoE quickstart: the tiny MoE, GSPO, experts over 2 trainer processes (issue #15 point 4)."""
    cfg = load_and_check(REPO / "configs" / "moe-quickstart.yaml")
    assert (cfg.model.create, cfg.train.expert_parallel_size, cfg.train.nprocs) == ("tiny-qwen3-moe", 2, 2)
    assert (cfg.algorithm.advantage_estimator, cfg.rollout.router) == ("gspo", False)
    replayed = load_and_check(REPO / "configs" / "moe-quickstart.yaml", ["algorithm.routing_replay=true"])
    assert replayed.algorithm.routing_replay


def test_environment_checks_run_only_with_the_environment_in_the_same_order(tmp_path):
    """Config imports no plug-in loader or model reader: ``hpcrl.config.load_config`` without an ``env`` skips
    the checks that need one, ``hpcrl.validate.load_and_check`` (what every command uses) runs them, and an
    error the config finds on its own still comes first in the order validate checks."""
    from hpcrl.validate import ENVIRONMENT

    bad_plugin = ["model.create=tiny-qwen2", "rollout.reward_function=os.no_such_function"]
    assert load_config(None, bad_plugin).rollout.reward_function == "os.no_such_function"
    with pytest.raises(ConfigError) as e:
        load_and_check(None, bad_plugin)
    assert "has no attribute 'no_such_function'" in assert_one_line(e.value, "rollout.reward_function")
    with pytest.raises(ConfigError) as e:  # the model section is checked before the rollout's plug-ins
        load_config(None, [*bad_plugin, "model.tiny_num_heads=3"], env=ENVIRONMENT)
    assert e.value.field == "model.tiny_num_heads"
