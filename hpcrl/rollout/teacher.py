"""On-policy distillation's teachers: engines that score the student's sampled tokens (``algorithm.opd``).

GLM-5's last training stage and slime's ``--use-opd --opd-type sglang``: each teacher is an inference server
of its own model; for every sample the student generated, the teacher is asked, with one prefill-only
``/generate`` (``input_ids`` = prompt + response, ``max_new_tokens: 0``, ``return_logprob``,
``logprob_start_len`` just before the response, at the rollout temperature as slime fixed in #2085), for the
log-probability of each response token. The trainer turns them into the per-token advantage
``coef * (log pi_teacher - log pi_student)`` (:meth:`hpcrl.train.actor.Actor.train`).

A teacher's engines start through the run's engine launcher (local processes, or a job step on Slurm) with
the run's key and their logs in ``logs/attempt-N/teacher-<name>/``; a :class:`hpcrl.rollout.health.
HealthMonitor` watches them and restarts a dead one from the teacher's folder. They are never weight-synced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hpcrl.data.sample import Sample


class FixedWeights:
    """The weights a teacher engine restarts from: its folder, at no weight version (a teacher is never
    synced, and has no adapter). Stands where the student's :class:`hpcrl.weights.snapshot.WeightSnapshot`
    stands for the health monitor."""

    version = None
    adapter_config = None

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def folder(self) -> tuple[Path, None]:
        return self.path, None

    async def load_on(self, client: Any, url: str, timeout_s: Any = None, name: Any = None) -> None:
        """Nothing to load: a restarted teacher engine starts from :attr:`path` as it is."""


@dataclass
class Teacher:
    """One started teacher: its name and folder, its engines, the client that reaches them and their health
    monitor."""

    name: str
    path: Path
    engines: list = field(default_factory=list)
    client: Any = None
    monitor: Any = None
    launch: Any = None
    """What the launcher returned (stopped with the run)."""


def teacher_cfg(cfg, teacher) -> Any:
    """The run config a teacher's engines start with: the student's rollout settings with
    ``rollout.num_engines`` the teacher's."""
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_engines=teacher.num_engines))


def teacher_dir(attempt_dir: Path, name: str) -> Path:
    """``attempt_dir/teacher-<name>``: the teacher's engine logs (created)."""
    d = Path(attempt_dir) / f"teacher-{name}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def response_log_probs(out: dict, response_length: int) -> list[float]:
    """The last ``response_length`` entries of a prefill-only ``/generate`` answer's
    ``meta_info.input_token_logprobs`` (``[logprob, token_id, text]`` triples or bare numbers), as floats.
    Raises ValueError when the answer has fewer."""
    entries = (out.get("meta_info") or {}).get("input_token_logprobs") or []
    tail = entries[len(entries) - response_length:] if response_length else []
    values = [e[0] if isinstance(e, (list, tuple)) else e for e in tail]
    if len(values) != response_length or any(v is None for v in values):
        raise ValueError(f"the teacher returned {len(entries)} input log-probs for a response of "
                         f"{response_length} tokens")
    return [float(v) for v in values]


async def score_sample(client, sample: Sample, temperature: float) -> list[float]:
    """The teacher's log-probs of ``sample``'s response tokens, ``[response_length]`` (nats): one
    prefill-only ``/generate`` through ``client`` (:class:`hpcrl.rollout.client.RolloutClient`) per sequence of
    the sample (``Sample.segments``; the first token of a later sequence, which has no context of its own and
    is never trained, gets 0.0). Raises RolloutError (the client's) and ValueError (:func:`response_log_probs`,
    ``Sample.segment_bounds``)."""
    n = sample.response_length
    if n == 0:
        return []
    prompt_len = len(sample.tokens) - n
    out: list[float] = []
    for a, b in sample.segment_bounds():
        ids = list(sample.tokens[a:b])
        k = b - max(a, prompt_len)  # response tokens in this sequence
        head = [0.0] if a >= prompt_len else []
        k -= len(head)
        if k == 0:
            out += head
            continue
        answer = await client.generate(ids, {"max_new_tokens": 0, "temperature": temperature},
                                       return_logprob=True, logprob_start_len=max(len(ids) - k - 1, 0))
        out += head + response_log_probs(answer, k)
    return out


