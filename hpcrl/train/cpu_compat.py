"""Run megatron-core on CPU (gloo): the few places where it hard-codes CUDA, adapted.

megatron-core assumes a GPU in a handful of modules: it allocates with ``device='cuda'`` or
``device=torch.cuda.current_device()``, keeps its tensor-parallel RNG states with ``torch.cuda.get_rng_state``,
waits on CUDA streams in the DDP grad buffers, and asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``
in the optimizer. On a CPU-only torch each of these raises "Torch not compiled with CUDA enabled".

:func:`apply` patches exactly these places, and only when ``torch.cuda.is_available()`` is false (on GPUs it
returns at once and megatron-core runs unmodified):

1. The modules in :data:`PATCHED_MODULES` get a private ``torch`` alias as their module global ``torch``
   (the real ``torch`` module is untouched; every other module, HF transformers included, sees real torch):

   - factory functions (``tensor``, ``zeros``, ``ones``, ``empty``, ``full``, ``arange``, ...) map
     ``device='cuda'``, ``'cuda:N'``, ``torch.device('cuda')`` and int devices to the CPU;
   - ``torch.cuda`` is a CPU stand-in: ``current_device()`` is ``torch.device('cpu')`` (so
     ``x.to(torch.cuda.current_device())`` stays on the CPU), ``synchronize`` / ``empty_cache`` do
     nothing, streams and events are inert objects, ``stream(s)`` is a null context, and
     ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` act on the CPU default generator.

   Why each module is listed (megatron-core 0.16.1 line numbers). Needed by the tests (dropping any one
   of these fails them):
   ``utils`` (GlobalMemoryBuffer for the attention scores, the local multi-tensor l2 norm at ~1207),
   ``tensor_parallel.random`` (RNG tracker ``add``, ``model_parallel_cuda_manual_seed`` at ~422),
   ``tensor_parallel.mappings`` (gather buffers on the current device, TP > 1),
   ``pipeline_parallel.schedules`` (every training step: the schedule's token counter
   ``torch.zeros([], device="cuda")`` at ~596),
   ``tensor_parallel.layers`` (sequence parallelism: the backward of a column-parallel linear all-gathers its
   sequence-split input into a buffer on ``torch.cuda.current_device()`` at ~552),
   ``models.common.embeddings.rotary_pos_embedding`` (``inv_freq`` moved to the current device at ~162),
   ``transformer.utils`` (``get_default_causal_mask``: ``torch.ones(sq, sq, device="cuda")``),
   ``distributed.param_and_grad_buffer`` (param/grad buffers on the current device at ~783-806, stream
   waits at ~417-529),
   ``optimizer.optimizer`` (scale tensors at ~473-485, ~907, ~1141), ``optimizer.clip_grads`` (norm
   buffers at ~90-115, ~207), ``dist_checkpointing.strategies.filesystem_async`` (``torch.cuda.synchronize()``
   after staging tensors to the host at ~230) and ``dist_checkpointing.strategies.state_dict_saver`` (the
   write-failure flag on ``torch.cuda.current_device()`` at ~252), both on every torch_dist save
   (:mod:`hpcrl.checkpoint`). Not reached by the tests but by options the trainer offers:
   ``distributed.distributed_data_parallel`` (a CUDA stream with ``overlap_grad_reduce``),
   ``optimizer.distrib_optimizer`` (state buffers when saving/loading distributed-optimizer checkpoints,
   ~791 and ~1077), ``optimizer.grad_scaler`` (fp16 loss scale).

2. ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` become the CPU generator's
   ``torch.get_rng_state`` / ``torch.set_rng_state``. The tracker's ``fork()`` therefore really switches the
   CPU generator, so dropout inside tensor-parallel regions differs per TP rank as on GPUs. (megatron-core
   logs "CPU RNG state changed within GPU RNG context" if random numbers are drawn inside a fork.)

3. ``clip_grad_by_total_norm_fp32`` (in ``optimizer.clip_grads`` and where ``optimizer.optimizer`` imported
   it) is replaced by :func:`_clip_grad_by_total_norm_fp32`: the same in-place scaling without the
   ``param.grad.type() == 'torch.cuda.FloatTensor'`` assert.

4. The constructors of ``Float16OptimizerWithFloat16Params`` (bf16/fp16 training) and
   ``DistributedOptimizer`` classify parameters by ``param.type()`` strings ('torch.cuda.FloatTensor', ...)
   and raise ``TypeError`` for CPU tensors. Only while those two constructors run, ``torch.Tensor.type()``
   called without arguments reports the CUDA type name of a CPU tensor.

   ``models.common.embeddings.yarn_rotary_pos_embedding`` (multi-latent attention's YaRN,
   :mod:`hpcrl.train.mla`: tables made on ``torch.cuda.current_device()`` at ~83, moved there at ~124).

5. MoE (megatron-core 0.16.1): ``transformer.moe.router``, ``moe_utils``, ``token_dispatcher``, ``experts`` and
   ``shared_experts`` are in :data:`PATCHED_MODULES` (router weights moved to the current device at ~90, the
   aux-loss tracker's ``device="cuda"`` buffers at ~998, the all-to-all dispatcher's device-to-host stream at
   ~445 and ~871, the shared experts' overlap stream); and ``moe_utils.te_general_gemm``, which
   ``router_gating_linear`` reads even when TransformerEngine is absent (its import sits in a ``try`` that
   leaves the name undefined), is set to None when ``moe_utils.HAVE_TE`` is false, so the router's logits come
   from ``torch.mm`` as megatron's own fallback intends (:func:`define_te_general_gemm`, the one change also
   made on GPUs, where TE can be absent too); the all-to-all dispatcher's
   ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` gives numpy split sizes for CPU tensors too (megatron
   converts only CUDA tensors, and gloo's ``all_to_all_single`` refuses a tensor of split sizes).

6. megatron-core is first imported with its JIT fuser off (:func:`_import_megatron_without_jit_fuser`):
   ``megatron.core.jit`` binds ``jit_fuser = torch.compile`` at import, and every fusion module decorates its
   functions with it then, which imports torch's compiler stack (dynamo, inductor's config: ~2 s of a
   trainer's ~3 s megatron-core import on a 2-core CPU machine, at every trainer start). On the CPU every one
   of those fusions is switched off (:func:`hpcrl.train.bridge.mcore_config_from_hf`: ``bias_activation_fusion``
   and the rest), so none of the decorated functions runs; megatron's own ``noop_decorator`` (what its
   ``disable_jit_fuser()`` sets) is ``jit_fuser`` instead. ``torch.compile`` itself is the real one again as
   soon as the import returns. When megatron-core was imported before :func:`apply`, nothing changes.

7. Uneven gathers over gloo (:func:`_uneven_gather_along_first_dim`, :func:`_uneven_reduce_scatter_along_first_dim`):
   ``tensor_parallel.mappings``' gather and reduce-scatter along the first dimension with per-rank split sizes
   (the all-to-all token dispatcher at expert-tensor parallelism > 1, whose expert-TP ranks hold different
   numbers of routed tokens) call ``all_gather`` with tensors of different sizes and a list ``reduce_scatter``,
   which gloo refuses ("invalid tensor size"). On the CPU they pad every rank's part to the largest and use the
   equal-size collectives, then drop the padding: the same values (the reduce sums the same addends). Calls
   without split sizes go to megatron's own code unchanged.

8. Pipeline parallelism: ``pipeline_parallel.p2p_communication`` joins :data:`PATCHED_MODULES` (its shape
   buffers on ``torch.cuda.current_device()`` at ~190-202 and ~313-321, ``torch.cuda.synchronize()`` at ~242
   and ~398); ``LanguageModule.setup_embeddings_and_output_layer`` (a tied embedding's copy on the last stage,
   made equal to the first stage's by an all-reduce of ``weight.data.cuda()`` at ~227) runs with
   ``Tensor.cuda()`` returning a CPU tensor itself (:func:`_with_cpu_tensor_cuda`), only while it runs.

9. Context parallelism: ``rope_utils.get_pos_emb_on_this_cp_rank`` (a rotary table's rows of this CP rank;
   YaRN's builds its cache with it at construction) makes its index with ``pin_memory=True`` and
   ``.cuda()`` (~63); :func:`_pos_emb_on_this_cp_rank` is the same selection on the table's device, where
   the rotary modules look it up.

Nothing else is changed. :func:`apply` is idempotent; :func:`is_applied` tells whether it has patched.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from typing import Any, Callable, Iterable

import torch

PATCHED_MODULES = (
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.utils",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
)
"""megatron-core modules whose global ``torch`` is replaced by the CPU alias (see the module docstring)."""

_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "eye",
    "linspace", "empty_strided", "zeros_like", "ones_like", "empty_like", "full_like",
)
_CPU = torch.device("cpu")
_applied = False


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``'cuda'``, ``'cuda:1'``, ``torch.device('cuda')``, ``0``) to the CPU."""
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _on_cpu(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # pinning needs CUDA
        return factory(*args, **kwargs)

    return wrapper


class _Inert:
    """A CUDA stream or event stand-in: every method does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def query(self) -> bool:
        return True

    def record_event(self, event=None) -> "_Inert":
        """A stream's event (the all-to-all dispatcher waits on it): inert too."""
        return event or _Inert()


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by the patched modules; anything not defined here is the real ``torch.cuda``."""

    Stream = _Inert
    Event = _Inert

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def current_stream(device=None) -> _Inert:
        return _Inert()

    default_stream = current_stream

    @staticmethod
    def stream(stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def get_rng_state(device="cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        # Not torch.manual_seed: that calls torch.cuda.manual_seed_all (harmless, but this is exact).
        torch.default_generator.manual_seed(int(seed))


class _CpuTorch(types.ModuleType):
    """A ``torch`` alias for the patched modules: real torch, except CPU factories and ``cuda``."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__.update({k: v for k, v in vars(torch).items() if not k.startswith("__")})
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))
        self.cuda = _CpuCuda()

    def __getattr__(self, name):  # names torch creates lazily after the alias was made
        return getattr(torch, name)


