"""HF <-> megatron-core for the families of :data:`hpcrl.models.hf.SUPPORTED_MODEL_TYPES`: model, weight
load and export (the config half is :mod:`hpcrl.train.hf_config`; the table by family: docs/models.md).

Our own small mapping (no mbridge, measured against it: docs/architecture.md): one table from megatron-core
parameter names to HF names plus four
layout rules, written from megatron-core 0.16.1's ``GPTModel`` with the local layer spec
(``get_gpt_layer_local_spec``) and HF transformers' ``{Qwen2,Qwen3,Llama}ForCausalLM``.

Megatron parameter (``decoder.layers.{i}.`` prefix)   HF parameter (``model.layers.{i}.`` prefix)   layout
``embedding.word_embeddings.weight``                    ``model.embed_tokens.weight``                 vocab
``output_layer.weight`` (untied only)                   ``lm_head.weight``                            vocab
``decoder.final_layernorm.weight``                      ``model.norm.weight``                         replicated
``input_layernorm.weight``                              ``input_layernorm.weight``                    replicated
``self_attention.linear_qkv.weight`` / ``.bias``       ``self_attn.{q,k,v}_proj.weight`` / ``.bias`` qkv
``self_attention.{q,k}_layernorm.weight`` (Qwen3)       ``self_attn.{q,k}_norm.weight``               replicated
``self_attention.linear_proj.weight``                   ``self_attn.o_proj.weight``                   row
``pre_mlp_layernorm.weight``                            ``post_attention_layernorm.weight``           replicated
``mlp.linear_fc1.weight``                               ``mlp.{gate,up}_proj.weight``                 fc1
``mlp.linear_fc2.weight``                               ``mlp.down_proj.weight``                      row
``mlp.router.weight`` (MoE)                             ``mlp.gate.weight``                         replicated
``mlp.router.expert_bias`` (GLM-4.5, buffer)            ``mlp.gate.e_score_correction_bias``        replicated
``mlp.shared_experts.linear_fc1.weight`` (GLM-4.5)      ``mlp.shared_experts.{gate,up}_proj.weight``  fc1
``mlp.shared_experts.linear_fc2.weight`` (GLM-4.5)      ``mlp.shared_experts.down_proj.weight``       row
``mlp.experts.local_experts.{j}.linear_fc1/2.weight``   ``mlp.experts.{J}.{gate,up,down}_proj.weight`` fc1/row

With TransformerEngine layer specs the two layer norms are fused into the next linear and named
``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``; the table accepts
those names too.

Layouts, for tensor-parallel size ``tp`` and rank ``r`` (megatron-core's ``ColumnParallelLinear`` splits dim 0,
``RowParallelLinear`` dim 1, each rank holding a contiguous block):

- vocab: rows padded with zeros from the HF vocab to ``padded_vocab_size`` (a multiple of
  ``make_vocab_size_divisible_by * tp``, Megatron-LM's rule), then split on dim 0. Export strips the padding.
- row: split on dim 1.
- qkv: the fused weight is interleaved per query group g (``num_query_groups`` groups):
  ``[q heads of group g (heads/groups * head_dim rows); k_g (head_dim rows); v_g (head_dim rows)]`` for
  g = 0, 1, ...; then split on dim 0, so each rank holds whole groups.
- fc1: ``[gate; up]`` per rank: rank r holds ``[gate.chunk(tp)[r]; up.chunk(tp)[r]]``.

GLM-4.5 (``glm4_moe``): the first ``first_k_dense_replace`` layers' dense MLP has the dense names; the
router's expert bias is a buffer on both sides (:func:`named_tensors` adds it to the parameters), loaded and
exported like them. Multi-token-prediction layers of a checkpoint (``model.layers.{i}`` with
``i >= num_hidden_layers``, ``num_nextn_predict_layers`` > 0) are dropped (:func:`is_mtp_tensor`), as HF
transformers drops them: not loaded, not trained, not exported (an exported folder has no MTP layers; SGLang's
MTP speculative decoding needs them from the original checkpoint).

DeepSeek-V3 / GLM-lite (``deepseek_v3``, ``glm4_moe_lite``): multi-latent attention's names and layouts are
:data:`hpcrl.train.mla.LAYER_RULES` (laid over this table for an MLA model; layout ``column``: split on dim 0
like ``ColumnParallelLinear``), its layer spec :func:`hpcrl.train.mla_layers.layer_spec`.

Supported: RMSNorm, SwiGLU, RoPE (default, Llama-3 scaling with the standard low/high frequency factors,
GLM's partial RoPE, YaRN for MLA), GQA, Qwen2's and GLM's qkv bias, Qwen3's and GLM's q/k norm, tied or
untied embeddings, Qwen3-MoE / Mixtral softmax routers and GLM / DeepSeek sigmoid grouped routers with shared
experts; pipeline stages (each stage's layers named from 0 by megatron, from its offset in HF). Anything else
raises ``NotImplementedError`` naming the unsupported setting (the login node refuses the same first:
:func:`hpcrl.models.support.unsupported_feature`).
Mistral and Mixtral are Llama's table plus a sliding window (``hf_config.sliding_window``);
Mixtral's MoE names are read and written in its checkpoint naming (``block_sparse_moe.gate``,
``block_sparse_moe.experts.{e}.w1/w3/w2``: :func:`hpcrl.models.moe.to_mixtral_name`), and loaded from
transformers 5's in-memory names (``mlp.gate``, fused ``mlp.experts.gate_up_proj``) as well.
"""

