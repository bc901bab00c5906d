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
        rng/rank_00000.pt         RNG states of global rank 0: python, numpy, torch CPU, CUDA (if any),
        rng/rank_00001.pt         megatron's tensor-parallel tracker; one small file per rank
        state.json                ``extra_state`` from rank 0 (rollout id, data source, metrics, config)
        COMPLETE                  JSON marker, written last: rollout id, time, world/TP/PP/DP sizes, model
                                  dtype, padded vocab, whether optimizer state is in it, and ``files``:
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
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
import shutil
import socket
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from hpcrl.fsutil import fsync_path

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
DIST_DIR = "dist"
RNG_DIR = "rng"
STATE_FILE = "state.json"
MARKER_FILE = "COMPLETE"
FORMAT = "hpcrl-checkpoint"
FORMAT_VERSION = 1
DISTRIB_OPTIM_SHARDING = "dp_reshardable"
"""How a distributed optimizer's state is saved (Megatron-LM's default): every rank writes its own buffers,
fast and without gathering; the checkpoint reshards across data parallel sizes only. ``fully_reshardable``
(pass ``distrib_optim_sharding_type``; needs TransformerEngine or Apex, so GPUs only) gathers over the DP
group and reshards across any layout. The ordinary (non-distributed) optimizer's state is sharded like the
parameters and always fully reshardable."""

_ITER_RE = re.compile(r"^iter_(\d{7})$")
_GARBAGE_RE = re.compile(r"^iter_\d{7}\.(tmp|del)-[0-9a-f]+$")
_CHUNK = 1 << 22  # 4 MiB read size for checksums


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete, truncated or not an hpcrl checkpoint (the message says why)."""


# ---------------------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------------------

def checkpoint_root(run_dir: Union[str, os.PathLike]) -> Path:
    """``run_dir/checkpoints``: the folder holding every checkpoint of a run."""
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoint_path(run_dir: Union[str, os.PathLike], rollout_id: int) -> Path:
    """``run_dir/checkpoints/iter_{rollout_id:07d}``: where the checkpoint of ``rollout_id`` lives."""
    if not 0 <= int(rollout_id) < 10**7:
        raise ValueError(f"rollout_id must be in [0, 9999999], got {rollout_id}")
    return checkpoint_root(run_dir) / f"iter_{int(rollout_id):07d}"


def rollout_id_of(path: Union[str, os.PathLike]) -> int:
    """The rollout id in a checkpoint folder's name (``iter_0000012`` -> 12); ValueError for other names."""
    m = _ITER_RE.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not named iter_XXXXXXX")
    return int(m.group(1))


# ---------------------------------------------------------------------------------------------------------
# Small helpers: fsync, checksums, collectives
# ---------------------------------------------------------------------------------------------------------


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _size_and_crc(path: Path, fsync: bool = False, crc: bool = True) -> tuple[int, Optional[str]]:
    """Size in bytes and CRC-32 (8 hex digits; None without ``crc``) of a file; ``fsync`` flushes it too.

    With ``crc`` the size is what reading returns (on NFS, open-to-close consistent, unlike a cached stat).
    """
    with open(path, "rb") as f:
        if crc:
            value, size = 0, 0
            while chunk := f.read(_CHUNK):
                value = zlib.crc32(chunk, value)
                size += len(chunk)
        else:
            size = os.fstat(f.fileno()).st_size
        if fsync:
            os.fsync(f.fileno())
    return size, f"{value:08x}" if crc else None


_DISTCP_RE = re.compile(rf"^{DIST_DIR}/__(\d+)_\d+\.distcp$")
_RNG_RE = re.compile(rf"^{RNG_DIR}/rank_(\d+)\.pt$")


def _owner(name: str, world: int) -> int:
    """The rank that wrote a checkpoint file (its data is in that node's page cache), else 0."""
    m = _DISTCP_RE.match(name) or _RNG_RE.match(name)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def _files(folder: Path) -> list[str]:
    """Every regular file under ``folder`` as sorted POSIX paths relative to it, ``COMPLETE`` excluded."""
    out = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return sorted(f for f in out if f != MARKER_FILE)


def _subdirs(folder: Path) -> list[Path]:
    return [folder, *sorted(p for p in folder.rglob("*") if p.is_dir())]


