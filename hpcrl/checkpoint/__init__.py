"""Checkpoints of a run: Megatron distributed checkpoint of model + optimizer, per-rank RNG, and run state.

A checkpoint is written at a rollout step (its *rollout id*) by every trainer rank together, and can be
loaded at another tensor-parallel size (megatron-core ``dist_checkpointing`` reshards; see
:func:`load_checkpoint`). Layout under the run folder::

    run_dir/checkpoints/
      iter_0000003/               one checkpoint; the number is the rollout id (Megatron-LM's names)
        dist/                     megatron-core distributed checkpoint, torch_dist backend (torch DCP):
          __0_0.distcp ...        tensor data, 2 files per rank that writes (``__<rank>_<n>.distcp``)
          .metadata               torch DCP index of every tensor shard
          common.pt               non-sharded objects (optimizer param groups, Adam step) and the
                                  sharding metadata the state dicts were built with; rank 0
          metadata.json           megatron backend/version marker
        dist_critic/              the same for a further named model saved with it (``models=``): a PPO
                                  run's critic (value model) and its optimizer (``algorithm.
                                  advantage_estimator: gae``); one ``dist_<name>/`` per such model
        rng/rank_00000.pt         RNG states of global rank 0: python, numpy, torch CPU, CUDA (if any),
        rng/rank_00001.pt         megatron's tensor-parallel tracker; one small file per rank
        state.json                ``extra_state`` from rank 0 (rollout id, data source, metrics, config)
        COMPLETE                  JSON marker, written last: rollout id, time, world/TP/PP/DP sizes, model
                                  dtype, padded vocab, whether optimizer state is in it, ``models``
                                  (each further model's folder and optimizer state), and ``files``:
                                  size in bytes and CRC-32 of every other file
      iter_0000004.tmp-1a2b3c4d/  a save in progress or a crashed one: never loaded, removed by the next save
      iter_0000001.del-1a2b3c4d/  a checkpoint being deleted: never loaded, removed by the next save

Atomicity: every rank writes into the ``.tmp-<nonce>`` folder; then each rank fsyncs and checksums the
files it wrote, and rank 0 writes ``COMPLETE``, fsyncs the folders and renames the temp folder to
``iter_XXXXXXX`` (replacing an existing checkpoint of the same id). A job killed at any moment leaves the
previous checkpoints untouched and either a complete new one or none.
:func:`find_latest_checkpoint` only trusts a folder whose ``COMPLETE`` marker parses and whose file
listing matches the disk (sizes; CRCs on request).

Bitwise resume: :func:`load_checkpoint` restores model parameters, optimizer state (Adam moments and step,
fp32 main parameters for bf16 and the distributed optimizer) and, when the parallel layout is unchanged,
every rank's RNG streams, so the steps after a load are bitwise identical to an uninterrupted run's.

Needs ``torch.distributed`` initialised (a world of 1 is fine) and megatron-core model parallelism; the run
folder must be on a file system every rank sees (on Slurm clusters the shared scratch or project file
system). megatron-core's torch_dist writer starts a helper process with multiprocessing's ``spawn`` on the
first save of a process, which imports the ``__main__`` module again: the trainer's entry script needs the
``if __name__ == "__main__":`` guard (``python -m`` modules and torchrun scripts with it are fine).

Modules: :mod:`~hpcrl.checkpoint.layout` (paths, marker, find, validate, prune), :mod:`~hpcrl.checkpoint.state`
(RNG, sharded state dicts), :mod:`~hpcrl.checkpoint.save` (the save in phases), :mod:`~hpcrl.checkpoint.load`,
:mod:`~hpcrl.checkpoint.manager` (the run's :class:`CheckpointManager`: the stateful objects, when to save).
"""

from __future__ import annotations

from hpcrl.checkpoint.layout import (CHECKPOINTS_DIR, DIST_DIR, RNG_DIR, STATE_FILE, MARKER_FILE, FORMAT,
                                     FORMAT_VERSION, CheckpointError, checkpoint_root, checkpoint_path,
                                     rollout_id_of, read_marker, validate_checkpoint, list_checkpoints,
                                     find_latest_checkpoint, prune_checkpoints)
from hpcrl.checkpoint.state import DISTRIB_OPTIM_SHARDING
from hpcrl.checkpoint.save import save_checkpoint
from hpcrl.checkpoint.load import load_checkpoint
from hpcrl.checkpoint.manager import CheckpointManager, FileStateful, RolloutCounter, Stateful

__all__ = [
    "CHECKPOINTS_DIR",
    "DIST_DIR",
    "RNG_DIR",
    "STATE_FILE",
    "MARKER_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointError",
    "checkpoint_root",
    "checkpoint_path",
    "rollout_id_of",
    "read_marker",
    "validate_checkpoint",
    "list_checkpoints",
    "find_latest_checkpoint",
    "prune_checkpoints",
    "DISTRIB_OPTIM_SHARDING",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointManager",
    "RolloutCounter",
    "Stateful",
    "FileStateful",
]