from __future__ import annotations

import os
import re
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from hpcrl.models.moe import RenamedWeights, from_mixtral_name, to_mixtral_name, unfuse_experts
from hpcrl.train import mla, parallel
from hpcrl.models.support import SUPPORTED_MODEL_TYPES, weight_files  # the login node's, the same
from hpcrl.train.hf_config import (  # noqa: F401 (re-exported: callers know them as bridge.*)
    check_supported, head_dim, mcore_config_from_hf, moe_kwargs, num_experts, padded_vocab_size, rope_scaling,
    rope_theta, rotary_percent)

_LAYER_RULES = {
    # megatron suffix -> (HF suffixes, layout)
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv"),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "replicated"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
    "mlp.router.weight": (("mlp.gate.weight",), "replicated"),
    # GLM-4.5 / DeepSeek-V3: the router's expert bias (a buffer on both sides) and the shared experts
    "mlp.router.expert_bias": (("mlp.gate.e_score_correction_bias",), "replicated"),
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), "fc1"),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_experts.down_proj.weight",), "row"),
}
_EXPERT_RULES = {
    # megatron suffix of ``mlp.experts.local_experts.{j}.`` -> (HF suffixes of ``mlp.experts.{J}.``, layout)
    "linear_fc1.weight": (("gate_proj.weight", "up_proj.weight"), "fc1"),
    "linear_fc2.weight": (("down_proj.weight",), "row"),
}
_TOP_RULES = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "vocab"),
    "output_layer.weight": (("lm_head.weight",), "vocab"),
    "decoder.final_layernorm.weight": (("model.norm.weight",), "replicated"),
}
_MLA_LAYER_RULES = {**_LAYER_RULES, **mla.LAYER_RULES}  # multi-latent attention (hpcrl.train.mla)
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_EXPERT_HF_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The megatron-core tensors the bridge maps: every parameter but LoRA adapters' (the base model's weights:
    :mod:`hpcrl.train.lora` exports the adapters), then the routers' ``expert_bias`` buffers (GLM-4.5 /
    DeepSeek-V3's ``e_score_correction_bias``: state, but not trained by the optimizer)."""
    yield from ((name, p) for name, p in module.named_parameters() if not is_adapter_name(name))
    for name, buf in module.named_buffers():
        if name.endswith("mlp.router.expert_bias"):
            yield name, buf


def is_adapter_name(name: str) -> bool:
    """Whether a megatron-core parameter name is a LoRA adapter's (``....lora.lora_A.q_proj``,
    :mod:`hpcrl.train.lora`), which the bridge's table leaves to that module."""
    return ".lora.lora_" in name


