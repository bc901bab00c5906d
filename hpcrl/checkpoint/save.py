"""Saving a checkpoint, all ranks together, in phases: stage (the temp folder), write (distributed checkpoint, RNG,
run state, extra files), verify (fsync and checksum per rank), publish (``COMPLETE``, rename), prune."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist

from hpcrl.fsutil import fsync_path
from hpcrl.checkpoint.layout import (DIST_DIR, FORMAT, FORMAT_VERSION, MARKER_FILE, RNG_DIR, STATE_FILE,
                                     checkpoint_path, file_owner, files_of, model_dist_dir, prune_checkpoints,
                                     size_and_crc, subdirs, write_file)
from hpcrl.checkpoint.state import (DISTRIB_OPTIM_SHARDING, broadcast_object, has_state, parallel_layout,
                                    require_dist, rng_state, sharded_state_dict, sharding_metadata, unwrap)

logger = logging.getLogger("hpcrl.checkpoint")


def _write_results_in_process() -> None:
    """Give megatron-core's checkpoint writer an in-process queue for its write results.

    megatron-core's ``FileSystemWriterAsync`` (the ``torch_dist`` save strategy) collects what its forked writer
    workers wrote in a module-level queue, by default a ``multiprocessing`` manager's (spawn context), started on
    the first save and kept for the life of the process. hpcrl saves synchronously (``AsyncRequest.
    execute_sync``: the results are put and taken in this process, never in another), so that manager was pure
    cost: its server process imported torch to unpickle the first results (~1.7 s on every attempt's first
    save), outlived a SIGKILLed trainer (20 killed runs left 4 GB of them) and died of the SIGTERM that Slurm
    sends to a step's processes while the trainer still saves. A ``queue.Queue`` serves the same ``put`` and
    ``get_nowait``. (An asynchronous save, whose writer runs in another process, would need the manager back.)
    A no-op if the queue exists or this megatron-core version has no such queue.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from hpcrl.procs import die_with_parent

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return
    filesystem_async._results_queue = queue.Queue()
    # Its writer workers are forked (multiprocessing fork context); one forked while the trainer is killed
    # hung in JoinableQueue.task_done forever. Every Python-level fork of this process now dies with it.
    os.register_at_fork(after_in_child=die_with_parent)


