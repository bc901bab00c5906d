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
last dimension (:func:`hpcrl.train.bridge.to_shard`).

Checkpoints: a model with adapters saves them alone in the megatron distributed checkpoint (the frozen base is
the HF folder the model is built from: :func:`hpcrl.checkpoint.state.sharded_state_dict`) and their Adam state in
the optimizer's; the split ones are saved split (:func:`_with_split_adapters`), so a run resumes bitwise at TP=1
and TP=2 (tests/integration/test_checkpoint.py).

What is done: dense families (Qwen2, Qwen3, Llama, Mistral) at any tensor-parallel size, with or without
sequence parallelism, and over pipeline stages (each stage adapts its own layers, named from its offset);
context parallelism, MoE experts and multi-latent attention raise NotImplementedError for now (issue #56).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import torch

from hpcrl.config.lora import PEFT_TARGETS

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

    @classmethod
    def of(cls, section) -> Optional["LoraSpec"]:
        """The spec of a run config's ``model.lora`` (:class:`hpcrl.config.lora.LoraSection`), None for None."""
        if section is None:
            return None
        return cls(int(section.rank), float(section.alpha), float(section.dropout), tuple(section.target_modules))


class LoraAdapter(torch.nn.Module):
    """The adapters of one megatron-core linear: for each of its PEFT modules ``t`` (those in the spec's
    targets) ``lora_A[t]`` and ``lora_B[t]``, split over tensor-parallel ranks as Megatron-Bridge's
    ``ParallelLinearAdapter`` splits them:

    - on a column-parallel linear (``linear_qkv``, ``linear_fc1``; ``kind`` "column") ``lora_A[t]`` [rank, in]
      is whole on every rank and ``lora_B[t]`` holds this rank's rows of the part [out(t) / tp, rank] (the rows
      of the base weight's part this rank holds: its query groups, its chunk of gate and of up);
    - on a row-parallel linear (``linear_proj``, ``linear_fc2``; "row") ``lora_A[t]`` holds this rank's columns
      [rank, in / tp] and ``lora_B[t]`` [out, rank] is whole.

    ``forward(x)``: ``x`` the linear's input ([seq, batch, in], sequence-split [seq / tp, ...] into a
    column-parallel linear under sequence parallelism; [seq, batch, in / tp] into a row-parallel one) -> the
    adapters' part of the linear's output, in its layout (this rank's fused rows, or the whole output;
    sequence-split under sequence parallelism), zeros where a part is not adapted. The collectives make every
    adapter gradient whole on its rank, so no tensor-parallel reduction is added: a column-parallel adapter's
    ``A x`` passes megatron's ``copy_to_tensor_model_parallel_region`` (its gradient summed over the ranks'
    rows), a row-parallel one's ``A x`` is summed over ranks (``reduce_from_tensor_model_parallel_region``); a
    sequence-split input is gathered (its gradient split back), a row-parallel output scattered over the
    sequence (its gradient gathered)."""

    def __init__(self, kind: str, layout: str, parts: Sequence[str], part_sizes: Sequence[int],
                 in_features: int, spec: LoraSpec, geometry, sequence_parallel: bool, dtype: torch.dtype,
                 device: torch.device, seeds: Mapping[str, int]):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        g = geometry
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.kind, self.layout, self.parts = kind, layout, tuple(parts)
        self.local_sizes = tuple(size // g.tp if kind == "column" else size for size in part_sizes)
        self.sequence_parallel, self.scaling = sequence_parallel, spec.scaling
        # the fused layout of this rank's rows alone (its heads and groups; fc1's [gate; up] halves)
        self.local_geometry = dataclasses.replace(g, tp=1, rank=0, num_heads=g.num_heads // g.tp,
                                                  num_groups=g.num_groups // g.tp)
        self.in_local = in_features // g.tp if kind == "row" else in_features
        # which of A and B is split over tensor-parallel ranks, and along which dimension
        self.split, self.split_dim = ("B", 0) if kind == "column" else ("A", 1)
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for part, size in zip(parts, part_sizes):
            if part not in spec.target_modules:
                continue
            whole = {"A": initial_a(spec.rank, in_features, seeds[part]).to(dtype=dtype, device=device),
                     "B": torch.zeros(size, spec.rank, dtype=dtype, device=device)}
            params = {k: torch.nn.Parameter(self.part_of(v, g.tp, g.rank) if k == self.split else v)
                      for k, v in whole.items()}
            set_tensor_model_parallel_attributes(params[self.split], True, self.split_dim, 1)
            self.lora_A[part], self.lora_B[part] = params["A"], params["B"]
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else torch.nn.Identity()
        self.enabled = True
        """False: the linear's output is its base's alone (:func:`adapters_disabled`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region, scatter_to_sequence_parallel_region)

        from hpcrl.train.bridge import to_shard

        linear, group = torch.nn.functional.linear, self.tp_group
        if self.kind == "column":
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)
            x = self.dropout(x)
            outs = [linear(copy_to_tensor_model_parallel_region(linear(x, self.lora_A[part]), group=group),
                           self.lora_B[part]) * self.scaling if part in self.lora_A
                    else x.new_zeros(*x.shape[:-1], size) for part, size in zip(self.parts, self.local_sizes)]
            if len(outs) == 1:
                return outs[0]
            # the fused layer's rows of each part, applied to the output's last dimension
            return to_shard(self.layout, [o.movedim(-1, 0) for o in outs], self.local_geometry).movedim(0, -1)
        (part,) = self.parts
        x = self.dropout(x)
        y = linear(reduce_from_tensor_model_parallel_region(linear(x, self.lora_A[part]), group=group),
                   self.lora_B[part]) * self.scaling
        return scatter_to_sequence_parallel_region(y, group=group) if self.sequence_parallel else y

    def part_of(self, whole: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part (of ``tp``) of the whole split tensor (:attr:`split`), a copy."""
        return whole.chunk(tp, dim=self.split_dim)[rank].clone()

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """What merging the adapters into the base adds to the linear's weight on this rank (PEFT's
        ``get_delta_weight``): ``scaling * B @ A`` of each part in the weight's layout, [out / tp, in] on a
        column-parallel linear (zeros for a part not adapted), [out, in / tp] on a row-parallel one."""
        from hpcrl.train.bridge import to_shard

        ref = next(iter(self.lora_A.values()))
        parts = [self.lora_B[p] @ self.lora_A[p] * self.scaling if p in self.lora_A
                 else ref.new_zeros(size, self.in_local) for p, size in zip(self.parts, self.local_sizes)]
        return parts[0] if len(parts) == 1 else to_shard(self.layout, parts, self.local_geometry)


def initial_a(rank: int, in_features: int, seed: int) -> torch.Tensor:
    """A fresh whole ``lora_A`` [rank, in_features] (float32, CPU): PEFT's ``kaiming_uniform_(a=sqrt(5))``
    drawn from a generator of its own seeded with ``seed`` (:func:`adapter_seed`), so every tensor-parallel,
    pipeline and data-parallel layout starts from the same adapters, whatever the ranks drew before."""
    a = torch.empty(rank, in_features)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    return a


def adapter_seed(seed: int, layer: int, part: str) -> int:
    """The seed of the ``lora_A`` of PEFT module ``part`` in global decoder layer ``layer``, from the run's
    ``seed``."""
    return zlib.crc32(f"{seed}:{layer}:{part}".encode())


def _add_output(module: torch.nn.Module, args: tuple, output):
    """Forward hook of an adapted linear: its output plus its adapter's (megatron's linears return
    ``(output, bias)``)."""
    if not module.lora.enabled:
        return output
    out, bias = output
    return out + module.lora(args[0]), bias


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Within it ``model`` (possibly wrapped) computes as its base, every adapter off: the reference policy of
    a LoRA run's KL (the base model, with no copy of its weights; PEFT's ``disable_adapter``)."""
    adapters = [a for _, a in _adapters(model)]
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(adapters, before):
            a.enabled = was


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` (possibly wrapped, any family) has LoRA adapters (:func:`add_lora`)."""
    return any(isinstance(m, LoraAdapter) for m in model.modules())


def _with_split_adapters(linear: torch.nn.Module):
    """``linear.sharded_state_dict`` (megatron's distributed checkpoint of the layer) with its adapters' split
    tensors marked split: megatron's own keeps the layer's weight and bias by its axis map and every other
    tensor of its state (the adapters, ``lora.lora_A.q_proj`` ...) as replicated, which for the split ones
    (``lora_B`` of a column-parallel linear, ``lora_A`` of a row-parallel one) would save rank 0's part for all
    ranks. The whole ones stay replicated; a checkpoint loads at another tensor-parallel size, as the weights."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    own = linear.sharded_state_dict
    adapter: LoraAdapter = linear.lora

    def sharded_state_dict(prefix: str = "", sharded_offsets=(), metadata=None):
        out = own(prefix, sharded_offsets, metadata)
        split = {f"lora.lora_{adapter.split}.{part}": t
                 for part, t in getattr(adapter, f"lora_{adapter.split}").items()}
        out.update(make_sharded_tensors_for_checkpoint(
            split, prefix, dict.fromkeys(split, adapter.split_dim), sharded_offsets, tp_group=adapter.tp_group,
            dp_cp_group=metadata["dp_cp_group"]))
        return out

    return sharded_state_dict


def add_lora(model: torch.nn.Module, spec: LoraSpec, seed: int = 0) -> list[str]:
    """Freeze every parameter of the megatron-core GPTModel ``model`` (built and loaded by
    :mod:`hpcrl.train.bridge`, not yet wrapped in DDP) and add a :class:`LoraAdapter` to each decoder linear that
    holds one of ``spec.target_modules`` (as ``<linear>.lora``, its output added by a forward hook), its
    ``lora_A`` drawn from ``seed`` (:func:`initial_a`: the same adapters at every layout). Returns the names of
    the adapters' parameters (``decoder.layers.{i}.<linear>.lora.lora_{A,B}.<peft name>``).
    Raises NotImplementedError for a layout not done yet (module docstring) and ValueError for an unknown
    target module."""
    from megatron.core import parallel_state

    from hpcrl.train import bridge

    unknown = sorted(set(spec.target_modules) - set(PEFT_TARGETS))
    if unknown:
        raise ValueError(f"model.lora.target_modules: {unknown} are not PEFT modules of the dense families; "
                         f"use some of {list(PEFT_TARGETS)}")
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1 or model.config.num_moe_experts or getattr(model.config, "multi_latent_attention", False):
        raise NotImplementedError(f"LoRA is done for dense models at tensor and pipeline parallelism so far "
                                  f"(context-parallel size {cp}, experts {model.config.num_moe_experts}): "
                                  "issue #56")
    g = bridge.geometry(model)
    sp = bool(model.config.sequence_parallel)
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for i, layer in enumerate(model.decoder.layers):
        for suffix, (layout, parts, _) in LINEARS.items():
            if not set(parts) & set(spec.target_modules):
                continue
            linear = layer.get_submodule(suffix)
            out_local, in_local = linear.weight.shape
            if layout == "qkv":
                part_sizes = (g.num_heads * g.head_dim,) + (g.num_groups * g.head_dim,) * 2
            elif layout == "fc1":
                part_sizes = (out_local * g.tp // 2,) * 2
            else:  # row-parallel: the whole output, this rank's columns of the input
                part_sizes = (out_local,)
            kind = "row" if layout == "row" else "column"
            in_features = in_local * g.tp if kind == "row" else in_local
            linear.lora = LoraAdapter(kind, layout, parts, part_sizes, in_features, spec, g, sp,
                                      linear.weight.dtype, linear.weight.device,
                                      {part: adapter_seed(seed, g.layer_offset + i, part) for part in parts})
            linear.register_forward_hook(_add_output)
            linear.sharded_state_dict = _with_split_adapters(linear)
            names += [f"decoder.layers.{i}.{suffix}.lora.{n}" for n, _ in linear.lora.named_parameters()]
    return names


def _whole(adapter: LoraAdapter, which: str, part: str) -> torch.Tensor:
    """A copy of the whole ``lora_A`` / ``lora_B`` of ``part`` (gathered over tensor-parallel ranks where it is
    split: a collective, every rank of the group calls it), detached."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    t = getattr(adapter, f"lora_{which}")[part].detach().clone()  # megatron's gather at TP=1 returns its input
    if which != adapter.split:
        return t
    # megatron gathers along the last dimension
    return gather_from_tensor_model_parallel_region(t.movedim(adapter.split_dim, -1).contiguous(),
                                                    group=adapter.tp_group).movedim(-1, adapter.split_dim).contiguous()


def _adapters(model: torch.nn.Module) -> Iterator[tuple[str, LoraAdapter]]:
    """``(PEFT module prefix, adapter)`` of each adapted linear of ``model`` (possibly wrapped), in layer
    order: ``base_model.model.model.layers.{i}.self_attn`` ..."""
    from hpcrl.train import bridge

    module = bridge.unwrap_model(model)
    offset = bridge.geometry(module).layer_offset
    for i, layer in enumerate(module.decoder.layers):
        for suffix, (_, _, hf_module) in LINEARS.items():
            try:
                adapter = getattr(layer.get_submodule(suffix), "lora", None)
            except AttributeError:  # a MoE or multi-latent attention layer has not every dense linear
                continue
            if adapter is not None:
                yield f"base_model.model.model.layers.{offset + i}.{hf_module}", adapter


def peft_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters of ``model`` (possibly wrapped) under PEFT's saved names
    (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ...: what ``adapter_model.safetensors``
    holds and ``peft.set_peft_model_state_dict`` loads), whole, detached copies, in layer order: gathered over
    tensor-parallel ranks, and under pipeline parallelism every stage's on every stage
    (:func:`hpcrl.train.bridge.stages_in_turn`): every rank of the model-parallel group iterates together."""
    from hpcrl.train import bridge

    def own():
        for prefix, adapter in _adapters(model):
            for part in adapter.lora_A:
                yield f"{prefix}.{part}.lora_A.weight", _whole(adapter, "A", part)
                yield f"{prefix}.{part}.lora_B.weight", _whole(adapter, "B", part)

    yield from bridge.stages_in_turn(bridge.unwrap_model(model), own())


@torch.no_grad()
def load_peft_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy whole adapters in PEFT's names (:func:`peft_state_dict`'s) into ``model``'s, this rank's part of
    each (its tensor-parallel split, its pipeline stage's layers). Raises KeyError naming an adapter ``state``
    lacks or a tensor no adapter of any stage takes."""
    from hpcrl.train import bridge

    g = bridge.geometry(bridge.unwrap_model(model))
    used = set()
    for prefix, adapter in _adapters(model):
        for part in adapter.lora_A:
            for which in "AB":
                name = f"{prefix}.{part}.lora_{which}.weight"
                if name not in state:
                    raise KeyError(f"the adapter state lacks {name}")
                whole = state[name]
                getattr(adapter, f"lora_{which}")[part].copy_(
                    adapter.part_of(whole, g.tp, g.rank) if which == adapter.split else whole)
                used.add(name)
    unused = sorted(n for n in set(state) - used if not bridge.on_other_stage(n.removeprefix("base_model.model."), g))
    if unused:
        raise KeyError(f"no adapter of the model takes {unused[:4]}")


def peft_config(spec: LoraSpec, base_model: str = "") -> dict:
    """PEFT's ``adapter_config.json`` of adapters made by ``spec`` (what ``peft.PeftModel.from_pretrained`` and
    SGLang's LoRA loads read; ``base_model``: its ``base_model_name_or_path``)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": sorted(spec.target_modules), "bias": "none",
            "use_rslora": False, "fan_in_fan_out": False, "inference_mode": True,
            "base_model_name_or_path": base_model}


def write_peft_folder(model: torch.nn.Module, dest, spec: LoraSpec, base_model: str = "") -> dict:
    """Write ``model``'s adapters as a PEFT adapter folder at ``dest`` (``adapter_config.json`` +
    ``adapter_model.safetensors``: what ``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter``
    load), atomically (a temporary folder, then a rename; an existing ``dest`` is replaced). ``base_model``: the
    config's ``base_model_name_or_path``. Every rank of the model-parallel group must call it (the adapters are
    gathered whole, :func:`peft_state_dict`); the global rank 0 writes. Returns ``{"bytes", "tensors"}`` of the
    adapter file. Raises OSError on write errors (the temporary folder is removed)."""
    import torch.distributed as dist

    state = {k: v.cpu().contiguous() for k, v in peft_state_dict(model)}
    stats = {"bytes": sum(t.numel() * t.element_size() for t in state.values()), "tensors": len(state)}
    if dist.is_initialized() and dist.get_rank() != 0:
        return stats
    save_peft_folder(state, peft_config(spec, base_model), dest)
    return stats


def save_peft_folder(state: Mapping[str, torch.Tensor], config: Mapping, dest) -> None:
    """Write ``state`` (PEFT's saved names, contiguous CPU tensors) and ``config`` (``adapter_config.json``) as a
    PEFT adapter folder at ``dest``, atomically (a temporary folder, each file fsynced, then a rename; an existing
    ``dest`` is replaced). Raises OSError on write errors (the temporary folder is removed)."""
    import json

    from safetensors.torch import save_file

    from hpcrl.fsutil import atomic_folder, fsync_path

    with atomic_folder(dest) as tmp:
        save_file(dict(state), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        for f in tmp.iterdir():
            fsync_path(f)