def is_mtp_tensor(hf_name: str, hf_config: Any) -> bool:
    """Whether an HF tensor belongs to a multi-token-prediction layer: ``model.layers.{i}`` with ``i`` one of
    the ``num_nextn_predict_layers`` after the ``num_hidden_layers`` decoder layers (GLM-4.5, DeepSeek-V3). The
    bridge drops them, as HF transformers' ``Glm4MoeForCausalLM`` does: not loaded, trained or exported."""
    mtp_layers = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    m = _HF_LAYER_RE.match(hf_name)
    return bool(m) and hf_config.num_hidden_layers <= int(m.group(1)) < hf_config.num_hidden_layers + mtp_layers


def build_gpt_model(hf_config: Any, tp: Optional[int] = None, dtype: torch.dtype = torch.float32,
                    make_vocab_size_divisible_by: int = 128, **overrides: Any):
    """Build a randomly initialised megatron-core ``GPTModel`` shaped like ``hf_config`` (local layer spec).

    Model parallelism must be initialised (:func:`hpcrl.train.parallel.initialize_model_parallel`);
    ``tp`` defaults to its tensor-parallel size. The vocab is padded (:func:`padded_vocab_size`); the HF config
    is kept as ``model.hf_config``. ``overrides`` go to :func:`mcore_config_from_hf`. Load weights with
    :func:`load_hf_weights`. Under pipeline parallelism the model is this stage's: its share of the layers
    (:func:`hpcrl.train.parallel.stage_layers`), the embedding on the first stage, the final norm and output
    layer on the last (a tied model's last stage holds a copy of the embedding that megatron keeps equal to the
    first's).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from hpcrl.train import packed_attention

    if tp is None:
        tp = parallel_state.get_tensor_model_parallel_world_size()
    config = mcore_config_from_hf(hf_config, tp=tp, dtype=dtype,
                                  ep=parallel_state.get_expert_model_parallel_world_size(),
                                  etp=parallel_state.get_expert_tensor_parallel_world_size(),
                                  pp=parallel_state.get_pipeline_model_parallel_world_size(),
                                  cp=parallel_state.get_context_parallel_world_size(), **overrides)
    if config.moe_enable_routing_replay:
        from hpcrl.train import routing_replay

        routing_replay.reset()  # megatron keeps one replay instance per router in a class-level list
    scaling = None if config.multi_latent_attention else rope_scaling(hf_config)  # MLA: RoPE in its layers
    model = GPTModel(
        config=config,
        # the local spec with packed (THD) core attention beside megatron's padded one (hpcrl.train.packing)
        transformer_layer_spec=_decoder_spec(config),
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp, make_vocab_size_divisible_by),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),  # the embedding on the first stage
        post_process=parallel_state.is_pipeline_last_stage(),  # the final norm and output layer on the last
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=rotary_percent(hf_config),
        rotary_base=rope_theta(hf_config),
        rope_scaling=scaling is not None,
        rope_scaling_factor=scaling or 8.0,
    )
    mark_experts_for_expert_data_parallel(model)
    if torch.cuda.is_available():
        # Megatron's get_model does this too: the local spec's torch norms are built on the CPU even where the
        # linear layers are allocated on the GPU (seen on an H100: "weight is on cpu ... fused_rms_norm")
        model.cuda(torch.cuda.current_device())
    model.hf_config = hf_config
    return model


def mark_experts_for_expert_data_parallel(model: torch.nn.Module) -> None:
    """Tag the routed experts' parameters ``allreduce = False`` when expert-tensor parallelism differs from
    tensor parallelism, so megatron-core's DDP reduces their gradients over the expert-data-parallel group and
    its optimizer counts them with the expert groups.

    Why: megatron-core 0.16.1 tags expert parameters so only when ``expert_model_parallel_size > 1``
    (``tensor_parallel/layers.py`` ~829, ``moe/experts.py`` ~89); at EP=1 with ETP 1 under TP 2 (sequence-
    parallel, each rank routing its half of the tokens through whole experts) the experts' gradients were
    reduced over the dense data-parallel group, which does not hold the other TP rank, so each rank kept its
    own half (tests/integration/test_megatron_moe.py, ``tp2sp-etp1``). With EP > 1 or ETP = TP megatron's
    tags already say this; nothing changes then."""
    config = model.config
    if not config.num_moe_experts or config.expert_tensor_parallel_size == config.tensor_model_parallel_size:
        return
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False


def _decoder_spec(config: Any) -> Any:
    """The decoder's block spec: :func:`hpcrl.train.packed_attention.layer_spec` (or multi-latent attention's)
    for every layer, with dense layers among MoE ones where ``moe_layer_freq`` is a list with zeros (GLM-4.5's
    first-k dense layers), and the final norm of :mod:`hpcrl.train.norms`."""
    from hpcrl.train import deepseek_moe, packed_attention

    def layer(experts=None):  # multi-latent attention (DeepSeek-V3, GLM-lite): hpcrl.train.mla's layer
        if config.multi_latent_attention:
            from hpcrl.train import mla_layers

            return mla_layers.layer_spec(experts)
        return packed_attention.layer_spec(config.qk_layernorm, experts)

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from hpcrl.train.norms import SequenceParallelNorm

    spec = layer(config.num_moe_experts)
    if config.num_moe_experts and isinstance(config.moe_layer_freq, list) and 0 in config.moe_layer_freq:
        block = deepseek_moe.block_spec(config, layer(), spec)
    else:
        # a block of one layer kind, with the final norm of hpcrl.train.norms (megatron's default for a layer
        # spec is WrappedTorchNorm, which refuses sequence parallelism)
        block = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=SequenceParallelNorm)
    # this pipeline stage's layers (megatron's get_gpt_decoder_block_spec slices the same way; the block
    # numbers them from the stage's offset)
    first, count = parallel.stage_layers(config)
    return TransformerBlockSubmodules(layer_specs=block.layer_specs[first:first + count],
                                      layer_norm=block.layer_norm)


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Geometry:
    """What the layout rules need to know about one model and its tensor-parallel placement."""

    tp: int
    rank: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int  # HF (unpadded)
    padded_vocab_size: int
    ep: int = 1  # expert-parallel size and rank: rank r holds experts r * local_experts ... (r + 1) * local - 1
    ep_rank: int = 0
    local_experts: int = 0
    etp: int = 1  # expert tensor-parallel size and rank (the experts' fc1/fc2 split as the dense MLP's)
    etp_rank: int = 0
    mla: bool = False  # multi-latent attention: hpcrl.train.mla's names
    layer_offset: int = 0  # the global index of this pipeline stage's first decoder layer
    layer_count: Optional[int] = None  # the stage's decoder layers (None: all, no pipeline parallelism)
    first_stage: bool = True  # the pipeline stage holds the embedding
    last_stage: bool = True  # ... the final norm and output layer
    tied_head: bool = False  # a last pipeline stage's copy of the tied embedding (output_layer.weight)

    def for_experts(self) -> "_Geometry":
        """The same geometry with the expert tensor-parallel split in place of the dense one."""
        return dataclasses.replace(self, tp=self.etp, rank=self.etp_rank)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip ``DistributedDataParallel`` / ``Float16Module`` wrappers (their ``.module``) off a GPTModel."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def geometry(model: torch.nn.Module) -> _Geometry:
    """What the layout rules need to know of the bare GPTModel ``model`` on this rank (its heads, groups,
    vocab, and its place in the tensor-, expert- and pipeline-parallel groups, read from megatron-core's
    parallel state)."""
    from megatron.core import parallel_state

    cfg = model.config
    experts = cfg.num_moe_experts or 0
    ep = parallel_state.get_expert_model_parallel_world_size() if experts else 1
    return _Geometry(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        rank=parallel_state.get_tensor_model_parallel_rank(),
        num_heads=cfg.num_attention_heads,
        num_groups=cfg.num_query_groups or cfg.num_attention_heads,
        head_dim=cfg.kv_channels,
        vocab_size=model.hf_config.vocab_size,
        padded_vocab_size=model.vocab_size,
        ep=ep,
        ep_rank=parallel_state.get_expert_model_parallel_rank() if experts else 0,
        local_experts=experts // ep,
        etp=parallel_state.get_expert_tensor_parallel_world_size() if experts else 1,
        etp_rank=parallel_state.get_expert_tensor_parallel_rank() if experts else 0,
        mla=bool(getattr(cfg, "multi_latent_attention", False)),
        layer_offset=parallel.stage_layers(cfg)[0],
        layer_count=parallel.stage_layers(cfg)[1] if cfg.pipeline_model_parallel_size > 1 else None,
        first_stage=model.pre_process,
        last_stage=model.post_process,
        tied_head=bool(model.share_embeddings_and_output_weights and model.post_process and not model.pre_process),
    )


def on_other_stage(hf_name: str, g: _Geometry) -> bool:
    """Whether the HF tensor ``hf_name`` (``model.layers.{i}....``, the embedding, the final norm or head)
    lives on another pipeline stage than this rank's (geometry ``g``; False without pipelines)."""
    if g.layer_count is None:
        return False
    m = _HF_LAYER_RE.match(hf_name)
    if m:
        return not g.layer_offset <= int(m.group(1)) < g.layer_offset + g.layer_count
    if hf_name == "model.embed_tokens.weight":
        return not (g.first_stage or g.tied_head)
    if hf_name in ("model.norm.weight", "lm_head.weight"):
        return not g.last_stage
    return False


