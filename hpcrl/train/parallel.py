"""Process groups of the trainer: distributed start-up and teardown (the model and optimizer are in
:mod:`hpcrl.train.model`).

- :func:`setup_parallel` is what a trainer rank calls once: the groups and the seeds.
- :func:`deterministic_mode` switches torch's deterministic algorithms on for the process
  (``run.deterministic``; the :class:`~hpcrl.train.actor.Actor` calls it first thing, so every way of
  building one gets it).
- :func:`init_distributed` starts ``torch.distributed`` from torchrun-style environment variables (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): NCCL on GPUs, gloo on CPUs (where it first
  applies :mod:`hpcrl.train.cpu_compat`). :func:`initialize_model_parallel` and
  :func:`model_parallel_cuda_manual_seed` wrap megatron-core's; :func:`destroy` undoes all three.
- :class:`CollectiveTimeout` is what a rank raises when a collective waited past ``train.collective_timeout_s``
  (:func:`is_collective_timeout` tells one, :class:`hpcrl.run_session.RunSession` raises it).
- :func:`handoff_group` / :func:`wait_for_controller`: where the ranks wait for the controller's rollout, under
  ``train.rollout_wait_timeout_s`` instead (the trainer's own collectives keep the short bound).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import random
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hpcrl.procs import env_rank


INIT_METHOD_ENV = "HPCRL_DIST_INIT_METHOD"
"""Environment variable with the ``torch.distributed`` init method of ``hpcrl run``'s trainer processes (a
``file://`` path that :func:`hpcrl.launch_local.run_local_workers` makes new for each launch)."""


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str


def setup_parallel(cfg: Any) -> DistEnv:
    """A trainer rank's process groups for a run: :func:`init_distributed`, Megatron's model-parallel groups
    from ``train.*_parallel_size`` and the seeded RNG states (``run.seed``); ``run.deterministic`` is switched
    on by the :class:`~hpcrl.train.actor.Actor` built next (:func:`deterministic_mode`). Returns the
    :class:`DistEnv`."""
    tc = cfg.train
    env = init_distributed(timeout_s=tc.collective_timeout_s)
    initialize_model_parallel(tc.tensor_parallel_size, tc.pipeline_parallel_size, tc.context_parallel_size,
                              tc.expert_parallel_size, timeout_s=tc.collective_timeout_s,
                              etp=tc.expert_tensor_parallel_size)
    model_parallel_cuda_manual_seed(cfg.run.seed)
    return env


def deterministic_mode(enabled: bool) -> None:
    """With ``enabled`` (``run.deterministic``), ``torch.use_deterministic_algorithms(True)`` for the whole
    process, after setting ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` if unset on GPUs (cuBLAS reads it when it
    starts). Without, nothing changes (an earlier call is not undone). Raises nothing."""
    if not enabled:
        return
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def prepare_megatron() -> None:
    """megatron-core for this device: :func:`hpcrl.train.cpu_compat.apply` without CUDA,
    :func:`hpcrl.train.cpu_compat.define_te_general_gemm` with it. Idempotent. Imports megatron-core (~1 s
    after torch on a 2-core CPU machine), which is why :func:`init_distributed` can leave it out. Raises
    ImportError if megatron-core is not installed. megatron-core's optional ``import wandb`` (inference
    contexts and timers, never used by hpcrl) fails while it is first imported here (:func:`module_hidden`):
    it cost 0.3-0.7 s of every trainer start; :mod:`hpcrl.tracking` imports W&B itself when a run uses it."""
    from hpcrl.train import cpu_compat

    with module_hidden("wandb"):
        if torch.cuda.is_available():
            cpu_compat.define_te_general_gemm()  # MoE routers on GPUs without TransformerEngine
        else:
            cpu_compat.apply()