def _clip_grad_by_total_norm_fp32(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                                  total_norm: float, use_decoupled_grad: bool = False) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` without its CUDA grad-type assert.

    Scales every grad in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        from megatron.core.utils import to_local_if_dtensor

        for g in grads:
            to_local_if_dtensor(g).detach().mul_(clip_coeff)


_REAL_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs):
    if dtype is None and not kwargs and not self.is_cuda:
        return _REAL_TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _REAL_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def _with_cuda_type_names(fn: Callable) -> Callable:
    """Wrap ``fn`` so that, while it runs, ``Tensor.type()`` names CPU tensors like CUDA ones."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        previous, torch.Tensor.type = torch.Tensor.type, _cuda_type_name
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = previous

    return wrapper


def _with_cpu_tensor_cuda(fn: Callable) -> Callable:
    """Wrap ``fn`` so that, while it runs, ``Tensor.cuda()`` of a CPU tensor returns the tensor itself."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        previous = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = previous

    return wrapper


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """megatron-core's ``rope_utils.get_pos_emb_on_this_cp_rank`` without its pinned host tensor moved to CUDA:
    the rows of chunks ``cp_rank`` and ``2 cp - 1 - cp_rank`` of ``2 cp`` along ``seq_dim``."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1):])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2):])


def _uneven_gather_along_first_dim(gather: Callable) -> Callable:
    """megatron's ``_gather_along_first_dim`` (``gather``) with ``output_split_sizes`` done by padding to the
    largest split and an equal ``all_gather_into_tensor`` (gloo has no uneven all-gather). ``[n_r, ...]`` on
    rank r in, ``[sum(n), ...]`` out."""

    @functools.wraps(gather)
    def wrapped(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        most = max(sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((most * len(sizes), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(out.chunk(len(sizes)), sizes)], dim=0)

    return wrapped


def _uneven_reduce_scatter_along_first_dim(reduce_scatter: Callable) -> Callable:
    """megatron's ``_reduce_scatter_along_first_dim`` (``reduce_scatter``) with ``input_split_sizes`` done by
    padding each rank's part to the largest and an equal ``reduce_scatter_tensor`` (gloo has no list
    reduce-scatter). ``[sum(n), ...]`` in, ``[n_r, ...]`` out on rank r."""

    @functools.wraps(reduce_scatter)
    def wrapped(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        most = max(sizes)
        padded = input_.new_zeros((most * len(sizes), *input_.shape[1:]))
        for part, chunk in zip(padded.chunk(len(sizes)), torch.split(input_, sizes, dim=0)):
            part[: chunk.shape[0]] = chunk
        out = input_.new_empty((most, *input_.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, padded, group=group)
        return out[: sizes[group.rank()]]

    return wrapped


def is_applied() -> bool:
    """True once :func:`apply` has patched megatron-core in this process."""
    return _applied


def _move_to_host(move: Callable) -> Callable:
    """megatron-core's ``maybe_move_tensor_to_cpu`` that also gives a CPU tensor as numpy when asked (the
    all-to-all split sizes, which gloo's ``all_to_all_single`` takes as a sequence of ints, not a tensor)."""

    @functools.wraps(move)
    def wrapper(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return wrapper


def define_te_general_gemm() -> None:
    """Set ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` to None where TransformerEngine is absent.

    megatron-core 0.16.1's ``router_gating_linear`` reads that name, whose import sits in a ``try`` that leaves
    it undefined without TE, so every MoE router forward raises ``NameError``; with None it takes megatron's own
    ``torch.mm`` fallback. Needed on GPUs without TE as well as on CPUs (seen failing on an H200, 2026-11-26):
    :func:`hpcrl.train.parallel.prepare_megatron` calls it on CUDA, :func:`apply` on CPU. Idempotent; does
    nothing where TE is installed."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def mark_te_absent_for_mla() -> None:
    """Set ``megatron.core.transformer.multi_latent_attention.HAVE_TE`` to False where TransformerEngine is not
    installed.

    megatron-core 0.16.1 imports TE's layers there through ``megatron.core.extensions.transformer_engine``, which
    succeeds without TE and gives ``MagicMock`` stand-ins, so ``HAVE_TE`` is True and MLA's
    ``isinstance(self.linear_proj, TELinear)`` raises ``TypeError`` when the layer is built. Needed on CPUs and on
    GPUs without TE alike; :func:`hpcrl.train.mla_layers.layer_spec` calls it. Idempotent."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _no_compile(fn=None, **_kwargs):
    """What ``torch.compile`` is while megatron-core is first imported on the CPU: ``fn`` itself (as
    ``@torch.compile`` and ``torch.compile(fn)``), or that decorator (as ``torch.compile(**options)``)."""
    return fn if fn is not None else (lambda f: f)


def _import_megatron_without_jit_fuser() -> None:
    """Import ``megatron.core`` with ``jit_fuser`` a no-op (point 6 of the module docstring): ``torch.compile``
    is :func:`_no_compile` only while ``megatron.core`` (and with it ``megatron.core.jit``) is imported, then
    ``jit_fuser`` is set to megatron's ``noop_decorator``. Does nothing when megatron-core is imported already.
    Raises ImportError if megatron-core is not installed."""
    if "megatron.core" in sys.modules:
        return
    real = torch.compile
    torch.compile = _no_compile
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = real
    jit = importlib.import_module("megatron.core.jit")
    jit.disable_jit_fuser()


def apply() -> bool:
    """Patch megatron-core for a CUDA-less torch (see the module docstring for exactly what changes).

    Call once at start-up, before building models (:func:`hpcrl.train.parallel.prepare_megatron` does);
    calling again does nothing. Returns True when megatron-core is (now or already) patched, False when CUDA
    is available and nothing was done. Raises ImportError if megatron-core is not installed.
    """
    global _applied
    if _applied:
        return True
    if torch.cuda.is_available():
        return False
    _import_megatron_without_jit_fuser()  # point 6 of the module docstring
    alias = _CpuTorch()
    for name in PATCHED_MODULES:
        importlib.import_module(name).torch = alias

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _with_cpu_tensor_cuda(
        LanguageModule.setup_embeddings_and_output_layer)  # point 8 of the module docstring
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):  # point 9
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    from megatron.core.transformer.moe import moe_utils

    define_te_general_gemm()  # point 5 of the module docstring
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _move_to_host(moe_utils.maybe_move_tensor_to_cpu)
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _uneven_gather_along_first_dim(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter_along_first_dim(
        mappings._reduce_scatter_along_first_dim)
    _applied = True
    return True