async def score_samples(teachers: Sequence[Teacher], samples: Sequence[Sample], temperature: float) -> float:
    """Set ``teacher_log_probs`` of every sample that has none yet: the mean over the teachers of their
    log-probs per token, or only the teacher named by ``sample.metadata["teacher"]`` when the data row names
    one (GLM-5 distils each domain from its own expert). Returns the seconds it took. Raises KeyError for a
    row naming an unknown teacher, and what :func:`score_sample` raises."""
    t0 = time.perf_counter()
    by_name = {t.name: t for t in teachers}

    async def one(sample: Sample) -> None:
        named = (sample.metadata or {}).get("teacher")
        if named is not None and named not in by_name:
            raise KeyError(f"sample {sample.index} names teacher {named!r}; the run has {sorted(by_name)}")
        chosen = [by_name[named]] if named is not None else list(teachers)
        per = await asyncio.gather(*(score_sample(t.client, sample, temperature) for t in chosen))
        sample.teacher_log_probs = [sum(v) / len(per) for v in zip(*per)] if per and per[0] else []

    todo = [s for s in samples if len(s.teacher_log_probs) != s.response_length or not s.response_length]
    await asyncio.gather(*(one(s) for s in todo))
    return time.perf_counter() - t0


def opd_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """``rollout/opd_reverse_kl``: ``rollout - teacher`` log-probs averaged over each sample's loss-masked
    response tokens (0 for a sample without any), then over the samples (nats per token; the sampled-token
    estimate of KL(student || teacher) at the rollout's weights). The same reduction as the trainer's
    ``train/opd_reverse_kl`` (:func:`hpcrl.train.algorithms.rollout_token_mean`), so the two differ only by the
    trainer's and the engine's log-probs (a token mean over the whole batch differed from it by up to 6% when
    responses differ in length). Empty dict when no sample has a loss token."""
    diffs = [[r - t for r, t, m in zip(s.rollout_log_probs, s.teacher_log_probs, s.loss_mask) if m]
             for s in samples]
    if not any(diffs):
        return {}
    return {"rollout/opd_reverse_kl": sum(sum(d) / len(d) for d in diffs if d) / len(diffs)}


def start_teacher(cfg, teacher_section, index: int, run_dir: Path, attempt_dir: Path, secret_path: Path,
                  launcher) -> Teacher:
    """Launch one teacher's engines (returns at once; :func:`connect_teacher` waits for them)."""
    name = teacher_section.name or f"t{index}"
    path = Path(teacher_section.path)
    launch = launcher(teacher_cfg(cfg, teacher_section), run_dir, teacher_dir(attempt_dir, name), path,
                      secret_path)
    return Teacher(name=name, path=path, launch=launch)


async def connect_teacher(teacher: Teacher, cfg, key: str) -> None:
    """Wait for a launched teacher's engines (in a thread), connect a client to them and start their health
    monitor (restarts from the teacher's folder, within ``rollout.max_engine_restarts``). Raises what the
    launch's ``wait()`` raises."""
    from hpcrl.rollout.client import RolloutClient
    from hpcrl.rollout.health import HealthMonitor

    rc = cfg.rollout
    teacher.engines, _ = await asyncio.to_thread(teacher.launch.wait)
    teacher.client = RolloutClient(None, [e.url for e in teacher.engines], api_key=key,
                                   timeout_s=rc.request_timeout_s, max_retries=rc.max_retries)
    await teacher.client.open()
    await teacher.client.wait_healthy(timeout_s=600)
    restart: Optional[Any] = getattr(teacher.launch, "restart", None)
    teacher.monitor = HealthMonitor(teacher.client, list(teacher.engines), restart, FixedWeights(teacher.path),
                                    rc.heartbeat_interval_s, rc.heartbeat_timeout_s, rc.max_engine_restarts,
                                    api_key=key)
    await teacher.monitor.start()


async def stop_teacher(teacher: Teacher) -> None:
    """Stop a teacher's monitor, client and engines (what was started of them)."""
    if teacher.monitor is not None:
        await teacher.monitor.stop()
    if teacher.client is not None:
        await teacher.client.close()
    if teacher.launch is not None:
        await asyncio.to_thread(teacher.launch.stop)
