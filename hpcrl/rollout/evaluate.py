"""Evaluation through the training path: eval sets, their sampling settings, and their metrics.

An eval prompt is generated and scored by the code that makes a rollout's samples
(:func:`hpcrl.rollout.rollout.generate_group`): the prompt is tokenised as the rollout tokenises it (chat
template, tools: :func:`hpcrl.rollout.rollout.tokenize_prompt`), generated with the run's generate function
(``rollout.generate_function``, or the agent of ``rollout.agent``), stopped by the rollout's stop rules
(``rollout.stop``, ``rollout.stop_token_ids``) and scored by the run's reward function
(``rollout.reward_function``; for the ``task`` reward, the eval set's own task). Only the sampling settings
differ: ``eval.temperature`` / ``top_p`` / ``max_new_tokens`` (a set's own values first), ``top_k`` off, and
``eval.n_samples`` responses per prompt. Nothing is filtered, trained or kept.

Metrics of a set (``eval/<name>/...``; the default set, the one ``data`` defines, without the name:
``eval/accuracy``):

- ``accuracy``: the mean reward over every response (:meth:`hpcrl.data.sample.Sample.scalar_reward`; the share
  correct for 0/1 rewards);
- ``pass@k`` for k = 1, 2, 4, ... and ``n_samples``: the unbiased estimator of Chen et al. 2021 ("Evaluating
  Large Language Models Trained on Code", eq. 1), ``1 - C(n - c, k) / C(n, k)`` per prompt with ``c`` the
  responses whose reward is at least 1, averaged over prompts;
- ``response_length`` (mean tokens), ``truncated`` (share of responses cut by ``max_new_tokens``), ``num``
  (prompts).

``eval/seconds`` is the whole evaluation's wall time.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from hpcrl.config.evaluation import DEFAULT_EVAL_SET
from hpcrl.data.sample import Sample, Status

EVAL_INDEX_BASE = 1 << 40
"""Eval samples' ``index`` starts here, so their sampling seeds (:func:`hpcrl.rollout.rollout.sample_seed`)
never repeat a training sample's."""


@dataclass
class EvalSet:
    """One eval set as the rollout runs it."""

    name: str
    """:data:`~hpcrl.config.evaluation.DEFAULT_EVAL_SET` for the set ``data`` defines."""
    items: list[dict[str, Any]]
    """Task items ``{"prompt", "label", "metadata"}``."""
    task: Any
    """The task that scores it (the ``task`` reward): :class:`hpcrl.data.tasks.Task`."""
    n_samples: int
    """Responses per prompt."""
    params: dict[str, Any]
    """SGLang ``sampling_params`` of its requests."""

    @property
    def prefix(self) -> str:
        """:func:`metric_prefix` of the set's name."""
        return metric_prefix(self.name)


def metric_prefix(name: str) -> str:
    """Where an eval set's metrics are named: ``eval/`` for the default set, ``eval/<name>/`` for a named
    one."""
    return "eval/" if name == DEFAULT_EVAL_SET else f"eval/{name}/"


def eval_params(cfg, set_cfg=None) -> dict[str, Any]:
    """The ``sampling_params`` of an eval set: the rollout's (stop rules, ``no_stop_trim``) with the eval
    temperature, top-p and max new tokens (``set_cfg``'s, else ``eval``'s, else ``rollout.max_new_tokens``)
    and top-k off."""
    from hpcrl.rollout.rollout import sampling_params

    e = cfg.eval

    def pick(name: str):
        own = getattr(set_cfg, name, None) if set_cfg is not None else None
        return own if own is not None else getattr(e, name)

    params = sampling_params(cfg.rollout)
    max_new = pick("max_new_tokens")
    params.update(temperature=float(pick("temperature")), top_p=float(pick("top_p")), top_k=-1,
                  max_new_tokens=int(max_new if max_new is not None else cfg.rollout.max_new_tokens))
    return params


def eval_sets(cfg, datasets) -> list[EvalSet]:
    """The run's eval sets: the default one (``datasets.eval``, when it has items) first, then ``eval.sets``
    in order (:class:`hpcrl.data.datasets.Datasets` holds their items)."""
    out = []
    if datasets.eval:
        out.append(EvalSet(DEFAULT_EVAL_SET, list(datasets.eval), datasets.task, cfg.eval.n_samples,
                           eval_params(cfg)))
    for s, loaded in zip(cfg.eval.sets, datasets.eval_sets):
        n = s.n_samples if s.n_samples is not None else cfg.eval.n_samples
        out.append(EvalSet(s.name, list(loaded.items), loaded.task, n, eval_params(cfg, s)))
    return out


