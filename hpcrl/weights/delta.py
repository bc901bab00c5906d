"""Delta weight sync (``weights.delta: true``): send only the words of each tensor that changed since the last
sync, and apply them on the engine.

Why: one optimizer step leaves many words of a bf16 or fp8 model unchanged (its rounding absorbs small
updates: at lr 1e-6 most bf16 words stay put), so most of a full sync's bytes repeat what the engines hold
(veRL's ``delta_sharded``, NeMo-RL's sparse-delta refit, slime's delta mode). fp32 words almost all change
every step, and there a delta falls back to full tensors on its own.

**Encoding** (:func:`encode_tensor`, per tensor, decided from the count of changed words alone): the words are
the tensor's bit patterns (``int16`` for bf16, ``int32`` for fp32, ``uint8`` for fp8), compared exactly (a
NaN or a -0.0 is a word like any other, so the engine ends bitwise equal). Of three forms the smallest is sent:

- ``full``: the tensor itself (under its own name);
- ``index``: int32 (int64 past 2^31 words) indices of the changed words + their new words, ``k (4 + s)``
  bytes for ``k`` changed words of ``s`` bytes: the smallest when few words change;
- ``mask``: a bitmask of the changed words (``np.packbits``, 1 bit a word) + their new words,
  ``n / 8 + k s`` bytes for ``n`` words: the smallest from about 3% (bf16) of words changed up to about 94%.

An unchanged tensor is not sent. No compressor runs: compressing (zlib, zstd) goes at 0.2-1 GB/s a core, slower
than the copy it would save on a node, and the bitmask already takes what structure there is (which words
changed); the values of changed words are close to random bits. A form's pieces travel as tensors named
``<name>:hpcrl_delta_index`` / ``:hpcrl_delta_mask`` and ``<name>:hpcrl_delta_values`` beside the full ones,
so every transport (tensor buckets, a broadcast's names/dtypes/shapes, a safetensors folder) carries them
unchanged.

**Sender** (:class:`DeltaSender`, on the trainer's rank 0): keeps the last sent version of every tensor on
the host (one copy of the model in the sync's dtype), encodes against it, and moves it forward as it goes. A
sync that fails drops it (:meth:`DeltaSender.reset`): the next one is full. The syncer forces a full sync too
on fresh or restarted engines and every ``weights.full_every`` syncs (:class:`hpcrl.weights.sync.WeightSyncer`).

**Receiver** (:func:`load_delta`): the engines are told ``load_format = DELTA_LOADER`` on every sync of a
delta run, full ones included (the loader keeps its base from those). hpcrl's CPU engine runs the same loader
(:meth:`hpcrl.engine.weights.WeightLoader.load_delta`) on every transport. SGLang 0.5.23 takes a custom loader
only on ``/update_weights_from_tensor`` (its ``distributed`` and ``disk`` paths load full tensors), and only
one named at start: start it with
``--custom-weight-loader hpcrl.weights.delta.load_delta`` (``sglang: {custom_weight_loader:
[hpcrl.weights.delta.load_delta]}``, which hpcrl adds itself when ``weights.delta`` is on) and hpcrl must be
importable in the engine's Python. :func:`load_delta` keeps the full HF tensors it was last given on the
engine's device (one more copy of the model there: SGLang's own parameters are fused and sharded, so a
delta cannot be applied to them directly), applies each delta to that base and hands the rebuilt tensors to
``model.load_weights``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch

DELTA_LOADER = "hpcrl.weights.delta.load_delta"
"""The ``load_format`` of every update of a delta run, and the import path SGLang's
``--custom-weight-loader`` names."""

INDEX, MASK, VALUES = ":hpcrl_delta_index", ":hpcrl_delta_mask", ":hpcrl_delta_values"
"""Name suffixes of a delta's pieces."""

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A delta that does not fit what the receiver holds (no base, another shape or dtype, indices out of
    range); nothing was changed."""


def words(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a contiguous tensor as a flat integer tensor of its element size (a view)."""
    return t.reshape(-1).view(_WORD[t.element_size()])


