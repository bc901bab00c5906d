"""Weight sync from the Megatron trainer to the rollout engines (SGLang's HTTP weight-update protocol).

After each train step the trainer pushes its new weights to every engine, in slime's order: pause generation,
flush the KV cache, transfer, verify, continue; the last transfer call sets the engines' ``weight_version``.
Three transports (``weights.method`` in the run config):

- ``tensor`` (colocated; slime's ``UpdateWeightFromTensor``): HF tensors packed into buckets of at most
  ``weights.bucket_bytes`` (slime's ``--update-weight-buffer-size``), each bucket serialized as handles (CUDA
  IPC on GPU, shared memory on CPU) and sent with ``/update_weights_from_tensor`` (:mod:`.tensor`).
- ``distributed`` (disaggregated; slime's ``UpdateWeightFromDistributed``): the sender and every engine rank
  form one torch.distributed group; names/dtypes/shapes go by ``/update_weights_from_distributed``, the
  data by ``broadcast`` from rank 0 (:mod:`.distributed`).
- ``disk`` (slime's ``--update-weight-transport disk``): an HF safetensors folder ``weight_v{N:06d}/`` in a
  shared folder, loaded with ``/update_weights_from_disk`` (:mod:`.disk`).

On any of them, ``weights.delta`` sends only the changed words of each tensor (:mod:`.delta`) and
``weights.rollout_dtype: fp8`` block-fp8 weights with their scales (:mod:`.fp8`). docs/weight-sync.md says
what each costs.

Entry point: :class:`~hpcrl.weights.sync.WeightSyncer` and :func:`~hpcrl.weights.sync.iterate_for_sync`::

    syncer = WeightSyncer.from_config(client, cfg.weights, cfg.run.mode, is_sender=dist.get_rank() == 0)
    metrics = await syncer.sync(iterate_for_sync(model), weight_version=str(step))   # on every trainer rank
    ...
    await syncer.close()

The names below are re-exported from the modules that define them (:mod:`.sync`, :mod:`.buckets`,
:mod:`.common`); those import nothing heavy at import time (torch, aiohttp and megatron are imported where
used), so neither does this package.
"""

from __future__ import annotations

from hpcrl.weights.buckets import iter_buckets, tensor_nbytes
from hpcrl.weights.common import WeightSyncError
from hpcrl.weights.sync import WeightSyncer, iterate_for_sync

__all__ = ["WeightSyncError", "WeightSyncer", "iter_buckets", "iterate_for_sync", "tensor_nbytes"]
