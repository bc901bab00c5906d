"""Supervised fine-tuning on the Megatron trainer (``run.mode: sft``, and the warm start of an RL run): the
same model, parallel layout, micro-batching, packing and precision as RL, a next-token loss on the
demonstrations' trained tokens (slime ``--loss-type sft_loss``).

:class:`SupervisedTrainer` lives on every trainer rank, built like the :class:`~hpcrl.train.actor.Actor`
after model parallelism is initialised. One :meth:`SupervisedTrainer.train` call is one optimizer step on a
batch of ``sft.batch_size`` demonstrations (:mod:`hpcrl.data.demonstrations`: ``Sample`` objects whose
``loss_mask`` marks the tokens to learn), this data-parallel rank's contiguous slice of it
(:func:`hpcrl.train.actor.build_steps`, one step per batch) in micro-batches of ``train.micro_batch_size``
rows or packed to ``train.max_tokens_per_microbatch`` tokens.

Loss: the mean negative log-likelihood over every trained token of the global batch (Hugging Face's
``CrossEntropyLoss`` over the batch's label tokens): each micro-batch contributes its masked sum over the
batch's token count, times the data-parallel size (megatron-core averages gradients over DP), so neither the
micro-batching nor the data-parallel split changes the gradient. Optimizer: megatron-core's Adam with the
SFT recipe of :mod:`hpcrl.sft` (betas 0.9 / 0.999, eps 1e-8, no weight decay, gradient norm clipped to 1.0,
``sft.lr`` warmed up then cosine-decayed to a tenth over ``sft.steps``, :func:`hpcrl.sft_recipe.lr_at`); precision
``train.bf16``. One step equals Hugging Face's model with ``torch.optim.AdamW`` on the same batch
(tests/unit/test_supervised.py at TP=1, tests/integration/test_megatron_tp2.py at TP=2).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from hpcrl.train import parallel
from hpcrl.train.model import ModelOnRank

if TYPE_CHECKING:
    from hpcrl.config import Config, TrainSection
    from hpcrl.data.sample import Sample


def sft_train_section(cfg: "Config") -> "TrainSection":
    """``cfg.train`` with the SFT recipe's optimizer (:mod:`hpcrl.sft_recipe`: no weight decay, clip 1.0,
    ``sft.lr``) and one optimizer step per batch; the layout, micro-batching and precision stay ``train``'s."""
    from hpcrl import sft_recipe as sft

    return dataclasses.replace(cfg.train, lr=cfg.sft.lr, min_lr=0.0, lr_warmup_steps=0,
                               lr_decay_style="constant", lr_decay_steps=None, weight_decay=sft.WEIGHT_DECAY,
                               clip_grad=sft.GRAD_CLIP, num_steps_per_rollout=1)


class SupervisedTrainer(ModelOnRank):
    """SFT on one trainer rank: megatron-core model + DDP + Adam, :meth:`train` per batch.

    Create on every trainer rank after :func:`~hpcrl.train.parallel.setup_parallel`. ``hf_path``: the HF
    folder it starts from. ``run.deterministic`` switches torch's deterministic algorithms on first.

    Attributes:
        ddp_model, optimizer: megatron-core's (checkpointed; the weight sync exports ``ddp_model``).
        model: the bare GPTModel (``hf_config`` attached).
        dp_size: data-parallel ranks (a batch splits over them).
    """

    critic = None
    """(no value model: the checkpoint manager and the weight sync treat it as an actor without one)"""

    def __init__(self, cfg: "Config", hf_path: Union[str, os.PathLike]) -> None:
        from hpcrl.train import model as tmodel

        parallel.deterministic_mode(cfg.run.deterministic)
        self.cfg = cfg
        self.train_section = sft_train_section(cfg)
        from hpcrl.train.lora import LoraSpec

        # with model.lora only adapters train; the export (warm start, weight sync) has them merged in
        self.bind_model(*tmodel.setup_model_and_optimizer(hf_path, self.train_section, dict(cfg.megatron or {}),
                                                          lora=LoraSpec.of(cfg.model.lora),
                                                          lora_seed=cfg.run.seed))

    def train(self, step: int, samples: Sequence["Sample"], lr_scale: float = 1.0) -> dict[str, float]:
        """One optimizer step on ``samples`` (the global batch; every rank passes all of them) at SFT step
        ``step`` (0-based; the learning rate is :func:`hpcrl.sft_recipe.lr_at` of it times ``lr_scale``, the
        SFT loop's decay after the target, ``sft.anneal_steps``). Collective over the trainer's ranks.

        Returns ``train/{loss (nats per trained token, the batch's mean), grad_norm, lr, tokens (trained
        tokens of the batch), tokens_per_s (all tokens of the batch per second), forward_tokens, seconds}``.
        Raises ValueError for a batch that does not split over the data-parallel ranks or a sample with
        inconsistent lengths, RuntimeError when the optimizer skips the step (non-finite gradients).
        """
        from hpcrl import sft_recipe as sft
        from hpcrl.train import model as tmodel
        from hpcrl.train.actor import build_steps
        from hpcrl.train.context_parallel import loss_scale
        from hpcrl.train.forward import staged_log_probs

        t0 = time.perf_counter()
        lr = sft.lr_at(step, self.cfg.sft.steps, self.cfg.sft.lr) * lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        masks = [torch.as_tensor(s.loss_mask, dtype=torch.float32) for s in samples]
        zeros = [torch.zeros_like(m) for m in masks]
        (micro_batches,), _ = build_steps(samples, masks, zeros, self.train_section, self.model.config,
                                          self.dp_rank, self.dp_size, self.device, with_rollout_log_probs=False)
        trained = float(sum(float(m.sum()) for m in masks))
        local: dict[str, torch.Tensor] = {}

        def loss_fn(model: torch.nn.Module, mb: Any) -> tmodel.StagedLoss:
            def nll_of(out) -> torch.Tensor:  # on the last pipeline stage
                nll = -(out.log_probs * mb.mask).sum() / max(trained, 1.0)
                local["loss"] = local["loss"] + nll.detach() if "loss" in local else nll.detach()
                return nll * loss_scale(self.dp_size)  # DDP averages over DP x CP ranks

            return staged_log_probs(self.ddp_model, self.model, mb, 1.0, False, self.vocab_size).then(nll_of)

        result = tmodel.train_step(self.ddp_model, self.optimizer, loss_fn, micro_batches)
        if not result["update_successful"]:
            raise RuntimeError("SFT optimizer step was skipped (update_successful=False): non-finite gradients?")
        sums = parallel.from_last_stage(parallel.sum_over_ranks(
            {"loss": local.get("loss", torch.zeros(())),
             "forward": float(sum(mb.forward_tokens for mb in micro_batches))},
            self.device, self._dp_group if self.dp_size > 1 else None))
        seconds = time.perf_counter() - t0
        grad_norm: Optional[Any] = result["grad_norm"]
        out = {"train/loss": sums["loss"], "train/lr": lr, "train/tokens": trained,
               "train/forward_tokens": sums["forward"], "train/seconds": seconds,
               "train/tokens_per_s": sum(len(s.tokens) for s in samples) / max(seconds, 1e-9)}
        if grad_norm is not None:
            out["train/grad_norm"] = float(grad_norm)
        return out