def save_checkpoint(run_dir: Union[str, os.PathLike], rollout_id: int, ddp_model: torch.nn.Module,
                    optimizer: Any, extra_state: Optional[Mapping[str, Any]] = None, keep_last: int = 2,
                    distrib_optim_sharding_type: str = DISTRIB_OPTIM_SHARDING,
                    checksums: bool = True,
                    write_files: Sequence[Callable[[Path], None]] = (),
                    models: Optional[Mapping[str, tuple[torch.nn.Module, Any]]] = None,
                    remote: Optional[Mapping[str, "RemotePart"]] = None) -> Path:
    """Write the checkpoint of ``rollout_id`` to ``run_dir/checkpoints/iter_{rollout_id:07d}/`` (all ranks).

    ``ddp_model``: the trainer's model (megatron-core DDP / Float16Module wrappers or a bare GPTModel).
    ``optimizer``: its megatron-core optimizer, or None to save the model only (an optimizer that has not
    stepped yet has no state; the marker records ``"optimizer": "initial"`` and a load rebuilds it).
    ``extra_state``: plain JSON (dicts, lists, str, numbers, bool, None) on rank 0, other ranks' is ignored:
    rollout id, ``DataSource.state_dict()``, metrics so far, resolved config; :func:`load_checkpoint`
    returns it. The layout and the atomic write are in the module docstring. An existing checkpoint of the
    same rollout id is replaced. Afterwards rank 0 prunes to the newest ``keep_last`` complete checkpoints
    (:func:`prune_checkpoints`; 0 or less keeps all, the one just written is always kept) and removes
    ``.tmp-*`` / ``.del-*`` leftovers of crashed saves. ``distrib_optim_sharding_type``: see
    :data:`DISTRIB_OPTIM_SHARDING`. ``checksums``: CRC-32 every file (each rank reads back the files it
    wrote, mostly from its page cache); False lists sizes only, for very large checkpoints. ``write_files``:
    writers rank 0 calls, in order, with the checkpoint's (temporary) folder, to add their files inside the
    same atomic save (the checkpoint manager's stateful objects that keep files, e.g. the HDF5 data buffer),
    listed and checksummed by ``COMPLETE`` with the rest. ``models``: further Megatron models saved in the
    same atomic save, ``{name: (ddp_model, optimizer or None)}`` (e.g. ``{"critic": ...}``, PPO's value
    model), each into its own distributed checkpoint folder ``dist_<name>/`` (:func:`model_dist_dir`); the
    marker's ``models`` records each one's folder and optimizer state (saved | initial | none) and
    :func:`load_checkpoint` restores them. ``remote``: further models whose ranks are not this world's
    (``{"critic": RemoteCritic}``: PPO's critic on ranks of its own, :mod:`hpcrl.train.critic_group`), each a
    :class:`RemotePart` that writes its ``dist_<name>/`` into the staged folder while this world writes its
    own, and returns its files' listing and its marker entry; they are in the same ``COMPLETE``.

    Returns the checkpoint folder. Raises, on every rank: RuntimeError without ``torch.distributed``,
    TypeError if ``extra_state`` is not plain JSON (nothing is written then), OSError if a rank fails to
    write; ValueError / NotImplementedError for a bad ``distrib_optim_sharding_type`` or model name.
    """
    rank, world = require_dist()
    final = checkpoint_path(run_dir, rollout_id)
    model = unwrap(ddp_model)
    main = model_part(DIST_DIR, ddp_model, optimizer, distrib_optim_sharding_type)
    extra_parts = {name: model_part(model_dist_dir(name), m, opt, distrib_optim_sharding_type)
                   for name, (m, opt) in (models or {}).items()}
    remote = dict(remote or {})
    remote_dirs = [model_dist_dir(name) for name in remote]
    tmp, state_json = stage(final, extra_state, rank, [p.dist for p in extra_parts.values()] + remote_dirs)
    for part in remote.values():  # they write beside this world's write
        part.start_save(tmp)
    failed: Optional[BaseException] = None
    try:
        write(tmp, final, [main, *extra_parts.values()], state_json, rank, write_files)
    except OSError as e:  # (on every rank) the remote parts' answers are still collected first
        failed = e
    remote_markers, remote_files = {}, {}
    for name, part in remote.items():
        try:
            remote_markers[name], files = part.finish_save()
        except RuntimeError as e:  # raised on every rank alike
            failed = failed or OSError(f"saving checkpoint {final} failed: {name}: {e}")
            continue
        remote_files.update(files)
    if failed is not None:
        raise failed
    listing = verify(tmp, final, checksums, rank, world, skip=remote_dirs)
    if listing is not None:
        listing.update(remote_files)
    marker = {
        "rollout_id": int(rollout_id), **parallel_layout(),
        "params_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "padded_vocab_size": int(getattr(model, "vocab_size", 0)) or None,
        "optimizer": main.optimizer_state, "sharding_metadata": main.marker()["sharding_metadata"],
        "models": {**{name: part.marker() for name, part in extra_parts.items()}, **remote_markers},
    }
    publish(tmp, final, marker, listing, rank)
    if rank == 0:
        try:
            prune_checkpoints(run_dir, keep_last, keep=final)
        except OSError as e:  # the new checkpoint is complete: a failed clean-up is no save failure
            logger.warning("pruning old checkpoints in %s failed: %s", final.parent, e)
    logger.info("saved checkpoint %s", final)
    return final


class RemotePart(Protocol):
    """A model of the checkpoint whose ranks are another world's (:class:`hpcrl.train.critic_group.
    RemoteCritic`): every rank of this world calls both, the writing happens over there."""

    def start_save(self, folder: Path) -> None:
        """Begin writing into ``folder / dist_<name>`` (made by :func:`stage`)."""

    def finish_save(self) -> tuple[dict[str, Any], dict[str, tuple]]:
        """``(its COMPLETE entry, {file relative to folder: (size, CRC-32)})`` once written and fsynced;
        raises RuntimeError (on every rank) when the write failed."""