@contextlib.contextmanager
def module_hidden(name: str):
    """Within the block ``import NAME`` raises ImportError (``sys.modules[NAME] = None``), so a library's
    optional ``try: import NAME`` falls back; afterwards NAME imports as usual. Does nothing when NAME is
    imported already (that import stands). Raises nothing itself."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


def init_distributed(backend: Optional[str] = None, timeout_s: float = 1800.0,
                     megatron: bool = True, store: Any = None) -> DistEnv:
    """Initialise the default process group from ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``.

    ``backend`` defaults to ``nccl`` with CUDA (the device is set to ``LOCAL_RANK``) and ``gloo`` without.
    ``megatron`` (default True) also prepares megatron-core for the device (:func:`prepare_megatron`, also
    when the group exists already); False forms the group only - the Slurm bootstrap, which starts the rollout
    step before the trainer imports megatron-core (:func:`setup_parallel` prepares it then). Without the
    variables a single process (rank 0 of 1) starts on a loopback port its store binds at once (port 0).
    With :data:`INIT_METHOD_ENV` set (``hpcrl run``'s workers: a ``file://`` rendezvous on this machine) that
    init method is used instead of the address and port; with a ``store`` (a ``torch.distributed.Store``: the
    critic world's, which the actor's controller hosts, :mod:`hpcrl.train.critic_group`) that store is the
    rendezvous. Returns the existing setup if already initialised.
    Raises KeyError if ``WORLD_SIZE`` > 1 and ``MASTER_ADDR`` or ``MASTER_PORT`` is missing.
    """
    if megatron:
        prepare_megatron()
    if dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                       dist.get_backend())
    rank = env_rank()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if store is not None:
        init_method = None
    elif os.environ.get(INIT_METHOD_ENV):  # hpcrl run's workers: a file on this machine, no port to race for
        init_method = os.environ[INIT_METHOD_ENV]
    elif world_size > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise KeyError(f"WORLD_SIZE={world_size} but {missing} not set (start with torchrun or srun)")
        init_method = f"tcp://{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT'])}"
    else:  # port 0: the store binds a port the OS picks as it binds, so no other process can take it first
        init_method = (f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:"
                       f"{int(os.environ.get('MASTER_PORT') or 0)}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, init_method=init_method, store=store, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return DistEnv(rank, world_size, local_rank, backend)


def initialize_model_parallel(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                              timeout_s: float = 1800.0, etp: Optional[int] = None) -> None:
    """megatron-core's ``parallel_state.initialize_model_parallel``; data parallel is what remains. Its groups'
    collectives time out after ``timeout_s`` seconds, rounded up to whole minutes (megatron-core's unit).
    ``etp``: the expert-tensor-parallel size (``train.expert_tensor_parallel_size``; None: megatron's default,
    ``tp``).

    ``world_size`` must be divisible by ``tp * pp * cp`` and by ``etp * ep * pp`` (megatron-core raises
    RuntimeError otherwise).
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp,
                                             distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))


_TIMED_OUT = re.compile(r"timed out waiting \d+ ?ms|collective operation timeout|watchdog caught collective",
                        re.IGNORECASE)
"""What gloo (``Timed out waiting 5000ms for recv operation to complete``) and NCCL's watchdog (``Watchdog
caught collective operation timeout``) say when a collective waited past the group's timeout."""


class CollectiveTimeout(RuntimeError):
    """A trainer rank waited past ``train.collective_timeout_s`` in a collective: another rank died or stalls
    (or, ``for_controller``, past ``train.rollout_wait_timeout_s`` for the controller's hand-over:
    :func:`handoff_group`). One line (a known error of :mod:`hpcrl.errors`, exit status 1) naming the rank, the
    step and the phase."""

    def __init__(self, rank: int, step: int, phase: str, timeout_s: float, last_checkpoint: Optional[str],
                 for_controller: bool = False):
        self.rank, self.step, self.phase, self.timeout_s = rank, step, phase, timeout_s
        key = "train.rollout_wait_timeout_s" if for_controller else "train.collective_timeout_s"
        whom, who = ("the controller (rank 0)", "it") if for_controller else ("the other ranks", "a rank")
        resume = (f"the run resumes from its last checkpoint ({last_checkpoint}) when started again"
                  if last_checkpoint else "no checkpoint was written yet")
        super().__init__(f"trainer rank {rank} waited more than {timeout_s:g} s ({key}) for {whom} in a "
                         f"collective of step {step} ({phase}): {who} died or stalls there, so the run stopped; "
                         f"{resume}; raise {key} if {'it is' if for_controller else 'the ranks are'} only slow")


class ControllerWaitTimeout(RuntimeError):
    """A trainer rank other than the controller waited past ``train.rollout_wait_timeout_s`` for the controller
    in the hand-off group (:func:`handoff_group`, :func:`waiting_for_controller`); the run's one line is the
    :class:`CollectiveTimeout` that :class:`hpcrl.run_session.RunSession` makes of it."""


def handoff_group(timeout_s: float, wait_s: float) -> Any:
    """A gloo process group of every trainer rank for where they wait on the controller (rank 0) while it
    works alone: its engines' start, each step's rollout, reward and filter, its eval, its weight send. The
    controller's side of it waits at most ``timeout_s`` (``train.collective_timeout_s``: a rank that does not
    come is a trainer fault), every other rank ``wait_s`` (``train.rollout_wait_timeout_s``: a rollout at
    scale takes many minutes, which the trainer's own collectives must not be given). None without
    torch.distributed or with one rank. Collective: every rank of the default group calls it, in the same
    order as its other new groups. Use with :func:`wait_for_controller` and
    :func:`hpcrl.run_session.broadcast`."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    mine = timeout_s if dist.get_rank() == 0 else wait_s
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=mine))


@contextlib.contextmanager
def waiting_for_controller(group: Any) -> Iterator[None]:
    """Around a collective of the hand-off ``group`` (:func:`handoff_group`): on a rank other than the
    controller, its timeout is raised as :class:`ControllerWaitTimeout` (from the collective's error)."""
    try:
        yield
    except RuntimeError as e:
        if group is not None and dist.get_rank() != 0 and is_collective_timeout(e):
            raise ControllerWaitTimeout("waited past train.rollout_wait_timeout_s for the controller") from e
        raise


def destroy_group(group: Any) -> None:
    """Destroy a process group of this process (:func:`handoff_group`'s); a no-op for None or once
    torch.distributed is torn down (which destroyed it with the rest)."""
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)