def _names(mcore_name: str, g: _Geometry, first_expert: int = 0) -> tuple[tuple[str, ...], str]:
    """HF names and layout of one of this rank's megatron-core tensors (:func:`_hf_names` at its pipeline
    stage's layer offset; a last stage's copy of a tied embedding is the HF embedding)."""
    if g.tied_head and mcore_name == "output_layer.weight":
        return _TOP_RULES["embedding.word_embeddings.weight"]
    return _hf_names(mcore_name, first_expert, g.mla, g.layer_offset)


def _hf_names(mcore_name: str, first_expert: int = 0, mla_names: bool = False, layer_offset: int = 0
              ) -> tuple[tuple[str, ...], str]:
    """HF names and layout for one megatron-core parameter name; KeyError if it has no HF counterpart.
    ``layer_offset``: the pipeline stage's first global layer (megatron names a stage's layers from 0).

    A routed expert's parameter (``mlp.experts.local_experts.{j}.``) maps to HF expert ``first_expert + j``
    (``first_expert``: the first expert of the EP rank that holds it); its layout is ``expert_fc1`` /
    ``expert_row``. ``mla_names``: a multi-latent-attention model's (:data:`hpcrl.train.mla.LAYER_RULES`)."""
    if mcore_name in _TOP_RULES:
        return _TOP_RULES[mcore_name]
    m = _LAYER_RE.match(mcore_name)
    rules = _MLA_LAYER_RULES if mla_names else _LAYER_RULES
    if m and m.group(2) in rules:
        hf, layout = rules[m.group(2)]
        return tuple(f"model.layers.{int(m.group(1)) + layer_offset}.{name}" for name in hf), layout
    e = _EXPERT_RE.match(m.group(2)) if m else None
    if e and e.group(2) in _EXPERT_RULES:
        hf, layout = _EXPERT_RULES[e.group(2)]
        index = first_expert + int(e.group(1))
        return (tuple(f"model.layers.{int(m.group(1)) + layer_offset}.mlp.experts.{index}.{name}" for name in hf),
                f"expert_{layout}")
    raise KeyError(f"no HF name for megatron-core parameter {mcore_name!r}")


