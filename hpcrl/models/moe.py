"""HF mixture-of-experts naming: transformers 5's fused in-memory experts and the checkpoints' per-expert names.

transformers 5 keeps a Qwen3-MoE layer's experts as two stacked parameters, while checkpoints, SGLang, weight
sync and hpcrl's Megatron bridge use one name per expert and projection:

=============================================  ===============================================================
in memory (``model.state_dict()``)             checkpoint / SGLang / weight sync
=============================================  ===============================================================
``mlp.experts.gate_up_proj`` ``[E, 2I, H]``    ``mlp.experts.{e}.gate_proj.weight`` ``[I, H]`` (rows ``:I``),
                                               ``mlp.experts.{e}.up_proj.weight`` ``[I, H]`` (rows ``I:``)
``mlp.experts.down_proj`` ``[E, H, I]``        ``mlp.experts.{e}.down_proj.weight`` ``[H, I]``
=============================================  ===============================================================

(``model.layers.{i}.`` prefix; ``E`` experts, ``I`` = ``moe_intermediate_size``, ``H`` = ``hidden_size``.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_FUSED_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def unfuse_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An HF state dict with transformers 5's fused run-time experts in checkpoint (per-expert) names.

    transformers 5 keeps a MoE layer's experts as ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first)
    and ``mlp.experts.down_proj [E, H, I]`` in memory, while checkpoints, SGLang and hpcrl.train.bridge name them
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (``[I, H]``, ``[I, H]``, ``[H, I]``). Other tensors pass
    through; the expert tensors are views of the fused ones.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _FUSED_EXPERTS_RE.match(name)
        if not m:
            out[name] = tensor
            continue
        for e, t in enumerate(tensor):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.{e}.down_proj.weight"] = t
            else:
                gate, up = t.chunk(2, dim=0)
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = gate
                out[f"{m.group(1)}.{e}.up_proj.weight"] = up
    return out


def fuse_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`unfuse_experts`: per-expert names to transformers 5's fused ``gate_up_proj`` /
    ``down_proj`` (experts stacked in index order). Raises KeyError when an expert index or one of an expert's
    three tensors is missing."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    pattern = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    for name, tensor in state.items():
        m = pattern.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensor
        else:
            out[name] = tensor
    for prefix, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise KeyError(f"{prefix}: experts {sorted(by_index)} are not 0..{len(by_index) - 1}")
        ordered = [by_index[e] for e in range(len(by_index))]
        for e, parts in enumerate(ordered):
            if len(parts) != 3:
                raise KeyError(f"{prefix}.{e}: the experts' tensors lack "
                               f"{sorted({'gate_proj', 'up_proj', 'down_proj'} - set(parts))}")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([t["gate_proj"], t["up_proj"]]) for t in ordered])
        out[f"{prefix}.down_proj"] = torch.stack([t["down_proj"] for t in ordered])
    return out


# Mixtral's checkpoint naming (released checkpoints, transformers 5's ``save_pretrained``, SGLang's
# ``MixtralForCausalLM`` loader) beside the canonical per-expert names above, which transformers 5 keeps in
# memory after its ``conversion_mapping`` rename ``.block_sparse_moe.`` -> ``.mlp.`` and w1/w3 -> gate/up:
#   ``block_sparse_moe.gate.weight``             <-> ``mlp.gate.weight`` (the router, ``[E, H]``)
#   ``block_sparse_moe.experts.{e}.w1.weight``   <-> ``mlp.experts.{e}.gate_proj.weight``
#   ``block_sparse_moe.experts.{e}.w3.weight``   <-> ``mlp.experts.{e}.up_proj.weight``
#   ``block_sparse_moe.experts.{e}.w2.weight``   <-> ``mlp.experts.{e}.down_proj.weight``
_MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_CANONICAL_MOE_RE = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.\d+\.(\w+)\.weight)$")
_MIXTRAL_MOE_RE = re.compile(
    r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate\.weight|experts\.\d+\.(w[123])\.weight)$")


def to_mixtral_name(name: str) -> str:
    """A canonical MoE name (``model.layers.{i}.mlp.gate.weight``,
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``) in Mixtral's checkpoint naming
    (``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{e}.w{1,3,2}.weight``); others unchanged."""
    m = _CANONICAL_MOE_RE.match(name)
    if not m or (m.group(3) is not None and m.group(3) not in _MIXTRAL_PROJ):
        return name
    rest = m.group(2) if m.group(3) is None else m.group(2).replace(m.group(3), _MIXTRAL_PROJ[m.group(3)])
    return f"{m.group(1)}.block_sparse_moe.{rest}"


def from_mixtral_name(name: str) -> str:
    """Inverse of :func:`to_mixtral_name`: Mixtral's checkpoint name to the canonical one; others
    unchanged."""
    m = _MIXTRAL_MOE_RE.match(name)
    if not m:
        return name
    back = {v: k for k, v in _MIXTRAL_PROJ.items()}
    rest = m.group(2) if m.group(3) is None else m.group(2).replace(m.group(3), back[m.group(3)])
    return f"{m.group(1)}.mlp.{rest}"


class RenamedWeights(Mapping[str, torch.Tensor]):
    """A read-only view of a name -> tensor mapping under other names: ``rename(name)`` is the new name of
    each key (e.g. :func:`from_mixtral_name`); values are read from ``state`` on access (lazy mappings stay
    lazy). Raises ValueError when two keys get the same name."""

    def __init__(self, state: Mapping[str, torch.Tensor], rename):
        self._state = state
        self._source: dict[str, str] = {}
        for key in state:
            new = rename(key)
            if new in self._source:
                raise ValueError(f"HF tensors {self._source[new]!r} and {key!r} are both {new!r}")
            self._source[new] = key

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._state[self._source[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._source

    def __iter__(self):
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)