def _bcast(obj: Any, src: int = 0) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _require_dist() -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised (hpcrl.train.parallel.init_distributed)")
    return dist.get_rank(), dist.get_world_size()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from hpcrl.train.bridge import unwrap_model

    return unwrap_model(model)


# ---------------------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------------------

def _rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, ints, floats and strings (loads with ``weights_only=True``)."""
    from megatron.core import tensor_parallel

    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    tracker = {}
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        tracker[name] = (state.get_state() if isinstance(state, torch.Generator) else state).clone().cpu()
    return {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state().cpu() if torch.cuda.is_available() else None,
        "tracker": tracker,
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    from megatron.core import tensor_parallel

    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["gauss"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current = tracker.get_states()
    restored = {}
    for name, saved in state["tracker"].items():
        if isinstance(current.get(name), torch.Generator):  # graph-safe tracker: keep the generator objects
            current[name].set_state(saved)
            restored[name] = current[name]
        else:
            restored[name] = saved.clone()
    tracker.set_states(restored)


# ---------------------------------------------------------------------------------------------------------
# Sharded state dicts
# ---------------------------------------------------------------------------------------------------------

def _sharding_metadata(optimizer: Any, distrib_optim_sharding_type: str) -> dict[str, Any]:
    """The ``metadata`` megatron-core's ``sharded_state_dict`` methods take (Megatron-LM's choices)."""
    from megatron.core.optimizer import DistributedOptimizer, distrib_optimizer

    if distrib_optim_sharding_type not in ("dp_reshardable", "fully_reshardable"):
        raise ValueError(f"distrib_optim_sharding_type must be 'dp_reshardable' or 'fully_reshardable', "
                         f"got {distrib_optim_sharding_type!r}")
    if distrib_optim_sharding_type == "fully_reshardable" and not distrib_optimizer.HAVE_APEX_OR_TE:
        # Its load copies into every key of the optimizer state, and torch's Adam has a per-parameter 'step'
        # the checkpoint lacks (KeyError in _set_main_param_and_optimizer_states, megatron-core 0.16.1).
        raise NotImplementedError("fully_reshardable distributed-optimizer checkpoints need TransformerEngine"
                                  " or Apex Adam; with torch's Adam (CPUs) use 'dp_reshardable'")

    md: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if any(isinstance(o, DistributedOptimizer) for o in _sub_optimizers(optimizer)):
        md["distrib_optim_sharding_type"] = distrib_optim_sharding_type
    return md


def _sharded_state_dict(model: torch.nn.Module, optimizer: Any, metadata: dict[str, Any],
                        is_loading: bool) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` of ShardedTensors; model keys are the bare GPTModel's names."""
    module = _unwrap(model)
    state = {"model": module.sharded_state_dict(metadata=dict(metadata))}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading,
                                                          metadata=dict(metadata))
    return state


def _sub_optimizers(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _has_state(optimizer: Any) -> bool:
    """Whether the optimizer has stepped (torch's and TE's Adam create their state at the first step)."""
    inners = [getattr(opt, "optimizer", None) for opt in _sub_optimizers(optimizer)]
    return any(inner is not None and len(inner.state) > 0 for inner in inners)


def _zero_state_to_load_into(optimizer: Any) -> None:
    """Give an optimizer that has not stepped yet zero Adam state (moments, and ``step`` for torch's Adam).

    megatron-core 0.16.1's ``DistributedOptimizer.state_dict()`` with torch's Adam (no TransformerEngine /
    Apex, as on CPUs) asserts on an optimizer without state, and ``sharded_state_dict(is_loading=True)``
    calls it before anything is loaded. The zeros are overwritten by the load.
    """
    for opt in _sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        init_state_fn = getattr(opt, "init_state_fn", None)
        if inner is None or init_state_fn is None or len(inner.state) > 0:
            continue
        init_state_fn(inner, opt.config)
        if type(inner).__module__.startswith("torch.optim"):  # torch's Adam keeps a step per parameter
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].setdefault("step", torch.tensor(0.0))


def _reset_to_initial(optimizer: Any) -> None:
    """Make ``optimizer`` what a freshly built one for the (just loaded) model parameters would be.

    Drops any Adam state and copies the model parameters into the optimizer's main (fp32) parameters
    (``reload_model_params``; nothing to copy for fp32 training without the distributed optimizer).
    """
    for opt in _sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            inner.state.clear()
    optimizer.reload_model_params()


