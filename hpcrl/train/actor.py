"""The training side of one RL step: rollout samples in, optimizer steps out (slime's ``train_actor``).

:class:`Actor` lives on every trainer rank. It owns the megatron-core model (wrapped in DDP) and its
optimizer, built from an HF folder by :func:`hpcrl.train.model.setup_model_and_optimizer`, and, with a KL
loss or a KL penalty in the reward (``algorithm.kl_coef``), a CPU copy of the initial weights (the reference policy) that is swapped into the same model for the
reference forward (:class:`WeightBackup`, slime's ``TensorBackuper``: no second model).

One :meth:`Actor.train` call does what slime's ``MegatronTrainRayActor.train_actor`` and Megatron's ``train``
loop do for one rollout:

1. rewards -> per-token advantages over the whole rollout
   (:func:`~hpcrl.train.algorithms.compute_advantages`); with a critic (``gae``) or a KL penalty in the reward
   (``algorithm.kl_coef``) after steps 3-4 instead (:mod:`hpcrl.train.ppo`, GAE from :attr:`Actor.critic`);
2. ``train.num_steps_per_rollout`` global batches, this data-parallel rank's contiguous slice of each, in
   micro-batches of ``train.micro_batch_size`` right-padded rows;
3. old log-probs recomputed with the current weights, or taken from the training forward itself when the step
   is exactly on-policy (slime's ``can_reuse_log_probs_in_loss``);
4. reference log-probs with the reference weights swapped in (``algorithm.use_kl_loss`` or ``kl_coef``);
5. the optimizer steps, each a :func:`~hpcrl.train.model.train_step` whose loss is
   :func:`~hpcrl.train.algorithms.compute_loss` reduced with ``algorithm.loss_reduction`` (default slime's
   per-rollout token mean) over the step's *global* batch (so neither micro-batching nor data parallelism changes the loss or its gradient);
6. metrics summed over micro-batches and data-parallel ranks, and slime's ``--ci-test`` gates;
7. with a critic, its optimizer steps over the same split into steps (only these in the
   ``critic.warmup_steps`` first rollouts): on these ranks after the actor's, or on the critic's own ranks
   (``critic.nprocs > 0``) beside them, its values forward beside 3-4 (:mod:`hpcrl.train.critic_group`).

Sizes: ``N`` samples per rollout (every rank gets all of them), ``dp`` data-parallel ranks, ``S`` =
``train.num_steps_per_rollout``. ``N`` must be a multiple of ``dp * S``; it need not be ``rollout.batch_size x
n_samples_per_prompt`` (nor ``S x train.global_batch_size``): when the dynamic filter starves, the loop hands
over the kept groups, as many as split into ``dp * S`` (the others wait for the next rollout), and each step
is then a smaller global batch with the same loss normalisation. The global batch of step ``s`` is
the contiguous ``s``-th ``N/S`` of the samples (Megatron's global batch), and rank ``r`` trains on the
contiguous ``r``-th ``N/(dp*S)`` of it. So which samples a step trains on does not depend on the parallel
layout, and a rollout gives the same result at any TP x DP (up to rounding). slime partitions over DP ranks
first and then into steps, which makes the steps' composition depend on the DP size when ``S > 1``; with
``S = 1`` both agree.

Pipeline and context parallelism are not supported (size 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union

import torch

from hpcrl.train import algorithms, forward, lora, parallel, ppo
from hpcrl.train.context_parallel import loss_scale
from hpcrl.train.critic import Critic
from hpcrl.train.model import ModelOnRank

if TYPE_CHECKING:
    from hpcrl.config import Config, TrainSection
    from hpcrl.data.sample import Sample
    from hpcrl.train.critic_group import RemoteCritic
    from hpcrl.train.packing import Pack

Tensor = torch.Tensor

CI_TOLERANCE = 1e-8
"""slime's ``--ci-test`` bound for values that must be exactly 0 (first-step ppo_kl, rollout-0 ref diff)."""


# ------------------------------------------------------------------------------------------------------------
# Reference weights
# ------------------------------------------------------------------------------------------------------------


