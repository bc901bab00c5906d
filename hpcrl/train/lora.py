"""LoRA adapters on megatron-core's linear layers (issue #56 point 1; Hu et al. 2021, "LoRA: Low-Rank Adaptation
of Large Language Models", in the parametrisation of HF PEFT's ``LoraLayer``).

For each PEFT target module of a decoder layer (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj``) the adapter holds ``lora_A`` [rank, in_features] and ``lora_B`` [out_features, rank]
with PEFT's initialisation (A: ``kaiming_uniform_(a=sqrt(5))``, B: zeros, so the adapted model starts equal to
its base) and adds ``scaling * B @ A @ dropout(x)`` to the module's output, ``scaling = alpha / rank``. The base
weights are frozen (``requires_grad=False``): megatron-core's DDP gives them no gradient buffer and its optimizer
no state, so only the adapters train.

megatron-core fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``. An adapter on a fused linear
keeps one A/B pair per PEFT module (its parameters are named ``<linear>.lora.lora_A.<peft name>``, so the pairs
map one to one onto PEFT's) and places each part's output where the fused layer has that part's rows: the
bridge's ``qkv`` layout (interleaved per query group) and ``fc1`` layout (``[gate; up]``), applied to the output's
last dimension (:func:`hpcrl.train.bridge._to_shard`).

What is done: dense families (Qwen2, Qwen3, Llama, Mistral) at tensor-, pipeline-, context- and expert-parallel
size 1; ``hpcrl validate`` refuses the rest for now (:func:`hpcrl.config.run.check_lora`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""PEFT's names of the dense families' linear modules, the values ``model.lora.target_modules`` takes."""

LINEARS = {
    # megatron-core linear (suffix of ``decoder.layers.{i}.``) -> (bridge layout, its PEFT modules, HF module)
    "self_attention.linear_qkv": ("qkv", ("q_proj", "k_proj", "v_proj"), "self_attn"),
    "self_attention.linear_proj": ("row", ("o_proj",), "self_attn"),
    "mlp.linear_fc1": ("fc1", ("gate_proj", "up_proj"), "mlp"),
    "mlp.linear_fc2": ("row", ("down_proj",), "mlp"),
}
"""Where each PEFT module lives in a megatron-core decoder layer (the bridge's table, ``hpcrl.train.bridge``)."""


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how (``model.lora`` of the run config): ``rank`` r (> 0), ``alpha`` (the output is
    scaled by ``alpha / rank``), ``dropout`` (on the adapter's input, as PEFT's ``lora_dropout``) and
    ``target_modules`` (PEFT names, :data:`PEFT_TARGETS`)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = PEFT_TARGETS

    @property
    def scaling(self) -> float:
        """``alpha / rank``: PEFT's ``scaling`` of a LoRA layer (without rsLoRA)."""
        return self.alpha / self.rank


