"""The weights the engines serve, kept on the controller's host so that a restarted engine can load them.

An engine that died is replaced by a new process (:mod:`hpcrl.rollout.health`), which must serve the current
weight version before it rejoins. The trainer cannot push them then: in sync mode it waits for the rollout
(and with tensor parallelism its export is a collective of all TP ranks), in async mode it is already training
the next version. So every weight sync is teed (:meth:`WeightSnapshot.tee`): each HF tensor the sync sends is
also copied to host memory, and a restart writes that copy once as an HF safetensors folder
(``run_dir/weights-rejoin/v<version>``, the run folder being shared with the engines' nodes) that the new
engine starts from. Before the first sync the snapshot is the model folder the engines started from.

Cost: one copy of the model in host memory on the controller, in the dtype the sync sends (e.g. 1 GB for a
0.5B model in bf16), and a device-to-host copy per sync on GPUs. It is only made when engines may restart
(``rollout.max_engine_restarts`` > 0). slime keeps no copy: it restarts dead engines only at the next weight
sync, so a run whose every engine died cannot finish its rollout.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional


class WeightSnapshot:
    """Host copy of the last weight version sent to the engines.

    Args:
        root: folder for the written snapshots (created when first written).
        model_path: the HF folder the engines started from (what a restart loads before the first sync; its
            config and tokenizer files are copied into every written snapshot).
        bucket_bytes: most bytes per safetensors shard written.
        adapter_config: PEFT's ``adapter_config.json`` when the syncs send LoRA adapters alone
            (:mod:`hpcrl.weights.adapter`): the snapshot holds the adapter, a restarted engine starts from
            ``model_path`` and loads it (:meth:`load_on`).
    """

    def __init__(self, root: Path, model_path: Path, bucket_bytes: int = 512 * 1024 * 1024,
                 adapter_config: Optional[dict] = None) -> None:
        self.root, self.model_path, self.bucket_bytes = Path(root), Path(model_path), int(bucket_bytes)
        self.adapter_config = adapter_config
        self.version: Optional[str] = None
        """The version of the held tensors (None before the first sync)."""
        self._tensors: Optional[list[tuple[str, Any]]] = None
        self._written: Optional[tuple[str, Path]] = None
        self._lock = threading.Lock()

    def tee(self, named_tensors: Iterable[tuple[str, Any]], version: Any) -> Iterator[tuple[str, Any]]:
        """Yield ``named_tensors`` unchanged (``(hf_name, tensor)``) while copying each tensor to host memory;
        once the stream is consumed whole, the copy becomes the snapshot of ``version``. A stream stopped
        early leaves the previous snapshot in place."""
        kept = []
        for name, t in named_tensors:
            kept.append((name, t.detach().to("cpu", copy=True)))
            yield name, t
        with self._lock:
            self._tensors, self.version = kept, str(version)

    def folder(self) -> tuple[Path, Optional[str]]:
        """``(HF folder, version)`` a restarted engine starts from: the snapshot written as a folder (once per
        version; older ones removed), or ``(model_path, None)`` before the first sync and for adapters (the
        engine starts from the base, then :meth:`load_on`). Raises OSError when the folder cannot be
        written."""
        from hpcrl.weights.disk import write_hf_folder

        with self._lock:
            tensors, version = self._tensors, self.version
            if tensors is None or version is None or self.adapter_config is not None:
                return self.model_path, None
            if self._written is not None and self._written[0] == version:
                return self._written[1], version
            dest = self.root / f"v{version}"
            write_hf_folder(tensors, dest, bucket_bytes=self.bucket_bytes, hf_checkpoint=self.model_path)
            for old in self.root.iterdir():
                if old.is_dir() and old != dest and old.name.startswith("v"):
                    shutil.rmtree(old, ignore_errors=True)
            self._written = (version, dest)
            return dest, version

    async def load_on(self, client: Any, url: str, timeout_s: Optional[float] = None,
                      name: Optional[str] = None) -> None:
        """Bring the engine at ``url`` to the snapshot's version through ``client`` (a
        :class:`hpcrl.rollout.client.RolloutClient`): ``/update_weights_from_disk`` of :meth:`folder`, or for
        adapters the adapter (a PEFT folder under ``root``) loaded under the name the client's requests use,
        then that version. Nothing before the first sync. Raises RolloutError, OSError."""
        import asyncio

        from hpcrl.weights.adapter import current_adapter, folder_body, version_body

        if self.adapter_config is None:
            path, version = await asyncio.to_thread(self.folder)
            if version is not None:
                await client.request("POST", "/update_weights_from_disk",
                                     {"model_path": str(path), "weight_version": version}, base_url=url,
                                     retry=False, timeout_s=timeout_s)
            return
        name = name or current_adapter(client)
        written = await asyncio.to_thread(self._adapter_folder) if name is not None else None
        if written is None:
            return
        folder, version = written
        for endpoint, body in (("/load_lora_adapter", folder_body(name, folder)),
                               ("/update_weight_version", version_body(version))):
            await client.request("POST", endpoint, body, base_url=url, retry=False, timeout_s=timeout_s)

    def _adapter_folder(self) -> Optional[tuple[Path, str]]:
        """``(PEFT folder, version)`` of the held adapter, written under :attr:`root` once per version (older
        ones removed), every engine that rejoins loading the same; None before the first sync. Raises OSError."""
        from hpcrl.weights.adapter import write_adapter_folder

        with self._lock:
            tensors, version = self._tensors, self.version
            if tensors is None or version is None:
                return None
            if self._written is not None and self._written[0] == version:
                return self._written[1], version
            dest = write_adapter_folder(dict(tensors), self.adapter_config, self.root, version)
            for old in self.root.glob("adapter_v*"):
                if old != dest:
                    shutil.rmtree(old, ignore_errors=True)
            self._written = (version, dest)
            return dest, version
