"""The header every benchmark prints first: what machine and settings its figures belong to.

Figures from these benchmarks are per machine: CPUs of the project's kind differ (some AVX2 only, some with
AVX-512 and AMX, whose bf16 is native), so a table is only comparable with tables printed under the same header.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Optional

VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""/proc/cpuinfo flags reported: AVX2, AVX-512 (foundation, bf16) and AMX (bf16 tiles)."""


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def vector_extensions() -> list[str]:
    """The vector extensions of :data:`VECTOR_FLAGS` this CPU has, in that order."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return [f for f in VECTOR_FLAGS if f in flags]


def native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX-512 bf16 or AMX); otherwise torch emulates it (slow)."""
    ext = vector_extensions()
    return "avx512_bf16" in ext or "amx_bf16" in ext


def machine_header(threads: Optional[int] = None, precision: Optional[str] = None) -> str:
    """One line: CPU model, vector extensions, cores, threads per process, torch version, the vector width
    torch's kernels use (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, ``AVX2``, ...), precision.

    ``threads``: the torch/OpenMP threads each benchmark process uses (default: ``torch.get_num_threads()``).
    """
    import torch

    ext = vector_extensions()
    parts = [f"CPU {cpu_model()}",
             "vector " + ("/".join(ext) if ext else "none of " + "/".join(VECTOR_FLAGS)),
             f"bf16 {'native' if native_bf16() else 'emulated'}",
             f"{os.cpu_count()} cores",
             f"{threads if threads is not None else torch.get_num_threads()} thread(s) per process",
             f"torch {torch.__version__}",
             # what torch's kernels use: AVX2 on an AVX-512 CPU when ATEN_CPU_CAPABILITY=avx2 restricts them
             f"torch kernels {torch.backends.cpu.get_cpu_capability()}"]
    if precision:
        parts.append(f"precision {precision}")
    return "# " + ", ".join(parts)


if __name__ == "__main__":
    print(machine_header())
