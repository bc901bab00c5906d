"""The colocated memory phases as the loop calls them, one verb per phase, on either kind of trainer rank.

Colocated phase order per step (no-op adapters on CPU; the memory mechanics are :mod:`hpcrl.offload`'s)::

    generate -> offload (engine memory off) -> onload_trainer -> train
    -> onload_weights (trainer off, engine weights on) -> update_weights -> onload_kv -> evaluate

:class:`ColocatedPhases` is the controller's: it moves the trainer's memory and the engines' (through the
client, on the rollout's event loop) and records the phase order, written to ``phases.jsonl`` at the end.
:class:`TrainerPhases` is every other trainer rank's: it moves only that rank's trainer memory, where the
controller does.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Coroutine

from hpcrl.offload import ColocatedMemory, TrainerMemory


@dataclass
class ColocatedPhases:
    """The controller's memory phases.

    Args:
        memory: the trainer adapter and the engines' memory endpoints (:class:`hpcrl.offload.ColocatedMemory`;
            with ``colocate=False`` it only records the phases).
        call: runs a coroutine on the rollout's event loop and returns its result
            (:meth:`hpcrl.rollout.fleet.RolloutFleet.call`).
    """

    memory: ColocatedMemory
    call: Callable[[Coroutine[Any, Any, Any]], Any]

    def offload(self) -> None:
        """Engines release their memory (weights and KV cache) for the trainer (slime ``offload``)."""
        self.call(self.memory.offload_engine())

    def onload_trainer(self) -> None:
        """The trainer's memory back on the device before it trains."""
        self.memory.onload_trainer()
        self.memory.mark("train")

    def onload_weights(self) -> None:
        """Trainer memory off, the engines' weight memory back, ready for the weight sync (slime
        ``onload_weights``)."""
        self.memory.offload_trainer()
        self.call(self.memory.onload_engine_weights())
        self.memory.mark("sync")

    def onload_kv(self) -> None:
        """The engines' KV cache back after the weights (slime ``onload_kv``)."""
        self.call(self.memory.onload_engine_kv())

    def mark(self, phase: str) -> None:
        """Record a phase that moves no memory (``generate``)."""
        self.memory.mark(phase)

    @property
    def trainer_paused_during_sync(self) -> bool:
        """Whether :meth:`onload_weights` unmaps this rank's trainer memory (colocated on GPUs), so the
        weights to sync must be read before it."""
        return self.memory.colocate and self.memory.trainer.pauses_device_memory

    def trainer_onloaded(self) -> contextlib.AbstractContextManager:
        """A context with this rank's trainer memory on the device (for a checkpoint save while colocated
        engines hold the GPUs: onload, save, offload again)."""
        return self.memory.trainer.onloaded() if self.memory.colocate else contextlib.nullcontext()

    def write(self, path: Path) -> None:
        """Write the recorded phase order to ``path`` (``phases.jsonl``): one ``{"phase", "t" (monotonic
        seconds), "wall" (Unix seconds)}`` per line. Raises OSError."""
        with open(path, "w") as f:
            offset = time.time() - time.monotonic()  # wall clock, for timings across processes
            for phase, t in self.memory.events:
                f.write(json.dumps({"phase": phase, "t": t, "wall": t + offset}) + "\n")


@dataclass
class TrainerPhases:
    """The memory phases of a trainer rank without engines: the engine phases do nothing; colocated, this
    rank offloads and onloads its own trainer memory where the controller does.

    Args:
        trainer: this rank's trainer memory (:func:`hpcrl.offload.create_trainer_memory`; the no-op
            :class:`hpcrl.offload.TrainerMemory` when not colocated).
    """

    trainer: TrainerMemory

    def offload(self) -> None:
        """Nothing: the engines are the controller's."""

    def onload_trainer(self) -> None:
        """This rank's trainer memory back on the device before it trains."""
        self.trainer.onload()

    def onload_weights(self) -> None:
        """This rank's trainer memory off for the engines' weights."""
        self.trainer.offload()

    def onload_kv(self) -> None:
        """Nothing: the engines are the controller's."""

    @property
    def trainer_paused_during_sync(self) -> bool:
        """Whether :meth:`onload_weights` unmaps this rank's trainer memory."""
        return self.trainer.pauses_device_memory

    def trainer_onloaded(self) -> contextlib.AbstractContextManager:
        """A context with this rank's trainer memory on the device."""
        return self.trainer.onloaded()