def mcore_to_hf_names(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Map each megatron-core parameter name of ``model`` to the HF tensor name(s) it is built from (this
    rank's: a routed expert's names carry its global expert index)."""
    module = unwrap_model(model)
    g = geometry(module)
    rename = _checkpoint_name(module.hf_config)
    return {name: tuple(map(rename, _names(name, g, g.ep_rank * g.local_experts)[0]))
            for name, _ in named_tensors(module)}


def _checkpoint_name(hf_config: Any):
    """The family's checkpoint name of a canonical HF name (Mixtral: ``block_sparse_moe.*``,
    :func:`hpcrl.models.moe.to_mixtral_name`; other families: the name itself)."""
    return to_mixtral_name if getattr(hf_config, "model_type", None) == "mixtral" else str


def to_shard(layout: str, hf: list[torch.Tensor], g: _Geometry) -> torch.Tensor:
    """This rank's megatron-core tensor from the full HF tensor(s) ``hf`` (one per HF name of the rule, each
    [rows, ...]) in ``layout`` (the module docstring's layouts) for geometry ``g``. Made of differentiable
    tensor operations (cat, reshape, chunk): :mod:`hpcrl.train.lora` places activations with it too."""
    if layout.startswith("expert_"):
        return to_shard(layout.removeprefix("expert_"), hf, g.for_experts())
    if layout == "replicated":
        return hf[0]
    if layout == "vocab":
        full = hf[0]
        pad = full.new_zeros((g.padded_vocab_size - full.shape[0], *full.shape[1:]))
        return torch.cat([full, pad]).chunk(g.tp, dim=0)[g.rank]
    if layout == "row":
        return hf[0].chunk(g.tp, dim=1)[g.rank]
    if layout == "column":
        return hf[0].chunk(g.tp, dim=0)[g.rank]
    if layout == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(g.tp, dim=0)[g.rank], up.chunk(g.tp, dim=0)[g.rank]])
    if layout == "qkv":
        q, k, v = hf
        rest = q.shape[1:]
        per_group = g.num_heads // g.num_groups * g.head_dim
        fused = torch.cat([q.reshape(g.num_groups, per_group, *rest), k.reshape(g.num_groups, g.head_dim, *rest),
                           v.reshape(g.num_groups, g.head_dim, *rest)], dim=1)
        return fused.reshape(-1, *rest).chunk(g.tp, dim=0)[g.rank]
    raise AssertionError(layout)


def _from_shards(layout: str, shards: list[torch.Tensor], g: _Geometry, copy: bool = True) -> list[torch.Tensor]:
    """The full HF tensor(s) from every rank's megatron-core tensor (rank order). ``copy=False``: from one
    shard, views of it where the HF tensor is a contiguous part of it (all layouts but ``qkv``)."""
    if layout.startswith("expert_"):
        return _from_shards(layout.removeprefix("expert_"), shards, g.for_experts(), copy)
    if not copy and len(shards) == 1 and layout != "qkv":
        s = shards[0]
        return {"replicated": [s], "vocab": [s[: g.vocab_size]], "row": [s], "column": [s],
                "fc1": list(s.chunk(2, dim=0))}[layout]
    if layout == "replicated":
        return [shards[0].clone()]
    if layout == "vocab":
        return [torch.cat(shards)[: g.vocab_size].clone()]
    if layout == "row":
        return [torch.cat(shards, dim=1)]
    if layout == "column":
        return [torch.cat(shards)]
    if layout == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if layout == "qkv":
        full = shards[0] if len(shards) == 1 and not copy else torch.cat(shards)
        rest = full.shape[1:]
        per_group = g.num_heads // g.num_groups * g.head_dim
        q, k, v = full.reshape(g.num_groups, per_group + 2 * g.head_dim, *rest).split(
            [per_group, g.head_dim, g.head_dim], dim=1)
        out = [t.reshape(-1, *rest) for t in (q, k, v)]  # a copy unless the part is contiguous (one group)
        base = full.untyped_storage().data_ptr()
        return [t.clone() if copy and t.untyped_storage().data_ptr() == base else t for t in out]
    raise AssertionError(layout)


def read_hf_state_dict(path: Union[str, os.PathLike]) -> dict[str, torch.Tensor]:
    """Read every tensor of an HF folder's safetensors files (single or sharded with an index) on the CPU."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        state.update(load_file(str(f)))
    return state


class _LazyHFWeights(Mapping[str, torch.Tensor]):
    """An HF folder's safetensors as a read-on-access mapping (each rank reads only the tensors it loads)."""

    def __init__(self, path: Union[str, os.PathLike]):
        from safetensors import safe_open

        self._file: dict[str, Path] = {}
        for f in weight_files(path):
            with safe_open(str(f), framework="pt") as handle:
                self._file.update(dict.fromkeys(handle.keys(), f))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._file[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._file

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_weights: Union[str, os.PathLike, Mapping[str, torch.Tensor]],
                    ignore: tuple[str, ...] = ()) -> None:
    """Copy HF weights into a megatron-core GPTModel built by :func:`build_gpt_model` (this rank's shards).

    ``model`` may be wrapped in megatron-core DDP / Float16Module. ``hf_weights`` is an HF folder
    (safetensors) or a state dict of full HF tensors (``HFModel.state_dict()``; transformers 5's fused
    experts are read through :func:`unfuse_experts`). Values are copied in place
    (cast to the parameter dtype), so DDP grad/param buffers stay valid. Every HF tensor must be used, except
    ``lm_head.weight`` of a tied model, ``rotary_emb.inv_freq`` buffers and the HF names in ``ignore`` (a
    value model's ``lm_head.weight`` / ``score.weight``: :mod:`hpcrl.train.critic` loads its own head).
    Under pipeline parallelism each stage loads its own layers (global layer ``offset + i`` into its local
    layer ``i``), the first stage the embedding, the last the final norm and head (a tied model's head copy
    from ``model.embed_tokens.weight``), and the tensors of other stages count as used.
    Raises KeyError for a missing or unused HF tensor, ValueError for a shape mismatch.
    """
    module = unwrap_model(model)
    state = _LazyHFWeights(hf_weights) if isinstance(hf_weights, (str, os.PathLike)) else unfuse_experts(hf_weights)
    if getattr(module.hf_config, "model_type", None) == "mixtral":  # released names -> canonical ones
        state = RenamedWeights(state, from_mixtral_name)
    g = geometry(module)
    used = set()
    for name, param in named_tensors(module):
        hf_names, layout = _names(name, g, g.ep_rank * g.local_experts)
        missing = [n for n in hf_names if n not in state]
        if missing:
            raise KeyError(f"HF weights lack {missing} (for megatron-core {name})")
        shard = to_shard(layout, [state[n] for n in hf_names], g)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: HF {hf_names} give shape {tuple(shard.shape)}, the model has "
                             f"{tuple(param.shape)}")
        param.copy_(shard)
        used.update(hf_names)
    ignorable = set(ignore) | ({"lm_head.weight"} if module.share_embeddings_and_output_weights else set())
    unused = [n for n in state if n not in used and n not in ignorable and not n.endswith("rotary_emb.inv_freq")
              and not (g.ep > 1 and _EXPERT_HF_RE.match(n))  # other EP ranks' experts
              and not on_other_stage(n, g)  # other pipeline stages' layers, embedding, head
              and not is_mtp_tensor(n, module.hf_config)]
    if unused:
        raise KeyError(f"HF tensors with no megatron-core counterpart: {unused[:8]}"
                       + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))