def wait_for_controller(group: Any) -> None:
    """Every trainer rank waits here until the controller comes (a barrier of the hand-off ``group``), so the
    trainer's collectives that follow start together; a no-op for ``None`` (one rank)."""
    if group is not None:
        with waiting_for_controller(group):
            dist.barrier(group=group)


def exception_chain(exc: Optional[BaseException]) -> Iterator[BaseException]:
    """``exc`` and what caused it, in turn (its ``__cause__``, else ``__context__``, until none or a cycle)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_collective_timeout(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` (or what caused it) is a collective's timeout: gloo's message, or NCCL's watchdog's where
    the process survives it (torch's default on GPUs ends the process instead, with that message)."""
    return any(isinstance(e, CollectiveTimeout) or (isinstance(e, RuntimeError) and _TIMED_OUT.search(str(e)))
               for e in exception_chain(exc))


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed Python, torch and megatron-core's tensor-parallel RNG tracker (Megatron-LM ``_set_random_seed``).

    Data-parallel ranks of one TP group share the default seed; TP ranks get ``seed + 2718 + tp_rank`` for
    dropout inside tensor-parallel regions (megatron-core). On CPU these act on the CPU generator.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def sum_over_ranks(values: dict[str, Any], device: torch.device, group: Any = None) -> dict[str, float]:
    """Sum each scalar of ``values`` (floats or 0-d tensors) over the ranks of ``group`` (a data-parallel
    group; None or a one-rank world: no collective), in float64: one collective and one device sync. Every
    rank must pass the same keys. Returns plain floats."""
    if not values:
        return {}
    keys = sorted(values)
    t = torch.stack([torch.as_tensor(values[k], device=device).detach().to(torch.float64).reshape(())
                     for k in keys])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist(), strict=True))


def stage_layers(config: Any) -> tuple[int, int]:
    """``(first, count)``: the global index of this pipeline stage's first decoder layer and how many it holds
    (megatron-core's ``get_transformer_layer_offset`` / ``get_num_layers_to_build``: layers split evenly, or
    ``num_layers_in_first/last_pipeline_stage`` first, slime's ``--decoder-first/last-pipeline-num-layers``).
    ``(0, num_layers)`` without pipeline parallelism."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.pipeline_model_parallel_size == 1:
        return 0, config.num_layers
    return get_transformer_layer_offset(config), get_num_layers_to_build(config)


def from_last_stage(obj: Any) -> Any:
    """``obj`` of the last pipeline stage, on every stage of this rank's pipeline group (a picklable object:
    the losses, metrics and log-probs that only the last stage computes; ``broadcast_object_list``). ``obj``
    itself without pipeline parallelism; other stages' ``obj`` is ignored. Every stage must call it."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() \
            or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return obj
    group = parallel_state.get_pipeline_model_parallel_group()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    box = [_map_tensors(obj, lambda t: t.detach().cpu())]  # pickled on the host: each stage has its own GPU
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, dist.get_world_size(group) - 1), group=group)
    return _map_tensors(box[0], lambda t: t.to(device)) if device is not None else box[0]


def _map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor inside its lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def gather_per_sample(flat: Sequence[Any], per_mb: Sequence[torch.Tensor], num_samples: int, group: Any,
                      dp_size: int) -> list[torch.Tensor]:
    """Every sample's row of per-micro-batch tensors, on every data-parallel rank.

    ``flat``: this rank's micro-batches (their ``positions`` and ``response_lengths``); ``per_mb``: one
    ``[b, R]`` tensor per micro-batch. Returns ``[response_length]`` float32 CPU tensors for positions ``0 ..
    num_samples-1`` (``all_gather_object`` over ``group`` when ``dp_size > 1``; the data-parallel ranks'
    micro-batches together hold every sample once). Raises RuntimeError when a position is missing.
    """
    local: dict[int, torch.Tensor] = {}
    for mb, t in zip(flat, per_mb, strict=True):
        for i, (p, n) in enumerate(zip(mb.positions, mb.response_lengths.tolist(), strict=True)):
            local[p] = t[i, :n].detach().float().cpu()
    if dp_size > 1:
        parts: list[Optional[dict[int, torch.Tensor]]] = [None] * dp_size
        torch.distributed.all_gather_object(parts, local, group=group)
        for part in parts:
            local.update(part or {})
    missing = [p for p in range(num_samples) if p not in local]
    if missing:
        raise RuntimeError(f"samples {missing[:8]} are in no data-parallel rank's micro-batches")
    return [local[p] for p in range(num_samples)]


def destroy(default_group: bool = True) -> None:
    """Destroy megatron-core's model-parallel groups and, with ``default_group``, the default process group
    (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if default_group and dist.is_initialized():
        dist.destroy_process_group()
