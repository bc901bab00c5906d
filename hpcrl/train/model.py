"""The trainer's Megatron model, optimizer and learning-rate schedule (the process groups are in
:mod:`hpcrl.train.parallel`).

- :func:`setup_model_and_optimizer` builds the GPTModel from an HF folder (:mod:`hpcrl.train.bridge`), loads
  its weights, wraps it in megatron-core ``DistributedDataParallel`` and builds the megatron optimizer, from
  hpcrl's :class:`~hpcrl.config.TrainSection` plus the free ``megatron:`` dict of the run config
  (:func:`split_megatron_kwargs`).
- :func:`lr_scheduler` / :func:`set_lr_step`: megatron-core's ``OptimizerParamScheduler``, driven by the
  global optimizer step.
- :func:`train_step` is one optimizer step over micro-batches through megatron-core's schedule
  (``get_forward_backward_func`` + ``finalize_model_grads``), as Megatron-LM's and slime's ``train_step``;
  :func:`forward_only` the schedule's forward-only pass (log-prob recompute, values).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import torch

HPCRL_MODEL_KEYS = ("make_vocab_size_divisible_by",)
"""``megatron:`` keys that are not dataclass fields but arguments of :func:`hpcrl.train.bridge.build_gpt_model`."""


def _dtype_value(key: str, value: Any) -> Any:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16`` for ``*dtype`` keys (YAML has no dtypes)."""
    if key.endswith("dtype") and isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"megatron.{key}: {value!r} is not a torch dtype (e.g. float32, bfloat16)")
        return dtype
    return value


