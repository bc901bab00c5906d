"""Running agent episodes and turning them into samples: the generate function of agentic rollouts.

:func:`agent_generate` is a :data:`~hpcrl.rollout.generate.GenerateFn` (``async (client, sample,
sampling_params) -> Sample``): for each sample slot it opens a gateway session, runs the agent - a Python
function or an external command (any language: it gets ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``,
``HPCRL_SESSION_ID`` and the task item as JSON on standard input) - closes the session and fills the sample
from the recorded calls (:func:`hpcrl.agent.session.build_trajectories`). The sample's ``response`` is the
agent's final answer (what the task's scorer reads); a reward the agent posted replaces the scorer's.

An episode fails - status FAILED, ``metadata["agent_failure"]`` says why, reward ``rollout.agent.failure_reward``
- when it times out (a command is killed with its process group), the agent raises or exits non-zero, or it
made no call. A failed episode with calls keeps its tokens (the policy is pushed away from what led there); one
without calls has one masked token, so nothing of it is trained.

When the agent rewrote or dropped its history, so that its calls no longer extend one another, the episode has
several prefix chains (:func:`~hpcrl.agent.session.build_trajectories`). Each chain is kept token-exact, never
re-tokenised: the sample holds them back to back, one ``Sample.segments`` entry per chain (the first chain's
prompt is the sample's prompt; the later chains' prompts and template glue are masked, their policy tokens
trained), and the trainer attends within each chain only, with positions restarting at 0, so every chain is
trained exactly as the engine saw it. The episode stays one sample of its group, with the episode's reward and
advantage: GRPO compares episodes, and an episode that split counts once. ``metadata["agent_chains"]`` counts
the chains.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from typing import Any, Awaitable, Callable, Optional

from hpcrl.agent.gateway import AgentGateway
from hpcrl.agent.session import Session, build_trajectories
from hpcrl.data.sample import Sample, Status

AgentFn = Callable[..., Awaitable[Optional[str]]]
"""``async (item, *, base_url, api_key, session_id) -> final answer | None``."""

STDERR_TAIL_CHARS = 400


class AgentFailed(RuntimeError):
    """The agent ended without an answer (raised, exited non-zero): the message is the sample's failure."""


def task_item(sample: Sample) -> dict[str, Any]:
    """What the agent is given: the prompt and the sample's index (never the label)."""
    return {"prompt": sample.prompt, "sample_index": sample.index, "group_index": sample.group_index}


async def run_command(command: list[str], item: dict, base_url: str, session: Session) -> Optional[str]:
    """Run ``command`` for one episode; its stripped standard output, or None when empty. Raises AgentFailed
    on a non-zero exit (with the stderr tail); on cancellation (a timeout) ends the process group (SIGTERM, then
    SIGKILL after 2 s)."""
    env = dict(os.environ, OPENAI_BASE_URL=base_url, OPENAI_API_KEY=session.key,
               HPCRL_SESSION_ID=session.session_id)
    proc = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = await proc.communicate(json.dumps(item).encode() + b"\n")
    except BaseException:  # a timeout: SIGTERM first (srun then ends its job step), SIGKILL after 2 s
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 2.0)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        raise
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-STDERR_TAIL_CHARS:]
        raise AgentFailed(f"agent command exited with status {proc.returncode}: {tail or '(no stderr)'}")
    text = out.decode(errors="replace").strip()
    return text or None


