"""Colocated memory phases: the trainer and the engines take turns on the same devices (slime 1.10).

One code path for GPU and CPU. The order of one colocated step is::

    offload trainer -> onload engine weights -> weight sync -> onload engine KV cache -> generate
    -> offload engine -> onload trainer -> train -> (next step)

On GPUs the trainer's memory is paused with torch-memory-saver (VMM: virtual addresses kept, physical memory
unmapped; the process must start with its ``LD_PRELOAD`` hook) and the engines free theirs with
``/release_memory_occupation`` (SGLang ``--enable-memory-saver``). On CPUs the trainer side is a no-op adapter
and the CPU engine only records its released tags and refuses generation while released, so the phase order
is the same code and tests assert it from :attr:`ColocatedMemory.events`.

A PPO run's critic (:class:`hpcrl.train.critic.Critic`, ``algorithm.advantage_estimator: gae``) lives in the
trainer process beside the actor, so it takes the actor's turns with no code of its own: on GPUs
torch-memory-saver pauses every device allocation of the process (``TMS_INIT_ENABLE=1``), the critic's weights,
gradients and Adam states with the actor's; it runs only inside ``Actor.train``, between onload and offload.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional

ENGINE_WEIGHTS = ["weights"]
ENGINE_KV = ["kv_cache", "cuda_graph"]


class TrainerMemory:
    """No-op trainer memory adapter (CPU, or colocation off): records nothing, frees nothing."""

    pauses_device_memory = False
    """Whether :meth:`offload` unmaps the trainer's device memory: from then until :meth:`onload` the trainer
    must neither read its tensors nor allocate on the device (the weight sync reads them before, a checkpoint
    save runs inside :meth:`onloaded`)."""

    offloaded = False
    """Whether the trainer's memory is offloaded now (set by :meth:`offload` / :meth:`onload`)."""

    def offload(self) -> None:
        """Free the trainer's device memory (no-op here)."""
        self.offloaded = True

    def onload(self) -> None:
        """Bring the trainer's device memory back (no-op here)."""
        self.offloaded = False

    @contextlib.contextmanager
    def onloaded(self) -> Iterator[None]:
        """Run the block with the trainer's memory on the device: onloaded first if it is offloaded, offloaded
        again after (a checkpoint save between the weight sync and the next train step)."""
        was_offloaded = self.offloaded
        if was_offloaded:
            self.onload()
        try:
            yield
        finally:
            if was_offloaded:
                self.offload()


class TorchMemorySaverTrainerMemory(TrainerMemory):
    """GPU trainer offload with torch-memory-saver (``torch_memory_saver.pause()`` / ``resume()``).

    Requires the process to have been started with torch-memory-saver's preload library in ``LD_PRELOAD``
    (``TMS_INIT_ENABLE=1``), which the hpcrl image sets for the trainer job step when colocated on GPUs and
    ``hpcrl run`` by restarting itself (:func:`restart_with_hook`). With
    ``TMS_INIT_ENABLE_CPU_BACKUP=1`` parameters, gradients and optimizer state come back bitwise on
    :meth:`onload`; while paused nothing may read them, so the colocated loop copies the weights to sync to host
    memory before it offloads (:func:`hpcrl.run_session.sync_weights`). Not exercised in CPU CI; measured on
    an H200 by ``benchmarks/trainer_offload.py`` (docs/gpu-verification.md).
    """

    pauses_device_memory = True

    def __init__(self) -> None:
        """Raises ConfigError (one line) when torch-memory-saver is not installed."""
        try:
            from torch_memory_saver import torch_memory_saver  # GPU-only, imported lazily
        except ImportError:
            from hpcrl.config import ConfigError

            raise ConfigError("run.placement", "colocate", "trainer and engines sharing GPUs need "
                              "torch-memory-saver to hand memory back and forth, and it is not installed",
                              "pip install torch-memory-saver (the gpu extra), or set "
                              "run.placement=disaggregate") from None
        self._tms = torch_memory_saver

    def offload(self) -> None:
        import torch

        torch.cuda.synchronize()
        self._tms.pause()
        self.offloaded = True

    def onload(self) -> None:
        self._tms.resume()
        self.offloaded = False


