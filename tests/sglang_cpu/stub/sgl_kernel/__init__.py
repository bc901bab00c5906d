"""Stand-in for ``sgl_kernel`` on a CPU-only machine (test infrastructure: tests/sglang_cpu/__init__.py).

PyPI's ``sgl-kernel`` / ``sglang-kernel`` wheels are CUDA-only. SGLang's CPU path imports ``*_cpu`` ops from it
at module level (e.g. ``copy_all_layer_kv_cache_cpu`` in ``sglang/kernels/ops/kvcache/cache_move.py``) but,
without Intel AMX kernels (``torch.ops.sgl_kernel.convert_weight_packed``, which nothing here registers), takes
plain-PyTorch paths and calls none of them. So every name of this module is a function that **raises** when
called, after appending its name to the file ``$HPCRL_SGL_KERNEL_CALLS`` (when set): the SGLang tier asserts that
file stays empty. Submodules do not exist: ``import sgl_kernel.scalar_type`` raises ImportError, which makes
SGLang use its own mock of it.

One exception, with a plain-torch body: :func:`assign_req_to_token_pool_cpu` (SGLang's scheduler calls it on
every batch on CPU; what it does is one slice assignment per request).
"""

from __future__ import annotations

import os

import torch


def _record(name: str) -> None:
    calls = os.environ.get("HPCRL_SGL_KERNEL_CALLS")
    if calls:
        with open(calls, "a") as f:
            f.write(name + "\n")


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len=None):
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` = request i's slice of
    ``out_cache_loc`` (the requests' slices lie one after another), as SGLang's Triton kernel
    ``assign_req_to_token_pool`` does (``sglang/srt/mem_cache/allocation.py``); ``pool_len`` is
    ``req_to_token.shape[1]``."""
    pos = 0
    for i in range(int(req_pool_indices.shape[0])):
        start, end = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[pos:pos + end - start].to(
            req_to_token.dtype)
        pos += end - start


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        _record(name)
        raise NotImplementedError(f"sgl_kernel.{name} was called: this CPU-only machine has no sgl_kernel "
                                  "(tests/sglang_cpu/stub/sgl_kernel)")

    missing.__name__ = name
    return missing


del torch
