"""The ``slurm`` and ``sweep`` sections; the Slurm checks (time, signal, memory formats). The sweep section's checks need
the whole schema and live in :mod:`hpcrl.config.load` (:func:`~hpcrl.config.load.check_sweep`)."""

from __future__ import annotations

import dataclasses
import difflib
import re
import signal as _signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hpcrl.config.errors import ConfigError
from hpcrl.config.checks import get_field, non_negative, positive, require


@dataclass
class SlurmGroup:
    """Resources of one het group (the rollout's in a disaggregated job, the critic's when it has ranks of its
    own)."""

    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem: Optional[str] = None
    partition: Optional[str] = None
    gpu_memory_gb: Optional[float] = None
    """Memory of one GPU of this group in GB (10^9 bytes; 80 for H100, 141 for H200); default
    ``slurm.gpu_memory_gb``. Only used by the memory estimate (:mod:`hpcrl.config.memory`)."""


@dataclass
class SlurmSection:
    """How the job is asked of Slurm (``hpcrl submit``)."""

    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "01:00:00"
    """Wall-clock limit in Slurm's format: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM`` or
    ``D-HH:MM:SS`` (write it as a string; unquoted ``90`` is an integer and rejected)."""
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem: Optional[str] = None
    constraint: Optional[str] = None
    exclusive: bool = False
    gpu_memory_gb: Optional[float] = None
    """Memory of one GPU in GB (10^9 bytes, as vendors state it: 80 for H100, 141 for H200). When set on GPU nodes,
    ``hpcrl validate`` / ``submit`` / ``sweep`` print a per-GPU memory estimate of the trainer and the engines and
    refuse a layout that cannot fit (:mod:`hpcrl.config.memory`). Not passed to Slurm."""
    signal: str = "USR2@120"
    """``SIGNAME@SECONDS``: signal sent this many seconds before the time limit (and on preemption);
    must be shorter than ``time``."""
    requeue: bool = True
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra ``#SBATCH`` lines, e.g. ``--reservation=foo``."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each step (``module load ...``)."""
    container: Optional[str] = None
    """Apptainer/Singularity image every step runs in."""
    rollout: Optional[SlurmGroup] = None
    """Het group 1 (rollout) resources when ``run.placement: disaggregate``."""
    critic: Optional[SlurmGroup] = None
    """The het group of PPO's critic on ranks of its own (``critic.nprocs``; after the trainer's group and
    the rollout's, if any): one critic rank per GPU (``critic.nprocs`` is set to ``nodes x gpus_per_node``),
    or ``critic.nprocs / nodes`` per node on CPU nodes. null: the critic shares the trainer's ranks."""


@dataclass
class SweepSection:
    """A hyperparameter sweep as one Slurm job array (``hpcrl sweep``)."""

    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Dotted key -> values; the cartesian product is swept."""
    seeds: list[int] = field(default_factory=list)
    num_random: int = 0
    random_space: dict[str, list[Any]] = field(default_factory=dict)
    random_seed: int = 0
    array_parallelism: int = 16


SIGNAL_RE = re.compile(r"(?:SIG)?([A-Z][A-Z0-9]*)@([0-9]+)")
"""``slurm.signal``: ``[SIG]NAME@SECONDS`` (group 1 the name without ``SIG``, group 2 the lead seconds)."""


_MEM_RE = re.compile(r"[0-9]+[KMGT]?", re.I)


_TIME_RE = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")


def slurm_time_seconds(text: str) -> Optional[int]:
    """Seconds in a Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``);
    ``None`` for ``UNLIMITED``/``INFINITE``. Raises ValueError for anything else."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME_RE.fullmatch(text)
    if not m:
        raise ValueError("unrecognised format")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        if h >= 24 or mi >= 60 or s >= 60:
            raise ValueError("after D- the hours must be < 24, minutes and seconds < 60")
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if b is None:  # minutes
        return int(a) * 60
    if c is None:  # MM:SS
        if int(b) >= 60:
            raise ValueError("in MM:SS the seconds must be < 60")
        return int(a) * 60 + int(b)
    if int(b) >= 60 or int(c) >= 60:  # HH:MM:SS
        raise ValueError("in HH:MM:SS the minutes and seconds must be < 60")
    return (int(a) * 60 + int(b)) * 60 + int(c)


