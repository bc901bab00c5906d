"""What a checkpoint holds besides files: the per-rank RNG states, megatron-core's sharded state dicts of model and
optimizer (and the optimizer's bookkeeping around them), the parallel layout; torch.distributed helpers."""

from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist



DISTRIB_OPTIM_SHARDING = "dp_reshardable"
"""How a distributed optimizer's state is saved (Megatron-LM's default): every rank writes its own buffers,
fast and without gathering; the checkpoint reshards across data parallel sizes only. ``fully_reshardable``
(pass ``distrib_optim_sharding_type``; needs TransformerEngine or Apex, so GPUs only) gathers over the DP
group and reshards across any layout. The ordinary (non-distributed) optimizer's state is sharded like the
parameters and always fully reshardable."""


def broadcast_object(obj: Any, src: int = 0) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def require_dist() -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised (hpcrl.train.parallel.init_distributed)")
    return dist.get_rank(), dist.get_world_size()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from hpcrl.train.bridge import unwrap_model

    return unwrap_model(model)


def rng_state() -> dict[str, Any]:
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


def set_rng_state(state: Mapping[str, Any]) -> None:
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


def sharding_metadata(optimizer: Any, distrib_optim_sharding_type: str) -> dict[str, Any]:
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


def sharded_state_dict(model: torch.nn.Module, optimizer: Any, metadata: dict[str, Any],
                        is_loading: bool) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` of ShardedTensors; model keys are the bare GPTModel's names. A
    model with LoRA adapters (:mod:`hpcrl.train.lora`) keeps only its adapters (its optimizer holds nothing
    else): the frozen base is the HF folder the run starts from, loaded before any checkpoint is."""
    from hpcrl.train.bridge import is_adapter_name
    from hpcrl.train.lora import has_adapters

    module = unwrap(model)
    state = {"model": module.sharded_state_dict(metadata=dict(metadata))}
    if has_adapters(module):
        state["model"] = {k: v for k, v in state["model"].items() if is_adapter_name(k)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=is_loading,
                                                          metadata=dict(metadata))
    return state


def _sub_optimizers(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def has_state(optimizer: Any) -> bool:
    """Whether the optimizer has stepped (torch's and TE's Adam create their state at the first step)."""
    inners = [getattr(opt, "optimizer", None) for opt in _sub_optimizers(optimizer)]
    return any(inner is not None and len(inner.state) > 0 for inner in inners)


def zero_state_to_load_into(optimizer: Any) -> None:
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


def reset_to_initial(optimizer: Any) -> None:
    """Make ``optimizer`` what a freshly built one for the (just loaded) model parameters would be.

    Drops any Adam state and copies the model parameters into the optimizer's main (fp32) parameters
    (``reload_model_params``; nothing to copy for fp32 training without the distributed optimizer).
    """
    for opt in _sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            inner.state.clear()
    optimizer.reload_model_params()


def restore_adam_steps(optimizer: Any) -> None:
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


def parallel_layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"world_size": dist.get_world_size(), "tp_size": ps.get_tensor_model_parallel_world_size(),
            "pp_size": ps.get_pipeline_model_parallel_world_size(),
            "dp_size": ps.get_data_parallel_world_size()}