class LoraAdapter(torch.nn.Module):
    """The adapters of one megatron-core linear: for each of its PEFT modules ``t`` (those in the spec's
    targets) ``lora_A[t]`` [rank, in_features] and ``lora_B[t]`` [out_features(t), rank].

    ``forward(x)``: ``x`` the linear's input [seq, batch, in_features] -> the adapters' contribution to its
    output [seq, batch, out_features of the fused linear], zeros where a part is not adapted."""

    def __init__(self, layout: str, parts: Sequence[str], part_sizes: Sequence[int], in_features: int,
                 spec: LoraSpec, geometry, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layout, self.parts, self.part_sizes, self.geometry = layout, tuple(parts), tuple(part_sizes), geometry
        self.scaling = spec.scaling
        adapted = [p for p in parts if p in spec.target_modules]
        self.lora_A = torch.nn.ParameterDict({
            p: torch.nn.Parameter(torch.empty(spec.rank, in_features, dtype=dtype, device=device))
            for p in adapted})
        self.lora_B = torch.nn.ParameterDict({
            p: torch.nn.Parameter(torch.zeros(size, spec.rank, dtype=dtype, device=device))
            for p, size in zip(parts, part_sizes) if p in spec.target_modules})
        for a in self.lora_A.values():
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's reset_lora_parameters
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from hpcrl.train.bridge import _to_shard

        x = self.dropout(x)
        outs = []
        for part, size in zip(self.parts, self.part_sizes):
            if part in self.lora_A:
                outs.append(torch.nn.functional.linear(
                    torch.nn.functional.linear(x, self.lora_A[part]), self.lora_B[part]) * self.scaling)
            else:
                outs.append(x.new_zeros(*x.shape[:-1], size))
        if len(outs) == 1:
            return outs[0]
        # the fused layer's rows of each part, applied to the output's last dimension
        return _to_shard(self.layout, [o.movedim(-1, 0) for o in outs], self.geometry).movedim(0, -1)


def _add_output(module: torch.nn.Module, args: tuple, output):
    """Forward hook of an adapted linear: its output plus its adapter's (megatron's linears return
    ``(output, bias)``)."""
    out, bias = output
    return out + module.lora(args[0]), bias


def add_lora(model: torch.nn.Module, spec: LoraSpec) -> list[str]:
    """Freeze every parameter of the megatron-core GPTModel ``model`` (built and loaded by
    :mod:`hpcrl.train.bridge`, not yet wrapped in DDP) and add a :class:`LoraAdapter` to each decoder linear that
    holds one of ``spec.target_modules`` (as ``<linear>.lora``, its output added by a forward hook). Returns the
    names of the adapters' parameters (``decoder.layers.{i}.<linear>.lora.lora_{A,B}.<peft name>``).
    Raises NotImplementedError for a layout not done yet (module docstring) and ValueError for an unknown
    target module."""
    from megatron.core import parallel_state

    from hpcrl.train import bridge

    unknown = sorted(set(spec.target_modules) - set(PEFT_TARGETS))
    if unknown:
        raise ValueError(f"model.lora.target_modules: {unknown} are not PEFT modules of the dense families; "
                         f"use some of {list(PEFT_TARGETS)}")
    sizes = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
             "pp": parallel_state.get_pipeline_model_parallel_world_size(),
             "cp": parallel_state.get_context_parallel_world_size()}
    if any(v > 1 for v in sizes.values()) or model.config.num_moe_experts or getattr(
            model.config, "multi_latent_attention", False):
        raise NotImplementedError(f"LoRA is done for dense models without model parallelism so far ({sizes}, "
                                  f"experts {model.config.num_moe_experts}): issue #56")
    g = bridge._geometry(model)
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for i, layer in enumerate(model.decoder.layers):
        for suffix, (layout, parts, _) in LINEARS.items():
            if not set(parts) & set(spec.target_modules):
                continue
            linear = layer.get_submodule(suffix)
            weight = linear.weight
            if layout == "qkv":
                q = g.num_heads * g.head_dim
                part_sizes = (q, g.num_groups * g.head_dim, g.num_groups * g.head_dim)
            elif layout == "fc1":
                part_sizes = (weight.shape[0] // 2,) * 2
            else:
                part_sizes = (weight.shape[0],)
            linear.lora = LoraAdapter(layout, parts, part_sizes, weight.shape[1], spec, g, weight.dtype,
                                      weight.device)
            linear.register_forward_hook(_add_output)
            names += [f"decoder.layers.{i}.{suffix}.lora.{n}" for n, _ in linear.lora.named_parameters()]
    return names


def is_lora_name(name: str) -> bool:
    """Whether a megatron-core parameter name is an adapter's (``....lora.lora_A.q_proj``)."""
    return ".lora.lora_" in name


def peft_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters of ``model`` (possibly wrapped) under PEFT's saved names
    (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ...: what ``adapter_model.safetensors``
    holds and ``peft.set_peft_model_state_dict`` loads), in layer order; the tensors are the parameters
    themselves (detach or clone to keep them)."""
    from hpcrl.train import bridge

    module = bridge.unwrap_model(model)
    offset = bridge._geometry(module).layer_offset
    for i, layer in enumerate(module.decoder.layers):
        for suffix, (_, _, hf_module) in LINEARS.items():
            adapter = getattr(layer.get_submodule(suffix), "lora", None)
            if adapter is None:
                continue
            for part in adapter.lora_A:
                base = f"base_model.model.model.layers.{offset + i}.{hf_module}.{part}"
                yield f"{base}.lora_A.weight", adapter.lora_A[part]
                yield f"{base}.lora_B.weight", adapter.lora_B[part]