class WeightBackup:
    """CPU copies of a model's parameters under tags, swapped into the one model on demand.

    slime: ``TensorBackuper`` (``slime/utils/tensor_backper.py``) with ``_switch_model(tag)``. Copies are
    taken of this rank's parameter shards (``model.named_parameters()`` of the bare GPTModel), in pinned
    memory on GPUs. :meth:`restore` writes in place (``param.data.copy_``), so DDP's contiguous parameter
    buffers and the optimizer's fp32 main parameters stay attached; restoring the tag that was backed up just
    before is bitwise exact.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = dict(model.named_parameters())
        self._tags: dict[str, dict[str, Tensor]] = {}

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags backed up so far."""
        return tuple(self._tags)

    @torch.no_grad()
    def backup(self, tag: str) -> None:
        """Copy the current parameters to the CPU under ``tag`` (replacing an earlier copy of that tag)."""
        pin = torch.cuda.is_available()
        store = self._tags.get(tag)
        if store is None:
            store = {name: torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                     for name, p in self._params.items()}
            self._tags[tag] = store
        for name, p in self._params.items():
            store[name].copy_(p.detach(), non_blocking=pin)
        if pin:
            torch.cuda.synchronize()

    @torch.no_grad()
    def restore(self, tag: str) -> None:
        """Copy the parameters saved under ``tag`` into the model, in place.

        Raises KeyError for an unknown tag.
        """
        if tag not in self._tags:
            raise KeyError(f"no weights backed up under tag {tag!r}; have {self.tags}")
        store = self._tags[tag]
        for name, p in self._params.items():
            p.data.copy_(store[name], non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def swapped(self, tag: str, current: str = "actor") -> Iterator[None]:
        """Run a block with the ``tag`` weights in the model; the current ones are saved as ``current``
        and put back afterwards (also on error)."""
        self.backup(current)
        self.restore(tag)
        try:
            yield
        finally:
            self.restore(current)


# ------------------------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------------------------


def sample_rewards(samples: Sequence["Sample"]) -> Tensor:
    """Scalar rewards ``[N]`` float32 (:meth:`hpcrl.data.sample.Sample.scalar_reward` of each sample).

    Raises ValueError naming the sample when a reward is missing, TypeError for a dict reward without
    ``"reward"``.
    """
    return torch.tensor([s.scalar_reward() for s in samples], dtype=torch.float32)


def _check_sample(i: int, s: "Sample", with_rollout_log_probs: bool) -> None:
    n = s.response_length
    if not 0 <= n < len(s.tokens):
        raise ValueError(f"sample {i} (index {s.index}): need 0 <= response_length ({n}) < len(tokens) "
                         f"({len(s.tokens)}); every response needs a prompt token")
    if len(s.loss_mask) != n:
        raise ValueError(f"sample {i} (index {s.index}): loss_mask has {len(s.loss_mask)} entries for "
                         f"response_length {n}")
    if with_rollout_log_probs and len(s.rollout_log_probs) != n:
        raise ValueError(f"sample {i} (index {s.index}): rollout_log_probs has {len(s.rollout_log_probs)} "
                         f"entries for response_length {n}")
    s.segment_bounds()  # ValueError for segments that do not split the tokens


@dataclasses.dataclass
class MicroBatch:
    """Right-padded tensors of a few samples; response-aligned tensors are ``[b, R]`` with ``R`` the longest
    response of the micro-batch (0 beyond a response)."""

    positions: list[int]
    """Positions of the samples in the rollout's full sample list (also their rollout ids)."""
    tokens: Tensor
    """``[b, T]`` prompt + response ids, right-padded with 0 to the longest sample."""
    total_lengths: Tensor
    """``[b]`` prompt + response lengths."""
    response_lengths: Tensor
    """``[b]``."""
    mask: Tensor
    """``[b, R]`` float32 loss mask."""
    advantages: Tensor
    """``[b, R]`` float32."""
    rollout_log_probs: Optional[Tensor]
    """``[b, R]`` float32 log-probs of the rollout engine, or None when the samples have none."""
    teacher_log_probs: Optional[Tensor] = None
    """``[b, R]`` float32 log-probs of the on-policy distillation teachers (``algorithm.opd``), or None."""
    old_log_probs: Optional[Tensor] = None
    """``[b, R]`` float32, set by the recompute pass (None: reuse the training forward's)."""
    ref_log_probs: Optional[Tensor] = None
    """``[b, R]`` float32, set by the reference pass (KL loss only)."""
    pack: Optional["Pack"] = None
    """The packed (THD) layout of the same samples (:mod:`hpcrl.train.packing`); None: the forward runs on
    the padded ``tokens``."""
    routed_experts: Optional[Tensor] = None
    """Routing replay: int64 ``[forward tokens, moe_layers, top_k]``, the engine's experts in the routers'
    token order (:mod:`hpcrl.train.routing_replay`); None: the routers choose."""

    @property
    def forward_tokens(self) -> int:
        """Tokens the decoder processes for this micro-batch: the pack's (padding included), else ``b x T``."""
        return int(self.pack.tokens.shape[1]) if self.pack is not None else int(self.tokens.numel())

    @property
    def padded_tokens(self) -> int:
        """Tokens of the padded layout (``b x T``), whichever layout runs."""
        return int(self.tokens.numel())


def build_micro_batch(samples: Sequence["Sample"], positions: Sequence[int], advantages: Sequence[Tensor],
                      device: Union[str, torch.device] = "cpu",
                      with_rollout_log_probs: bool = True, packed: bool = False, share_prompt: bool = True,
                      pad_to_multiple: int = 1, with_teacher_log_probs: bool = False,
                      routing: Optional[tuple[int, int]] = None) -> MicroBatch:
    """Pad ``samples[p] for p in positions`` into a :class:`MicroBatch` on ``device``.

    ``advantages``: per sample of the full list, ``[response_length]``. An empty response is allowed (it
    trains nothing). ``packed``: also lay the samples out as one :class:`~hpcrl.train.packing.Pack` (the
    forward then runs on it; ``share_prompt`` and ``pad_to_multiple`` as in
    :func:`~hpcrl.train.packing.build_pack`; the padded layout's width is a multiple of ``pad_to_multiple``
    too); a micro-batch with a sample of several segments
    (``Sample.segments``) is always packed, so attention stays within each. Raises ValueError for a sample
    without prompt or whose
    ``loss_mask`` / ``rollout_log_probs`` lengths differ from ``response_length`` (``teacher_log_probs`` too,
    with ``with_teacher_log_probs``). ``routing``: ``(moe_layers, top_k)`` for routing replay: the samples'
    ``rollout_routed_experts`` become :attr:`MicroBatch.routed_experts` (ValueError for a sample without them
    or with another shape).
    """
    rows = [samples[p] for p in positions]
    for p, s in zip(positions, rows, strict=True):
        _check_sample(p, s, with_rollout_log_probs)
    b = len(rows)
    width = -(-max(len(s.tokens) for s in rows) // pad_to_multiple) * pad_to_multiple  # SP splits it over TP
    resp_width = max(s.response_length for s in rows)
    tokens = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, resp_width, dtype=torch.float32)
    adv = torch.zeros(b, resp_width, dtype=torch.float32)
    rollout_lp = torch.zeros(b, resp_width, dtype=torch.float32) if with_rollout_log_probs else None
    teacher_lp = torch.zeros(b, resp_width, dtype=torch.float32) if with_teacher_log_probs else None
    for i, (p, s) in enumerate(zip(positions, rows, strict=True)):
        n = s.response_length
        if teacher_lp is not None:
            if len(s.teacher_log_probs) != n:
                raise ValueError(f"sample {p} (index {s.index}): teacher_log_probs has "
                                 f"{len(s.teacher_log_probs)} entries for response_length {n}")
            teacher_lp[i, :n] = torch.as_tensor(s.teacher_log_probs, dtype=torch.float32)
        tokens[i, : len(s.tokens)] = torch.as_tensor(s.tokens, dtype=torch.long)
        mask[i, :n] = torch.as_tensor(s.loss_mask, dtype=torch.float32)
        adv[i, :n] = advantages[p].to(torch.float32)
        if rollout_lp is not None:
            rollout_lp[i, :n] = torch.as_tensor(s.rollout_log_probs, dtype=torch.float32)
    total = torch.tensor([len(s.tokens) for s in rows], dtype=torch.long)
    resp = torch.tensor([s.response_length for s in rows], dtype=torch.long)
    to = dict(device=device)
    pack = None
    if packed or any(len(s.segments) > 1 for s in rows):
        from hpcrl.train.packing import build_pack

        pack = build_pack(rows, share_prompt=share_prompt, pad_to_multiple=pad_to_multiple, device=device)
    routed = None
    if routing is not None:
        from hpcrl.engine.routing import decode
        from hpcrl.train import routing_replay

        layers, top_k = routing
        per_sample = []
        for p, s in zip(positions, rows, strict=True):
            if not s.rollout_routed_experts:
                raise ValueError(f"sample {p} (index {s.index}) has no rollout_routed_experts for routing replay "
                                 "(the generate call must ask for return_routed_experts)")
            try:
                per_sample.append(torch.from_numpy(decode(s.rollout_routed_experts, len(s.tokens), layers,
                                                          top_k).copy()))
            except ValueError as e:
                raise ValueError(f"sample {p} (index {s.index}): routed experts do not fit {len(s.tokens)} tokens "
                                 f"x {layers} layers x top-{top_k}: {e}") from e
        routed = (routing_replay.packed_indices(per_sample, pack.sources, layers, top_k) if pack is not None
                  else routing_replay.padded_indices(per_sample, [len(s.tokens) for s in rows], width, layers,
                                                     top_k)).to(device)
    return MicroBatch(positions=list(positions), tokens=tokens.to(**to), total_lengths=total.to(**to),
                      response_lengths=resp.to(**to), mask=mask.to(**to), advantages=adv.to(**to),
                      rollout_log_probs=rollout_lp.to(**to) if rollout_lp is not None else None, pack=pack,
                      teacher_log_probs=teacher_lp.to(**to) if teacher_lp is not None else None,
                      routed_experts=routed)


def split_steps(num_samples: int, dp_rank: int, dp_size: int, num_steps: int,
                micro_batch_size: int) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Which samples each optimizer step trains on, globally and on this data-parallel rank.

    Step ``s`` trains on the contiguous global batch ``[s * N/S, (s+1) * N/S)``; rank ``r`` on the contiguous
    ``r``-th ``N/(S*dp)`` of it, in micro-batches of at most ``micro_batch_size`` (the last may be smaller).
    Returns ``(local, global_)``: ``local[s]`` this rank's micro-batches of step ``s`` (lists of positions
    in the full list); ``global_[s]`` all positions of step ``s``. Raises ValueError when ``num_samples`` is
    not a positive multiple of ``dp_size * num_steps``.
    """
    if num_samples <= 0 or num_samples % (dp_size * num_steps) != 0:
        raise ValueError(f"{num_samples} samples do not split into {dp_size} data-parallel ranks x "
                         f"{num_steps} steps per rollout (need a positive multiple of {dp_size * num_steps})")
    global_size = num_samples // num_steps
    local_size = global_size // dp_size
    local, global_ = [], []
    for s in range(num_steps):
        global_.append(list(range(s * global_size, (s + 1) * global_size)))
        mine = global_[-1][dp_rank * local_size: (dp_rank + 1) * local_size]
        local.append([mine[i: i + micro_batch_size] for i in range(0, local_size, micro_batch_size)])
    return local, global_


def plan_steps(samples: Sequence["Sample"], train: "TrainSection", dp_rank: int, dp_size: int
               ) -> tuple[list[list[list[int]]], list[list[int]]]:
    """``(local, global_)`` as :func:`split_steps` returns them, for ``train``'s micro-batching: fixed
    ``train.micro_batch_size`` micro-batches of contiguous rank slices, or, with
    ``train.max_tokens_per_microbatch``, token-budget micro-batches balanced over the ``dp_size``
    data-parallel ranks (:func:`~hpcrl.train.packing.plan_micro_batches`). Which samples a step trains on
    (``global_``) does not depend on ``dp_size``. Raises what :func:`split_steps` raises."""
    n = len(samples)
    if train.max_tokens_per_microbatch is None:
        return split_steps(n, dp_rank, dp_size, train.num_steps_per_rollout, train.micro_batch_size)
    from hpcrl.train.packing import plan_micro_batches

    _, global_ = split_steps(n, 0, 1, train.num_steps_per_rollout, max(n // train.num_steps_per_rollout, 1))
    local = [plan_micro_batches(samples, g, dp_rank, dp_size, train.max_tokens_per_microbatch,
                                train.share_group_prompt) for g in global_]
    return local, global_


def sequence_multiple(model_config: Any) -> int:
    """What a micro-batch's sequence length (padded width, or pack tokens) must be a multiple of for a model
    with this megatron ``TransformerConfig``: its tensor-parallel size under sequence parallelism (megatron
    splits the sequence into that many equal parts), else 1; times ``2 x`` the context-parallel size (the pack
    is cut into that many equal chunks: :func:`hpcrl.train.context_parallel.local_rows`). The
    ``pad_to_multiple`` of :func:`build_micro_batch`."""
    tp = model_config.tensor_model_parallel_size if model_config.sequence_parallel else 1
    cp = model_config.context_parallel_size
    return tp * (2 * cp if cp > 1 else 1)


def build_steps(samples: Sequence["Sample"], masks: Sequence[Tensor], advantages: Sequence[Tensor],
                train: "TrainSection", model_config: Any, dp_rank: int, dp_size: int,
                device: Union[str, torch.device], with_rollout_log_probs: bool = True,
                with_teacher_log_probs: bool = False, routing: Optional[tuple[int, int]] = None
                ) -> tuple[list[list[MicroBatch]], list[dict[int, float]]]:
    """This data-parallel rank's micro-batches of each optimizer step of a rollout and each step's rollout
    mask sums (the reducers' step-wide denominators), for the actor and for a critic on ranks of its own.

    ``masks``: every sample's ``[response_length]`` loss mask; ``advantages`` as :func:`build_micro_batch`;
    ``train``: micro-batching (:func:`plan_steps`), packing (``max_tokens_per_microbatch``,
    ``share_group_prompt``); ``model_config``: the megatron model's (a packed layout is padded to the
    tensor-parallel size under sequence parallelism). Raises what :func:`plan_steps` and
    :func:`build_micro_batch` raise."""
    local, global_ = plan_steps(samples, train, dp_rank, dp_size)
    packed = train.max_tokens_per_microbatch is not None
    pad = sequence_multiple(model_config)
    steps = [[build_micro_batch(samples, mb, advantages, device, with_rollout_log_probs, packed=packed,
                                share_prompt=train.share_group_prompt, pad_to_multiple=pad,
                                with_teacher_log_probs=with_teacher_log_probs, routing=routing)
              for mb in step] for step in local]
    return steps, [algorithms.compute_rollout_mask_sums([masks[p] for p in g], g) for g in global_]


# ------------------------------------------------------------------------------------------------------------
# Actor
# ------------------------------------------------------------------------------------------------------------


class Actor(ModelOnRank):
    """The policy trainer on one rank: megatron-core model + optimizer, reference weights, :meth:`train`.

    Create on every trainer rank after :func:`~hpcrl.train.parallel.init_distributed`,
    :func:`~hpcrl.train.parallel.initialize_model_parallel` (``cfg.train.tensor_parallel_size``) and
    :func:`~hpcrl.train.parallel.model_parallel_cuda_manual_seed`. The reference copy (``use_kl_loss``) is
    taken here, from the HF weights: load a checkpoint into :attr:`ddp_model` / :attr:`optimizer` afterwards,
    never before, or the reference would be the checkpoint. ``run.deterministic`` turns on
    ``torch.use_deterministic_algorithms(True)`` for the whole process, first thing
    (:func:`hpcrl.train.parallel.deterministic_mode`, its one home).

    Args:
        cfg: the run config (``train``, ``megatron``, ``algorithm``, ``rollout.temperature``,
            ``rollout.n_samples_per_prompt``, ``run.deterministic``).
        hf_path: HF folder of the initial policy.
        ci_checks: slime's ``--ci-test`` gates in :meth:`train` (raise AssertionError on failure).
        recompute_log_probs: ``None`` (slime's rule): recompute old log-probs unless the step is exactly
            on-policy (``run.mode: async`` never is); ``True``: always recompute; ``False``: never (an error
            when off-policy).
        ci_logprob_abs_diff_threshold: with ``ci_checks``, also require ``train_rollout_logprob_abs_diff``
            at most this (slime's ``--ci-train-rollout-logprob-abs-diff-threshold``); None: no check.
        critic: makes a PPO run's critic on ranks of its own (``critic.nprocs > 0``:
            :class:`~hpcrl.train.critic_group.RemoteCritic`), called once the actor's model is built (the
            critic's ranks load meanwhile); None: with ``algorithm.advantage_estimator: gae`` a
            :class:`~hpcrl.train.critic.Critic` is built on these ranks.

    Attributes:
        ddp_model: the megatron-core ``DistributedDataParallel`` model (for checkpointing).
        optimizer: the megatron-core optimizer (for checkpointing).
        model: the bare GPTModel (``hf_config`` attached).
        weights: the :class:`WeightBackup` (tag ``"ref"`` with ``use_kl_loss`` or ``kl_coef > 0``).
        critic: the value model (``advantage_estimator: gae``): a :class:`~hpcrl.train.critic.Critic` on
            these ranks or the ``critic`` given (ranks of its own); None without one. :meth:`train` drives
            either through ``begin``, ``sample_values``, ``begin_train`` and ``end_train``.
        step_metrics: per optimizer step of the last :meth:`train` call, that step's global metrics (the keys
            of :meth:`train` without the ``train/`` prefix; ``grad_norm`` None when not computed).

    Raises NotImplementedError for pipeline or context parallel size > 1; ValueError for
    ``recompute_log_probs=False`` with an off-policy setup, or when megatron's tensor-parallel size is not
    ``train.tensor_parallel_size``.
    """

    def __init__(self, cfg: "Config", hf_path: Union[str, os.PathLike], *, ci_checks: bool = False,
                 recompute_log_probs: Optional[bool] = None,
                 ci_logprob_abs_diff_threshold: Optional[float] = None,
                 critic: Optional[Callable[[], "RemoteCritic"]] = None) -> None:
        from megatron.core import parallel_state

        from hpcrl.train import model as tmodel

        parallel.deterministic_mode(cfg.run.deterministic)
        self.cfg = cfg
        self.uses_ref = cfg.algorithm.use_kl_loss or cfg.algorithm.kl_coef > 0  # KL loss or KL in the reward
        self.ci_checks = ci_checks
        self.ci_logprob_abs_diff_threshold = ci_logprob_abs_diff_threshold
        # async (one step off): the samples come from the weights before the last step, so the old log-probs
        # are recomputed with the current ones (slime train_async.py)
        self.on_policy = (cfg.run.mode == "sync" and cfg.train.num_steps_per_rollout == 1
                          and not self.uses_ref and not cfg.algorithm.use_tis
                          and cfg.algorithm.mis_level is None)
        if recompute_log_probs is False and not self.on_policy:
            raise ValueError("recompute_log_probs=False needs an exactly on-policy step "
                             "(sync mode, num_steps_per_rollout 1, no KL loss, no TIS, no MIS)")
        self.recompute = (not self.on_policy) if recompute_log_probs is None else recompute_log_probs
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp != cfg.train.tensor_parallel_size:
            raise ValueError(f"megatron's tensor-parallel size is {tp} but train.tensor_parallel_size is "
                             f"{cfg.train.tensor_parallel_size}; call initialize_model_parallel with the "
                             f"config's size")
        megatron = dict(cfg.megatron or {})
        if cfg.algorithm.routing_replay:
            megatron["moe_enable_routing_replay"] = True
        self.lora = lora.LoraSpec.of(cfg.model.lora)  # (LoRA: only adapters train; hpcrl.train.lora)
        self.bind_model(*tmodel.setup_model_and_optimizer(hf_path, cfg.train, megatron, lora=self.lora,
                                                          lora_seed=cfg.run.seed))
        # the actor's schedule starts at its first step, after PPO's critic-only rollouts (slime's scheduler
        # advances only on the actor's steps)
        self.critic_only = cfg.critic.warmup_steps if cfg.algorithm.advantage_estimator == "gae" else 0
        self.lr_scheduler = tmodel.lr_scheduler(self.optimizer, cfg.train,
                                                cfg.run.num_rollout - self.critic_only)
        self.weights = WeightBackup(self.model)
        self.routing: Optional[tuple[int, int]] = None
        if cfg.algorithm.routing_replay:
            from hpcrl.train import routing_replay

            mc = self.model.config
            if not mc.num_moe_experts:
                raise ValueError("algorithm.routing_replay: the model is dense (no experts to route); set it to "
                                 "false or train a mixture-of-experts model")
            self.routing = (routing_replay.moe_layer_count(mc), mc.moe_router_topk)
        self.step_metrics: list[dict[str, Optional[float]]] = []
        if self.uses_ref and self.lora is None:  # (with LoRA the reference is the base: the adapters off)
            self.weights.backup("ref")
        if cfg.algorithm.advantage_estimator != "gae":
            self.critic: Optional[Union[Critic, "RemoteCritic"]] = None
        else:
            self.critic = critic() if critic is not None else Critic(cfg, hf_path)

    def reference(self):
        """Context manager: the model is the reference policy in it, the initial weights swapped in (tag "ref")
        or with ``model.lora`` the base, every adapter off (:func:`hpcrl.train.lora.adapters_disabled`)."""
        return lora.adapters_disabled(self.model) if self.lora is not None else self.weights.swapped("ref")

    # -- forward passes ------------------------------------------------------------------------------------

    def _forward(self, mb: MicroBatch, with_entropy: bool = False):
        """The forward of a micro-batch on this pipeline stage, as a :class:`~hpcrl.train.model.StagedLoss`
        whose finish gives its response log-probs (and entropy) at the rollout temperature, ``[b, R]`` each
        (:func:`~hpcrl.train.forward.staged_log_probs`)."""
        from hpcrl.train import routing_replay

        with routing_replay.replaying(mb.routed_experts, self.model.config):  # the engine's, when replayed
            return self._forward_routed(mb, with_entropy)

    def _forward_routed(self, mb: MicroBatch, with_entropy: bool):
        """:meth:`_forward` under whatever routing is in force."""
        return forward.staged_log_probs(self.ddp_model, self.model, mb, self.cfg.rollout.temperature,
                                         with_entropy, self.vocab_size)

    @torch.no_grad()
    def _forward_only(self, micro_batches: Sequence[MicroBatch]) -> list[Tensor]:
        """Log-probs ``[b, R]`` of each micro-batch, in eval mode without autograd, through megatron's
        schedule (:func:`hpcrl.train.model.forward_only`; otherwise the very forward of training)."""
        from hpcrl.train import model as tmodel

        self.ddp_model.eval()
        try:
            return tmodel.forward_only(self.ddp_model, lambda _, mb: self._forward(mb).then(_log_probs),
                                       micro_batches)
        finally:
            self.ddp_model.train()

    def _all_reduce_sum(self, values: dict[str, Union[float, Tensor]]) -> dict[str, float]:
        """Sum each scalar over the data-parallel ranks (:func:`hpcrl.train.parallel.sum_over_ranks`)."""
        return parallel.sum_over_ranks(values, self.device, self._dp_group if self.dp_size > 1 else None)

    # -- one rollout ---------------------------------------------------------------------------------------

    def train(self, rollout_id: int, samples: Sequence["Sample"]) -> dict[str, float]:
        """Train on one rollout's samples: ``train.num_steps_per_rollout`` optimizer steps (slime's
        ``train_actor``). Collective: every trainer rank calls it with the same full ``samples`` list.

        ``samples``: ``N`` samples, the ``rollout.n_samples_per_prompt`` samples of each prompt adjacent, each
        with a reward, ``loss_mask`` and ``rollout_log_probs`` of ``response_length`` entries (the log-probs
        may be empty for every sample; then there is no ``train_rollout_logprob_abs_diff`` and TIS/MIS raise).

        Returns metrics (floats, the same on every rank): ``train/{loss, pg_loss, pg_clipfrac, ppo_kl,
        entropy, grad_norm, train_rollout_logprob_abs_diff}`` (means over the optimizer steps, each the
        global per-sample token mean of its step; entropy in nats, log-prob diff in nats per token),
        ``train/kl_loss`` (KL loss), ``train/{tis, tis_clipfrac, tis_abs}`` (TIS), ``train/{mis_masked_frac,
        mis_masked_seq_frac}`` (MIS: shares of loss tokens masked and of samples with a masked token),
        ``train/first_step_ppo_kl``, ``train/ref_logprob_diff`` (rollout 0 with a reference: masked mean
        ``|old - ref|``), ``train/forward_tokens`` / ``train/padded_tokens`` (tokens through the decoder per
        pass over the rollout, all ranks, and what the padded layout would take), ``train/seconds`` (wall time of this call), ``train/tokens_per_s`` (prompt +
        response tokens of all ``N`` samples per second), ``train/num_steps``. Per-step values are in
        :attr:`step_metrics`. With a critic: ``critic/{value_loss, value_clipfrac, grad_norm, lr,
        explained_variance, values_mean, returns_mean, seconds}`` (:mod:`hpcrl.train.ppo`); in a critic-only
        rollout (``rollout_id < critic.warmup_steps``) no actor step runs (``train/num_steps`` 0, no loss
        keys), and the actor's learning-rate schedule (warm-up, decay) starts at its first step.

        Raises ValueError for samples that do not split over ranks and steps, lack a reward or have
        inconsistent lengths; AssertionError (``ci_checks``) naming the failed metric and its value;
        RuntimeError when the optimizer skips a step (non-finite gradients).
        """
        from hpcrl.train import model as tmodel

        t0 = time.perf_counter()
        cfg, alg = self.cfg, self.cfg.algorithm
        samples = list(samples)
        n = len(samples)
        with_rollout_lp = any(len(s.rollout_log_probs) for s in samples)
        for key, on in (("use_tis", alg.use_tis), ("mis_level", alg.mis_level is not None)):
            if on and not with_rollout_lp:
                raise ValueError(f"algorithm.{key} needs the samples' rollout_log_probs")

        # 1. advantages over the whole rollout, before any split (slime: compute_advantages_and_returns);
        # with a critic or a KL penalty in the reward they need forwards first (4b).
        masks = [torch.as_tensor(s.loss_mask, dtype=torch.float32) for s in samples]
        shaped = self.critic is not None or alg.kl_coef > 0
        advantages = [torch.zeros_like(m) for m in masks] if shaped else algorithms.compute_advantages(
            alg.advantage_estimator, sample_rewards(samples), masks, cfg.rollout.n_samples_per_prompt,
            cfg=alg)

        # 2. this rank's micro-batches per step; step-wide (global) denominators of the reduction.
        opd = bool(alg.opd.teachers)
        steps, step_sums = build_steps(samples, masks, advantages, cfg.train, self.model.config, self.dp_rank,
                                       self.dp_size, self.device, with_rollout_lp, with_teacher_log_probs=opd,
                                       routing=self.routing)
        flat = [mb for step in steps for mb in step]
        critic = self.critic
        if critic is not None:  # on ranks of its own, the critic's values forward starts now, beside 3-4
            critic.begin(rollout_id, samples, steps, step_sums)

        # 3. old log-probs with the current weights, unless reused from the training forward.
        if self.recompute:
            for mb, lp in zip(flat, self._forward_only(flat), strict=True):
                mb.old_log_probs = lp
        # 4. reference log-probs with the reference weights swapped in (LoRA: the base, adapters off).
        if self.uses_ref:
            with self.reference():
                for mb, lp in zip(flat, self._forward_only(flat), strict=True):
                    mb.ref_log_probs = lp

        metrics: dict[str, float] = {}
        # 4b. advantages from the KL-in-reward penalty and the critic's values (hpcrl.train.ppo)
        if shaped:
            values = critic.sample_values(n) if critic is not None else None
            more, returns = ppo.shaped_advantages(cfg, flat, sample_rewards(samples), masks, values,
                                                  self._dp_group, self.dp_size)
            metrics.update(more)
            if critic is not None:  # on ranks of its own, the critic trains beside the actor's steps (5)
                critic.begin_train(returns)
        # 4c. on-policy distillation (slime --use-opd): advantage += coef * (teacher - student) per token
        if opd:
            metrics["train/opd_reverse_kl"] = self._add_opd_advantage(flat, masks, alg.opd.coef)
        if rollout_id == 0 and self.uses_ref:  # (a reference always recomputes)
            metrics["train/ref_logprob_diff"] = self._rollout_mean(
                flat, masks, lambda mb: (mb.old_log_probs - mb.ref_log_probs).abs())
            if self.ci_checks:
                _gate("train/ref_logprob_diff", metrics["train/ref_logprob_diff"], CI_TOLERANCE)

        # 5. the optimizer steps, each at the scheduled learning rate of its global step number (a pure
        # function of rollout_id, so a resumed run continues the schedule exactly); none in the critic-only
        # rollouts (critic.warmup_steps); then the critic's steps over the same split.
        per_step = []
        warmup = rollout_id < self.critic_only
        actor_first = (rollout_id - self.critic_only) * cfg.train.num_steps_per_rollout
        for k, (step, sums) in enumerate(zip(steps, step_sums, strict=True) if not warmup else ()):
            lr = tmodel.set_lr_step(self.lr_scheduler, actor_first + k)
            per_step.append(self._optimizer_step(step, sums))
            per_step[-1]["lr"] = lr
        self.step_metrics = per_step
        if critic is not None:
            metrics.update(critic.end_train())
        if per_step:
            metrics["train/first_step_ppo_kl"] = per_step[0]["ppo_kl"]
        if self.ci_checks and per_step:
            _gate("train/first_step_ppo_kl", per_step[0]["ppo_kl"], CI_TOLERANCE)
            if rollout_id == 0 and alg.use_kl_loss:
                _gate("train/kl_loss (first step of rollout 0)", per_step[0]["kl_loss"], CI_TOLERANCE)
        metrics.update(tmodel.mean_over_steps(per_step, per_step[0] if per_step else (), "train/"))
        if self.ci_checks and self.ci_logprob_abs_diff_threshold is not None and with_rollout_lp and per_step:
            diff = metrics["train/train_rollout_logprob_abs_diff"]
            if not diff <= self.ci_logprob_abs_diff_threshold:
                raise AssertionError(f"train/train_rollout_logprob_abs_diff = {diff!r} > "
                                     f"{self.ci_logprob_abs_diff_threshold}")
        tokens = self._all_reduce_sum({"forward": sum(mb.forward_tokens for mb in flat),
                                       "padded": sum(mb.padded_tokens for mb in flat)})
        metrics["train/forward_tokens"], metrics["train/padded_tokens"] = tokens["forward"], tokens["padded"]
        seconds = time.perf_counter() - t0
        metrics["train/num_steps"] = float(len(per_step))
        metrics["train/seconds"] = seconds
        metrics["train/tokens_per_s"] = sum(len(s.tokens) for s in samples) / max(seconds, 1e-9)
        return metrics

    def _add_opd_advantage(self, flat: Sequence[MicroBatch], masks: Sequence[Tensor], coef: float) -> float:
        """On-policy distillation's advantage, GLM-5's ``A_t = sg[log pi_teacher - log pi_train]`` (slime
        ``--use-opd``, ``--opd-kl-coef``): adds ``coef * (teacher - student) * mask`` to every micro-batch's
        ``advantages`` ``[b, R]``. The student's log-probs are the recomputed old ones when there are (slime's
        default), else, on an exactly on-policy step, the rollout engine's (slime ``--use-rollout-logprobs``).
        Returns the reverse KL estimate ``mean(student - teacher)`` (nats per token, per-sample token mean
        over all samples). Raises ValueError when neither student log-probs exist."""
        def student(mb: MicroBatch) -> Tensor:
            lp = mb.old_log_probs if mb.old_log_probs is not None else mb.rollout_log_probs
            if lp is None:
                raise ValueError("on-policy distillation needs the student's log-probs: the rollout's "
                                 "(return_logprob) or recomputed ones")
            return lp

        for mb in flat:
            mb.advantages = algorithms.opd_advantages(mb.advantages, mb.teacher_log_probs, student(mb), mb.mask,
                                                      coef)
        return self._rollout_mean(flat, masks, lambda mb: student(mb) - mb.teacher_log_probs)

    def _rollout_mean(self, flat: Sequence[MicroBatch], masks: Sequence[Tensor], values) -> float:
        """Per-sample token mean of ``values(mb)`` ``[b, R]``, averaged over all ``N`` samples."""
        sums = algorithms.compute_rollout_mask_sums(masks, range(len(masks)))
        local = sum(algorithms.rollout_token_mean(values(mb), mb.mask, mb.positions, sums) for mb in flat)
        return self._all_reduce_sum({"v": local})["v"]

    def _reducers(self, mb: MicroBatch, rollout_mask_sums: dict[int, float]
                  ) -> tuple[algorithms.Reducer, algorithms.Reducer]:
        """``(loss, metrics)`` reducers of a micro-batch of a step, for the actor's and the critic's losses:
        :func:`~hpcrl.train.algorithms.step_reducers` (``algorithm.loss_reduction`` for the loss, per-sample
        token means for the metrics) with the step's mask sums."""
        return algorithms.step_reducers(self.cfg, mb.mask, mb.positions, rollout_mask_sums)

    def _optimizer_step(self, micro_batches: Sequence[MicroBatch], rollout_mask_sums: dict[int, float]
                        ) -> dict[str, Optional[float]]:
        """One :func:`~hpcrl.train.model.train_step` over this rank's micro-batches of a step.

        The loss of a micro-batch is :func:`~hpcrl.train.algorithms.compute_loss` with the step's global
        ``algorithm.loss_reduction`` reducer (:func:`~hpcrl.train.algorithms.step_reducers`), times
        ``dp_size`` (slime: ``loss *= dp_size``; megatron-core DDP averages gradients over DP ranks, so the
        gradient is that of the global reduction). Returns the step's metrics (per-sample token means but
        ``loss``), each summed over micro-batches and DP ranks (the global value), plus ``grad_norm``.
        """
        from hpcrl.train import model as tmodel

        cfg = self.cfg.algorithm
        local: dict[str, Tensor] = {}

        def loss_fn(model: torch.nn.Module, mb: MicroBatch) -> tmodel.StagedLoss:
            return self._forward(mb, with_entropy=True).then(functools.partial(loss_of, mb=mb))

        def loss_of(out, mb: MicroBatch) -> Tensor:  # on the last pipeline stage
            logp = out.log_probs
            entropy = out.entropy if cfg.entropy_coef != 0.0 else out.entropy.detach()
            old = mb.old_log_probs if mb.old_log_probs is not None else logp.detach()
            reduce, report = self._reducers(mb, rollout_mask_sums)
            res = algorithms.compute_loss(logp, old, mb.advantages, mb.mask, reduce, cfg, entropy=entropy,
                                          ref_logp=mb.ref_log_probs, rollout_logp=mb.rollout_log_probs,
                                          metric_reduce=report)
            values = {f.name: getattr(res, f.name).detach() for f in dataclasses.fields(res)
                      if getattr(res, f.name) is not None}
            if mb.rollout_log_probs is not None:
                values["train_rollout_logprob_abs_diff"] = report((old - mb.rollout_log_probs).abs())
            for k, v in values.items():
                local[k] = local[k] + v if k in local else v
            return res.loss * loss_scale(self.dp_size)  # DDP averages over DP x CP ranks

        result = tmodel.train_step(self.ddp_model, self.optimizer, loss_fn, micro_batches)
        if not result["update_successful"]:
            raise RuntimeError("optimizer step was skipped (update_successful=False): non-finite gradients?")
        out: dict[str, Optional[float]] = dict(parallel.from_last_stage(self._all_reduce_sum(local)))
        grad_norm = result["grad_norm"]
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else None
        return out


def _log_probs(out) -> Tensor:
    """The log-probs ``[b, R]`` of a :class:`~hpcrl.train.logprobs.ResponseLogProbs` (a forward-only pass)."""
    return out.log_probs


def _gate(name: str, value: Optional[float], tol: float) -> None:
    """slime ``--ci-test``: ``|value| < tol`` or AssertionError naming the metric."""
    if value is None or not math.isfinite(value) or abs(value) >= tol:
        raise AssertionError(f"ci check failed: {name} = {value!r}, expected |{name}| < {tol}")