@dataclass
class ModelPart:
    """One Megatron model of a checkpoint and how it is saved: ``dist`` (its folder, ``dist`` or
    ``dist_<name>``), the bare model, the optimizer whose state is saved (None when there is none to save),
    ``optimizer_state`` (the marker's saved | initial | none) and the sharding ``metadata``."""

    dist: str
    model: torch.nn.Module
    optimizer: Any
    optimizer_state: str
    metadata: dict[str, Any]

    def marker(self) -> dict[str, Any]:
        """What ``COMPLETE`` records of it: folder, optimizer state, sharding metadata."""
        from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

        return {"dist": self.dist, "optimizer": self.optimizer_state,
                "sharding_metadata": _clean_metadata_for_serialization(self.metadata)}


def model_part(dist_dir: str, ddp_model: torch.nn.Module, optimizer: Any, sharding_type: str) -> ModelPart:
    """The :class:`ModelPart` of a model and its optimizer (None: model only), saved into ``dist_dir``."""
    # An optimizer that has not stepped has no state to save (and megatron-core 0.16.1 mis-saves one whose
    # torch-Adam step is 0: ``if step:``); the marker says so and a load rebuilds it from the model.
    optimizer_state = "none" if optimizer is None else ("saved" if has_state(optimizer) else "initial")
    save_optimizer = optimizer if optimizer_state == "saved" else None
    return ModelPart(dist_dir, unwrap(ddp_model), save_optimizer, optimizer_state,
                     sharding_metadata(save_optimizer, sharding_type))


def stage(final: Path, extra_state: Optional[Mapping[str, Any]], rank: int,
          dists: Sequence[str] = ()) -> tuple[Path, Optional[str]]:
    """Phase 1 (collective): rank 0 checks that ``extra_state`` is plain JSON and makes the temp folder
    ``<final>.tmp-<nonce>`` with ``dist/``, the further models' ``dists`` and ``rng/``; every rank learns
    its name. Returns ``(temp folder,
    the state as JSON text on rank 0, None elsewhere)``. Raises TypeError (not plain JSON) or OSError (the
    folder cannot be made) on every rank."""
    header: dict[str, Any] = {}
    state_json = None
    if rank == 0:
        try:
            state_json = json.dumps(dict(extra_state or {}), indent=1, allow_nan=True)
        except (TypeError, ValueError) as e:
            header = {"error": f"extra_state is not plain JSON: {e}", "type": "TypeError"}
        else:
            try:
                tmp = final.parent / f"{final.name}.tmp-{secrets.token_hex(4)}"
                (tmp / DIST_DIR).mkdir(parents=True)
                for d in (*dists, RNG_DIR):
                    (tmp / d).mkdir()
                header = {"tmp": str(tmp)}
            except OSError as e:
                header = {"error": f"cannot create {final.parent}: {e}", "type": "OSError"}
    header = broadcast_object(header)
    if "error" in header:
        raise (TypeError if header["type"] == "TypeError" else OSError)(header["error"])
    return Path(header["tmp"]), state_json


