"""Weight sync of LoRA adapters (``model.lora.sync: adapter``; issue #56 point 3): a sync sends the actor's
adapters alone (PEFT's tensors, :func:`hpcrl.train.lora.peft_state_dict`: megabytes where the model is
gigabytes), every engine loads them as a new LoRA adapter, and from then on the rollout's requests name it
(``lora_path``, in the client's ``generate_fields``).

- ``tensor`` (colocated): ``/load_lora_adapter_from_tensors`` with ``config_dict`` (PEFT's
  ``adapter_config.json``) and ``serialized_named_tensors``, one ``{name: tensor}`` payload per engine TP rank
  (SGLang's form; shared memory, as the weight updates' payloads);
- ``disk`` (and ``distributed``: SGLang loads no adapter from a process group): a PEFT adapter folder
  ``adapter_v{N:06d}/`` in the sync folder, written atomically, then ``/load_lora_adapter``;
- then ``/update_weight_version`` (``abort_all_requests: false``): the engines report the new version.

Each adapter gets a new name (``hpcrl-policy-{version}-{n}``, n counting this run's syncs), so requests in
flight keep the adapter they started on (a pause ``in_place`` or ``retract`` resumes them on it) while new ones
take the new; the one before the previous is unloaded after the sync (SGLang's unload returns once the
requests on it have finished). The engines must be launched with ``--enable-lora``, ``--max-lora-rank`` and
``--lora-target-modules`` (:func:`hpcrl.rollout.engines.engine_sglang_args` adds them).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, Sequence

from hpcrl.weights.common import EngineCalls, WeightSyncError

logger = logging.getLogger(__name__)

KEEP = 2
"""Adapters left loaded on the engines after a sync: the new one and the previous (requests in flight)."""


def adapter_sync_config(cfg: Any, model_path: Any) -> Optional[dict]:
    """PEFT's ``adapter_config.json`` of the actor's adapters when run config ``cfg`` syncs them alone
    (``model.lora.sync: adapter``; ``model_path`` its ``base_model_name_or_path``), else None."""
    lora = cfg.model.lora
    if lora is None or lora.sync != "adapter":
        return None
    from hpcrl.train.lora import LoraSpec, peft_config

    return peft_config(LoraSpec.of(lora), str(model_path))


def adapter_name(weight_version: str, count: "int | str") -> str:
    """The engines' name of the adapter of ``weight_version`` sent by this run's ``count``-th sync."""
    return f"hpcrl-policy-{weight_version}-{count}"


def tensors_body(name: str, config: dict, payload: str, tp: int) -> dict:
    """SGLang's ``LoadLoRAAdapterFromTensorsReqInput``: ``payload`` (:func:`hpcrl.engine.serialize.
    serialize_tensor_dict`) once per engine TP rank."""
    return {"lora_name": name, "config_dict": config, "serialized_named_tensors": [payload] * tp}


def folder_body(name: str, folder: Path) -> dict:
    """SGLang's ``LoadLoRAAdapterReqInput`` for a PEFT folder."""
    return {"lora_name": name, "lora_path": str(folder)}


def unload_body(name: str) -> dict:
    """SGLang's ``UnloadLoRAAdapterReqInput``."""
    return {"lora_name": name}


def version_body(weight_version: str) -> dict:
    """SGLang's ``UpdateWeightVersionReqInput``, requests in flight left alone (they keep their adapter)."""
    return {"new_version": weight_version, "abort_all_requests": False}


async def send_adapter(calls: EngineCalls, named_tensors: Iterable, weight_version: str, name: str, *,
                       config: dict, method: str, tp_sizes: Optional[Sequence[int]],
                       disk_dir: Optional[str]) -> dict:
    """Load ``named_tensors`` (PEFT's names, whole tensors) as adapter ``name`` (PEFT ``config``) on every
    engine of ``calls``, by ``method`` (``tensor``: from tensors; else from a folder in ``disk_dir``), then set
    ``weight_version``. Returns ``{"bytes", "buckets": 1, "tensors"}``. Raises WeightSyncError naming the
    engine that refused, ValueError for an empty stream."""
    tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in named_tensors}
    if not tensors:
        raise ValueError("no adapter tensors to sync")
    nbytes = sum(int(t.numel()) * t.element_size() for t in tensors.values())
    if method == "tensor":
        from hpcrl.engine.serialize import serialize_tensor_dict

        payload = serialize_tensor_dict(list(tensors.items()))
        sizes = list(tp_sizes or [1] * len(calls.urls))
        await calls.each("/load_lora_adapter_from_tensors", [tensors_body(name, config, payload, tp) for tp in sizes],
                         per_engine=True)
    else:
        folder = write_adapter_folder(tensors, config, Path(disk_dir), weight_version)
        await calls.each("/load_lora_adapter", folder_body(name, folder))
    await calls.each("/update_weight_version", version_body(weight_version))
    return {"bytes": nbytes, "buckets": 1, "tensors": len(tensors)}


def write_adapter_folder(tensors: dict, config: dict, disk_dir: Path, weight_version: str) -> Path:
    """A PEFT adapter folder ``disk_dir/adapter_v{N:06d}`` (``adapter_config.json`` + ``adapter_model.
    safetensors``; N the version when it is an integer, else the time in ms) written atomically; its path.
    Raises OSError."""
    from hpcrl.train.lora import save_peft_folder

    index = int(weight_version) if weight_version.isdigit() else int(time.time() * 1000)
    dest = disk_dir / f"adapter_v{index:06d}"
    save_peft_folder(tensors, config, dest)
    return dest


async def unload_old(calls: EngineCalls, loaded: list[str], disk_dir: Optional[str]) -> None:
    """Unload every adapter of ``loaded`` (oldest first) but the last :data:`KEEP` from every engine (the list
    is trimmed in place), and remove the ``adapter_v*`` folders of ``disk_dir`` but the newest :data:`KEEP`. An
    engine that no longer has an adapter (replaced since) is logged, not an error."""
    while len(loaded) > KEEP:
        name = loaded.pop(0)
        try:
            await calls.each("/unload_lora_adapter", unload_body(name))
        except WeightSyncError as e:
            logger.warning("unloading LoRA adapter %s: %s", name, e)
    if disk_dir is not None and Path(disk_dir).is_dir():
        for old in sorted(Path(disk_dir).glob("adapter_v*"))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)


def current_adapter(client: Any) -> Optional[str]:
    """The adapter ``client``'s ``/generate`` requests name (None: the base model)."""
    return client.generate_fields.get("lora_path")
