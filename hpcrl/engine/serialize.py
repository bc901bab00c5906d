"""The ``/update_weights_from_tensor`` payload: SGLang's ``MultiprocessingSerializer`` format, for both sides.

A payload is the base64 text of ``multiprocessing.reduction.ForkingPickler`` bytes of ``list[(name, tensor)]``
(or, with ``load_format="flattened_bucket"``, of ``{"flattened_tensor": t, "metadata":
[FlattenedTensorMetadata]}``). The pickle carries no tensor data, only handles:

- CUDA tensors become CUDA-IPC handles (as in SGLang).
- CPU tensors are copied into shared memory with torch's ``file_system`` sharing strategy, so the payload
  carries shared-memory file names that any local process can open (the default ``file_descriptor``
  strategy would need a socket to the sender's resource sharer, which an unrelated server process cannot
  use).

**Lifetime rule.** The sender keeps the tensors it serialized alive until the HTTP call that carries the
payload has returned. This is required for CUDA IPC. On CPU, :func:`serialize_named_tensors` copies each
tensor into a fresh shared-memory block and takes an extra reference that the receiver drops when it opens the
block, so the block outlives the sender's copy; a payload that is never deserialized keeps its blocks until
torch's shared-memory manager exits with the last process that used it. Payloads are for one machine only
(shared memory, IPC).

The engine unpickles with an allow-list (torch's rebuild functions, storages, dtypes, sizes and the
flattened-bucket metadata), never arbitrary globals.

**Busy machines.** Opening a ``file_system`` block (the receiver) and sharing one (the sender's arena) ask the
sender's ``torch_shm_manager`` daemon, and torch gives its answer one second (libshm's ``poll``). On cores
loaded by other work the daemon can miss that ("Shared memory manager connection has timed out": a quickstart
warm start died so at a load average of 12), so both are retried (:data:`SHM_RETRY_SECONDS`). A retried open
is the same call again: the failed one neither cached the block nor dropped its reference.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
import sys
import threading
import time
from typing import Any, Callable, TypeVar

import torch

_STRATEGY_LOCK = threading.Lock()
_T = TypeVar("_T")

SHM_RETRY_SECONDS = (0.2, 0.5, 1.0, 2.0, 4.0)
"""The waits (seconds) before each retry of a shared-memory open or share that torch's shared-memory manager
did not answer within its one second (module doc): six tries over ~13 s."""
SHM_TIMEOUT_MESSAGE = "Shared memory manager connection has timed out"


def retry_shm_timeouts(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)``, called again after each wait of :data:`SHM_RETRY_SECONDS` while it raises
    torch's shared-memory manager timeout (a RuntimeError with :data:`SHM_TIMEOUT_MESSAGE`); raises the last
    one, and any other error at once."""
    for wait in (*SHM_RETRY_SECONDS, None):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if wait is None or SHM_TIMEOUT_MESSAGE not in str(e):
                raise
            time.sleep(wait)
    raise AssertionError("unreachable")


