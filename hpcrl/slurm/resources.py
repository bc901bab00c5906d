"""The ``slurm:`` config section as Slurm resources: one allocation (colocated) or a het job (disaggregated).

:func:`plan_job` turns a validated config into a :class:`JobPlan` and does the checks that need the whole
config and only matter for Slurm (a disaggregated run needs ``slurm.rollout``; the trainer's task count must
suit the parallel sizes; ``extra_sbatch`` must not re-set an option that has its own field). Every problem is
a :class:`~hpcrl.config.ConfigError` naming the field, raised before anything is written or queued.

Shape of the job:

* colocated (``run.placement: colocate``): one allocation of ``slurm.nodes`` nodes. The trainer step has one
  task per GPU (``slurm.gpus_per_node`` tasks per node), or ``train.nprocs / slurm.nodes`` tasks per node on
  CPU nodes. The rollout step (started inside the allocation) shares those nodes and GPUs with
  ``srun --overlap``.
* disaggregated (``run.placement: disaggregate``): a heterogeneous job. Het group 0 = trainer (the ``slurm.*``
  fields), het group 1 = rollout (``slurm.rollout.*``, one task per node; the engines are started with
  ``srun --het-group=1``).
* PPO's critic on ranks of its own (``critic.nprocs > 0``): one more het group after those, ``slurm.critic.*``
  (one task per GPU, or ``critic.nprocs / nodes`` per node on CPU nodes; started by the controller with
  ``srun --het-group=K``, :mod:`hpcrl.slurm.critic_step`). A colocated run with it is a het job too.

GPU counts come from the config; ``CUDA_VISIBLE_DEVICES`` is always Slurm's (``--gpus-per-node``), never set
by hpcrl.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hpcrl.config import Config, ConfigError, SIGNAL_RE, slurm_time_seconds, validate

UNLIMITED_MINUTES = 10 ** 7
"""submitit's timeout bookkeeping for ``slurm.time: UNLIMITED`` (about 19 years, in minutes)."""

# sbatch options that have their own field: an extra_sbatch line setting one of them is an error.
_MANAGED_OPTIONS = {
    "--partition": "slurm.partition", "-p": "slurm.partition",
    "--account": "slurm.account", "-A": "slurm.account",
    "--qos": "slurm.qos", "-q": "slurm.qos",
    "--time": "slurm.time", "-t": "slurm.time",
    "--nodes": "slurm.nodes", "-N": "slurm.nodes",
    "--gpus-per-node": "slurm.gpus_per_node",
    "--cpus-per-task": "slurm.cpus_per_task", "-c": "slurm.cpus_per_task",
    "--mem": "slurm.mem",
    "--constraint": "slurm.constraint", "-C": "slurm.constraint",
    "--exclusive": "slurm.exclusive",
    "--signal": "slurm.signal",
    "--requeue": "slurm.requeue", "--no-requeue": "slurm.requeue",
    "--job-name": "run.name", "-J": "run.name",
    "--output": "the run folder (hpcrl sets it)", "-o": "the run folder (hpcrl sets it)",
    "--error": "the run folder (hpcrl sets it)", "-e": "the run folder (hpcrl sets it)",
    "--ntasks-per-node": "slurm.gpus_per_node / train.nprocs",
    "--array": "hpcrl sweep (job arrays)", "-a": "hpcrl sweep (job arrays)",
}


@dataclass
class GroupPlan:
    """Resources of one het group (or of the one allocation of a colocated run)."""

    role: str
    """``trainer``, ``rollout`` or ``critic``."""
    nodes: int
    ntasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    mem: Optional[str] = None
    partition: Optional[str] = None

    @property
    def ntasks(self) -> int:
        """Tasks of this group in total (``nodes * ntasks_per_node``)."""
        return self.nodes * self.ntasks_per_node


@dataclass
class JobPlan:
    """Everything sbatch is asked for, derived from one config by :func:`plan_job`."""

    job_name: str
    placement: str
    trainer: GroupPlan
    """Het group 0 (disaggregated) or the whole allocation (colocated)."""
    rollout: Optional[GroupPlan]
    """Het group 1 (disaggregated only)."""
    time: str
    """``slurm.time`` as written (plain sbatch templates use it verbatim)."""
    time_s: Optional[int]
    """The time limit in seconds; ``None`` for UNLIMITED."""
    signal_name: str
    """Signal name without ``SIG`` (``USR2``)."""
    signal_lead_s: int
    """Seconds before the time limit that the signal is sent."""
    requeue: bool
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    exclusive: bool = False
    extra_sbatch: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    critic: Optional[GroupPlan] = None
    """The critic's own ranks (``critic.nprocs > 0``): the last het group (:attr:`critic_het_group`)."""

    @property
    def het(self) -> bool:
        """Whether this is a heterogeneous job (disaggregated placement, or a critic with ranks of its own)."""
        return self.rollout is not None or self.critic is not None

    @property
    def components(self) -> list[GroupPlan]:
        """The het groups after group 0 (the trainer), in order: rollout (disaggregated), critic."""
        return [g for g in (self.rollout, self.critic) if g is not None]

    @property
    def critic_het_group(self) -> Optional[int]:
        """The critic's het group index (1 colocated, 2 disaggregated), None without one."""
        return 1 + (self.rollout is not None) if self.critic is not None else None

    @property
    def signal(self) -> str:
        """``NAME@SECONDS`` as sbatch's ``--signal`` takes it (``USR2@120``)."""
        return f"{self.signal_name}@{self.signal_lead_s}"

    @property
    def time_min(self) -> int:
        """The time limit in whole minutes, rounded up (what submitit's ``time`` parameter takes)."""
        return UNLIMITED_MINUTES if self.time_s is None else max(1, math.ceil(self.time_s / 60))