def encode_tensor(name: str, new: torch.Tensor, base: torch.Tensor, scratch: Optional[torch.Tensor] = None
                  ) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """The pieces that turn ``base`` into ``new`` (both contiguous CPU tensors of one shape and dtype) and the
    count of changed words: ``[]`` when none changed, else the smallest of the full tensor, indices + values,
    or bitmask + values (module doc). ``base`` is moved to ``new`` (its changed words written). ``scratch``: a
    bool buffer of at least ``new.numel()`` elements to compare into (the sender reuses one: no fresh memory
    per tensor). Raises ValueError for another shape or dtype."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"{name}: {new.dtype}{list(new.shape)} against a base of {base.dtype}{list(base.shape)}")
    out = scratch[: new.numel()] if scratch is not None and scratch.numel() >= new.numel() else None
    changed = torch.ne(words(new), words(base), out=out).numpy()
    index = np.flatnonzero(changed)  # (numpy: torch's sum and nonzero of a bool tensor are 20-90x slower)
    k = int(index.size)
    if k == 0:
        return [], 0
    n, size = new.numel(), new.element_size()
    index_bytes = k * ((4 if n < 2 ** 31 else 8) + size)
    mask_bytes = (n + 7) // 8 + k * size
    if n * size <= min(index_bytes, mask_bytes):
        base.copy_(new)
        return [(name, new)], k
    at = torch.from_numpy(index)
    values = new.reshape(-1).index_select(0, at)
    words(base).index_copy_(0, at, words(values))
    if index_bytes <= mask_bytes:
        return [(name + INDEX, at.to(torch.int32 if n < 2 ** 31 else torch.int64)), (name + VALUES, values)], k
    return [(name + MASK, torch.from_numpy(np.packbits(changed))), (name + VALUES, values)], k


@dataclasses.dataclass
class DeltaStats:
    """What one sync's encoding saw: words compared and changed, bytes of the full tensors and bytes sent."""

    words: int = 0
    changed: int = 0
    full_bytes: int = 0
    sent_bytes: int = 0

    @property
    def density(self) -> float:
        """Share of words that changed (1.0 for a full sync, which compares nothing)."""
        return self.changed / self.words if self.words else 1.0


