"""PPO's value model (``algorithm.advantage_estimator: gae``): a megatron-core GPTModel with a scalar value
head.

slime's critic (``--critic-*``, ``MegatronTrainRayActor`` with ``role="critic"``), veRL's
``DataParallelPPOCritic`` (``AutoModelForTokenClassification`` with ``num_labels=1``), OpenRLHF's
``CriticModel``: the actor's architecture whose output layer is replaced by ``Linear(hidden, 1)``; the value
of response token ``j`` is read at the position that predicts it (the position of its log-prob), so
``values[i, j]`` is ``V(s_j)``, the value of the state before token ``j``
(:func:`hpcrl.train.gae.gae_advantages_and_returns`'s convention).

:class:`Critic` lives on every trainer rank beside the :class:`~hpcrl.train.actor.Actor` (which owns it as
``actor.critic``), with the actor's tensor- and data-parallel layout and the same micro-batches, and its own
megatron DDP, Adam and learning-rate schedule (``critic.nprocs: 0``); or on ranks of its own, a world of its
own with its own layout (``critic.nprocs > 0``: :mod:`hpcrl.train.critic_worker`, driven by the actor through
:class:`hpcrl.train.critic_group.RemoteCritic`). Either way the actor drives it per rollout with the same four
calls: :meth:`Critic.begin`, :meth:`~Critic.sample_values`, :meth:`~Critic.begin_train`,
:meth:`~Critic.end_train`. :class:`ValueHead` is the head; :func:`load_value_model` builds the model from an HF
folder.

Value head initialisation: zeros (``critic.path`` a causal LM), so every value starts at 0 and the first
rollout's GAE advantages are the plain (discounted) returns, as REINFORCE with no baseline would give: no
random head output adds noise to the actor's first steps, and the backbone gets no gradient until the head has
moved off 0 (a zero head passes none back), so the first critic steps fit the head on the pretrained features
(veRL and OpenRLHF draw small normal heads instead; at 0 the first values are exactly known, which the tests
use). A ``critic.path`` with a one-output ``score`` head (HF ``*ForSequenceClassification`` /
``*ForTokenClassification`` with ``num_labels=1``, a reward model) loads that head.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from hpcrl.train import parallel
from hpcrl.train.context_parallel import loss_scale

if TYPE_CHECKING:
    from hpcrl.config import Config, TrainSection

Tensor = torch.Tensor
Reducer = Callable[[Tensor], Tensor]

SCORE_HEAD = "score.weight"
"""HF name of a sequence/token-classification model's head (``[num_labels, hidden]``, no bias)."""


