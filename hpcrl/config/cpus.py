"""The syntax of ``train.cpus`` and ``rollout.cpus``: the kernel's CPU lists (``taskset -c``, ``cpuset.cpus``):
``"0-3,8,10-11"``, or one integer. :func:`check_cpu_specs` is part of :func:`hpcrl.config.validate` (it needs
no machine); :mod:`hpcrl.placement` places a local run's processes on them (and re-exports these names)."""

from __future__ import annotations

from typing import Optional, Union

from hpcrl.config.errors import ConfigError

CpuSpec = Optional[Union[int, str]]


def parse_cpu_list(spec: Union[int, str]) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (sorted, unique); an int is one CPU.

    Raises ValueError naming the bad part (empty list, a range whose end is below its start, a negative or
    non-integer entry)."""
    if isinstance(spec, bool):
        raise ValueError(f"{spec!r} is not a CPU list")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"CPU {spec} is negative")
        return [spec]
    cpus: set[int] = set()
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            raise ValueError(f"empty entry in {spec!r}")
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"{part!r} is not a CPU number or range") from None
        if a < 0 or b < a:
            raise ValueError(f"{part!r} is not a range of CPUs (start <= end, both >= 0)")
        cpus.update(range(a, b + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """Inverse of :func:`parse_cpu_list`: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, cpus = [], sorted(set(cpus))
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def check_cpu_specs(train_spec: CpuSpec, rollout_spec: CpuSpec) -> tuple[Optional[list[int]], Optional[list[int]]]:
    """Parse ``train.cpus`` and ``rollout.cpus`` (None stays None) and refuse an overlap: the checks that need
    no machine (validation on the login node). Raises :class:`hpcrl.config.ConfigError`."""
    out = []
    for name, spec in (("train.cpus", train_spec), ("rollout.cpus", rollout_spec)):
        try:
            out.append(None if spec is None else parse_cpu_list(spec))
        except ValueError as e:
            raise ConfigError(name, spec, str(e), 'write a CPU list such as "0-3,8"') from None
    overlap = sorted(set(out[0] or ()) & set(out[1] or ()))
    if overlap:
        raise ConfigError("rollout.cpus", rollout_spec, f"overlaps train.cpus={train_spec!r} on CPUs "
                          f"{format_cpu_list(overlap)}", "give trainer and engines disjoint CPU sets")
    return out[0], out[1]