@torch.no_grad()
def export_hf_weights(model: torch.nn.Module, dtype: Optional[torch.dtype] = None, copy: bool = True,
                      merge_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every HF tensor of the model, in megatron-core parameter order.

    Tensor-parallel shards are all-gathered over the TP group (a routed expert's over the expert-TP group),
    and a routed expert's tensors over the expert-parallel group (local expert j of EP rank r is HF expert
    ``r * local_experts + j``; the EP ranks' copies of j are yielded in rank order), so every rank yields the
    same full tensors (all ranks of the model-parallel group must iterate together: each tensor is a
    collective). Under pipeline parallelism the stages' tensors come stage after stage, each broadcast from
    its stage over the pipeline group (a header object, then the tensor: one tensor in memory at a time), so
    every stage yields the whole model too; the last stage's copy of a tied embedding is not yielded.
    Vocab padding is stripped; a tied model yields no ``lm_head.weight`` (as HF saves it).
    Tensors are fresh copies, on the parameters' device, cast to ``dtype`` if given; with ``copy=False`` a
    tensor that needs no gather nor reshuffle (without tensor or pipeline parallelism: all but the fused
    q/k/v) is a view of the parameter instead, valid until the parameter changes (a weight sync, which copies
    each tensor once before the next optimizer step). ``merge_adapters`` (default): an adapted linear's weight
    is yielded with its LoRA adapters merged in (base + ``delta_weight()`` of
    :class:`hpcrl.train.lora.LoraAdapter`: what PEFT's ``merge_and_unload`` gives: the model a LoRA run trained,
    for the weight sync to engines that serve no adapters and for ``hpcrl convert``); False: the base alone.
    """
    module = unwrap_model(model)
    g = geometry(module)
    yield from stages_in_turn(module, _stage_tensors(module, g, dtype, copy, merge_adapters))


def stages_in_turn(module: torch.nn.Module, own: Iterator[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every pipeline stage's ``(name, tensor)`` items on every stage: ``own`` is this stage's; the stages'
    items come stage after stage, each broadcast from its stage over the pipeline group (a header object, then
    the tensor: one tensor in memory at a time). ``own`` itself without pipeline parallelism. Every stage of
    the pipeline group must iterate together (each item is a collective); ``own`` is consumed on this stage's
    turn only."""
    g = geometry(module)
    if g.layer_count is None:
        yield from own
        return
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    me = parallel_state.get_pipeline_model_parallel_rank()
    for stage in range(dist.get_world_size(group)):
        src = dist.get_global_rank(group, stage)
        mine = own if stage == me else None
        while True:
            item = next(mine, None) if mine is not None else None
            header = [(item[0], item[1].shape, item[1].dtype) if item is not None else None]
            dist.broadcast_object_list(header, src=src, group=group)
            if header[0] is None:
                break
            name, shape, tensor_dtype = header[0]
            tensor = item[1].contiguous() if item is not None else torch.empty(
                shape, dtype=tensor_dtype, device=next(module.parameters()).device)
            dist.broadcast(tensor, src=src, group=group)
            yield name, tensor


def _stage_tensors(module: torch.nn.Module, g: _Geometry, dtype: Optional[torch.dtype], copy: bool,
                   merge_adapters: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`export_hf_weights` of this pipeline stage's tensors (the whole model without pipelines)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group() if g.tp > 1 else None
    rename = _checkpoint_name(module.hf_config)
    for name, param in named_tensors(module):
        if g.tied_head and name == "output_layer.weight":
            continue  # the first stage's embedding is the HF tensor
        hf_names, layout = _names(name, g)
        local = param.detach()
        adapter = getattr(module.get_submodule(name.rsplit(".", 1)[0]), "lora", None) if merge_adapters else None
        if adapter is not None and name.endswith(".weight"):
            local = local + adapter.delta_weight().to(local.dtype)
        if not layout.startswith("expert_"):
            yield from _gathered(tuple(map(rename, hf_names)), layout, local, g.tp, group, g, dtype, copy)
            continue
        etp_group = parallel_state.get_expert_tensor_parallel_group() if g.etp > 1 else None
        copies = [local]
        if g.ep > 1:
            copies = [torch.empty_like(local) for _ in range(g.ep)]
            dist.all_gather(copies, local.contiguous(), group=parallel_state.get_expert_model_parallel_group())
        for r, tensor in enumerate(copies):
            names = tuple(map(rename, _names(name, g, r * g.local_experts)[0]))
            yield from _gathered(names, layout, tensor, g.etp, etp_group, g, dtype, copy)


def _gathered(hf_names: tuple[str, ...], layout: str, local: torch.Tensor, size: int, group: Any, g: _Geometry,
              dtype: Optional[torch.dtype], copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of one parameter from its shards all-gathered over ``group`` (``size`` ranks;
    none gathered for a replicated layout or size 1)."""
    import torch.distributed as dist

    if size > 1 and layout != "replicated":
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local.contiguous(), group=group)
    else:
        shards = [local]
    for hf_name, tensor in zip(hf_names, _from_shards(layout, shards, g, copy)):
        yield hf_name, tensor if dtype is None else tensor.to(dtype)