def split_megatron_kwargs(megatron: Optional[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Split the run config's free ``megatron:`` dict by which megatron-core dataclass has each field.

    Returns ``{"transformer": ..., "optimizer": ..., "ddp": ..., "model": ...}``: ``TransformerConfig``,
    ``OptimizerConfig`` and ``DistributedDataParallelConfig`` fields, and :data:`HPCRL_MODEL_KEYS`. A key that
    several dataclasses have (``bf16``, ``params_dtype``, ``use_distributed_optimizer``) goes to each. Values of
    ``*dtype`` keys may be dtype names (``"bfloat16"``). Raises ValueError naming an unknown key (with close
    matches) or a bad dtype name.
    """
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    targets = {"transformer": TransformerConfig, "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}
    fields = {k: {f.name for f in dataclasses.fields(cls)} for k, cls in targets.items()}
    out: dict[str, dict[str, Any]] = {k: {} for k in (*targets, "model")}
    for key, value in (megatron or {}).items():
        if key in HPCRL_MODEL_KEYS:
            out["model"][key] = value
            continue
        homes = [k for k in targets if key in fields[k]]
        if not homes:
            known = set().union(*fields.values(), HPCRL_MODEL_KEYS)
            close = difflib.get_close_matches(key, known, n=3)
            raise ValueError(f"megatron.{key}: not a field of TransformerConfig, OptimizerConfig or "
                             f"DistributedDataParallelConfig" + (f"; did you mean {close}?" if close else ""))
        for home in homes:
            out[home][key] = _dtype_value(key, value)
    return out


def optimizer_config(train: Any, **extra: Any):
    """megatron-core ``OptimizerConfig`` (Adam) from a :class:`~hpcrl.config.TrainSection`; ``extra`` wins."""
    from megatron.core.optimizer import OptimizerConfig

    dtype = torch.bfloat16 if train.bf16 else torch.float32
    kwargs = dict(optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
                  adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, clip_grad=train.clip_grad,
                  bf16=train.bf16, params_dtype=dtype, use_distributed_optimizer=train.use_distributed_optimizer)
    kwargs.update(extra)
    return OptimizerConfig(**kwargs)


def wrap_model_and_optimizer(model: torch.nn.Module, train: Any, megatron: Optional[Mapping[str, Any]] = None):
    """Wrap a GPTModel in megatron-core DDP (after ``Float16Module`` when ``train.bf16``) and build its optimizer.

    DDP: ``grad_reduce_in_fp32=True``, ``overlap_grad_reduce=False``, ``use_distributed_optimizer`` from
    ``train``; gradients are averaged over data-parallel ranks; a router's expert bias stays fp32 and bitwise
    under bf16, as HF keeps it. Optimizer: :func:`optimizer_config` with
    ``get_megatron_optimizer`` (Adam with decoupled weight decay). ``megatron`` DDP/optimizer keys override.
    The model's config gets what megatron's schedule (:func:`train_step`) reads: ``grad_scale_func`` (the
    optimizer's loss scale), ``finalize_model_grads_func`` and, with ``overlap_grad_reduce``, ``no_sync_func``
    (``variable_seq_lengths``, which only the pipeline schedules read, waits for pipeline parallelism: megatron
    refuses it beside the all-gather token dispatcher, hpcrl's choice at EP=1).
    Returns ``(ddp_model, optimizer)``.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from hpcrl.train import deepseek_moe

    extra = split_megatron_kwargs(megatron)
    config = model.config
    if train.bf16:
        with deepseek_moe.fp32_expert_bias(model):  # Float16Module casts every buffer to bf16
            model = Float16Module(config, model)
    ddp_kwargs = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                      use_distributed_optimizer=train.use_distributed_optimizer)
    ddp_kwargs.update(extra["ddp"])
    ddp_model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(**ddp_kwargs),
                                        module=model)
    optimizer = get_megatron_optimizer(optimizer_config(train, **extra["optimizer"]), [ddp_model])
    # what megatron's schedule reads from the config (as Megatron-LM's training setup sets it)
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_model.ddp_config.overlap_grad_reduce:
        config.no_sync_func = ddp_model.no_sync
    return ddp_model, optimizer


def setup_model_and_optimizer(hf_path: Union[str, os.PathLike], train: Any,
                              megatron: Optional[Mapping[str, Any]] = None, load_weights: bool = True,
                              lora: Any = None, lora_seed: int = 0):
    """Build the trainer's model from an HF folder, load its weights, wrap it and build the optimizer.
    With ``lora`` (a :class:`hpcrl.train.lora.LoraSpec`) the base weights are frozen and adapters added before
    the wrap (:func:`hpcrl.train.lora.add_lora`, drawn from ``lora_seed``): the optimizer holds the adapters
    alone.

    Needs :func:`init_distributed` and :func:`initialize_model_parallel` first (tensor-parallel size from
    megatron-core's parallel state). The model dtype is bf16 when ``train.bf16``, else fp32; sequence-parallel
    as ``train.sequence_parallel`` says (:func:`hpcrl.config.train.sequence_parallel`). ``megatron``:
    the run config's free dict (:func:`split_megatron_kwargs`). Returns ``(ddp_model, optimizer)``; the bare
    GPTModel is ``bridge.unwrap_model(ddp_model)``, with the HF config as its ``hf_config``.
    """
    from transformers import AutoConfig

    from hpcrl.train import bridge

    from hpcrl.config.train import sequence_parallel

    extra = split_megatron_kwargs(megatron)
    hf_config = AutoConfig.from_pretrained(str(hf_path))
    dtype = torch.bfloat16 if train.bf16 else torch.float32
    model = bridge.build_gpt_model(hf_config, dtype=dtype, sequence_parallel=sequence_parallel(train),
                                   **extra["model"], **extra["transformer"])
    if load_weights:
        bridge.load_hf_weights(model, hf_path)
    if lora is not None:
        from hpcrl.train.lora import add_lora

        add_lora(model, lora, lora_seed)
    return wrap_model_and_optimizer(model, train, megatron)


class ModelOnRank:
    """What a trainer of a megatron-core model holds on its rank once :meth:`bind_model` ran (the actor's
    and SFT's): ``ddp_model`` (DDP-wrapped), ``optimizer``, ``model`` (the bare GPTModel, ``hf_config``
    attached), ``vocab_size`` (the HF vocabulary, not the padded one), ``device``, and its data-parallel
    place (``dp_rank``, ``dp_size``, ``_dp_group``)."""

    def bind_model(self, ddp_model: torch.nn.Module, optimizer: Any) -> None:
        """Hold ``ddp_model`` and ``optimizer`` (:func:`setup_model_and_optimizer`'s) and what follows from
        them and from megatron-core's parallel state (initialised first)."""
        from megatron.core import parallel_state

        from hpcrl.train import bridge

        self.ddp_model, self.optimizer = ddp_model, optimizer
        self.model = bridge.unwrap_model(ddp_model)
        self.vocab_size: int = self.model.hf_config.vocab_size
        self.device = next(self.model.parameters()).device
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self._dp_group = parallel_state.get_data_parallel_group()


def lr_scheduler(optimizer: Any, train: Any, num_rollout: int) -> Any:
    """megatron-core's ``OptimizerParamScheduler`` for ``train``'s learning-rate schedule, counted in optimizer
    steps: linear warmup from 0 over ``train.lr_warmup_steps`` (slime ``--lr-warmup-iters``), then
    ``train.lr_decay_style`` (``constant``/``linear``/``cosine``, slime ``--lr-decay-style``) from ``train.lr`` to
    ``train.min_lr`` at ``train.lr_decay_steps`` (default ``num_rollout * train.num_steps_per_rollout``).
    Weight decay stays ``train.weight_decay``. The optimizer's learning rate is set to that of step 0.
    Raises AssertionError (megatron-core's) for warmup >= decay steps or ``min_lr > lr``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = train.lr_decay_steps or max(num_rollout * train.num_steps_per_rollout, 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if train.lr_warmup_steps else train.lr, max_lr=train.lr, min_lr=train.min_lr,
        lr_warmup_steps=train.lr_warmup_steps, lr_decay_steps=max(decay, train.lr_warmup_steps + 1),
        lr_decay_style=train.lr_decay_style, start_wd=train.weight_decay, end_wd=train.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant")


def set_lr_step(scheduler: Any, step: int) -> float:
    """Move ``scheduler`` to global optimizer step ``step`` (0-based; forward or backward) and set the
    optimizer's learning rate for it. Returns that learning rate. The schedule depends only on ``step``, so
    a resumed run (step from its rollout id) gets exactly the learning rates of an uninterrupted one."""
    scheduler.step(increment=step - scheduler.num_steps)
    return float(scheduler.get_lr(scheduler.optimizer.param_groups[0]))


def mean_over_steps(per_step: Sequence[Mapping[str, Optional[float]]], keys: Iterable[str], prefix: str
                    ) -> dict[str, float]:
    """``{prefix + key: mean}`` of each of ``keys`` over a rollout's optimizer steps' metrics ``per_step``,
    skipping the steps where it is None (e.g. a grad norm not computed); a key None in every step is left out.
    The actor's ``train/*`` and the critic's ``critic/*`` rollout metrics."""
    out: dict[str, float] = {}
    for key in keys:
        vals = [m[key] for m in per_step if m.get(key) is not None]
        if vals:
            out[f"{prefix}{key}"] = sum(vals) / len(vals)
    return out


class StagedLoss(NamedTuple):
    """What a loss (or forward-only) function hands megatron's schedule so that it can run over pipeline
    stages: the model's ``output`` (the decoder's hidden states on a stage before the last, which the
    schedule sends on; the logits on the last) and ``finish``, which makes the loss (or the result) from the
    last stage's output. Without pipeline parallelism every rank is the last stage."""

    output: torch.Tensor
    finish: Callable[[torch.Tensor], Any]

    def then(self, fn: Callable[[Any], Any]) -> "StagedLoss":
        """The same output, finished by ``fn`` of this finish's result (e.g. a loss from the log-probs)."""
        finish = self.finish
        return StagedLoss(self.output, lambda output: fn(finish(output)))


def train_step(ddp_model: torch.nn.Module, optimizer: Any,
               loss_fn: Callable[[torch.nn.Module, Any], Any], micro_batches: Iterable[Any]) -> dict[str, Any]:
    """One optimizer step through megatron-core's schedule (``get_forward_backward_func()``, Megatron-LM's and
    slime's ``train_step``; 1F1B over the stages under pipeline parallelism): zero the grad buffers, forward +
    backward every micro-batch, then the schedule's ``finalize_model_grads`` (data-parallel reduction, the
    tensor-parallel sum of replicated and sequence-parallel parameters' gradients, the tied embedding's
    gradient summed over the first and last stages, megatron's aux-loss-free expert-bias step),
    ``optimizer.step()``.

    ``loss_fn(ddp_model, micro_batch)`` returns a :class:`StagedLoss` whose ``finish(output)`` gives a scalar
    loss tensor or ``(loss, metrics)`` with a dict of floats, run on the last pipeline stage only; or, without
    pipeline parallelism, the loss (or ``(loss, metrics)``) itself. Gradients of all micro-batches are summed,
    so the loss must already carry its share of the normalisation (e.g. divided by the tokens of the whole
    step); megatron-core DDP then averages over data-parallel ranks. The schedule divides each loss by the
    number of micro-batches ``n`` (its ``forward_step_calc_loss``, loss averaging over micro-batches); it is
    handed ``loss * n`` (slime's ``loss * num_microbatches``), so the gradient is the loss's own: bitwise for
    ``n`` up to 40, above it the factor ``fl(fl(1/n) * n)`` can be one float32 ulp under 1 (relative 6e-8;
    e.g. ``n`` = 41, 47, 55). The MoE auxiliary losses get megatron's scale ``1/n`` per micro-batch (their
    mean over the micro-batches, as in Megatron-LM). The loss is multiplied by the optimizer's loss scale
    before backward (the config's ``grad_scale_func``; 1 for fp32/bf16). A model with an expert bias (GLM-4.5,
    DeepSeek-V3) gets megatron's bias update in ``finalize_model_grads`` (``moe_router_bias_update_rate``; 0,
    the default, leaves it as it was). Under pipeline parallelism the activations between stages have each
    micro-batch's own shape (megatron's ``variable_seq_lengths``: the shape goes first).

    Returns ``loss`` (sum over micro-batches), ``grad_norm`` (before clipping; None if not computed),
    ``update_successful``, ``num_zeros`` (None unless ``log_num_zeros_in_grad``), ``num_micro_batches``, and
    the mean of each metric over micro-batches; the loss and metrics are the last stage's on every stage.
    Raises ValueError for no micro-batch, a model not wrapped by :func:`wrap_model_and_optimizer` (no
    ``finalize_model_grads_func`` on its config) or a loss function that is not staged under pipeline
    parallelism.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hpcrl.train import deepseek_moe
    from hpcrl.train.parallel import from_last_stage

    micro_batches = list(micro_batches)
    n = len(micro_batches)
    config = _schedule_config(ddp_model, n)
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    deepseek_moe.reset_token_counts(ddp_model)
    losses: list[float] = []

    def finish_loss(output: torch.Tensor, finish: Callable[[torch.Tensor], Any]):
        out = finish(output)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        losses.append(float(loss.detach()))
        return _loss_for_schedule(loss, n, metrics)

    def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
        out = loss_fn(model, next(data_iterator))
        if not isinstance(out, StagedLoss):
            _check_unstaged(config)  # the whole loss, made in this forward step
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            out = StagedLoss(loss, functools.partial(_with_metrics, metrics=metrics))
        return out.output, functools.partial(finish_loss, finish=out.finish)

    reduced = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                                          model=ddp_model, num_microbatches=n, seq_length=0, micro_batch_size=1,
                                          forward_only=False)
    update_successful, grad_norm, num_zeros = optimizer.step()
    metrics: dict[str, float] = {}
    for mb_metrics in reduced:
        for k, v in mb_metrics.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    loss, metrics = from_last_stage((sum(losses), metrics))
    return dict(loss=loss, grad_norm=grad_norm, update_successful=update_successful, num_zeros=num_zeros,
                num_micro_batches=n, **{k: v / n for k, v in metrics.items()})


def forward_only(ddp_model: torch.nn.Module, fn: Callable[[torch.nn.Module, Any], Any],
                 micro_batches: Iterable[Any]) -> list[Any]:
    """``fn(ddp_model, micro_batch)`` of every micro-batch through megatron-core's schedule with
    ``forward_only=True`` (no backward, no gradient reduction; slime's log-prob recompute and Megatron-LM's
    evaluation): returns the results in order. ``fn`` returns the result, or a :class:`StagedLoss` whose
    ``finish(output)`` makes it on the last pipeline stage (needed under pipeline parallelism); the results
    are then the last stage's on every stage (sent over the pipeline group). Call inside ``torch.no_grad()``
    and eval mode where wanted (the caller's choice). An empty ``micro_batches`` gives ``[]``. Raises
    ValueError for a result that is not staged under pipeline parallelism."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hpcrl.train.parallel import from_last_stage

    micro_batches = list(micro_batches)
    if not micro_batches:
        return []
    config = _schedule_config(ddp_model, len(micro_batches))
    results: list[Any] = []
    # on the model's device: megatron scales the MoE aux loss by a tensor made on this one's device
    device = next(ddp_model.parameters()).device

    def keep(output: torch.Tensor, finish: Callable[[torch.Tensor], Any]):
        results.append(finish(output))
        return torch.zeros((), device=device), {}

    def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
        out = fn(model, next(data_iterator))
        if not isinstance(out, StagedLoss):
            _check_unstaged(config)
            results.append(out)
            return torch.zeros((), device=device), _nothing_to_reduce
        return out.output, functools.partial(keep, finish=out.finish)

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=ddp_model,
                                num_microbatches=len(micro_batches), seq_length=0, micro_batch_size=1,
                                forward_only=True)
    return from_last_stage(results)


def _check_unstaged(config: Any) -> None:
    """Raise ValueError when a loss or forward function made its whole result in the forward step under
    pipeline parallelism (the stages before the last have no logits)."""
    if config.pipeline_model_parallel_size > 1:
        raise ValueError("under pipeline parallelism the loss function must return a StagedLoss (the model's "
                         "output and what makes the loss from it on the last stage)")


def _loss_for_schedule(loss: torch.Tensor, n: int, metrics: Mapping[str, Any]):
    """The schedule's loss function of a micro-batch: ``(loss * n, 1 token, metrics)``; the schedule divides
    by the tokens (1) and by ``n`` micro-batches, which gives ``loss`` back (see :func:`train_step`)."""
    return loss * n, torch.ones((), dtype=torch.int), metrics


def _with_metrics(loss: torch.Tensor, metrics: Mapping[str, Any]):
    """``(loss, metrics)``: the finish of a loss made whole in the forward step."""
    return loss, metrics


def _nothing_to_reduce(output: torch.Tensor):
    """The schedule's loss function of a forward-only pass whose results were kept by the forward step."""
    return output, {}


def _schedule_config(ddp_model: torch.nn.Module, n: int) -> Any:
    """The model's ``TransformerConfig`` as megatron's schedule reads it, checked: at least one micro-batch,
    and the hooks :func:`wrap_model_and_optimizer` sets. Raises ValueError otherwise."""
    from megatron.core.utils import get_model_config

    if n < 1:
        raise ValueError("no micro-batch on this rank: every data-parallel rank needs at least one "
                         "(hpcrl.train.packing gives every rank the same number)")
    config = get_model_config(ddp_model)
    if config.finalize_model_grads_func is None:
        raise ValueError("the model's config has no finalize_model_grads_func: wrap it with "
                         "hpcrl.train.model.wrap_model_and_optimizer")
    from hpcrl.config.train import SCHEDULE_REFUSED

    for key in SCHEDULE_REFUSED:
        if getattr(config, key, False):
            raise ValueError(f"megatron.{key}: true is not supported: hpcrl's losses are already normalised "
                             "over the step; remove it")
    if config.pipeline_model_parallel_size > 1:
        # micro-batches of different lengths (packed or padded to their own longest): the stages send each
        # activation's shape before it (megatron's p2p_communication). Set here, after the config's checks:
        # TransformerConfig refuses it beside the all-gather token dispatcher, which hpcrl uses only at EP=1,
        # where its gathers span the tensor-parallel ranks of one micro-batch (equal lengths)
        config.variable_seq_lengths = True
    return config



def sum_replicated_grads_over_tp(ddp_model: torch.nn.Module) -> None:
    """The tensor-parallel step of megatron-core's ``finalize_model_grads`` on its own, for a backward run
    outside :func:`train_step` (which runs the whole of it through megatron's schedule): the gradients of the q/k layernorms (``qk_layernorm``: replicated on every TP rank,
    each rank's heads giving a part of their gradient), of sequence-parallel norms and of parameters marked
    ``average_gradients_across_tp_domain`` are reduced over the TP group, so the replicas stay equal. A no-op at
    TP=1 and for models without such parameters (Qwen2, Llama at TP > 1 without sequence parallelism; with it,
    on by default, their norms are summed). Call after ``finish_grad_sync``."""
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    from hpcrl.train.bridge import unwrap_model

    _allreduce_non_tensor_model_parallel_grads([ddp_model], unwrap_model(ddp_model).config)