class ValueHead(torch.nn.Module):
    """``Linear(hidden, 1)`` without bias, in place of GPTModel's ``output_layer``.

    GPTModel's ``_postprocess`` calls ``output_layer(hidden_states, weight=...,
    runtime_gather_output=...)`` on ``[seq, batch, hidden]`` and returns the first output transposed to
    ``[batch, seq, 1]`` (megatron-core 0.16.1); the head ignores both keywords (no vocab, no tied weight) and
    returns ``(values, None)``. The head is replicated on every tensor-parallel rank: without sequence
    parallelism every rank holds the full hidden states, so it computes the same values and gets the same
    gradient. With ``sequence_parallel`` the hidden states are split along the sequence and are gathered first
    (backward: each rank keeps its slice of the gradient, since every rank computes the full, identical
    loss).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: Union[str, torch.device],
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.gather_sequence = sequence_parallel

    def forward(self, hidden_states: Tensor, weight: Optional[Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[Tensor, None]:
        """``[seq, batch, hidden]`` -> (``[seq, batch, 1]``, None)."""
        if self.gather_sequence:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states,
                                                                 tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight), None


def _read_tensor(path: Union[str, os.PathLike], name: str) -> Optional[Tensor]:
    """The tensor ``name`` of an HF folder's safetensors, or None when no file has it."""
    from safetensors import safe_open

    from hpcrl.models.support import weight_files

    for f in weight_files(path):
        with safe_open(str(f), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None


def load_value_model(path: Union[str, os.PathLike], dtype: torch.dtype, megatron: Optional[dict] = None,
                     sequence_parallel: bool = False):
    """A GPTModel shaped like the HF folder ``path`` with its weights and a :class:`ValueHead`.

    The decoder and embeddings are loaded as the actor's (:func:`hpcrl.train.bridge.load_hf_weights`); the
    LM head (``lm_head.weight``; a tied model's output weight is the embedding, which stays with the
    embedding) is not used. The value head is ``score.weight`` when the folder has one of shape ``[1,
    hidden]``, else zeros. Needs model parallelism initialised; ``sequence_parallel`` as the actor's (the value
    head then gathers the sequence: :class:`ValueHead`); under pipeline parallelism only the last stage has
    the head. Returns the bare model (``hf_config`` attached). Raises ValueError for a ``score.weight`` of
    another shape (a classifier with several labels), and what :func:`~hpcrl.train.bridge.load_hf_weights`
    raises.
    """
    from transformers import AutoConfig

    from hpcrl.train import bridge, model as tmodel

    extra = tmodel.split_megatron_kwargs(megatron)
    hf_config = AutoConfig.from_pretrained(str(path))
    model = bridge.build_gpt_model(hf_config, dtype=dtype, sequence_parallel=sequence_parallel,
                                   **extra["model"], **extra["transformer"])
    # no LM head: nothing of the model is the output layer, and the tied embedding is an embedding only
    model.output_layer = torch.nn.Identity()
    if model.share_embeddings_and_output_weights:
        model.share_embeddings_and_output_weights = False  # (megatron then sums no tied gradient over stages)
        if model.pre_process:  # a last pipeline stage's copy of it went with the output layer
            weight = model.embedding.word_embeddings.weight
            if hasattr(weight, "zero_out_wgrad"):
                del weight.zero_out_wgrad
    bridge.load_hf_weights(model, path, ignore=("lm_head.weight", SCORE_HEAD))
    if not model.post_process:  # a pipeline stage before the last: no head
        del model.output_layer
        return model
    device = next(model.parameters()).device
    head = ValueHead(model.config.hidden_size, dtype, device, bool(model.config.sequence_parallel))
    score = _read_tensor(path, SCORE_HEAD)
    if score is not None:
        if tuple(score.shape) != (1, model.config.hidden_size):
            raise ValueError(f"{path}: {SCORE_HEAD} has shape {tuple(score.shape)}; a value head needs "
                             f"[1, {model.config.hidden_size}] (a one-output score head, num_labels=1)")
        with torch.no_grad():
            head.weight.copy_(score)
    model.output_layer = head
    return model


def critic_train_section(cfg: "Config") -> "TrainSection":
    """``cfg.train`` with the critic's learning rate: ``critic.lr``, linear warmup over
    ``critic.lr_warmup_steps`` optimizer steps, then constant (betas, weight decay, grad clip, bf16 and the
    distributed optimizer stay ``train``'s)."""
    return dataclasses.replace(cfg.train, lr=cfg.critic.lr, min_lr=0.0,
                               lr_warmup_steps=cfg.critic.lr_warmup_steps, lr_decay_style="constant",
                               lr_decay_steps=None)


@dataclasses.dataclass
class ValueTargets:
    """What the value loss of one micro-batch compares against, ``[b, R]`` float32 each (0 beyond a
    response)."""

    old_values: Tensor
    """The critic's values before this rollout's critic steps (the clip's centre)."""
    returns: Tensor
    """GAE returns ``advantages + old_values`` (before any whitening of the advantages)."""


class Critic:
    """The value model on one trainer rank: megatron-core model + DDP + Adam + lr schedule.

    Create on every trainer rank after model parallelism is initialised (as
    :class:`~hpcrl.train.actor.Actor`), with the same config. ``hf_path``: the actor's HF folder, used when
    ``critic.path`` is null.

    Attributes:
        ddp_model: megatron-core ``DistributedDataParallel`` (for checkpointing).
        optimizer: the megatron-core optimizer (for checkpointing).
        lr_scheduler: megatron-core ``OptimizerParamScheduler`` over :func:`critic_train_section`; its
            learning rate is a pure function of the global optimizer step
            (:func:`hpcrl.train.model.set_lr_step`).
        model: the bare GPTModel with :class:`ValueHead` as ``output_layer`` (``hf_config`` attached).
        path: the HF folder it was built from.
    """

    def __init__(self, cfg: "Config", hf_path: Union[str, os.PathLike]) -> None:
        from megatron.core import parallel_state

        from hpcrl.train import bridge, model as tmodel

        self.cfg = cfg
        self.path = str(cfg.critic.path or hf_path)
        train = critic_train_section(cfg)
        megatron = {k: v for k, v in (cfg.megatron or {}).items() if k != "moe_enable_routing_replay"}
        dtype = torch.bfloat16 if train.bf16 else torch.float32
        from hpcrl.config.train import sequence_parallel

        # at the critic's own tensor-parallel size (critic.nprocs > 0 may give it another than the actor's)
        sp = sequence_parallel(cfg.train, parallel_state.get_tensor_model_parallel_world_size())
        bare = load_value_model(self.path, dtype, megatron, sequence_parallel=sp)
        self.ddp_model, self.optimizer = tmodel.wrap_model_and_optimizer(bare, train, megatron)
        self.lr_scheduler = tmodel.lr_scheduler(self.optimizer, train, cfg.run.num_rollout)
        self.model = bridge.unwrap_model(self.ddp_model)
        self.device = next(self.model.parameters()).device
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self._dp_group = parallel_state.get_data_parallel_group()
        self._rollout: Optional[_Rollout] = None

    # -- forward -------------------------------------------------------------------------------------------

    def forward(self, mb: Any) -> Tensor:
        """Values of a micro-batch's response tokens, ``[b, R]`` float32 with autograd, 0 beyond a response,
        without pipeline parallelism: :meth:`staged_forward` run to its end."""
        staged = self.staged_forward(mb)
        return staged.finish(staged.output)

    def staged_forward(self, mb: Any):
        """The value model's forward of a micro-batch on this pipeline stage, as a
        :class:`~hpcrl.train.model.StagedLoss` whose finish (on the last stage) gives the values of its response
        tokens, ``[b, R]`` float32 with autograd, 0 beyond a response.

        ``mb``: a :class:`~hpcrl.train.actor.MicroBatch` (its ``tokens``, ``total_lengths``,
        ``response_lengths`` and ``pack``). Padded layout: the value of response token ``j`` of row ``i`` is
        the head's output at column ``total_i - resp_i + j - 1`` (where its log-prob is predicted,
        :func:`hpcrl.train.logprobs.response_log_probs`); packed layout: at the pack's ``logit_rows``
        (:func:`hpcrl.train.packing.packed_response_log_probs`), under context parallelism this rank's share
        of them, gathered over the CP ranks (:mod:`hpcrl.train.context_parallel`).
        """
        from hpcrl.train import context_parallel as cpar
        from hpcrl.train.deepseek_moe import padding_kwargs
        from hpcrl.train.logprobs import prediction_columns
        from hpcrl.train.model import StagedLoss

        resp = mb.response_lengths
        if mb.pack is not None:
            from hpcrl.train.packing import packed_seq_params, rotary_positions

            width = int(resp.max()) if resp.numel() else 0
            mask = torch.arange(width, device=resp.device).unsqueeze(0) < resp.unsqueeze(1)  # [b, R]
            pack, params = mb.pack, packed_seq_params(mb.pack)
            local = cpar.local_pack(pack, params)  # this CP rank's rows and response predictions
            with rotary_positions(self.model, pack.positions):
                out = self.ddp_model(input_ids=local.tokens, position_ids=local.positions.unsqueeze(0),
                                     attention_mask=None, packed_seq_params=params,
                                     **padding_kwargs(self.model, local.valid))

            def finish_packed(head: Tensor) -> Tensor:
                flat = head[0, :, 0].float().index_select(0, local.rows.to(head.device))  # [K] or [K_rank]
                flat = local.gathered(flat, pack.logit_rows.numel())
                return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat)

            return StagedLoss(out, finish_packed)
        tokens = mb.tokens
        batch, seq = tokens.shape
        position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, -1)
        total = mb.total_lengths.to(tokens.device)
        padding = padding_kwargs(self.model, position_ids < total.unsqueeze(1))
        out = self.ddp_model(input_ids=tokens, position_ids=position_ids, attention_mask=None, **padding)
        index, mask = prediction_columns(total, resp.to(tokens.device))
        return StagedLoss(out, lambda head: torch.gather(head[..., 0].float(), 1, index).masked_fill(~mask, 0.0))

    @torch.no_grad()
    def values(self, micro_batches: Sequence[Any]) -> list[Tensor]:
        """:meth:`forward` of each micro-batch in eval mode without autograd, through megatron's schedule
        (:func:`hpcrl.train.model.forward_only`): ``[b, R]`` per micro-batch, aligned with the actor's response
        log-probs of the same micro-batch."""
        from hpcrl.train import model as tmodel

        self.ddp_model.eval()
        try:
            return tmodel.forward_only(self.ddp_model, lambda _model, mb: self.staged_forward(mb).then(Tensor.detach),
                                       micro_batches)
        finally:
            self.ddp_model.train()

    # -- optimizer step ------------------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[Any], targets: Sequence[ValueTargets],
                   reducers: Callable[[Any], tuple[Reducer, Reducer]], step: int
                   ) -> dict[str, Optional[float]]:
        """One optimizer step of the critic over this rank's micro-batches of an actor step (the same split).

        The loss of a micro-batch is :func:`hpcrl.train.gae.value_loss` (clipped with ``critic.value_clip``)
        reduced with the first of ``reducers(mb)``, the actor's ``(loss, metrics)`` reducers of that
        micro-batch (step-wide denominators, so the micro-batches' losses sum to the step's;
        ``value_clipfrac`` uses the metrics one, so it stays a fraction whatever the loss reduction), times
        the data-parallel size (megatron DDP averages gradients over DP; slime's ``loss *= dp_size``).
        ``targets[i]`` belong to ``micro_batches[i]``; ``step``: the global optimizer step
        (``rollout_id * train.num_steps_per_rollout + k``), which sets the
        learning rate. Collective over the data-parallel group. Returns ``value_loss`` and
        ``value_clipfrac`` (the step's global values), ``grad_norm`` (None when not computed) and ``lr``.
        Raises RuntimeError when the optimizer skips the step (non-finite gradients).
        """
        from hpcrl.train import gae, model as tmodel

        lr = tmodel.set_lr_step(self.lr_scheduler, step)
        clip = self.cfg.critic.value_clip
        local: dict[str, Tensor] = {}

        def loss_fn(model: torch.nn.Module, item: tuple[Any, ValueTargets]) -> tmodel.StagedLoss:
            return self.staged_forward(item[0]).then(lambda values: value_loss(values, *item))

        def value_loss(values: Tensor, mb: Any, target: ValueTargets) -> Tensor:  # on the last stage
            reduce, report = reducers(mb)
            loss, clipfrac = gae.value_loss(values, target.old_values, target.returns, mb.mask, reduce, clip)
            if report is not reduce:
                clipfrac = gae.value_loss(values.detach(), target.old_values, target.returns, mb.mask, report,
                                          clip)[1]
            for k, v in (("value_loss", loss.detach()), ("value_clipfrac", clipfrac.detach())):
                local[k] = local[k] + v if k in local else v
            return loss * loss_scale(self.dp_size)  # DDP averages over DP x CP ranks

        result = tmodel.train_step(self.ddp_model, self.optimizer, loss_fn, list(zip(micro_batches, targets,
                                                                                     strict=True)))
        if not result["update_successful"]:
            raise RuntimeError("critic optimizer step was skipped (update_successful=False): "
                               "non-finite gradients?")
        out: dict[str, Optional[float]] = dict(parallel.from_last_stage(self.all_reduce_sum(local)))
        grad_norm = result["grad_norm"]
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else None
        out["lr"] = lr
        return out

    def all_reduce_sum(self, values: dict[str, Tensor]) -> dict[str, float]:
        """Sum each scalar over the data-parallel ranks (:func:`hpcrl.train.parallel.sum_over_ranks`)."""
        return parallel.sum_over_ranks(values, self.device, self._dp_group if self.dp_size > 1 else None)

    # -- one rollout: what Actor.train asks of its critic (RemoteCritic serves the same from its own ranks) --

    def begin(self, rollout_id: int, samples: Sequence[Any], steps: Sequence[Sequence[Any]],
              step_sums: Sequence[dict[int, float]]) -> None:
        """Start rollout ``rollout_id``: ``steps[k]`` this rank's micro-batches of optimizer step ``k`` (the
        values forward and the critic's steps use them), ``step_sums[k]`` that step's rollout mask sums (the
        reducers' step-wide denominators, :func:`hpcrl.train.algorithms.compute_rollout_mask_sums`).
        ``samples`` (the rollout's ``N`` samples) are in the micro-batches already; a critic on ranks of its own
        (:class:`hpcrl.train.critic_group.RemoteCritic`) sends them."""
        self._rollout = _Rollout(rollout_id, [list(s) for s in steps], list(step_sums))

    def sample_values(self, num_samples: int) -> list[Tensor]:
        """Every sample's values before this rollout's critic steps, on every rank: ``[response_length]``
        float32 CPU tensors for positions ``0 .. num_samples-1`` (:meth:`values` of this rank's micro-batches,
        gathered over the data-parallel ranks). Collective over the data-parallel group. Raises RuntimeError
        before :meth:`begin`, or when a position is in no rank's micro-batches."""
        r = self._current()
        t0 = time.perf_counter()
        flat = [mb for step in r.steps for mb in step]
        r.old_values = self.values(flat)
        out = parallel.gather_per_sample(flat, r.old_values, num_samples, self._dp_group, self.dp_size)
        r.seconds += time.perf_counter() - t0
        return out

    def begin_train(self, returns: Sequence[Tensor]) -> None:
        """The critic's regression targets: every sample's ``[response_length]`` GAE returns (positions ``0 ..
        N-1``), from :func:`hpcrl.train.ppo.shaped_advantages`. Training runs in :meth:`end_train`. Raises
        RuntimeError before :meth:`sample_values`."""
        r = self._current()
        if r.old_values is None:
            raise RuntimeError("begin_train before sample_values: the value clip needs the old values")
        r.returns = list(returns)

    def end_train(self) -> dict[str, float]:
        """The critic's optimizer steps of this rollout (:meth:`train_steps` over the split of :meth:`begin`,
        at global steps ``rollout_id * train.num_steps_per_rollout + k``); returns their metrics, with
        ``critic/seconds`` the time of the values forward and the steps. Collective over the data-parallel
        group. Raises RuntimeError before :meth:`begin_train`, and what :meth:`train_step` raises."""
        r = self._current()
        if r.returns is None:
            raise RuntimeError("end_train before begin_train: no returns to regress on")
        self._rollout = None
        targets = []
        for mb, old in zip((mb for step in r.steps for mb in step), r.old_values, strict=True):
            rows = torch.zeros_like(old)
            for i, (p, k) in enumerate(zip(mb.positions, mb.response_lengths.tolist(), strict=True)):
                rows[i, :k] = r.returns[p][:k].to(rows)
            targets.append(ValueTargets(old_values=old, returns=rows))
        return self.train_steps(r.steps, targets, r.step_sums, r.rollout_id * self.cfg.train.num_steps_per_rollout,
                                r.seconds)

    def _current(self) -> "_Rollout":
        if self._rollout is None:
            raise RuntimeError("no rollout begun: call Critic.begin first")
        return self._rollout

    def train_steps(self, steps: Sequence[Sequence[Any]], targets: Sequence[ValueTargets],
                    step_sums: Sequence[dict[int, float]], first_step: int, seconds: float = 0.0
                    ) -> dict[str, float]:
        """The critic's optimizer steps over a rollout's split: step ``k`` trains on ``steps[k]`` (this rank's
        micro-batches) with the reducers of ``step_sums[k]`` (:func:`hpcrl.train.algorithms.step_reducers`:
        ``algorithm.loss_reduction`` for the loss, per-sample token means for the metrics; the actor's) at
        global optimizer step ``first_step + k`` (:meth:`train_step`). ``targets``: one per micro-batch, in
        the order of ``steps`` flattened.

        Returns ``critic/{value_loss, value_clipfrac, grad_norm}`` (means over the steps, each the step's
        global value), ``critic/lr`` (of the last step) and ``critic/seconds`` (wall time plus ``seconds``,
        the time already spent on the critic in this rollout: its values forward). Collective over the
        data-parallel group; raises ValueError when ``targets`` do not match the micro-batches, and what
        :meth:`train_step` raises.
        """
        from hpcrl.train import algorithms, model as tmodel

        t0 = time.perf_counter()
        per_step, i = [], 0
        for k, (step, sums) in enumerate(zip(steps, step_sums, strict=True)):
            def reducers(mb: Any, sums: dict[int, float] = sums) -> tuple[Reducer, Reducer]:
                return algorithms.step_reducers(self.cfg, mb.mask, mb.positions, sums)

            per_step.append(self.train_step(step, targets[i: i + len(step)], reducers, first_step + k))
            i += len(step)
        if i != len(targets):
            raise ValueError(f"{len(targets)} value targets for {i} micro-batches")
        out = tmodel.mean_over_steps(per_step, ("value_loss", "value_clipfrac", "grad_norm"), "critic/")
        out["critic/lr"] = float(per_step[-1]["lr"])
        out["critic/seconds"] = seconds + time.perf_counter() - t0
        return out


@dataclasses.dataclass
class _Rollout:
    """What :class:`Critic` keeps of the rollout in progress, from :meth:`~Critic.begin` to
    :meth:`~Critic.end_train`."""

    rollout_id: int
    steps: list[list[Any]]
    step_sums: list[dict[int, float]]
    old_values: Optional[list[Tensor]] = None
    """``[b, R]`` per micro-batch of ``steps`` flattened (:meth:`Critic.sample_values`)."""
    returns: Optional[list[Tensor]] = None
    """``[len_i]`` per sample (:meth:`Critic.begin_train`)."""
    seconds: float = 0.0
    """Time spent on this rollout so far (the values forward)."""
