"""The ``rollout`` section and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from hpcrl import names
from hpcrl.config.environment import Environment
from hpcrl.config.checks import check_plugin, non_negative, positive, require
from hpcrl.config.train import GROUP_ESTIMATORS
from hpcrl.names import DEFAULT_DATA_SOURCE, DEFAULT_GENERATE_FUNCTION, DEFAULT_ROLLOUT_FUNCTION


@dataclass
class AgentSection:
    """Agentic rollouts over HTTP (``rollout.agent``, ``docs/agents.md``): each sample is one episode of an agent
    that talks to the policy through the controller's OpenAI-compatible gateway (:mod:`hpcrl.agent`). Set
    exactly one of ``function`` and ``command`` to turn it on."""

    function: Optional[str] = None
    """Dotted path of ``async def agent(item, *, base_url, api_key, session_id) -> str | None`` (the final
    answer; None: the last assistant message)."""
    command: list[str] = field(default_factory=list)
    """An executable and its arguments, run once per episode with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
    ``HPCRL_SESSION_ID`` set and the task item as JSON on standard input; its standard output (stripped) is the
    final answer (empty: the last assistant message). Any language; no hpcrl import needed."""
    timeout_s: float = 120.0
    """An episode still running after this many seconds is ended (the command killed) and its sample fails."""
    failure_reward: float = 0.0
    """Reward of a failed episode (timeout, crashed agent, no calls)."""
    chat_template: Optional[str] = None
    """Jinja chat template file for the gateway (default: the policy tokenizer's)."""
    tool_parser: Optional[Literal["hermes"]] = None
    """Turn generated ``<tool_call>{json}</tool_call>`` text into OpenAI ``tool_calls``."""

    @property
    def enabled(self) -> bool:
        """Whether agentic rollouts are on."""
        return bool(self.function or self.command)


@dataclass
class RolloutSection:
    """Generation: batch shape, sampling, engines and plug-ins (slime's rollout arguments)."""

    batch_size: int = 8
    """Prompts (groups) per rollout step (slime ``--rollout-batch-size``)."""
    n_samples_per_prompt: int = 8
    """Samples per group (slime ``--n-samples-per-prompt``)."""
    over_sampling_batch_size: Optional[int] = None
    """Prompts submitted at once before filtering; default ``batch_size``; must be >= ``batch_size``."""
    dynamic_filter: Optional[str] = None
    """``nonzero_std`` (drop groups whose rewards are all equal) or a dotted import path."""
    on_filter_starved: Literal["train", "error"] = "train"
    """When the dynamic filter keeps fewer than ``batch_size`` groups within 32 x ``batch_size`` submitted:
    ``train`` on the kept groups (at least one; warns, ``rollout/groups_short`` in the metrics), or ``error``
    (the run stops, after checkpointing its last finished step)."""
    partial_rollout: bool = False
    """Keep aborted partial groups in the buffer and continue them next step (slime ``--partial-rollout``);
    generations are then streamed, so an engine that dies mid-generation costs only the tokens it had not sent
    (the rest continue on another engine). Each SSE chunk carries the response so far (SGLang's default), so
    for long responses set ``sglang.stream_interval`` (tokens per chunk) on SGLang engines."""
    max_inflight_groups: Optional[int] = None
    """``run.mode: fully_async``: groups generating on the engines at all times (slime's fully-async
    concurrency); default 2 x ``batch_size``; must be >= ``batch_size``."""
    max_staleness: int = 2
    """``run.mode: fully_async``: the most weight versions between the policy that sampled a token and the
    policy that trains on it (a token sampled by weights v and trained at step k has staleness k - v; K = 0 is
    on-policy, 1 what ``run.mode: async`` gives; docs/algorithms.md). New groups are not started when they
    would exceed it at the trainer's pace; a finished group that exceeds it meets ``stale_policy``."""
    stale_policy: Literal["keep", "regenerate", "drop"] = "keep"
    """``run.mode: fully_async``: a finished group older than ``max_staleness``: ``keep`` it (trained, its
    off-policy part corrected by TIS / MIS; no bias against long responses), ``regenerate`` it from its prompt,
    or ``drop`` it (counted in ``rollout/stale_dropped``; biases training against long responses)."""
    max_new_tokens: int = 16
    """Response length limit in tokens (slime ``--rollout-max-response-len``)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    engine: Literal["auto", "cpu", "sglang"] = "auto"
    """``auto``: SGLang when CUDA is present, else hpcrl's CPU engine. ``sglang`` on a machine without CUDA
    runs SGLang's CPU path (``--device cpu``, one thread, a bounded KV pool: :func:`hpcrl.rollout.engines.
    engine_command`); SGLang's CPU runtime must be importable there (tests/sglang_cpu says how it is
    installed)."""
    engine_env: dict[str, str] = field(default_factory=dict)
    """Environment variables added to every engine process's (e.g. ``SGLANG_*`` settings, or the
    ``PYTHONPATH`` of an SGLang runtime installed beside hpcrl's: tests/sglang_cpu)."""
    num_engines: int = 1
    cpus: Optional[Union[int, str]] = None
    """Local runs with ``run.placement: disaggregate``: the CPUs of the engines and the router (``"2-3"``;
    default: the half of this machine's CPUs the trainer does not take; engines split them). Each engine uses
    one thread per CPU it gets. On Slurm the het job's rollout group is the rollout's (this is ignored)."""
    router: bool = True
    """Put the real ``sglang-router`` in front of the engines."""
    agent: AgentSection = field(default_factory=AgentSection)
    """Agentic rollouts over HTTP (off unless ``agent.function`` or ``agent.command`` is set)."""
    agent_step: bool = False
    """On Slurm, run each episode of ``agent.command`` as its own job step (``srun --overlap``, on the rollout's
    het group when there is one) instead of where the controller runs; the gateway then listens on all
    interfaces and agents reach it by the controller node's address."""
    request_timeout_s: float = 600.0
    max_retries: int = 3
    heartbeat_interval_s: float = 10.0
    """Seconds between two health probes of each engine (``/health_generate``) and of the router
    (``/health``) by the controller's monitor (slime ``--rollout-health-check-interval``)."""
    heartbeat_timeout_s: float = 30.0
    """An engine whose probes have not succeeded for this many seconds is hung and is replaced; one whose
    process exited or refuses connections is replaced at once (slime ``--rollout-health-check-timeout``).
    Must be >= ``heartbeat_interval_s``."""
    max_engine_restarts: int = 10
    """Restarts allowed per engine in one attempt of the run (a requeue starts a new count), with a
    backoff of 1, 2, 4 ... 30 s while a new engine dies before serving. 0: a dead engine stops the run (after
    checkpointing its last finished step). When no engine is left and none may restart, the run
    checkpoints and exits for requeue (exit status 75)."""
    reward_function: str = "task"
    """A built-in reward (``task``: the data source's own scorer; ``exact_match``, ``math_answer``,
    ``countdown``, ``remote_rm:<url>``) or a dotted import path (slime ``--custom-rm-path``)."""
    generate_function: Optional[str] = DEFAULT_GENERATE_FUNCTION
    """Dotted path of the per-sample generate (slime ``--custom-generate-function-path``); null: the built-in."""
    rollout_function: Optional[str] = DEFAULT_ROLLOUT_FUNCTION
    """Dotted path of the rollout (slime ``--rollout-function-path``); null: the built-in."""
    data_source: Optional[str] = DEFAULT_DATA_SOURCE
    """Dotted path of the data source class (slime ``--data-source-path``); null: the built-in. See
    :mod:`hpcrl.rollout.plugins` for what it is called with."""
    eval_interval: int = 10
    """Greedy eval every this many rollout steps (0: only at start and end)."""


def sglang_engines_by_config(cfg: "Config") -> bool:
    """Whether the config alone makes the engines SGLang: ``rollout.engine: sglang``, or ``auto`` in a Slurm job
    with ``slurm.gpus_per_node`` (login-node checks; a local ``auto`` run also picks SGLang where torch sees
    CUDA: :func:`hpcrl.rollout.engines.sglang_engines`)."""
    return cfg.rollout.engine == "sglang" or (cfg.rollout.engine == "auto" and cfg.slurm.gpus_per_node > 0)


BUILTIN_REWARD_FUNCTIONS = names.REWARDS
"""Reward names :func:`hpcrl.rewards.resolve.get_reward_function` knows, besides ``remote_rm:<url>``."""


BUILTIN_DYNAMIC_FILTERS = names.FILTERS
"""Filter names :mod:`hpcrl.rollout.filters` implements."""


def check_rollout(cfg: Config, check_files: bool, env: Optional[Environment] = None) -> None:
    r = cfg.rollout
    positive(cfg, "rollout.batch_size", "rollout.n_samples_per_prompt", "rollout.over_sampling_batch_size",
              "rollout.max_new_tokens", "rollout.num_engines", "rollout.request_timeout_s")
    non_negative(cfg, "rollout.max_retries", "rollout.eval_interval", "rollout.temperature",
                 "rollout.max_engine_restarts")
    positive(cfg, "rollout.heartbeat_interval_s", "rollout.heartbeat_timeout_s")
    require(r.heartbeat_timeout_s >= r.heartbeat_interval_s, "rollout.heartbeat_timeout_s",
            r.heartbeat_timeout_s, f"is below rollout.heartbeat_interval_s={r.heartbeat_interval_s:g}, so a "
            "healthy engine could be declared hung between two probes",
            f"set it to at least {r.heartbeat_interval_s:g} (3x the interval is usual)")
    if r.over_sampling_batch_size is not None:
        require(r.over_sampling_batch_size >= r.batch_size, "rollout.over_sampling_batch_size",
                 r.over_sampling_batch_size, f"must be >= rollout.batch_size={r.batch_size}",
                 f"set it to at least {r.batch_size} or leave it unset")
    if r.max_inflight_groups is not None:
        require(r.max_inflight_groups >= r.batch_size, "rollout.max_inflight_groups", r.max_inflight_groups,
                f"must be >= rollout.batch_size={r.batch_size}, or a step could never fill",
                f"set it to at least {r.batch_size} or leave it unset (2 x batch_size)")
    non_negative(cfg, "rollout.max_staleness")
    if cfg.run.mode == "fully_async":
        require(r.rollout_function in (None, DEFAULT_ROLLOUT_FUNCTION), "rollout.rollout_function",
                r.rollout_function, "replaces the step-scoped rollout, which run.mode: fully_async does not "
                "call (its producer generates group by group across steps)", "unset rollout.rollout_function "
                "(a custom rollout.generate_function still plugs in), or use run.mode=async")
        require(not r.agent.enabled, "rollout.agent", r.agent.function or r.agent.command,
                "agent episodes cannot be continued after a weight update aborts them, which run.mode: "
                "fully_async relies on",
                "use run.mode=async with rollout.agent")
    require(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]", "use 1.0 to disable top-p")
    require(r.top_k == -1 or r.top_k > 0, "rollout.top_k", r.top_k, "must be -1 (off) or > 0",
             "use -1 to disable top-k")
    for i, s in enumerate(r.stop):
        require(s != "", f"rollout.stop[{i}]", s, "stop strings must not be empty",
                 "remove the empty string")
    for i, t in enumerate(r.stop_token_ids):
        require(t >= 0, f"rollout.stop_token_ids[{i}]", t, "token ids must be >= 0", "fix the token id")
    est = cfg.algorithm.advantage_estimator
    if est in GROUP_ESTIMATORS and not cfg.algorithm.opd.teachers:
        require(r.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt", r.n_samples_per_prompt,
                 f"{est} normalises rewards within a group, so a group of 1 has zero advantage",
                 "use 2 or more samples per prompt (8 is common), or distil from a teacher "
                 "(algorithm.opd.teachers), whose advantage needs no group")
    if est == "rloo":  # even with a teacher: the leave-one-out baseline of a group of 1 is undefined
        require(r.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt", r.n_samples_per_prompt,
                "rloo's baseline is the mean reward of the group's other samples, and a group of 1 has none",
                "use 2 or more samples per prompt")
    if r.dynamic_filter == "nonzero_std":
        require(r.n_samples_per_prompt >= 2, "rollout.n_samples_per_prompt", r.n_samples_per_prompt,
                 "dynamic_filter nonzero_std drops every group of 1 sample",
                 "use 2 or more samples per prompt")
    check_plugin("rollout.reward_function", r.reward_function, BUILTIN_REWARD_FUNCTIONS, check_files, env)
    check_plugin("rollout.dynamic_filter", r.dynamic_filter, BUILTIN_DYNAMIC_FILTERS, check_files, env)
    check_plugin("rollout.generate_function", r.generate_function, (), check_files, env)
    check_agent(cfg, check_files, env)
    check_plugin("rollout.rollout_function", r.rollout_function, (), check_files, env)
    check_plugin("rollout.data_source", r.data_source, (), check_files, env)


def check_agent(cfg: "Config", check_files: bool, env: Optional[Environment] = None) -> None:
    """``rollout.agent``: one of function and command; an executable command; a readable template."""
    import os
    import shutil

    a = cfg.rollout.agent
    require(not (a.function and a.command), "rollout.agent", "function and command",
            "names two agents", "set rollout.agent.function or rollout.agent.command, not both")
    if cfg.rollout.agent_step:
        require(bool(a.command), "rollout.agent_step", True,
                "runs each episode of rollout.agent.command as a job step, and no command is set",
                "set rollout.agent.command (a Python function runs in the controller), or agent_step: false")
    if not a.enabled:
        return
    require(a.timeout_s > 0, "rollout.agent.timeout_s", a.timeout_s, "must be > 0", "e.g. 120")
    require(cfg.rollout.generate_function in (None, DEFAULT_GENERATE_FUNCTION), "rollout.generate_function",
            cfg.rollout.generate_function, "is replaced by the agent's episodes when rollout.agent is set",
            "leave rollout.generate_function unset")
    require(not cfg.rollout.partial_rollout, "rollout.partial_rollout", True,
            "an agent episode cannot be continued on another engine", "set rollout.partial_rollout: false")
    check_plugin("rollout.agent.function", a.function, (), check_files, env)
    if a.command and check_files:
        exe = a.command[0]
        found = shutil.which(exe) if os.sep not in exe else (exe if os.path.isfile(exe) else None)
        require(found is not None and os.access(found, os.X_OK), "rollout.agent.command", exe,
                "is not an executable file (or not on PATH)",
                f"chmod +x {exe}, or give the interpreter first, e.g. [python3, {exe}]")
    if a.chat_template and check_files:
        require(os.path.isfile(a.chat_template), "rollout.agent.chat_template", a.chat_template,
                "does not exist", "give the path of a jinja chat template file")