def _check_extra_sbatch(lines: list[str]) -> None:
    for i, line in enumerate(lines):
        opt = line.split("=", 1)[0].split()[0]
        if opt in _MANAGED_OPTIONS:
            raise ConfigError(f"slurm.extra_sbatch[{i}]", line, f"{opt} has its own setting",
                              f"set {_MANAGED_OPTIONS[opt]} instead of an extra #SBATCH line")


def trainer_tasks_per_node(cfg: Config) -> int:
    """Trainer tasks per node: one per GPU, or ``train.nprocs / slurm.nodes`` on CPU nodes.

    Raises ConfigError (``train.nprocs``) when CPU trainer processes do not split evenly over the nodes.
    """
    s = cfg.slurm
    if s.gpus_per_node > 0:
        return s.gpus_per_node
    n = cfg.train.nprocs
    if n % s.nodes != 0:
        raise ConfigError("train.nprocs", n,
                          f"on CPU nodes the trainer runs train.nprocs tasks split evenly over slurm.nodes="
                          f"{s.nodes}",
                          f"use a multiple of {s.nodes} (e.g. train.nprocs={s.nodes * max(1, n // s.nodes)}) "
                          "or change slurm.nodes")
    return n // s.nodes


def gpu_trainer_ranks(cfg: Config) -> Optional[int]:
    """The trainer's rank count on GPU nodes (``slurm.nodes * slurm.gpus_per_node``), None on CPU nodes.

    Works on a typed but not yet validated config (what :func:`hpcrl.slurm.submit.prepare_config` has before
    ``train.nprocs`` is set from it). Raises ConfigError (``slurm.gpus_per_node``) when tensor x pipeline x
    context parallel does not divide that count.
    """
    s, t = cfg.slurm, cfg.train
    ints = (s.nodes, s.gpus_per_node, t.tensor_parallel_size, t.pipeline_parallel_size,
            t.context_parallel_size)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in ints):
        return None  # CPU nodes, or a bad value that validate() reports on its own field
    world = s.nodes * s.gpus_per_node
    model_par = t.tensor_parallel_size * t.pipeline_parallel_size * t.context_parallel_size
    if world % model_par != 0:
        raise ConfigError("slurm.gpus_per_node", s.gpus_per_node,
                          f"the trainer gets slurm.nodes x gpus_per_node = {world} ranks, which tensor x "
                          f"pipeline x context parallel = {model_par} does not divide",
                          "ask for a multiple of the model-parallel size in GPUs, or lower the parallel "
                          "sizes")
    return world


def slurm_config(cfg: Config) -> Config:
    """A copy of ``cfg`` with ``train.nprocs`` set to the trainer's Slurm rank count, validated again.

    On GPU nodes the trainer has ``slurm.nodes * slurm.gpus_per_node`` ranks (one per GPU) whatever
    ``train.nprocs`` says, so the saved config tells the truth and Megatron's parallel sizes are checked
    against it. On CPU nodes ``train.nprocs`` is kept and must split evenly over ``slurm.nodes``. The critic's
    own ranks alike: ``critic.nprocs`` is ``slurm.critic.nodes * gpus_per_node`` on GPU nodes.

    Raises:
        ConfigError: ``slurm.gpus_per_node`` (see :func:`gpu_trainer_ranks`), ``train.nprocs`` (CPU), or any
            rule :func:`~hpcrl.config.validate` checks against the new ``train.nprocs``.
    """
    out = copy.deepcopy(cfg)
    world = gpu_trainer_ranks(out)
    if world is not None:
        out.train.nprocs = world
    g = out.slurm.critic
    if g is not None and isinstance(g.gpus_per_node, int) and isinstance(g.nodes, int) and g.gpus_per_node > 0:
        out.critic.nprocs = g.nodes * g.gpus_per_node
    validate(out, check_files=False)
    trainer_tasks_per_node(out)
    critic_tasks_per_node(out)
    return out