def agent_step_prefix(job_name: str, het_group: Optional[int] = None,
                      environ: Optional[dict] = None) -> list[str]:
    """The ``srun`` prefix that runs one episode's command as its own job step of the current Slurm job:
    one task on one node, sharing the allocation (``--overlap --mem=0``), on ``het_group`` when given. Raises
    RuntimeError outside a Slurm job."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job:
        raise RuntimeError("rollout.agent_step: true runs each agent episode as a job step and needs a Slurm job "
                           "(hpcrl submit); set rollout.agent_step: false for a local run")
    cmd = ["srun", f"--jobid={job}", "--overlap", "--mem=0", "--ntasks=1", "--nodes=1", "--kill-on-bad-exit=1",
           "--quiet", f"--job-name={job_name}"]
    if het_group is not None:
        cmd.append(f"--het-group={het_group}")
    return cmd


def agent_generate(gateway: AgentGateway, function: Optional[AgentFn], command: list[str], timeout_s: float,
                   failure_reward: float, eos_id: int = 0):
    """The generate function of an agentic rollout (see the module docstring). ``function`` or ``command``
    is the agent (a command may start with an ``srun`` prefix, :func:`agent_step_prefix`); ``eos_id`` pads a
    failed episode without calls."""

    async def generate(client, sample: Sample, sampling_params: dict) -> Sample:
        item = task_item(sample)
        session = gateway.open(item, seed=sampling_params.get("sampling_seed"),  # the rollout's or eval's
                               sampling={k: v for k, v in sampling_params.items() if k != "sampling_seed"})
        answer: Optional[str] = None
        failure: Optional[str] = None
        try:
            if function is not None:
                run = function(item, base_url=gateway.url, api_key=session.key, session_id=session.session_id)
            else:
                run = run_command(command, item, gateway.url, session)
            answer = await asyncio.wait_for(run, timeout_s)
        except asyncio.TimeoutError:
            failure = f"the agent did not finish within rollout.agent.timeout_s={timeout_s:g} s"
        except AgentFailed as e:
            failure = str(e)
        except Exception as e:  # noqa: BLE001 - an agent function that raised: the episode failed
            failure = f"the agent raised {type(e).__name__}: {e}"
        finally:
            gateway.close(session)
        if failure is None and not session.calls:
            failure = "the agent made no call to the policy"
        return fill_sample(sample, session, answer, failure, failure_reward, eos_id)

    return generate


def fill_sample(sample: Sample, session: Session, answer: Optional[str], failure: Optional[str],
                failure_reward: float, eos_id: int) -> Sample:
    """Replace ``sample``'s tokens and response with the episode's chains, one segment each (module
    docstring)."""
    chains = build_trajectories(session.calls)
    last = chains[-1] if chains else None  # the last call's chain: chains come in the order of their last calls
    trained = [c for c in chains if c.response_ids]
    if trained:
        first = trained[0]
        sample.tokens = list(first.prompt_ids) + list(first.response_ids)
        sample.response_length = len(first.response_ids)
        sample.loss_mask = list(first.loss_mask)
        sample.rollout_log_probs = list(first.log_probs)
        sample.weight_versions = list(first.weight_versions)
        sample.segments = [len(sample.tokens)] if len(trained) > 1 else []
        for chain in trained[1:]:  # a later chain: its own sequence, its prompt masked
            ids = list(chain.prompt_ids) + list(chain.response_ids)
            sample.tokens += ids
            sample.response_length += len(ids)
            sample.loss_mask += [0] * len(chain.prompt_ids) + list(chain.loss_mask)
            sample.rollout_log_probs += [0.0] * len(chain.prompt_ids) + list(chain.log_probs)
            sample.weight_versions += chain.weight_versions
            sample.segments.append(len(ids))
    elif sample.response_length == 0:
        sample.append_response_tokens([eos_id], trainable=False)
    sample.metadata.update(agent_session=session.session_id, agent_calls=len(session.calls),
                           agent_chains=len(chains),
                           agent_tool_calls=sum("<tool_call>" in c.text for c in session.calls))
    if failure is not None:
        sample.status = Status.FAILED
        sample.metadata.update(agent_failure=failure, reward_source="agent_failure")
        sample.reward = float(failure_reward)
        sample.response = answer or ""
        return sample
    sample.response = answer if answer is not None else (last.text if last is not None else "")
    sample.status = Status.TRUNCATED if last is not None and last.finish_reason == "length" else Status.COMPLETED
    sample.metadata.pop("reward_source", None)
    if session.reward is not None:  # posted by the agent: the scorer is not asked
        sample.reward = float(session.reward)
        sample.metadata["reward_source"] = "agent"
    return sample
