"""Pack a stream of ``(name, tensor)`` into buckets of at most ``bucket_bytes`` bytes (slime's
``--update-weight-buffer-size`` chunks).

The stream is consumed lazily, so at most one bucket plus one tensor are held at a time (the trainer's export
all-gathers each tensor as it is asked for). A tensor larger than a bucket travels alone. Each bucket comes
with an ``is_last`` flag, known without reading ahead more than one tensor, so that the last transfer call
can carry the new ``weight_version`` (as slime does).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


def tensor_nbytes(tensor: Any) -> int:
    """Bytes of a tensor's data: ``numel * element_size`` (views count their own elements only)."""
    return int(tensor.numel()) * int(tensor.element_size())


@dataclass
class Bucket:
    """One transfer unit: tensors in stream order, their total bytes, its position, whether it is the last."""

    tensors: list[tuple[str, Any]] = field(default_factory=list)
    nbytes: int = 0
    index: int = 0
    is_last: bool = False

    def __len__(self) -> int:
        return len(self.tensors)


def iter_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[Bucket]:
    """Yield :class:`Bucket` s of consecutive tensors, each of at most ``bucket_bytes`` bytes.

    Greedy: a tensor joins the current bucket if the bucket stays within ``bucket_bytes``, else the bucket is
    yielded and a new one starts; a tensor larger than ``bucket_bytes`` forms a bucket of its own. Order is
    preserved, no bucket is empty, and only the final bucket has ``is_last=True``. An empty stream yields
    nothing. Raises ValueError if ``bucket_bytes`` < 1 and TypeError if an item is not a ``(str, tensor)``
    pair.
    """
    if int(bucket_bytes) < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    current = Bucket()
    for item in named_tensors:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and hasattr(item[1], "element_size")):
            raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        n = tensor_nbytes(tensor)
        if current.tensors and current.nbytes + n > bucket_bytes:
            yield current
            current = Bucket(index=current.index + 1)
        current.tensors.append((name, tensor))
        current.nbytes += n
    if current.tensors:
        current.is_last = True
        yield current
