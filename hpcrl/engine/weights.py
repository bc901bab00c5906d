"""In-place weight updates of the engine's model, and the torch.distributed weight-update groups.

Weights are addressed by their Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``).
Every update validates *all* incoming names and shapes before it copies anything, so a failed update leaves
the model unchanged. Incoming tensors are cast to the parameter's dtype.

Weight-update groups are extra torch.distributed process groups (one per ``group_name``) created next to, not
as, the default group, so the engine and a trainer that already has its own default group can both join: rank
0 is the trainer's sender, the engine's rank is ``rank_offset``. Both sides must call
:func:`init_custom_process_group` with the same address, port, world size and group name (the store is
prefixed with the group name, as SGLang and slime do). Backend ``nccl`` falls back to ``gloo`` when CUDA is
absent.
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path

import torch

from hpcrl.weights.distributed import wire_view

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightUpdateError(ValueError):
    """An update was refused (unknown name, shape mismatch, bad file, group error); nothing was changed."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``, ``"torch.bfloat16"`` or a dtype to a ``torch.dtype``. Raises WeightUpdateError if
    unknown."""
    if isinstance(name, torch.dtype):
        return name
    attr = str(name).removeprefix("torch.")
    dtype = getattr(torch, attr, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}")
    return dtype


class WeightLoader:
    """Copies named tensors into ``model``'s parameters and persistent buffers.

    ``model``: the HF model. Tied ``lm_head.weight`` (with ``tie_word_embeddings``) and rotary ``inv_freq``
    buffers are accepted and skipped, as SGLang's loaders do. A MoE model's experts are also addressed by
    their checkpoint names (``mlp.experts.{e}.gate_proj.weight`` ...: views into transformers 5's fused
    ``gate_up_proj`` / ``down_proj``, :mod:`hpcrl.models.moe`), which is what the trainer sends and SGLang
    loads; a Mixtral's also by its checkpoint names (``block_sparse_moe.gate.weight``,
    ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``), which the trainer sends for it.

    ``fp8``: the engine serves block-fp8 weights (:mod:`hpcrl.weights.fp8`) and emulates them: an
    ``float8_e4m3fn`` weight and its ``<name>_scale_inv`` (which may come in different calls, as SGLang loads
    them into two parameters) are kept as sent, and the parameter is their dequantisation whenever one of
    them changes; any other tensor loads as usual.
    """

    def __init__(self, model: torch.nn.Module, fp8: bool = False):
        from hpcrl.models.moe import unfuse_experts

        self.model = model
        self._targets = dict(model.named_parameters())
        for name, buf in model.named_buffers():
            self._targets.setdefault(name, buf)
        for name, view in unfuse_experts(dict(model.named_parameters())).items():
            self._targets.setdefault(name, view)
        if getattr(model.config, "model_type", None) == "mixtral":  # checkpoint names, as the trainer sends
            from hpcrl.models.moe import to_mixtral_name

            for name, target in list(self._targets.items()):
                self._targets.setdefault(to_mixtral_name(name), target)
        self._tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.fp8 = fp8
        self._fp8: dict[str, list] = {}
        """``{weight name: [fp8 tensor or None, scale_inv or None]}`` as last sent (``fp8`` engines)."""

    def names(self) -> list[str]:
        """HF names of the parameters and buffers that updates can target."""
        return list(self._targets)

    def _skip(self, name: str) -> bool:
        if name.endswith(_IGNORED_SUFFIXES):
            return True
        return self._tied and name == "lm_head.weight" and name not in self._targets

    def check(self, names_shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        """Validate names and shapes against the model. Raises WeightUpdateError listing every problem."""
        from hpcrl.weights.fp8 import SCALE_SUFFIX, scale_shape

        problems = []
        for name, shape in names_shapes:
            if self._skip(name):
                continue
            if self.fp8 and name.endswith(SCALE_SUFFIX):
                target = self._targets.get(name.removesuffix(SCALE_SUFFIX))
                if target is not None and target.dim() == 2:  # the scales of that weight's blocks
                    target = torch.empty(scale_shape(tuple(target.shape)), device="meta")
            else:
                target = self._targets.get(name)
            if target is None:
                problems.append(f"unknown parameter {name!r}")
            elif tuple(target.shape) != tuple(shape):
                problems.append(f"shape mismatch for {name!r}: got {list(shape)}, "
                                f"model has {list(target.shape)}")
        if problems:
            shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
            raise WeightUpdateError("; ".join(shown))

    @torch.no_grad()
    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Validate, then copy each tensor into its parameter. Returns how many tensors were copied.

        Raises WeightUpdateError (and changes nothing) on an unknown name, a shape mismatch or a non-tensor
        value.
        """
        for name, t in named_tensors:
            if not isinstance(t, torch.Tensor):
                raise WeightUpdateError(f"value for {name!r} is not a tensor")
        self.check([(name, tuple(t.shape)) for name, t in named_tensors])
        count, touched = 0, []
        for name, t in named_tensors:
            if self._skip(name):
                continue
            fp8 = self._fp8_part(name, t)
            if fp8 is not None:
                touched.append(fp8)
            else:
                target = self._targets[name]
                target.copy_(t.to(device=target.device, dtype=target.dtype))
            count += 1
        for name in dict.fromkeys(touched):
            self._dequantize(name)
        return count

    def _fp8_part(self, name: str, t: torch.Tensor) -> str | None:
        """On an ``fp8`` engine, keep a block-fp8 weight or its scales and return the weight's name; None for
        any other tensor."""
        from hpcrl.weights.fp8 import FP8, SCALE_SUFFIX

        if not self.fp8:
            return None
        if name.endswith(SCALE_SUFFIX):
            weight, i = name.removesuffix(SCALE_SUFFIX), 1
        elif t.dtype == FP8:
            weight, i = name, 0
        else:
            self._fp8.pop(name, None)  # a weight sent in full precision: no longer an fp8 pair
            return None
        self._fp8.setdefault(weight, [None, None])[i] = t.detach().to("cpu", copy=True)
        return weight

    def _dequantize(self, name: str) -> None:
        """The parameter ``name`` from its kept fp8 weight and scales (once both have come)."""
        from hpcrl.weights.fp8 import dequantize

        q, scale = self._fp8[name]
        if q is not None and scale is not None:
            target = self._targets[name]
            target.copy_(dequantize(q, scale, target.dtype).to(target.device))

    def checksums(self, skip: list[str] | None = None) -> dict[str, str]:
        """``{name: 16 hex digits}``: a BLAKE2b hash of the bytes of every parameter and persistent buffer
        (names with a substring in ``skip`` left out); equal exactly when the tensors are bitwise equal."""
        import hashlib

        out = {}
        for name, t in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            if any(s in name for s in skip or ()) or name.endswith(_IGNORED_SUFFIXES):
                continue
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[name] = hashlib.blake2b(data, digest_size=8).hexdigest()
        return out

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """:meth:`load` under the name SGLang's models give it (what :func:`hpcrl.weights.delta.load_delta`
        calls)."""
        return self.load(named_tensors)

    def load_delta(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Apply a delta sync's payload (:mod:`hpcrl.weights.delta`: full tensors, index or mask + values)
        with the loader SGLang runs for it (:func:`hpcrl.weights.delta.load_delta`, its base kept on this
        loader). Returns how many tensors were loaded. Raises WeightUpdateError (and changes nothing) on a
        delta without a base, a piece that does not fit it, an unknown name or a shape mismatch."""
        from hpcrl.weights.delta import DeltaError, load_delta, split_pieces

        try:
            n = len(split_pieces(named_tensors))
            load_delta(self, named_tensors)
        except DeltaError as e:
            raise WeightUpdateError(str(e)) from e
        return n

    def load_from_disk(self, model_path: str | Path, delta: bool = False) -> int:
        """Load all safetensors weights of an HF folder of the same architecture. Returns tensors copied.
        ``delta``: the folder holds a delta sync's pieces (:meth:`load_delta`).

        Raises WeightUpdateError if the folder is missing, has no ``*.safetensors`` files, declares other
        ``architectures`` in its config.json, or has unknown names or wrong shapes.
        """
        from safetensors.torch import load_file

        path = Path(model_path)
        if not path.is_dir():
            raise WeightUpdateError(f"model_path {str(path)!r} is not a folder")
        cfg_file = path / "config.json"
        if cfg_file.exists():
            theirs = json.loads(cfg_file.read_text()).get("architectures")
            ours = getattr(self.model.config, "architectures", None)
            if theirs and ours and list(theirs) != list(ours):
                raise WeightUpdateError(f"architecture mismatch: {theirs} in {path}, engine serves {ours}")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"no *.safetensors files in {path}")
        tensors: list[tuple[str, torch.Tensor]] = []
        for f in files:
            try:
                tensors.extend(load_file(str(f)).items())
            except Exception as e:  # noqa: BLE001 - report as a failed update
                raise WeightUpdateError(f"cannot read {f}: {e}") from e
        return self.load_delta(tensors) if delta else self.load(tensors)


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's ``overall_checksum``: SHA-256 over the sorted names and their hashes."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta):
    """Create a process group next to (not as) the default group, as SGLang's ``init_custom_process_group``.

    ``init_method``: ``tcp://host:port`` (rank 0 hosts the TCPStore). The store is prefixed with
    ``group_name``. Returns the ``ProcessGroup``. Raises on rendezvous timeout (``timeout``) or backend
    errors. Both the trainer (rank 0) and the engine use this function.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def resolve_backend(backend: str) -> str:
    """``nccl`` becomes ``gloo`` without CUDA; other names pass through."""
    if backend == "nccl" and not torch.cuda.is_available():
        return "gloo"
    return backend


class WeightUpdateGroups:
    """The engine's weight-update process groups by name, and receiving tensors on them.

    ``timeout_s``: seconds for rendezvous and for each collective (the group's timeout).
    """

    def __init__(self, timeout_s: float):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._groups: dict[str, tuple[object, str]] = {}

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str) -> str:
        """Join group ``group_name`` as rank ``rank_offset``. Returns the backend used.

        Raises WeightUpdateError if the group exists or the rendezvous / backend setup fails (e.g. timeout).
        """
        if group_name in self._groups:
            raise WeightUpdateError(f"weight update group {group_name!r} already exists")
        if not 0 <= rank_offset < world_size:
            raise WeightUpdateError(f"rank_offset {rank_offset} is outside world_size {world_size}")
        used = resolve_backend(backend)
        try:
            pg = init_custom_process_group(used, f"tcp://{master_address}:{master_port}", world_size,
                                           rank_offset, group_name, self.timeout)
        except Exception as e:  # noqa: BLE001 - a failed init is a failed request
            raise WeightUpdateError(f"cannot init weight update group {group_name!r}: {e}") from e
        self._groups[group_name] = (pg, used)
        return used

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                loader: WeightLoader, delta: bool = False) -> int:
        """Receive each tensor by ``broadcast(src=0)`` on the group, then load them all (``delta``: a delta
        sync's pieces, :meth:`WeightLoader.load_delta`). Returns tensors copied.

        All broadcasts are received even when a name or shape is wrong (so the sender does not hang); the
        update is then refused as a whole. Raises WeightUpdateError on an unknown group, mismatched list
        lengths, a bad dtype, a communication error or timeout, or a failed validation.
        """
        entry = self._groups.get(group_name)
        if entry is None:
            raise WeightUpdateError(f"unknown weight update group {group_name!r}; "
                                    "call /init_weights_update_group first")
        pg, backend = entry
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightUpdateError("names, dtypes and shapes must have the same length")
        parsed = [parse_dtype(d) for d in dtypes]
        device = "cuda" if backend == "nccl" else "cpu"
        received = []
        try:
            for name, dtype, shape in zip(names, parsed, shapes):
                t = torch.empty(tuple(shape), dtype=dtype, device=device)
                torch.distributed.broadcast(wire_view(t), src=0, group=pg)
                received.append((name, t))
        except Exception as e:  # noqa: BLE001 - timeout or peer failure
            raise WeightUpdateError(f"broadcast on {group_name!r} failed: {e}") from e
        return loader.load_delta(received) if delta else loader.load(received)

    def destroy(self, group_name: str) -> None:
        """Destroy group ``group_name``. Raises WeightUpdateError if it does not exist."""
        entry = self._groups.pop(group_name, None)
        if entry is None:
            raise WeightUpdateError(f"unknown weight update group {group_name!r}")
        try:
            torch.distributed.destroy_process_group(entry[0])
        except Exception as e:  # noqa: BLE001
            logger.warning("destroying group %s: %s", group_name, e)

    def destroy_all(self) -> None:
        """Destroy every group (at shutdown)."""
        for name in list(self._groups):
            self.destroy(name)