def _check_slurm_group(cfg: Config, prefix: str) -> None:
    positive(cfg, f"{prefix}.nodes", f"{prefix}.cpus_per_task", f"{prefix}.gpu_memory_gb")
    non_negative(cfg, f"{prefix}.gpus_per_node")
    gpu_memory = get_field(cfg, f"{prefix}.gpu_memory_gb")
    require(gpu_memory is None or get_field(cfg, f"{prefix}.gpus_per_node") > 0, f"{prefix}.gpu_memory_gb",
            gpu_memory, f"states the GPU memory, but {prefix}.gpus_per_node is 0 (CPU nodes)",
            f"set {prefix}.gpus_per_node, or remove {prefix}.gpu_memory_gb")
    mem = get_field(cfg, f"{prefix}.mem")
    if mem is not None:
        require(bool(_MEM_RE.fullmatch(mem)), f"{prefix}.mem", mem, "not a Slurm memory size",
                 "write e.g. 64G, 512000M or 0 (all memory of the node)")


def check_slurm(cfg: Config, check_files: bool) -> None:
    s = cfg.slurm
    try:
        limit = slurm_time_seconds(s.time)
    except ValueError as e:
        raise ConfigError("slurm.time", s.time, f"not a Slurm time limit ({e})",
                          "write '[D-]HH:MM:SS' or minutes, e.g. '04:00:00' or '1-00:00:00'") from None
    require(limit is None or limit > 0, "slurm.time", s.time, "must be longer than 0", "e.g. '01:00:00'")
    m = SIGNAL_RE.fullmatch(s.signal)
    known = sorted(sig.name[3:] for sig in _signal.Signals)
    require(m is not None, "slurm.signal", s.signal, "must look like SIGNAME@SECONDS",
             "e.g. USR2@120 (USR2 this many seconds before the time limit)")
    name, lead = m.group(1), int(m.group(2))
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        raise ConfigError("slurm.signal", s.signal, f"unknown signal name {name!r}",
                          f"did you mean {close[0]}@{lead}?" if close else "use e.g. USR2@120")
    require(0 < lead <= 65535, "slurm.signal", s.signal, "the lead time must be 1..65535 seconds",
             "e.g. USR2@120")
    if limit is not None:
        require(lead < limit, "slurm.signal", s.signal,
                 f"the lead time ({lead} s) must be shorter than slurm.time ({limit} s)",
                 "lower the lead time or raise slurm.time")
    _check_slurm_group(cfg, "slurm")
    for i, line in enumerate(s.extra_sbatch):
        require(line.startswith("-") and len(line) > 1, f"slurm.extra_sbatch[{i}]", line,
                 "must be an sbatch option", "write e.g. --reservation=foo (without '#SBATCH')")
    if s.rollout is not None:
        require(cfg.run.placement == "disaggregate", "slurm.rollout",
                 dataclasses.asdict(cfg.slurm.rollout),
                 "a rollout het group needs run.placement: disaggregate",
                 "set run.placement=disaggregate or slurm.rollout=null")
        _check_slurm_group(cfg, "slurm.rollout")
    if s.critic is not None:
        require(cfg.algorithm.advantage_estimator == "gae", "slurm.critic", dataclasses.asdict(s.critic),
                f"has no effect: only PPO (algorithm.advantage_estimator=gae) has a critic (not "
                f"{cfg.algorithm.advantage_estimator})", "set algorithm.advantage_estimator=gae, or slurm.critic=null")
        _check_slurm_group(cfg, "slurm.critic")
    if s.container is not None and check_files and "://" not in s.container:
        require(Path(s.container).is_file(), "slurm.container", s.container, "no such container image",
                 "fix the path (or use a docker:// / oras:// URI)")
