"""Loading a checkpoint into a model and optimizer (resharded across tensor-parallel sizes), with the RNG states."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from hpcrl.checkpoint.layout import (DIST_DIR, RNG_DIR, STATE_FILE, CheckpointError, model_dist_dir,
                                     validate_checkpoint)
from hpcrl.checkpoint.state import (broadcast_object, parallel_layout, require_dist, reset_to_initial,
                                    restore_adam_steps, set_rng_state, sharded_state_dict, unwrap,
                                    zero_state_to_load_into)

logger = logging.getLogger("hpcrl.checkpoint")


def optimizer_classes() -> list[type]:
    """The optimizer classes megatron-core's CPU optimizer offload (``megatron.optimizer_cpu_offload``:
    ``HybridDeviceOptimizer``) keeps in its param groups (``cpu_optimizer_cls``, ``gpu_optimizer_cls``: torch's
    AdamW / SGD, or TransformerEngine's or apex's fused ones), which megatron pickles into a checkpoint's
    common state. ``torch.load`` in its default ``weights_only`` mode refuses to read a class back unless it
    is allowed, so the load allows exactly these (references to classes megatron itself chose, no code run);
    without it a checkpoint of such a run could not be resumed or converted (seen on an H200, 2026-11-27)."""
    from megatron.core import optimizer as megatron_optimizer

    return list({getattr(megatron_optimizer, name) for name in ("Adam", "SGD", "CPUAdam", "CPUSGD")})


def load_checkpoint(path: Union[str, os.PathLike], ddp_model: torch.nn.Module, optimizer: Any = None,
                    load_rng: bool = True, strict: bool = True,
                    models: Optional[Mapping[str, tuple[torch.nn.Module, Any]]] = None,
                    remote: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint` into a freshly built model; every rank calls.

    ``ddp_model`` / ``optimizer``: built as for training
    (:func:`hpcrl.train.model.setup_model_and_optimizer`; the HF weights it loaded are overwritten).
    The model may have another tensor-parallel size than the saved one (megatron-core reshards; build it
    with the saved padded vocab, the marker's ``padded_vocab_size``, as :mod:`hpcrl.convert` does), and so
    may an ordinary optimizer; a distributed optimizer saved as ``dp_reshardable`` needs the same TP/PP
    sizes. ``optimizer=None`` loads the model only; a checkpoint saved before the first optimizer step
    resets ``optimizer`` to a fresh one. This rank's RNG states are restored when ``load_rng`` and the
    world, TP and PP sizes equal the saved ones (otherwise a warning says they are not). ``strict`` goes to
    the model's ``load_state_dict``. ``models``: the further models saved with ``save_checkpoint(models=...)``,
    ``{name: (ddp_model, optimizer or None)}``, loaded alike from their ``dist_<name>/`` folders; their names
    must be exactly the checkpoint's (None: load the main model only and ignore any others, as
    :mod:`hpcrl.convert` does). ``remote``: further models whose ranks are another world's
    (``{"critic": RemoteCritic}``, :func:`save_checkpoint`'s ``remote``), each asked to load its entry
    (``start_load(path, entry)`` while this world loads, ``finish_load()``); their names count with
    ``models``'s.

    Returns the ``extra_state`` saved with it. Raises, on every rank: CheckpointError if the folder is
    incomplete or truncated (checked by rank 0, sizes only), has no optimizer state but ``optimizer`` is
    given, or holds other named models than ``models`` (one line naming the checkpoint and the fix),
    ValueError if the ranks name different folders, RuntimeError without ``torch.distributed``;
    megatron-core raises CheckpointingException for state that does not fit the model.
    """
    rank, world = require_dist()
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
    header = broadcast_object(header)
    if "error" in header:
        raise CheckpointError(header["error"])
    marker = header["marker"]
    saved_models = dict(marker.get("models") or {})
    remote = dict(remote or {})
    if models is not None and set(models) | set(remote) != set(saved_models):
        raise CheckpointError(models_mismatch(path, sorted(saved_models), sorted(set(models) | set(remote))))
    for name, part in remote.items():  # they load beside this world's load
        part.start_load(path, dict(saved_models[name], dist=model_dist_dir(name)))
    main = {"dist": DIST_DIR, "optimizer": marker.get("optimizer", "saved"),
            "sharding_metadata": marker.get("sharding_metadata")}
    load_model(path, main, ddp_model, optimizer, strict)
    for name, (other_model, other_optimizer) in (models or {}).items():
        load_model(path, dict(saved_models[name], dist=model_dist_dir(name)), other_model, other_optimizer,
                   strict)
    for name, part in remote.items():
        try:
            part.finish_load()
        except RuntimeError as e:  # raised on every rank alike
            raise CheckpointError(f"{path}: loading its {name} failed: {e}") from e

    if load_rng:
        layout = parallel_layout()
        same = all(marker.get(k) == layout[k] for k in ("world_size", "tp_size", "pp_size"))
        if same:
            set_rng_state(torch.load(path / RNG_DIR / f"rank_{rank:05d}.pt", weights_only=True))
        elif rank == 0:
            logger.warning("RNG states not restored: %s was saved with world/TP/PP %s/%s/%s, this job has "
                           "%s/%s/%s",
                           path, marker.get("world_size"), marker.get("tp_size"), marker.get("pp_size"),
                           layout["world_size"], layout["tp_size"], layout["pp_size"])
    dist.barrier()
    return header["extra"]