TMS_INIT_ENV = {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
"""torch-memory-saver's start-up switches for a colocated trainer (slime's ``RayTrainGroup`` sets the same):
every device allocation in its region, paused contents backed up in host memory."""


def hook_env(hook: str, environ: Mapping[str, str]) -> Optional[dict[str, str]]:
    """``environ`` with torch-memory-saver's preload library ``hook`` (a path) first in ``LD_PRELOAD`` and
    :data:`TMS_INIT_ENV` (values already in ``environ`` win); None when ``LD_PRELOAD`` already holds a
    torch-memory-saver library (nothing to do)."""
    preload = environ.get("LD_PRELOAD", "")
    if "torch_memory_saver" in preload:
        return None
    env = {**TMS_INIT_ENV, **environ}
    env["LD_PRELOAD"] = f"{hook}:{preload}" if preload else hook
    return env


def trainer_hook_env(environ: Mapping[str, str]) -> Optional[dict[str, str]]:
    """:func:`hook_env` with the preload library of the installed torch-memory-saver (the build for this
    torch's CUDA major). Raises ImportError when torch-memory-saver is not installed."""
    from torch_memory_saver.utils import get_binary_path_from_package  # GPU-only, imported lazily

    return hook_env(str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload")), environ)


def restart_with_hook(colocate: bool) -> None:
    """Colocated on CUDA, make sure this process runs under torch-memory-saver's hook: the hook must be loaded
    before CUDA starts, so without it the process replaces itself (``os.execve``, same command line and pid)
    with :func:`hook_env`'s environment. ``hpcrl run`` calls it first; the image sets the hook for Slurm job
    steps (:func:`hpcrl.slurm.container.container_env`). Returns without doing anything off CUDA, when not
    colocated, when the hook is in place, or when torch-memory-saver is not installed (the trainer adapter
    then says what to install)."""
    from hpcrl.procs import cuda_available

    if not colocate or not cuda_available():  # without a GPU device node torch is not imported just to ask
        return
    try:
        env = trainer_hook_env(os.environ)
    except ImportError:
        return
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def create_trainer_memory(colocate: bool) -> TrainerMemory:
    """The trainer adapter: torch-memory-saver when colocated on CUDA, else the no-op one."""
    import torch

    if colocate and torch.cuda.is_available():
        return TorchMemorySaverTrainerMemory()
    return TrainerMemory()


@dataclass
class ColocatedMemory:
    """Drives the colocated phase order over the trainer adapter and the engines' memory endpoints.

    ``events`` lists ``(phase, monotonic seconds)`` in the order they happened. When ``colocate`` is False
    every memory call is a no-op (disaggregated: nothing shares devices); :meth:`mark` still records.

    ``released`` holds, per engine URL, the tags this object released and has not resumed: a resume goes only
    to the engines whose tag it released, since SGLang 0.5.23 dies on a resume of a tag that is not released
    (:mod:`hpcrl.engine.state`) - an engine that replaced a dead one while the others were released starts
    with its memory held, and is released with the others at the next offload.
    """

    trainer: TrainerMemory
    client: object
    colocate: bool = True
    events: list[tuple[str, float]] = field(default_factory=list)
    released: dict[str, set[str]] = field(default_factory=dict)

    def _mark(self, phase: str) -> None:
        self.events.append((phase, time.monotonic()))

    def offload_trainer(self) -> None:
        if self.colocate:
            self.trainer.offload()
            self._mark("offload_trainer")

    def onload_trainer(self) -> None:
        if self.colocate:
            self.trainer.onload()
            self._mark("onload_trainer")

    async def _resume(self, tags: list[str]) -> None:
        urls = [u for u, held in self.released.items() if set(tags) <= held]
        if urls:
            await self.client.post_all("/resume_memory_occupation", {"tags": tags}, skip_lost=True, only=urls)
        for u in urls:
            self.released[u] -= set(tags)
        self.released = {u: held for u, held in self.released.items() if held}

    async def onload_engine_weights(self) -> None:
        if self.colocate:
            await self._resume(ENGINE_WEIGHTS)
            self._mark("onload_engine_weights")

    async def onload_engine_kv(self) -> None:
        if self.colocate:
            await self._resume(ENGINE_KV)
            self._mark("onload_engine_kv")

    async def offload_engine(self) -> None:
        if self.colocate:
            await self.client.flush_cache()
            # (post_all keeps the order)
            targets = [u for u in self.client.engine_urls if u not in self.released]
            results = await self.client.post_all("/release_memory_occupation", {"tags": None}, skip_lost=True,
                                                 only=targets)
            for u, r in zip(targets, results):
                if "skipped" not in r:
                    self.released[u] = set(ENGINE_WEIGHTS + ENGINE_KV)
            self._mark("offload_engine")

    def mark(self, phase: str) -> None:
        """Record a non-memory phase (``sync``, ``generate``, ``train``) so the full order and its times are
        visible (``phases.jsonl``), in either placement."""
        self._mark(phase)

    def phases(self) -> list[str]:
        """The recorded phase names, in order."""
        return [p for p, _ in self.events]