class DeltaSender:
    """The trainer's side of delta sync: the last version sent, and the encoder.

    ``dtype``: the dtype the engines hold (tensors are cast to it before they are compared, so a word counts
    as changed only if the engine's word would change); None: the tensors' own.
    """

    def __init__(self, dtype: Optional[torch.dtype] = None) -> None:
        self.dtype = dtype
        self.base: Optional[dict[str, torch.Tensor]] = None
        self.stats = DeltaStats()
        self._scratch = torch.zeros(0, dtype=torch.bool)

    @property
    def ready(self) -> bool:
        """Whether there is a base to encode against (False: the next sync must be full)."""
        return self.base is not None

    def reset(self) -> None:
        """Forget the base (a sync failed, or the engines changed): the next sync is full."""
        self.base = None

    def encode(self, named_tensors: Iterable[tuple[str, torch.Tensor]], full: bool
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """The pieces to send for ``named_tensors`` (HF names, full tensors, any device): every tensor whole
        when ``full`` (or without a base), else only what changed (:func:`encode_tensor`; when nothing did,
        the last tensor whole, so that the engines still take the update and its version); the base moves to
        the new version as the stream is consumed (a stream stopped early: :meth:`reset`). :attr:`stats`
        counts this sync."""
        base = {} if full or self.base is None else self.base
        self.base, self.stats = None, DeltaStats()
        last, sent = None, False
        for name, t in named_tensors:
            new = t.detach().to("cpu", self.dtype or t.dtype).contiguous()
            old = base.get(name)
            nbytes = new.numel() * new.element_size()
            self.stats.full_bytes += nbytes
            if old is None:
                base[name] = new.clone()
                pieces = [(name, base[name])]
                self.stats.changed += new.numel()
            else:
                if self._scratch.numel() < new.numel():
                    self._scratch = torch.zeros(new.numel(), dtype=torch.bool)
                pieces, k = encode_tensor(name, new, old, self._scratch)  # (moves the base)
                self.stats.changed += k
            self.stats.words += new.numel()
            self.stats.sent_bytes += sum(p.numel() * p.element_size() for _, p in pieces)
            sent, last = sent or bool(pieces), (name, base[name])
            yield from pieces
        if not sent and last is not None:  # nothing changed: one tensor whole, so the update still happens
            self.stats.sent_bytes += last[1].numel() * last[1].element_size()
            yield last
        self.base = base


# ----------------------------------------------------------------------------------------------- receiving


def piece_owner(wire: str) -> str:
    """The tensor a piece named ``wire`` belongs to (``x:hpcrl_delta_values`` -> ``x``; a full one: itself)."""
    return wire.split(":hpcrl_delta_", 1)[0]


def split_pieces(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Group a delta payload by tensor: ``{name: {"full" | "index" | "mask" | "values": tensor}}``. Raises
    DeltaError for a name twice, or an index / mask without values (or values without either)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    kinds = {INDEX: "index", MASK: "mask", VALUES: "values"}
    for wire, t in named_tensors:
        name = piece_owner(wire)
        kind = kinds.get(wire[len(name):], "full") if wire != name else "full"
        if wire != name and wire[len(name):] not in kinds:
            raise DeltaError(f"{wire}: not a delta piece name")
        parts = out.setdefault(name, {})
        if kind in parts:
            raise DeltaError(f"{name}: two {kind} pieces in one update")
        parts[kind] = t
    for name, parts in out.items():
        forms = [k for k in ("full", "index", "mask") if k in parts]
        if len(forms) != 1 or (forms[0] == "full") == ("values" in parts):
            raise DeltaError(f"{name}: a delta needs one of full / index + values / mask + values, got "
                             f"{sorted(parts)}")
    return out


def check_piece(name: str, parts: Mapping[str, torch.Tensor], target: torch.Tensor) -> None:
    """Raise DeltaError unless ``parts`` (:func:`split_pieces`) fits ``target`` (the base): a full tensor of its
    shape, or values of its dtype with as many indices (in range) or a mask of its length."""
    if "full" in parts:
        if tuple(parts["full"].shape) != tuple(target.shape):
            raise DeltaError(f"{name}: shape {list(parts['full'].shape)}, the engine has {list(target.shape)}")
        return
    values, n = parts["values"], target.numel()
    if values.dtype != target.dtype:
        raise DeltaError(f"{name}: a delta in {values.dtype} for a base in {target.dtype} (the sync's dtype "
                         "changed since the last full sync)")
    if "index" in parts:
        index = parts["index"]
        if index.numel() != values.numel() or (index.numel() and not 0 <= int(index.min()) <= int(index.max()) < n):
            raise DeltaError(f"{name}: {index.numel()} indices for {values.numel()} values of {n} words")
    else:
        mask = parts["mask"]
        if mask.dtype != torch.uint8 or mask.numel() != (n + 7) // 8:
            raise DeltaError(f"{name}: a mask of {mask.numel()} bytes for {n} words")


def apply_piece(parts: Mapping[str, torch.Tensor], target: torch.Tensor) -> None:
    """Apply one tensor's checked pieces (:func:`check_piece`) to ``target`` in place (bitwise)."""
    if "full" in parts:
        target.copy_(parts["full"])
        return
    dense = target if target.is_contiguous() else target.contiguous()
    if "index" in parts:
        at = parts["index"].to(dense.device).long()
    else:
        at = torch.from_numpy(np.flatnonzero(np.unpackbits(parts["mask"].cpu().numpy(), count=dense.numel())))
    words(dense).index_copy_(0, at.to(dense.device), words(parts["values"].to(dense.device)))
    if dense is not target:
        target.copy_(dense)


def load_delta(model: Any, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """The receiver of delta sync: SGLang's custom weight loader (``--custom-weight-loader
    hpcrl.weights.delta.load_delta``; ``load_format`` :data:`DELTA_LOADER` on ``/update_weights_from_tensor``)
    and what hpcrl's CPU engine runs on every update endpoint
    (:meth:`hpcrl.engine.weights.WeightLoader.load_delta`).

    Keeps on ``model`` (attribute ``_hpcrl_delta_base``) the full HF tensors it was last given, on their
    device and in the sync's dtype: a full piece is copied over its base, a delta is applied to it in place,
    bitwise; the bases then go to ``model.load_weights`` (SGLang's own, which fuses and shards them; the CPU
    engine's, which casts them to its parameters' dtype), so the parameters end as a full sync of the same
    tensors would leave them. Raises DeltaError (nothing changed) for a delta without a base (an engine the
    sender did not sync in full first) or one that does not fit it; a model with a ``check(names_shapes)``
    (the CPU engine's loader) refuses unknown names and shapes before anything changes too. A
    ``load_weights`` that fails halfway leaves the bases ahead of the model: the sync fails, and the sender's
    next one is full, which rewrites them.
    """
    bases: dict[str, torch.Tensor] = getattr(model, "_hpcrl_delta_base", None) or {}
    pieces = split_pieces(named_tensors)
    for name, parts in pieces.items():
        if "full" not in parts:
            if name not in bases:
                raise DeltaError(f"{name}: a delta but no full tensor before it (sync this engine in full)")
            check_piece(name, parts, bases[name])
    check = getattr(model, "check", None)
    if check is not None:
        check([(n, tuple((p.get("full") if "full" in p else bases[n]).shape)) for n, p in pieces.items()])
    with torch.no_grad():  # in place: a copy per tensor would cost fresh memory, and page faults, every sync
        for name, parts in pieces.items():
            full, base = parts.get("full"), bases.get(name)
            if full is None:
                apply_piece(parts, base)
            elif base is not None and base.shape == full.shape and base.dtype == full.dtype:
                base.copy_(full)
            else:
                bases[name] = full.clone()
    model._hpcrl_delta_base = bases
    model.load_weights([(name, bases[name]) for name in pieces])