def models_mismatch(path: Path, saved: list[str], wanted: list[str]) -> str:
    """The one-line error for a checkpoint whose further models (e.g. the critic) are not this run's."""
    missing, unexpected = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    what = []
    if missing:
        what.append(f"has no {', '.join(missing)} model, which this run has")
    if unexpected:
        what.append(f"holds a {', '.join(unexpected)} model, which this run does not have")
    return (f"checkpoint {path} {' and '.join(what)}: it was saved by a run with other settings (e.g. another "
            f"algorithm.advantage_estimator; gae has a critic); resume with the settings it was saved with, "
            f"or start a new run in another run folder")


def load_model(path: Path, entry: Mapping[str, Any], ddp_model: torch.nn.Module, optimizer: Any,
               strict: bool) -> None:
    """Load one model (+ optimizer) of checkpoint ``path`` from its folder ``entry["dist"]``, as its
    ``COMPLETE`` entry (``optimizer``: saved | initial | none, ``sharding_metadata``) says; collective.
    Raises CheckpointError if it has no optimizer state but ``optimizer`` is given."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    dist_dir = str(path / entry["dist"])
    allowed = torch.serialization.safe_globals(optimizer_classes())
    with allowed:
        metadata = (dist_checkpointing.load_content_metadata(dist_dir)
                    or dict(entry.get("sharding_metadata") or {}))
    model = unwrap(ddp_model)
    saved_optimizer = entry.get("optimizer", "saved")
    if optimizer is not None and saved_optimizer == "none":
        raise CheckpointError(f"{path} was saved without optimizer state in {entry['dist']}/; load it with "
                              f"optimizer=None")
    load_optimizer = optimizer if saved_optimizer == "saved" else None
    zero_state_to_load_into(load_optimizer)
    sharded = sharded_state_dict(model, load_optimizer, metadata, is_loading=True)
    # Tensors asked for but absent from the checkpoint fail in the load itself; extra ones (the optimizer's
    # when loading the model only) are fine.
    with allowed:
        loaded = dist_checkpointing.load(sharded, dist_dir, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    with torch.no_grad():  # the distributed optimizer copies into views of parameters that require grad
        # a LoRA model's checkpoint has its adapters alone (checkpoint.state.sharded_state_dict): the frozen base
        # stays as loaded from the HF folder (an adapter absent from the checkpoint failed the load above)
        from hpcrl.train.lora import has_adapters

        model.load_state_dict(loaded["model"], strict=strict and not has_adapters(model))
        if load_optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
            restore_adam_steps(optimizer)
        elif optimizer is not None:  # saved before the first step
            reset_to_initial(optimizer)