def _rebuild_storage_filename(*args: Any, **kwargs: Any) -> Any:
    """torch's ``rebuild_storage_filename`` (the receiver's open of a ``file_system`` block), retried on the
    manager's timeout."""
    from torch.multiprocessing.reductions import rebuild_storage_filename

    return retry_shm_timeouts(rebuild_storage_filename, *args, **kwargs)


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Where one tensor lives in a flattened bucket (same fields as SGLang's ``FlattenedTensorMetadata``).

    ``start_idx``/``end_idx``/``numel`` count elements of the flattened tensor: bytes when it is ``uint8``
    (SGLang's multi-dtype buckets), elements of the tensor's own dtype otherwise (SGLang's older single-dtype
    buckets).
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"


def metadata_class() -> type:
    """The class a flattened bucket's metadata is pickled as: SGLang's own ``FlattenedTensorMetadata`` once
    :data:`SGLANG_METADATA_MODULE` is imported in this process (real SGLang unpickles no other class: its
    scheduler exits with ``Blocked unsafe global``; hpcrl's CPU engine takes both), else hpcrl's
    (:class:`FlattenedTensorMetadata`, the same fields). :func:`hpcrl.weights.sync.tensor_format_for` imports
    SGLang's module where the engines are SGLang."""
    module = sys.modules.get(SGLANG_METADATA_MODULE)
    return getattr(module, "FlattenedTensorMetadata", None) or FlattenedTensorMetadata


def _share(t: torch.Tensor) -> torch.Tensor:
    """Move CPU tensor ``t``'s storage into ``file_system`` shared memory (retried on the manager's timeout),
    so pickling it later only names the block."""
    import torch.multiprocessing as tmp

    with _STRATEGY_LOCK:
        old = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            retry_shm_timeouts(t.share_memory_)
        finally:
            tmp.set_sharing_strategy(old)
    return t


def _prepare(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type == "cpu":
        t = _share(t.clone(memory_format=torch.contiguous_format))
    return t


def _dumps(obj: Any) -> str:
    """ForkingPickler bytes of ``obj`` with the ``file_system`` strategy for CPU storages, base64 text."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    buf = io.BytesIO()
    with _STRATEGY_LOCK:
        old = tmp.get_sharing_strategy()
        tmp.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf).dump(obj)
        finally:
            tmp.set_sharing_strategy(old)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Serialize ``[(name, tensor), ...]`` for ``serialized_named_tensors`` (one entry per TP rank).

    Returns base64 text. CPU tensors are copied into shared memory (the originals are untouched); CUDA tensors
    are shared by IPC handle and must stay alive until the HTTP call returns (see the module's lifetime rule).
    Raises TypeError if an entry is not a ``(str, Tensor)`` pair.
    """
    return _dumps(_checked_pairs(named_tensors))


def serialize_tensor_dict(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Serialize tensors as one ``{name: tensor}`` dict: the default payload of SGLang's
    ``/load_lora_adapter_from_tensors`` (its ``serialized_named_tensors``, one per TP rank; the weight updates
    take a list of pairs, :func:`serialize_named_tensors`). Returns base64 text; shared memory as there. Raises
    TypeError as there."""
    return _dumps(dict(_checked_pairs(named_tensors)))


def _checked_pairs(named_tensors) -> list[tuple[str, torch.Tensor]]:
    """``named_tensors`` checked to be ``(str, Tensor)`` pairs, each tensor prepared for pickling (shared
    memory for CPU tensors). Raises TypeError naming the first bad entry's type."""
    prepared = []
    for item in named_tensors:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        prepared.append((item[0], _prepare(item[1])))
    return prepared


def serialize_flattened_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Serialize tensors as one flattened ``uint8`` bucket (``load_format="flattened_bucket"``).

    All tensors must be on one device. Returns base64 text of
    ``{"flattened_tensor": uint8 [total_bytes], "metadata": [FlattenedTensorMetadata, ...]}``.
    Raises ValueError on an empty list or mixed devices.
    """
    if not named_tensors:
        raise ValueError("cannot serialize an empty bucket")
    devices = {t.device for _, t in named_tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors of a bucket must be on one device, got {sorted(map(str, devices))}")
    parts, metadata, offset, meta_cls = [], [], 0, metadata_class()
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(flat)
        metadata.append(meta_cls(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                 end_idx=offset + flat.numel(), numel=flat.numel()))
        offset += flat.numel()
    flattened = torch.cat(parts)
    if flattened.device.type == "cpu":
        _share(flattened)
    return _dumps({"flattened_tensor": flattened, "metadata": metadata})


ALIGN_BYTES = 64
"""Each tensor of a :class:`StagingArena` starts at a multiple of this many bytes (any dtype's view fits, and
no two tensors share a cache line)."""


class StagingArena:
    """A sender's reusable shared-memory buffer for CPU tensor payloads: each bucket's tensors are copied into
    it (one copy, cast to a dtype on the way if asked) and sent as views of it, whose pickles carry the
    buffer's shared-memory name and an offset, not data.

    The buffer is allocated once (grown when a bucket needs more), shared with torch's ``file_system``
    strategy and touched at allocation, so a sync neither allocates nor takes page faults on the sender, and
    every receiver maps the same pages: one payload per receiving rank is one more pickle of a handle, not
    one more copy (:func:`serialize_named_tensors` and :func:`serialize_flattened_bucket` copy each bucket
    into fresh shared memory per receiver instead). The views are valid until the next :meth:`pack`; the
    sender must not pack again before every receiver has copied the last bucket out (the tensor path waits for
    every engine's answer). Not for CUDA tensors (those travel as IPC handles).
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # the old one's pages go before the new one's come
            # zeroed: its pages are touched here, not per sync
            self.buffer = _share(torch.zeros(nbytes, dtype=torch.uint8))
        return self.buffer

    def pack(self, named_tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
             ) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor, list[FlattenedTensorMetadata]]:
        """Copy ``named_tensors`` (CPU, any strides) into the buffer, cast to ``dtype`` when given, each at a
        multiple of :data:`ALIGN_BYTES`. Returns ``(views, flat, metadata)``: the ``(name, tensor)`` views in
        the buffer, the ``uint8`` span holding them all and its ``flattened_bucket`` metadata (byte offsets).
        Raises ValueError for a CUDA tensor."""
        sizes = []
        for name, t in named_tensors:
            if t.device.type != "cpu":
                raise ValueError(f"{name}: a staging arena holds CPU tensors, got {t.device}")
            sizes.append(int(t.numel()) * (dtype or t.dtype).itemsize)
        offsets, end = [], 0
        for n in sizes:
            offsets.append(end)
            end += -(-n // ALIGN_BYTES) * ALIGN_BYTES
        buf = self._reserve(max(end, ALIGN_BYTES))
        views, metadata, meta_cls = [], [], metadata_class()
        for (name, t), off, n in zip(named_tensors, offsets, sizes, strict=True):
            view = buf[off: off + n].view(dtype or t.dtype).view(t.shape)
            view.copy_(t.detach())
            views.append((name, view))
            metadata.append(meta_cls(name=name, shape=t.shape, dtype=view.dtype, start_idx=off, end_idx=off + n,
                                     numel=n))
        return views, buf[:end], metadata


def serialize_views(obj: Any) -> str:
    """Serialize a payload whose CPU tensors are views of a :class:`StagingArena` (``[(name, view), ...]``,
    or ``{"flattened_tensor": span, "metadata": [...]}``) without copying them: base64 text of their handles.
    Each call takes one reference on the shared memory that the receiver's deserialisation drops, so each
    receiving rank needs a call of its own (as for :func:`serialize_named_tensors`)."""
    return _dumps(obj)


_ALLOWED_TORCH_NAMES = {"Tensor", "Size", "device", "UntypedStorage", "TypedStorage"}
_METADATA_MODULES = {
    "hpcrl.engine.serialize",
    "sglang.srt.weight_sync.tensor_bucket",
    "sglang.srt.model_executor.model_runner",
}
_SAFE_BUILTINS = {"list", "tuple", "dict", "set", "frozenset", "int", "float", "bool", "str", "bytes",
                  "complex", "slice"}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals a tensor payload needs."""

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
        if module == "torch.multiprocessing.reductions" and name == "rebuild_storage_filename":
            return _rebuild_storage_filename
        if module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"):
            import torch.multiprocessing.reductions as red

            return getattr(red, name)
        if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
            return getattr(torch.storage, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if name in _ALLOWED_TORCH_NAMES or isinstance(obj, torch.dtype):
                return obj
        if module == "torch.nn.parameter" and name == "Parameter":
            return torch.nn.Parameter
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        if module == "builtins" and name in _SAFE_BUILTINS:
            import builtins

            return getattr(builtins, name)
        if module in _METADATA_MODULES and name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload")


def _loads(payload: str | bytes) -> Any:
    data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`serialize_named_tensors`: base64 text (or raw pickle bytes) to ``[(name, tensor),
    ...]``.

    The tensors map the sender's shared memory (or IPC handles); copy them before the sender frees them.
    Raises ValueError on a malformed payload (bad base64, a disallowed global, not a list of pairs).
    """
    try:
        obj = _loads(payload)
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot deserialize tensor payload: {e}") from e
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(it, (list, tuple)) and len(it) == 2 and isinstance(it[0], str)
            and isinstance(it[1], torch.Tensor) for it in obj):
        raise ValueError("tensor payload must be a list of (name, tensor) pairs")
    return [(name, t) for name, t in obj]


def deserialize_tensor_dict(payload: str | bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`serialize_tensor_dict` (SGLang's LoRA tensor payload): ``{name: tensor}``. Raises
    ValueError on a malformed payload or anything but a dict of tensors by name."""
    try:
        obj = _loads(payload)
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot deserialize tensor payload: {e}") from e
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in obj.items()):
        raise ValueError("the LoRA tensor payload must be a dict of tensors by name")
    return obj


def deserialize_flattened_bucket(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Decode a ``flattened_bucket`` payload (hpcrl's or SGLang's) into ``[(name, tensor), ...]`` views.

    Raises ValueError on a malformed payload or metadata that does not fit the flattened tensor.
    """
    try:
        obj = _loads(payload)
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot deserialize flattened bucket: {e}") from e
    if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
        raise ValueError("flattened bucket must be a dict with 'flattened_tensor' and 'metadata'")
    flat = obj["flattened_tensor"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D tensor")
    out = []
    for meta in obj["metadata"]:
        start, end, shape, dtype = int(meta.start_idx), int(meta.end_idx), tuple(meta.shape), meta.dtype
        if not (0 <= start <= end <= flat.numel()):
            raise ValueError(f"{meta.name}: slice [{start}, {end}) outside the bucket of {flat.numel()} "
                             "elements")
        piece = flat[start:end]
        if flat.dtype == torch.uint8 and dtype != torch.uint8:
            piece = piece.view(dtype)
        elif piece.dtype != dtype:
            piece = piece.to(dtype)
        out.append((meta.name, piece.reshape(shape)))
    return out
