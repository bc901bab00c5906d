"""Export an hpcrl checkpoint's model as an HF folder (safetensors + config + tokenizer) an engine can serve.

:func:`mcore_to_hf` builds the megatron-core GPTModel from the run's base HF folder, loads the model part of a
checkpoint (:mod:`hpcrl.checkpoint`; the optimizer is not read) and writes the weights with
:func:`hpcrl.train.bridge.export_hf_weights` (a LoRA run's adapters merged in: the model it trained). It runs
as a single process (tensor-parallel size 1) whatever tensor-parallel size the checkpoint was saved with:
megatron-core's ``dist_checkpointing`` reads each parameter's shards and reassembles them. Inside a running
``torch.distributed`` job every rank calls it and rank 0 writes.

Output folder (written to ``<out_dir>.tmp-<nonce>`` and renamed, so it is either complete or absent)::

    out_dir/
      model.safetensors             or model-00001-of-0000N.safetensors ... + model.safetensors.index.json
      config.json                   the base folder's, with ``dtype`` set to the exported dtype
      tokenizer.json, tokenizer_config.json, generation_config.json, ...  copied from the base folder
      hpcrl_export.json             provenance: checkpoint folder, rollout id, dtype

Command line: ``python -m hpcrl.convert CHECKPOINT_OR_RUN_DIR HF_BASE OUT_DIR [--dtype bfloat16]`` (a run
folder means its newest complete checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from hpcrl.fsutil import fsync_path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
"""Files of the base folder that are weights (not copied); everything else at its top level is copied."""
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _dtype(name: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype (e.g. float32, bfloat16)")
    return dtype



def _vocab_divisor(padded_vocab_size: int, tp: int) -> int:
    """``make_vocab_size_divisible_by`` that pads exactly to ``padded_vocab_size`` at TP size ``tp``."""
    if padded_vocab_size % tp:
        raise ValueError(f"the checkpoint's padded vocab ({padded_vocab_size}) does not split over TP={tp}")
    return padded_vocab_size // tp


class _ShardWriter:
    """Write ``(name, tensor)`` pairs into safetensors files of at most ``max_bytes`` each (one tensor may be
    bigger), named as HF names them: ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json``."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.parts: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.max_bytes:
            self._flush()
        self.current[name] = tensor.contiguous().cpu()
        self.current_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        part = f"part-{len(self.parts):05d}.safetensors"
        save_file(self.current, str(self.folder / part), metadata={"format": "pt"})
        self.parts.append((part, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def close(self) -> None:
        """Write the last file, give the files their final names and write the index if there are several."""
        if self.current or not self.parts:
            self._flush()
        n = len(self.parts)
        if n == 1:
            os.rename(self.folder / self.parts[0][0], self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, (part, names) in enumerate(self.parts):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.rename(self.folder / part, self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def mcore_to_hf(checkpoint_dir: Union[str, os.PathLike], hf_base_path: Union[str, os.PathLike],
                out_dir: Union[str, os.PathLike], dtype: Optional[Union[str, torch.dtype]] = None,
                megatron: Optional[Mapping[str, Any]] = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, fp8: bool = False) -> Path:
    """Write the model of an hpcrl checkpoint as an HF safetensors folder at ``out_dir``; returns ``out_dir``.

    ``checkpoint_dir``: an ``iter_XXXXXXX`` folder (:mod:`hpcrl.checkpoint`). ``hf_base_path``: the run's base
    HF folder (config + tokenizer; its weights are not read). ``dtype``: of the written tensors, default the
    dtype the model was trained in (the checkpoint marker's ``params_dtype``). ``megatron``: the run config's
    free ``megatron:`` dict, for TransformerConfig overrides that change the model (rarely needed).
    ``max_shard_bytes``: largest safetensors file; bigger models get several files and an index. ``fp8``: the
    linear weights in block-fp8 with their ``_scale_inv`` (:mod:`hpcrl.weights.fp8`, what the engines of a
    ``weights.rollout_dtype: fp8`` run serve; the rest in ``dtype``) and ``quantization_config`` in the config.

    Without ``torch.distributed`` a world of 1 at TP=1 is started and torn down afterwards; inside a job
    every rank must call (each tensor is gathered over the TP group) and rank 0 writes. The model is built
    with the checkpoint's padded vocab size, so a checkpoint saved at any TP size loads at TP=1.
    Raises FileExistsError if ``out_dir`` exists, :class:`hpcrl.checkpoint.CheckpointError` for an
    incomplete checkpoint, ValueError for a bad dtype or a padded vocab that does not split over this job's
    TP size, OSError if writing fails.
    """
    from hpcrl import checkpoint
    from hpcrl.train import bridge

    checkpoint_dir, hf_base_path, out_dir = Path(checkpoint_dir), Path(hf_base_path), Path(out_dir)
    marker = checkpoint.validate_checkpoint(checkpoint_dir)
    train_dtype = _dtype(marker.get("params_dtype") or "float32")
    out_dtype = _dtype(dtype) if dtype is not None else train_dtype

    with _world():
        rank = dist.get_rank()
        tmp = None
        if rank == 0:
            if out_dir.exists():
                tmp = {"error": f"{out_dir} already exists"}
            else:
                tmp = {"path": str(out_dir.with_name(f"{out_dir.name}.tmp-{secrets.token_hex(4)}"))}
        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        if "error" in box[0]:
            raise FileExistsError(box[0]["error"])
        tmp = Path(box[0]["path"])
        model = checkpoint_model(checkpoint_dir, hf_base_path, marker, megatron)

        writer, error = None, None
        if rank == 0:
            tmp.mkdir(parents=True)
            writer = _ShardWriter(tmp, max_shard_bytes)
        stream = bridge.export_hf_weights(model, dtype=out_dtype)  # a collective per tensor
        if fp8:
            from hpcrl.weights.fp8 import quantize_stream

            stream = quantize_stream(stream)
        for name, tensor in stream:
            if writer is not None:
                writer.add(name, tensor)
        del model
        if rank == 0:
            try:
                writer.close()
                _write_metadata_files(hf_base_path, tmp, out_dtype, checkpoint_dir, marker, fp8)
                for f in tmp.iterdir():
                    fsync_path(f)
                fsync_path(tmp)
                os.rename(tmp, out_dir)
                fsync_path(out_dir.parent)
            except OSError as e:
                error = f"writing {out_dir} failed: {e}"
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise OSError(box[0])
        return out_dir


@contextlib.contextmanager
def _world():
    """``torch.distributed`` and megatron-core's model parallelism for a conversion: a world of 1 at TP=1 when
    none is running (torn down after), else the running job's."""
    from megatron.core import parallel_state

    from hpcrl.train import parallel

    started_dist = not dist.is_initialized()
    if started_dist:
        parallel.init_distributed()
    started_mp = not parallel_state.model_parallel_is_initialized()
    if started_mp:
        parallel.initialize_model_parallel(tp=1)
        # the model-parallel RNG states the layers' init forks (on CUDA a missing one is an error: "cuda rng
        # state model-parallel-rng is not added", seen on an H100); the values are overwritten by the checkpoint
        if torch.cuda.is_available():
            parallel.model_parallel_cuda_manual_seed(0)
    try:
        yield
    finally:
        if started_mp:
            parallel_state.destroy_model_parallel()
        if started_dist:
            dist.destroy_process_group()


def checkpoint_model(checkpoint_dir: Path, hf_base_path: Path, marker: Mapping[str, Any],
                     megatron: Optional[Mapping[str, Any]] = None) -> torch.nn.Module:
    """The megatron-core GPTModel of ``checkpoint_dir`` (built from ``hf_base_path``'s config with the
    checkpoint's padded vocab and dtype; for a LoRA run's checkpoint, :func:`checkpoint_lora`, the base weights
    loaded from ``hf_base_path`` and the adapters added), its weights loaded, in eval mode. Needs :func:`_world`.
    Raises what the checkpoint load raises."""
    from transformers import AutoConfig
    from megatron.core import parallel_state

    from hpcrl import checkpoint
    from hpcrl.train import bridge, model as tmodel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    hf_config = AutoConfig.from_pretrained(str(hf_base_path))
    extra = tmodel.split_megatron_kwargs(megatron)
    model_kwargs = dict(extra["model"], **extra["transformer"])
    for key in ("bf16", "fp16", "params_dtype", "pipeline_dtype"):  # the checkpoint's dtype decides
        model_kwargs.pop(key, None)
    if marker.get("padded_vocab_size"):
        model_kwargs["make_vocab_size_divisible_by"] = _vocab_divisor(marker["padded_vocab_size"], tp)
    model = bridge.build_gpt_model(hf_config, dtype=_dtype(marker.get("params_dtype") or "float32"),
                                   **model_kwargs)
    spec = checkpoint_lora(checkpoint_dir)
    if spec is not None:  # a LoRA run's checkpoint holds its adapters alone: the frozen base is the HF folder's
        from hpcrl.train.lora import add_lora

        bridge.load_hf_weights(model, hf_base_path)
        add_lora(model, spec)
    checkpoint.load_checkpoint(checkpoint_dir, model, None, load_rng=False)
    model.eval()
    return model


def mcore_to_peft(checkpoint_dir: Union[str, os.PathLike], hf_base_path: Union[str, os.PathLike],
                  out_dir: Union[str, os.PathLike]) -> Path:
    """Write the LoRA adapters of a LoRA run's checkpoint as a PEFT adapter folder at ``out_dir``
    (``adapter_config.json`` + ``adapter_model.safetensors``: what ``peft.PeftModel.from_pretrained`` on the
    base loads, and SGLang's ``/load_lora_adapter``; :func:`hpcrl.train.lora.write_peft_folder`); returns
    ``out_dir``. Raises ValueError for a checkpoint of a run without ``model.lora``, FileExistsError if
    ``out_dir`` exists, :class:`hpcrl.checkpoint.CheckpointError` for an incomplete checkpoint."""
    from hpcrl import checkpoint
    from hpcrl.train.lora import write_peft_folder

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    spec = checkpoint_lora(checkpoint_dir)
    if spec is None:
        raise ValueError(f"{checkpoint_dir} was saved by a run without model.lora: it has no adapters "
                         "(export it with mcore-to-hf)")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    marker = checkpoint.validate_checkpoint(checkpoint_dir)
    with _world():
        write_peft_folder(checkpoint_model(checkpoint_dir, Path(hf_base_path), marker), out_dir, spec,
                          base_model=str(hf_base_path))
    return out_dir


def checkpoint_lora(checkpoint_dir: Union[str, os.PathLike]):
    """The :class:`hpcrl.train.lora.LoraSpec` of the run that saved ``checkpoint_dir`` (its ``state.json``'s
    ``model.lora``), or None for a run without adapters (or a checkpoint without ``state.json``)."""
    from hpcrl.config.lora import LoraSection
    from hpcrl.train.lora import LoraSpec

    state = Path(checkpoint_dir, "state.json")
    section = ((json.loads(state.read_text()).get("config") or {}).get("model") or {}).get("lora") \
        if state.exists() else None
    return LoraSpec.of(LoraSection(**section)) if section else None


def _write_metadata_files(base: Path, out: Path, dtype: torch.dtype, checkpoint_dir: Path,
                          marker: Mapping[str, Any], fp8: bool = False) -> None:
    """Copy the base folder's non-weight files (tokenizer, generation config); write config, provenance."""
    for f in sorted(base.iterdir()):
        weights = f.name in WEIGHT_INDEXES or f.name.endswith(WEIGHT_SUFFIXES)
        if not f.is_file() or weights or f.name == "config.json":
            continue
        shutil.copy2(f, out / f.name)
    config = json.loads((base / "config.json").read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    config["dtype"] = dtype_name
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    if fp8:
        from hpcrl.weights.fp8 import QUANTIZATION_CONFIG

        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    provenance = {"checkpoint": str(checkpoint_dir.resolve()), "rollout_id": marker.get("rollout_id"),
                  "dtype": dtype_name, "saved_tp_size": marker.get("tp_size")}
    (out / "hpcrl_export.json").write_text(json.dumps(provenance, indent=2) + "\n")


def convert_run_checkpoint(src: Union[str, os.PathLike], dst: Union[str, os.PathLike],
                           hf_base: Optional[Union[str, os.PathLike]] = None, dtype: Optional[str] = None,
                           fp8: bool = False, peft: bool = False) -> Path:
    """``hpcrl convert mcore-to-hf``: export a checkpoint folder, or a run folder's newest complete one
    (``peft``: ``hpcrl convert mcore-to-peft``, a LoRA run's adapters as a PEFT folder: :func:`mcore_to_peft`).

    ``hf_base`` defaults to the HF folder the run trained from, read from the checkpoint's ``state.json``
    (``sft.output`` when SFT was enabled, else ``model.path``; a relative one is taken from the folder the run
    started in, :func:`_launch_relative`). ``fp8``: block-fp8 linear weights (:func:`mcore_to_hf`). Raises
    FileNotFoundError when ``src`` holds no
    complete checkpoint, ValueError when the base cannot be derived.
    """
    from hpcrl import checkpoint

    path = Path(src)
    if not (path / checkpoint.MARKER_FILE).exists():
        latest = checkpoint.find_latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"{path} is neither a checkpoint nor a run folder with a complete checkpoint")
        path = latest
    if hf_base is None:
        state = json.loads((path / "state.json").read_text()) if (path / "state.json").exists() else {}
        cfg = state.get("config") or {}
        sft, model = cfg.get("sft") or {}, cfg.get("model") or {}
        hf_base = sft.get("output") if sft.get("enabled") else model.get("path")
        if not hf_base:
            raise ValueError(f"{path}: cannot tell the base HF folder from state.json; pass --hf-base")
        hf_base = _launch_relative(Path(hf_base), path, (cfg.get("run") or {}).get("output_dir"))
    if peft:
        return mcore_to_peft(path, hf_base, dst)
    return mcore_to_hf(path, hf_base, dst, dtype=dtype, fp8=fp8)


def _launch_relative(base: Path, checkpoint_dir: Path, output_dir: Optional[str]) -> Path:
    """A run config's relative model path, resolved against the folder the run was started from.

    Relative paths in a run config are relative to the folder ``hpcrl run``/``submit`` ran in, which is not
    necessarily the one ``convert`` runs in. That folder is found from the checkpoint's place:
    ``LAUNCH/output_dir/name/checkpoints/iter_N`` when ``run.output_dir`` is relative. An absolute path, or one
    that exists from the current folder, is kept as it is.
    """
    if base.is_absolute() or base.exists() or not output_dir or Path(output_dir).is_absolute():
        return base
    launch = checkpoint_dir.resolve().parents[2 + len(Path(output_dir).parts)]
    return launch / base if (launch / base).exists() else base


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m hpcrl.convert CHECKPOINT_OR_RUN_DIR HF_BASE OUT_DIR [--dtype D]``."""
    parser = argparse.ArgumentParser(prog="python -m hpcrl.convert",
                                     description="Export an hpcrl checkpoint as an HF safetensors folder.")
    parser.add_argument("checkpoint", type=Path,
                        help="an iter_XXXXXXX folder, or a run folder (its newest complete checkpoint)")
    parser.add_argument("hf_base", type=Path, help="the run's base HF folder (config + tokenizer)")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default=None,
                        help="dtype of the written tensors (default: the dtype the model was trained in)")
    args = parser.parse_args(argv)
    try:
        out = convert_run_checkpoint(args.checkpoint, args.out_dir, hf_base=args.hf_base, dtype=args.dtype)
    except FileNotFoundError as e:
        parser.error(str(e))
    print(out)


if __name__ == "__main__":
    main()