def write_part(tmp: Path, part: ModelPart) -> None:
    """The megatron-core distributed checkpoint of one model + optimizer into ``tmp / part.dist`` (collective
    over this world; megatron-core raises what the writers raise)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    _write_results_in_process()
    sharded = sharded_state_dict(part.model, part.optimizer, part.metadata, is_loading=False)
    dist_checkpointing.save(sharded, str(tmp / part.dist), get_default_save_sharded_strategy("torch_dist"),
                            content_metadata=_clean_metadata_for_serialization(part.metadata))


def list_own_files(tmp: Path, names: Sequence[str], checksums: bool, rank: int, world: int
                   ) -> dict[str, tuple]:
    """Fsync and checksum the files ``names`` (relative to ``tmp``) this rank wrote (:func:`file_owner`):
    ``{name: (size in bytes, CRC-32 or None)}``. Raises OSError for a file that cannot be read."""
    return {n: size_and_crc(tmp / n, fsync=True, crc=checksums) for n in names if file_owner(n, world) == rank}


def write(tmp: Path, final: Path, parts: Sequence[ModelPart], state_json: Optional[str], rank: int,
          write_files: Sequence[Callable[[Path], None]] = ()) -> None:
    """Phase 2 (collective): the megatron-core distributed checkpoint of each model + optimizer of ``parts``
    into its folder (all ranks), each rank's RNG states, and on rank 0 ``state.json`` and the
    ``write_files``. Raises OSError on every rank if any rank failed."""
    for part in parts:
        write_part(tmp, part)
    try:
        write_file(tmp / RNG_DIR / f"rank_{rank:05d}.pt", _torch_bytes(rng_state()))
        if rank == 0:
            write_file(tmp / STATE_FILE, state_json.encode())
            for writer in write_files:
                writer(tmp)
        error = None
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
        error = f"rank {rank}: {type(e).__name__}: {e}"
    _raise_if_any(error, final)


def verify(tmp: Path, final: Path, checksums: bool, rank: int, world: int, skip: Sequence[str] = ()
           ) -> Optional[dict[str, tuple]]:
    """Phase 3 (collective): each rank fsyncs and checksums the files it wrote (its own view of its own files
    is current, also on NFS), but those under the folders ``skip`` (another world's, which lists its own).
    Returns the listing ``{name: (size in bytes, CRC-32 or None)}`` of every file on rank 0, None elsewhere.
    Raises OSError on every rank if a rank's files are missing or unreadable."""
    try:
        names = [n for n in files_of(tmp) if not any(n.startswith(f"{d}/") for d in skip)]
        mine = list_own_files(tmp, names, checksums, rank, world)
        own_rng = f"{RNG_DIR}/rank_{rank:05d}.pt"
        error = None if own_rng in mine else f"rank {rank}: {own_rng} is not in the folder"
    except OSError as e:
        mine, error = {}, f"rank {rank}: {e}"
    _raise_if_any(error, final)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    files: dict[str, tuple] = {}
    for part in gathered:
        files.update(part)
    return files


def publish(tmp: Path, final: Path, marker: dict[str, Any], files: Optional[dict[str, tuple]], rank: int) -> None:
    """Phase 4 (collective): rank 0 writes the ``COMPLETE`` marker (``marker`` plus format, time, host,
    megatron-core version and the file listing), fsyncs the folders and renames the temp folder to ``final``
    (replacing a checkpoint of the same rollout id). Raises OSError on every rank if that failed."""
    error = None
    if rank == 0:
        try:
            full = {
                "format": FORMAT, "version": FORMAT_VERSION, "rollout_id": marker["rollout_id"],
                "time": time.time(), "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "host": socket.gethostname(),
                **{k: v for k, v in marker.items() if k != "rollout_id"},
                "megatron_core": _megatron_version(),
                "files": {n: {"size": files[n][0], "crc32": files[n][1]} for n in sorted(files)},
            }
            write_file(tmp / MARKER_FILE, json.dumps(full, indent=1).encode())
            for d in reversed(subdirs(tmp)):
                fsync_path(d)
            root = final.parent
            if final.exists():  # the same rollout id saved again (e.g. after a resume): replace it
                old = root / f"{final.name}.del-{secrets.token_hex(4)}"
                os.rename(final, old)
                os.rename(tmp, final)
                fsync_path(root)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            fsync_path(root)
        except OSError as e:
            error = f"rank 0: {e}"
    _raise_if_any(error, final)


def _torch_bytes(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _raise_if_any(error: Optional[str], what: Path) -> None:
    """Collective: raise OSError on every rank if any rank reports an error (so none waits forever)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if errors:
        raise OSError(f"saving checkpoint {what} failed: {'; '.join(errors)}")


def _megatron_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001
        return None