def eval_groups(es: EvalSet, rollout_id: int, first_index: int) -> list[list[Sample]]:
    """``[len(items)][n_samples]`` fresh samples of ``es`` (copies of each item, as the data source makes
    them), with indices from ``first_index`` on."""
    groups, index = [], first_index
    for g, item in enumerate(es.items):
        group = []
        for _ in range(es.n_samples):
            group.append(Sample(group_index=g, index=index, rollout_id=rollout_id,
                                prompt=copy.deepcopy(item["prompt"]), label=copy.deepcopy(item.get("label")),
                                metadata=copy.deepcopy(item.get("metadata") or {})))
            index += 1
        groups.append(group)
    return groups


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` responses of which ``c`` are correct (Chen et al. 2021):
    ``1 - C(n - c, k) / C(n, k)``. Raises ValueError unless ``0 <= c <= n`` and ``1 <= k <= n``."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k reported for ``n`` responses per prompt: 1, 2, 4, ... below ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def set_metrics(es: EvalSet, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
    """The metrics of one evaluated set (module doc), named under :attr:`EvalSet.prefix`."""
    samples = [s for g in groups for s in g]
    n = max(len(samples), 1)
    rewards = [s.scalar_reward() for s in samples]
    out = {
        f"{es.prefix}accuracy": sum(rewards) / n,
        f"{es.prefix}response_length": sum(s.response_length for s in samples) / n,
        f"{es.prefix}truncated": sum(s.status == Status.TRUNCATED for s in samples) / n,
        f"{es.prefix}num": float(len(groups)),
    }
    for k in pass_ks(es.n_samples):
        values = [pass_at_k(len(g), sum(s.scalar_reward() >= 1.0 for s in g), k) for g in groups if g]
        out[f"{es.prefix}pass@{k}"] = sum(values) / max(len(values), 1)
    return out


async def generate_eval(cfg, ctx, sets: Sequence[EvalSet], rollout_id: int,
                        reward_fn_of: Optional[Callable[[EvalSet], Any]] = None
                        ) -> list[tuple[EvalSet, list[list[Sample]]]]:
    """Generate and score every set's samples through the rollout's path (all sets at once): ``[(set,
    [prompts][n_samples] samples)]``, in the order of ``sets``.

    Args:
        cfg: the run config; ctx: the rollout's :class:`~hpcrl.rollout.rollout.RolloutContext` (client,
            tokenizer, generate function, reward function).
        sets: from :func:`eval_sets`.
        rollout_id: the step the evaluation follows (-1 before the first), stored on the samples.
        reward_fn_of: the reward function of a set (default ``ctx.reward_fn``): the ``task`` reward scores
            with the set's own task.

    Raises what the rollout raises (:class:`hpcrl.rollout.client.RolloutError`, a reward function's error).
    """
    from hpcrl.rollout.rollout import generate_group

    jobs, calls, first = [], [], EVAL_INDEX_BASE
    for es in sets:
        set_ctx = dataclasses.replace(ctx, reward_fn=reward_fn_of(es)) if reward_fn_of else ctx
        groups = eval_groups(es, rollout_id, first)
        first += len(es.items) * es.n_samples
        jobs.append((es, groups))
        calls += [generate_group(cfg, set_ctx, g, es.params, evaluation=True) for g in groups]
    await asyncio.gather(*calls)
    return jobs


async def evaluate(cfg, ctx, sets: Sequence[EvalSet], rollout_id: int,
                   reward_fn_of: Optional[Callable[[EvalSet], Any]] = None) -> dict[str, float]:
    """:func:`generate_eval`, then every set's metrics (:func:`set_metrics`) and ``eval/seconds`` (wall)."""
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    for es, groups in await generate_eval(cfg, ctx, sets, rollout_id, reward_fn_of):
        metrics.update(set_metrics(es, groups))
    metrics["eval/seconds"] = time.perf_counter() - t0
    return metrics
