"""Where a local run's processes run: CPU sets for ``run.placement: disaggregate`` on one machine.

On a cluster, disaggregated means separate nodes (the het job's groups, :mod:`hpcrl.slurm`). On one machine it
means disjoint CPU sets: the trainer process(es) on ``train.cpus``, the engines (and the router) on
``rollout.cpus``; unset, the CPUs this process may use are split evenly (the trainer takes the first half).
Each side sets its thread count to its CPU count, so generation and training can really overlap
(``run.mode: async``) instead of fighting for the same cores. Colocated runs leave affinity alone.

CPU lists use the kernel's syntax (``taskset -c``, ``cpuset.cpus``): ``"0-3,8,10-11"``, or one integer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from hpcrl.config.cpus import CpuSpec, check_cpu_specs, format_cpu_list, parse_cpu_list  # the syntax


@dataclass(frozen=True)
class CpuSets:
    """The trainer's and the rollout's CPUs on this machine (disjoint)."""

    train: tuple[int, ...]
    rollout: tuple[int, ...]

    def engine(self, i: int, num_engines: int) -> tuple[int, ...]:
        """Engine ``i``'s CPUs: its share of the rollout CPUs when there are at least as many as engines,
        else all of them (engines then share)."""
        n = len(self.rollout)
        if n < num_engines:
            return self.rollout
        per = n // num_engines
        return self.rollout[i * per:(i + 1) * per] if i < num_engines - 1 else self.rollout[i * per:]


def local_cpu_sets(train_spec: CpuSpec, rollout_spec: CpuSpec,
                   available: Optional[list[int]] = None) -> CpuSets:
    """The CPU sets of a disaggregated local run from ``train.cpus`` / ``rollout.cpus`` (either may be None:
    it gets the available CPUs the other does not take; both None: an even split, the trainer first).
    ``available`` defaults to this process's affinity (:func:`check_cpu_specs` has the checks that need no
    machine).

    Raises :class:`hpcrl.config.ConfigError` (one line: field, value, fix) when a list is malformed, names
    CPUs this process may not use, the two overlap, or a side ends up with no CPU (one CPU cannot be split).
    """
    from hpcrl.config.errors import ConfigError

    avail = sorted(available if available is not None else os.sched_getaffinity(0))
    train, rollout = check_cpu_specs(train_spec, rollout_spec)
    for name, spec, cpus in (("train.cpus", train_spec, train), ("rollout.cpus", rollout_spec, rollout)):
        outside = sorted(set(cpus or ()) - set(avail))
        if outside:
            raise ConfigError(name, spec, f"CPUs {format_cpu_list(outside)} are not available to this run "
                              f"(it may use {format_cpu_list(avail)})", "pick CPUs from that list")
    if train is None and rollout is None:
        half = len(avail) - len(avail) // 2
        train, rollout = avail[:half], avail[half:]
    elif train is None:
        train = [c for c in avail if c not in rollout]
    elif rollout is None:
        rollout = [c for c in avail if c not in train]
    for name, spec, cpus in (("train.cpus", train_spec, train), ("rollout.cpus", rollout_spec, rollout)):
        if not cpus:
            raise ConfigError(name, spec, f"leaves no CPU for the other side (available: "
                              f"{format_cpu_list(avail)}); a disaggregated local run needs at least 2 CPUs",
                              "give each side CPUs of its own, or set run.placement=colocate")
    return CpuSets(tuple(train), tuple(rollout))


def run_cpu_sets(cfg) -> Optional[CpuSets]:
    """The CPU sets of a local run: :func:`local_cpu_sets` when ``run.placement`` is ``disaggregate``, None
    when colocated. Raises ConfigError as :func:`local_cpu_sets`."""
    if cfg.run.placement != "disaggregate":
        return None
    return local_cpu_sets(cfg.train.cpus, cfg.rollout.cpus)


def pin(cpus, threads: Optional[int] = None) -> tuple[set[int], int]:
    """Pin this process to ``cpus`` and set torch's intra-op threads to ``threads`` (default: one per CPU).
    Returns the previous ``(affinity, threads)`` for :func:`unpin`."""
    import torch

    before = (os.sched_getaffinity(0), torch.get_num_threads())
    os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(max(1, threads or len(cpus)))
    return before


def unpin(before: tuple[set[int], int]) -> None:
    """Undo :func:`pin`."""
    import torch

    os.sched_setaffinity(0, before[0])
    torch.set_num_threads(before[1])