def _restore_adam_steps(optimizer: Any) -> None:
    """Give every parameter of a loaded distributed optimizer its own, correct Adam ``step`` tensor.

    With torch's Adam (no TransformerEngine / Apex, as on CPUs) megatron-core 0.16.1's
    ``DistributedOptimizer.load_state_dict`` gets two things wrong: it puts one shared ``step`` tensor into
    every parameter's state (torch's Adam increments it in place once per parameter, so the step count and
    bias correction run ahead), and ``load_parameter_state_from_dp_reshardable`` then copies the step the
    optimizer had *before* the load (a non-persistent placeholder) over it. The saved step survives in the
    inner optimizer's ``param_groups[i]["step"]``; this puts it back, one tensor per parameter.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in _sub_optimizers(optimizer):
        if not isinstance(opt, distrib_optimizer.DistributedOptimizer):
            continue
        for group in opt.optimizer.param_groups:
            if group.get("step") is None:
                continue
            for p in group["params"]:
                state = opt.optimizer.state.get(p)
                if state is not None and torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype,
                                                 device=state["step"].device)


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"world_size": dist.get_world_size(), "tp_size": ps.get_tensor_model_parallel_world_size(),
            "pp_size": ps.get_pipeline_model_parallel_world_size(),
            "dp_size": ps.get_data_parallel_world_size()}


# ---------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------

def _writer_queue_dies_with_us() -> None:
    """Start megatron-core's checkpoint-writer results queue ourselves, in a manager process that dies with
    this one.

    megatron-core's ``FileSystemWriterAsync`` (the ``torch_dist`` save strategy) lazily starts a
    ``multiprocessing`` manager server (spawn context, ~200 MB, ~2 s to start) for its write results and keeps
    it for the life of the process, and forks its writer workers. When the trainer is SIGKILLed (outside a Slurm step, whose cgroup is
    cleaned up) that server was orphaned and lived on: 20 killed runs left 4 GB of them. Started here with
    ``PR_SET_PDEATHSIG`` (:func:`hpcrl.procs.die_with_parent`), it ends with the trainer. A no-op
    if the queue exists or this megatron-core version has no such queue.
    """
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from hpcrl.procs import die_with_parent

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(die_with_parent)
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager (and its server) alive
    # Its writer workers are forked (multiprocessing fork context); one forked while the trainer is killed
    # hung in JoinableQueue.task_done forever. Every Python-level fork of this process now dies with it.
    os.register_at_fork(after_in_child=die_with_parent)


def save_checkpoint(run_dir: Union[str, os.PathLike], rollout_id: int, ddp_model: torch.nn.Module,
                    optimizer: Any, extra_state: Optional[Mapping[str, Any]] = None, keep_last: int = 2,
                    distrib_optim_sharding_type: str = DISTRIB_OPTIM_SHARDING,
                    checksums: bool = True,
                    extra_files: Optional[Mapping[str, Callable[[Path], None]]] = None) -> Path:
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
    wrote, mostly from its page cache); False lists sizes only, for very large checkpoints. ``extra_files``:
    ``{name: writer}``; rank 0 calls ``writer(path)`` to write the file ``name`` at the checkpoint's top level
    (e.g. the HDF5 data buffer), inside the same atomic save (listed and checksummed by ``COMPLETE``).

    Returns the checkpoint folder. Raises, on every rank: RuntimeError without ``torch.distributed``,
    TypeError if ``extra_state`` is not plain JSON (nothing is written then), OSError if a rank fails to
    write; ValueError / NotImplementedError for a bad ``distrib_optim_sharding_type``.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    rank, world = _require_dist()
    final = checkpoint_path(run_dir, rollout_id)
    root = final.parent
    model = _unwrap(ddp_model)
    # An optimizer that has not stepped has no state to save (and megatron-core 0.16.1 mis-saves one whose
    # torch-Adam step is 0: ``if step:``); the marker says so and a load rebuilds it from the model.
    optimizer_state = "none" if optimizer is None else ("saved" if _has_state(optimizer) else "initial")
    save_optimizer = optimizer if optimizer_state == "saved" else None
    metadata = _sharding_metadata(save_optimizer, distrib_optim_sharding_type)

    # 1. Rank 0 checks extra_state and makes the temp folder; everyone learns its name (or the error).
    header: dict[str, Any] = {}
    if rank == 0:
        try:
            state_json = json.dumps(dict(extra_state or {}), indent=1, allow_nan=True)
        except (TypeError, ValueError) as e:
            header = {"error": f"extra_state is not plain JSON: {e}", "type": "TypeError"}
        else:
            try:
                tmp = root / f"{final.name}.tmp-{secrets.token_hex(4)}"
                (tmp / DIST_DIR).mkdir(parents=True)
                (tmp / RNG_DIR).mkdir()
                header = {"tmp": str(tmp)}
            except OSError as e:
                header = {"error": f"cannot create {root}: {e}", "type": "OSError"}
    header = _bcast(header)
    if "error" in header:
        raise (TypeError if header["type"] == "TypeError" else OSError)(header["error"])
    tmp = Path(header["tmp"])

    # 2. The distributed checkpoint of model + optimizer (all ranks), RNG (each rank), state.json (rank 0).
    sharded = _sharded_state_dict(model, save_optimizer, metadata, is_loading=False)
    _writer_queue_dies_with_us()
    dist_checkpointing.save(sharded, str(tmp / DIST_DIR), get_default_save_sharded_strategy("torch_dist"),
                            content_metadata=_clean_metadata_for_serialization(metadata))
    try:
        _write_file(tmp / RNG_DIR / f"rank_{rank:05d}.pt", _torch_bytes(_rng_state()))
        if rank == 0:
            _write_file(tmp / STATE_FILE, state_json.encode())
            for name, writer in (extra_files or {}).items():
                writer(tmp / name)
        error = None
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
        error = f"rank {rank}: {type(e).__name__}: {e}"
    _raise_if_any(error, final)

    # 3. Each rank fsyncs and checksums the files it wrote (its own view of its own files is current, also
    #    on NFS); rank 0 gathers the listing.
    try:
        mine = {n: _size_and_crc(tmp / n, fsync=True, crc=checksums)
                for n in _files(tmp) if _owner(n, world) == rank}
        own_rng = f"{RNG_DIR}/rank_{rank:05d}.pt"
        error = None if own_rng in mine else f"rank {rank}: {own_rng} is not in the folder"
    except OSError as e:
        mine, error = {}, f"rank {rank}: {e}"
    _raise_if_any(error, final)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)

    # 4. Rank 0: marker, fsync folders, rename, prune. Everyone learns whether it worked.
    error = None
    if rank == 0:
        try:
            files = {}
            for part in gathered:
                files.update(part)
            marker = {
                "format": FORMAT, "version": FORMAT_VERSION, "rollout_id": int(rollout_id),
                "time": time.time(), "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "host": socket.gethostname(),
                **_layout(),
                "params_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "padded_vocab_size": int(getattr(model, "vocab_size", 0)) or None,
                "optimizer": optimizer_state,
                "sharding_metadata": _clean_metadata_for_serialization(metadata),
                "megatron_core": _megatron_version(),
                "files": {n: {"size": files[n][0], "crc32": files[n][1]} for n in sorted(files)},
            }
            _write_file(tmp / MARKER_FILE, json.dumps(marker, indent=1).encode())
            for d in reversed(_subdirs(tmp)):
                fsync_path(d)
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
        else:
            try:
                prune_checkpoints(run_dir, keep_last, keep=final)
            except OSError as e:  # the new checkpoint is complete: a failed clean-up is no save failure
                logger.warning("pruning old checkpoints in %s failed: %s", root, e)
    _raise_if_any(error, final)
    logger.info("saved checkpoint %s", final)
    return final


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


# ---------------------------------------------------------------------------------------------------------
# Validate, find, prune
# ---------------------------------------------------------------------------------------------------------

def read_marker(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """The parsed ``COMPLETE`` marker of a checkpoint folder (no file checks: :func:`validate_checkpoint`).

    Raises CheckpointError if it is missing, unreadable or not an hpcrl marker.
    """
    marker_file = Path(path) / MARKER_FILE
    try:
        marker = json.loads(marker_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MARKER_FILE} marker (incomplete save)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable {MARKER_FILE} marker ({e})") from None
    if not (isinstance(marker, dict) and marker.get("format") == FORMAT
            and isinstance(marker.get("files"), dict)):
        raise CheckpointError(f"{path}: {MARKER_FILE} is not an {FORMAT} marker")
    return marker


def validate_checkpoint(path: Union[str, os.PathLike], verify_checksums: bool = False) -> dict[str, Any]:
    """Check a checkpoint folder against its ``COMPLETE`` marker and return the marker.

    Every listed file must exist with the listed size in bytes (with ``verify_checksums`` also the listed
    CRC-32, if the save computed one; this reads the whole checkpoint). The torch DCP index
    ``dist/.metadata``, ``dist/metadata.json``, ``state.json`` and one RNG file per rank of the saved world
    must be among them. Files on disk that are not listed are ignored. Raises CheckpointError naming the
    first problem.
    """
    path = Path(path)
    marker = read_marker(path)
    files: dict[str, Any] = marker["files"]
    required = [f"{DIST_DIR}/.metadata", f"{DIST_DIR}/metadata.json", STATE_FILE]
    required += [f"{RNG_DIR}/rank_{r:05d}.pt" for r in range(int(marker.get("world_size", 1)))]
    missing = [f for f in required if f not in files]
    if missing:
        raise CheckpointError(f"{path}: {MARKER_FILE} does not list {missing}")
    for name, info in files.items():
        f = path / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: {name} is missing") from None
        if size != info["size"]:
            raise CheckpointError(f"{path}: {name} has {size} bytes, {info['size']} expected (truncated?)")
        if verify_checksums and info.get("crc32") and _size_and_crc(f)[1] != info["crc32"]:
            raise CheckpointError(f"{path}: {name} fails its CRC-32 check (corrupted)")
    return marker


def list_checkpoints(run_dir: Union[str, os.PathLike]) -> list[Path]:
    """Every ``iter_XXXXXXX`` folder in ``run_dir/checkpoints``, oldest rollout id first (complete or not)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _ITER_RE.match(p.name)), key=rollout_id_of)


