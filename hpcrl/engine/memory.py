"""Memory-saver adapter: release and resume engine memory by tag, the same calls on CPU and GPU.

SGLang frees GPU memory between rollouts with torch-memory-saver (``pause``/``resume`` of tagged regions:
weights, KV cache, CUDA graphs) so a colocated trainer can use it. On CPU there is nothing to free, so the
default adapter is a no-op; the engine still records which tags are released and refuses generation while
weights or KV cache are out, so the release -> update -> resume phase order is exercised by the same code
everywhere.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

logger = logging.getLogger(__name__)

TAG_WEIGHTS = "weights"
TAG_KV_CACHE = "kv_cache"
TAG_CUDA_GRAPH = "cuda_graph"
ALL_TAGS = (TAG_WEIGHTS, TAG_KV_CACHE, TAG_CUDA_GRAPH)
"""Memory tags in SGLang's order of release (weights first) and resume."""


class MemorySaver:
    """No-op adapter (CPU, or GPU without ``--enable-memory-saver``): regions are plain, pause/resume do
    nothing."""

    enabled = False

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        """Context manager under which allocations belong to ``tag`` (no-op here)."""
        yield

    def pause(self, tag: str) -> None:
        """Release the memory of ``tag`` (no-op here)."""

    def resume(self, tag: str) -> None:
        """Re-map the memory of ``tag`` (no-op here)."""


class TorchMemorySaver(MemorySaver):
    """GPU adapter over ``torch_memory_saver`` (imported lazily; needs CUDA and the preload library).

    Raises ImportError at construction if torch-memory-saver is not installed.
    """

    enabled = True

    def __init__(self) -> None:
        from torch_memory_saver import torch_memory_saver  # noqa: PLC0415 - GPU-only dependency

        self._tms = torch_memory_saver

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        with self._tms.region(tag=tag):
            yield

    def pause(self, tag: str) -> None:
        self._tms.pause(tag)

    def resume(self, tag: str) -> None:
        self._tms.resume(tag)


def create_memory_saver(enable: bool, device: str) -> MemorySaver:
    """The adapter for this process: :class:`TorchMemorySaver` if ``enable`` and ``device`` is CUDA, else
    no-op."""
    if enable and device.startswith("cuda"):
        return TorchMemorySaver()
    if enable:
        logger.info("--enable-memory-saver on %s: memory release is recorded only (no-op adapter)", device)
    return MemorySaver()


def normalize_tags(tags: list[str] | None) -> list[str]:
    """Validate ``tags`` (None or empty means all, as in SGLang) and return them in :data:`ALL_TAGS` order.

    Raises ValueError on an unknown tag or a non-list value.
    """
    if tags is None or tags == []:  # SGLang: null or empty means every tag
        return list(ALL_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError("tags must be a list of strings or null")
    unknown = sorted(set(tags) - set(ALL_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; known: {list(ALL_TAGS)}")
    return [t for t in ALL_TAGS if t in tags]