def critic_tasks_per_node(cfg: Config) -> int:
    """Tasks per node of the critic's het group: one per GPU, or ``critic.nprocs / slurm.critic.nodes`` on
    CPU nodes; 0 without ``slurm.critic``. Raises ConfigError when the critic has ranks of its own but no het
    group, a het group but no ranks (CPU nodes), or CPU ranks that do not split evenly over its nodes."""
    g, n = cfg.slurm.critic, cfg.critic.nprocs
    if g is None:
        if n > 0:
            raise ConfigError("critic.nprocs", n,
                              "on Slurm the critic's ranks of its own run in a het group of their own, and "
                              "slurm.critic is not set",
                              "add slurm.critic: {nodes: 1, gpus_per_node: 8}, or set critic.nprocs=0 (the "
                              "critic on the trainer's ranks)")
        return 0
    if g.gpus_per_node > 0:
        return g.gpus_per_node
    if n <= 0 or n % g.nodes != 0:
        raise ConfigError("critic.nprocs", n,
                          f"slurm.critic asks for CPU nodes, which run critic.nprocs tasks split evenly over "
                          f"slurm.critic.nodes={g.nodes}",
                          f"set critic.nprocs to a multiple of {g.nodes}, or slurm.critic=null")
    return n // g.nodes


def plan_job(cfg: Config) -> JobPlan:
    """The Slurm shape of a run: groups, time, signal, requeue, extra lines, setup lines.

    Args:
        cfg: a validated, resolved config (``load_config``'s result).

    Returns:
        The :class:`JobPlan`; ``plan.rollout`` is set for ``run.placement: disaggregate``, ``plan.critic`` for
        a critic on ranks of its own.

    Raises:
        ConfigError: a disaggregated run without ``slurm.rollout``; CPU trainer tasks not divisible by
            ``slurm.nodes``; an ``extra_sbatch`` line re-setting an option with its own field; the critic's
            problems of :func:`critic_tasks_per_node`.
    """
    s = cfg.slurm
    m = SIGNAL_RE.fullmatch(s.signal)
    if m is None:  # validate() already rejects this; keep the error local for configs built in code
        raise ConfigError("slurm.signal", s.signal, "must look like SIGNAME@SECONDS", "e.g. USR2@120")
    _check_extra_sbatch(s.extra_sbatch)
    trainer = GroupPlan("trainer", nodes=s.nodes, ntasks_per_node=trainer_tasks_per_node(cfg),
                        gpus_per_node=s.gpus_per_node, cpus_per_task=s.cpus_per_task, mem=s.mem,
                        partition=s.partition)
    rollout = None
    if cfg.run.placement == "disaggregate":
        g = s.rollout
        if g is None:
            raise ConfigError("slurm.rollout", None,
                              "run.placement: disaggregate runs the engines in het group 1, which needs its "
                              "own resources",
                              "add slurm.rollout: {nodes: 1, gpus_per_node: 8}, or set "
                              "run.placement=colocate")
        rollout = GroupPlan("rollout", nodes=g.nodes, ntasks_per_node=1, gpus_per_node=g.gpus_per_node,
                            cpus_per_task=g.cpus_per_task, mem=g.mem,
                            partition=g.partition if g.partition is not None else s.partition)
    critic = None
    if critic_tasks_per_node(cfg) > 0:
        g = cfg.slurm.critic
        critic = GroupPlan("critic", nodes=g.nodes, ntasks_per_node=critic_tasks_per_node(cfg),
                           gpus_per_node=g.gpus_per_node, cpus_per_task=g.cpus_per_task, mem=g.mem,
                           partition=g.partition if g.partition is not None else s.partition)
    return JobPlan(job_name=cfg.run.name, placement=cfg.run.placement, trainer=trainer, rollout=rollout,
                   critic=critic,
                   time=s.time, time_s=slurm_time_seconds(s.time), signal_name=m.group(1),
                   signal_lead_s=int(m.group(2)), requeue=s.requeue, account=s.account, qos=s.qos,
                   constraint=s.constraint, exclusive=s.exclusive, extra_sbatch=list(s.extra_sbatch),
                   setup=list(s.setup))


def group_flags(plan: JobPlan, group: GroupPlan) -> dict[str, Any]:
    """The sbatch flags of one group as ``{option_name: value}`` (``_`` for ``-``; ``True`` = bare flag).

    Used for het group 1, which gets its own copy of the job-wide options (time, account, qos, exclusive)
    rather than relying on what Slurm propagates between components.
    """
    flags: dict[str, Any] = {
        "nodes": group.nodes,
        "ntasks_per_node": group.ntasks_per_node,
        "cpus_per_task": group.cpus_per_task,
        "time": "UNLIMITED" if plan.time_s is None else plan.time_min,
    }
    if group.gpus_per_node > 0:
        flags["gpus_per_node"] = group.gpus_per_node
    for key, value in (("mem", group.mem), ("partition", group.partition), ("account", plan.account),
                       ("qos", plan.qos)):
        if value is not None:
            flags[key] = value
    if plan.exclusive:
        flags["exclusive"] = True
    return flags