def find_latest_checkpoint(run_dir: Union[str, os.PathLike],
                           verify_checksums: bool = False) -> Optional[Path]:
    """The newest valid checkpoint of a run (:func:`validate_checkpoint`), or None if there is none.

    Folders that fail validation (no marker, missing or short file) are skipped with a logged warning and
    the next older one is tried; ``.tmp-*`` / ``.del-*`` folders are never considered. Reads only the file
    system, so every rank gets the same answer as long as no save runs at the same time.
    """
    for path in reversed(list_checkpoints(run_dir)):
        try:
            validate_checkpoint(path, verify_checksums)
        except CheckpointError as e:
            logger.warning("skipping checkpoint: %s", e)
            continue
        return path
    return None


def prune_checkpoints(run_dir: Union[str, os.PathLike], keep_last: int,
                      keep: Optional[Union[str, os.PathLike]] = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` valid checkpoints and the leftovers of crashed saves.

    Call on one rank only (:func:`save_checkpoint` does, on rank 0). ``keep_last`` <= 0 keeps every
    checkpoint. ``keep`` (a checkpoint folder) is never deleted. Removed: ``.tmp-*`` and ``.del-*`` folders,
    valid checkpoints beyond the newest ``keep_last``, and invalid ``iter_*`` folders older than the oldest
    kept checkpoint (invalid ones newer than that are left alone, with a warning from
    :func:`find_latest_checkpoint`). A checkpoint is first renamed to ``.del-<nonce>`` and then deleted, so a
    kill during deletion never leaves a half-deleted ``iter_*`` folder. Returns the removed paths.
    """
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    keep_path = Path(keep).resolve() if keep is not None else None
    removed: list[Path] = []
    for p in root.iterdir():
        if p.is_dir() and _GARBAGE_RE.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if keep_last <= 0:
        return removed
    valid, invalid = [], []
    for p in list_checkpoints(run_dir):
        try:
            validate_checkpoint(p)
            valid.append(p)
        except CheckpointError:
            invalid.append(p)
    kept = set(valid[-keep_last:]) | ({keep_path} if keep_path else set())
    oldest_kept = min((rollout_id_of(p) for p in kept if _ITER_RE.match(p.name)), default=None)
    doomed = [p for p in valid if p not in kept and p.resolve() != keep_path]
    doomed += [p for p in invalid if oldest_kept is not None and rollout_id_of(p) < oldest_kept]
    for p in sorted(doomed, key=rollout_id_of):
        trash = root / f"{p.name}.del-{secrets.token_hex(4)}"
        os.rename(p, trash)
        fsync_path(root)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(p)
        logger.info("pruned checkpoint %s", p)
    return removed


# ---------------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------------

def load_checkpoint(path: Union[str, os.PathLike], ddp_model: torch.nn.Module, optimizer: Any = None,
                    load_rng: bool = True, strict: bool = True) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint` into a freshly built model; every rank calls.

    ``ddp_model`` / ``optimizer``: built as for training
    (:func:`hpcrl.train.parallel.setup_model_and_optimizer`; the HF weights it loaded are overwritten).
    The model may have another tensor-parallel size than the saved one (megatron-core reshards; build it
    with the saved padded vocab, the marker's ``padded_vocab_size``, as :mod:`hpcrl.convert` does), and so
    may an ordinary optimizer; a distributed optimizer saved as ``dp_reshardable`` needs the same TP/PP
    sizes. ``optimizer=None`` loads the model only; a checkpoint saved before the first optimizer step
    resets ``optimizer`` to a fresh one. This rank's RNG states are restored when ``load_rng`` and the
    world, TP and PP sizes equal the saved ones (otherwise a warning says they are not). ``strict`` goes to
    the model's ``load_state_dict``.

    Returns the ``extra_state`` saved with it. Raises, on every rank: CheckpointError if the folder is
    incomplete or truncated (checked by rank 0, sizes only) or has no optimizer state but ``optimizer`` is
    given, ValueError if the ranks name different folders, RuntimeError without ``torch.distributed``;
    megatron-core raises CheckpointingException for state that does not fit the model.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    rank, world = _require_dist()
    path = Path(path)
    paths = [None] * world
    dist.all_gather_object(paths, str(path.resolve()))
    if len(set(paths)) > 1:
        raise ValueError(f"ranks asked to load different checkpoints: {sorted(set(paths))}")
    # Rank 0 checks the files (one pass over the listing, not one per rank) and reads state.json.
    header: dict[str, Any] = {}
    if rank == 0:
        try:
            header = {"marker": validate_checkpoint(path),
                      "extra": json.loads((path / STATE_FILE).read_text())}
        except CheckpointError as e:
            header = {"error": str(e)}
        except (OSError, ValueError) as e:  # state.json unreadable or not JSON: name the checkpoint
            header = {"error": f"{path}: unreadable {STATE_FILE} ({type(e).__name__}: {e})"}
    header = _bcast(header)
    if "error" in header:
        raise CheckpointError(header["error"])
    marker = header["marker"]
    dist_dir = str(path / DIST_DIR)
    metadata = (dist_checkpointing.load_content_metadata(dist_dir)
                or dict(marker.get("sharding_metadata") or {}))
    model = _unwrap(ddp_model)
    saved_optimizer = marker.get("optimizer", "saved")
    if optimizer is not None and saved_optimizer == "none":
        raise CheckpointError(f"{path} was saved without optimizer state; load it with optimizer=None")
    load_optimizer = optimizer if saved_optimizer == "saved" else None
    _zero_state_to_load_into(load_optimizer)
    sharded = _sharded_state_dict(model, load_optimizer, metadata, is_loading=True)
    # Tensors asked for but absent from the checkpoint fail in the load itself; extra ones (the optimizer's
    # when loading the model only) are fine.
    loaded = dist_checkpointing.load(sharded, dist_dir, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    with torch.no_grad():  # the distributed optimizer copies into views of parameters that require grad
        model.load_state_dict(loaded["model"], strict=strict)
        if load_optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(optimizer)
        elif optimizer is not None:  # saved before the first step
            _reset_to_initial(optimizer)

    if load_rng:
        layout = _layout()
        same = all(marker.get(k) == layout[k] for k in ("world_size", "tp_size", "pp_size"))
        if same:
            _set_rng_state(torch.load(path / RNG_DIR / f"rank_{rank:05d}.pt", weights_only=True))
        elif rank == 0:
            logger.warning("RNG states not restored: %s was saved with world/TP/PP %s/%s/%s, this job has "
                           "%s/%s/%s",
                           path, marker.get("world_size"), marker.get("tp_size"), marker.get("pp_size"),
                           layout["world_size"], layout["tp_size"], layout["pp_size"])
    dist.barrier()
    return header["extra"]
