"""Agentic RL end to end (issue #17 point 5): ``hpcrl run`` with ``rollout.agent`` on the tiny model: sync with
a dotted-path function agent that talks to the gateway with the ``openai`` package (two turns per episode),
async with the example's command agent written without hpcrl imports, and on the local Slurm cluster with each
episode as its own job step.

The tiny random model cannot add, so the reward is the answer's share of digits (a real signal, as in
test_loop.py); what is checked is that episodes become trained samples: every sample of the sync run has two
calls, half of them rewrote their history and so have two chains (two segments), none failed, and the trainer's
log-probs of the trained tokens equal the engine's (``train_rollout_logprob_abs_diff``: rounding only, which holds
only if each chain is trained as the engine saw it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.run_utils import engine_log as engine_log_of
from tests.integration.test_loop import run_config
from tests.integration.test_opd import submit_and_wait

pytestmark = pytest.mark.integration

AGENT_MODULE = '''
import itertools

import openai

EPISODES = itertools.count()


async def two_turns(item, *, base_url, api_key, session_id):
    """Two turns; every other episode edits its first message before resending the history (the second call
    then extends no earlier call), which splits the episode into two chains."""
    rewrite = next(EPISODES) % 2 == 1
    c = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": item["prompt"]}]
    r = await c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    reply = r.choices[0].message.content
    if rewrite:
        messages[0] = {"role": "user", "content": item["prompt"] + " "}
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "1"}]
    r = await c.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    return r.choices[0].message.content


def digit_fraction(args, sample):
    text = sample.response
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)
'''

COMMAND_AGENT = '''#!{python}
import json, os, sys, urllib.request
item = json.loads(sys.stdin.read())
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
                             data=json.dumps({{"model": "p", "max_tokens": 4,
                                              "messages": [{{"role": "user", "content": item["prompt"]}}]}}).encode(),
                             headers={{"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                       "Content-Type": "application/json"}})
print(json.loads(urllib.request.urlopen(req).read())["choices"][0]["message"]["content"])
'''

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}={{ m['content'] }}</s>"
            "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}={% endif %}")


def run_agent(tmp_path: Path, name: str, *overrides: str, timeout: int = 600):
    """`hpcrl run` of the agent config (:func:`write_agent_run`) with ``overrides``."""
    return run_config(tmp_path, write_agent_run(tmp_path, name), name, *overrides, timeout=timeout)


def write_agent_run(tmp_path: Path, name: str) -> Path:
    """``tmp_path/run.yaml`` (run ``name``: the tiny model, 2 steps of 2 prompts x 2 episodes of the two-turn
    function agent) and the modules it names; returns the config path."""
    (tmp_path / "agent_mod.py").write_text(AGENT_MODULE)
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(textwrap.dedent(f"""
        run: {{name: {name}, output_dir: {tmp_path / 'runs'}, num_rollout: 2, seed: 3}}
        model: {{path: {tmp_path / 'tiny'}, create: tiny-qwen2, tiny_hidden_size: 64, tiny_num_layers: 2}}
        data: {{source: addition, num_train: 64, num_eval: 8}}
        rollout: {{batch_size: 2, n_samples_per_prompt: 2, max_new_tokens: 4, eval_interval: 0,
                  reward_function: agent_mod.digit_fraction,
                  agent: {{function: agent_mod.two_turns, chat_template: {tmp_path / 'chat.jinja'},
                           timeout_s: 60}}}}
        train: {{lr: 1.0e-3, micro_batch_size: 4}}
        checkpoint: {{save_interval: 0}}
    """))
    return cfg


def rows(tmp_path: Path, name: str) -> list[dict]:
    path = tmp_path / "runs" / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


EXAMPLE_COMMAND = Path(__file__).resolve().parents[2] / "examples" / "agent_calculator" / "agent_cmd.py"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_agent_episodes_train(tmp_path, mode):
    """Sync: the two-turn function agent. Async: the example's command agent
    (examples/agent_calculator/agent_cmd.py: the openai package, no hpcrl import; the random tiny model writes
    no tool call, so each of its episodes is one call)."""
    extra = (("run.mode=async", "run.placement=disaggregate", "rollout.agent.function=null",
              f"rollout.agent.command=[{sys.executable}, {EXAMPLE_COMMAND}]") if mode == "async" else ())
    out = run_agent(tmp_path, f"agent-{mode}", *extra)
    assert out.returncode == 0, out.log[-3000:]
    steps = [r for r in rows(tmp_path, f"agent-{mode}") if r["step"] >= 0]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/agent_calls"] == (2 if mode == "sync" else 1) and r["rollout/agent_failed"] == 0
        assert r["rollout/agent_split_episodes"] == (0.5 if mode == "sync" else 0)
        assert r["train/grad_norm"] > 0
        if mode == "sync":  # on policy: the trainer's log-probs are the engine's, chain by chain
            assert r["train/train_rollout_logprob_abs_diff"] < 1e-4
    assert "agent gateway at http://127.0.0.1:" in out.log


REPO = Path(__file__).resolve().parents[2]


def test_the_calculator_example_runs_in_one_command(tmp_path):
    """Issue #34 point 6: ``hpcrl run configs/smollm2-agent.yaml`` as the example is, with no PYTHONPATH (the
    agent is named by its file, examples/agent_calculator/agent.py:solve): the SFT warm start on the
    example's tool-use demonstrations from the config's ``sft:`` section (``sft.data``, not the RL prompts),
    cached behind ``sft.output``, then the agent run from the warm-started model; a second run reuses the cache.
    Kept short (~20 s): the tiny model (its character tokenizer keeps the demonstrations within its context)
    instead of SmolLM2, 2 SFT steps, 1 RL step of 2 prompts x 2 episodes."""
    overrides = [f"run.output_dir={tmp_path / 'runs'}", "run.num_rollout=1",
                 f"model.path={tmp_path / 'tiny'}", "model.create=tiny-qwen2", "model.gguf_file=null",
                 "model.tiny_hidden_size=64", "model.tiny_num_layers=2",
                 f"sft.output={tmp_path / 'sft'}", "sft.steps=2", "sft.batch_size=4", "sft.data.num_eval=2",
                 "data.num_train=8", "data.num_eval=2", "rollout.batch_size=2",
                 "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=8", "rollout.agent.timeout_s=60"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"

    def hpcrl_run(name: str) -> str:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as f:  # -m: this checkout's hpcrl; the repository is on sys.path, examples/ not
            out = subprocess.run([sys.executable, "-m", "hpcrl", "run", "configs/smollm2-agent.yaml",
                                  f"run.name={name}", *overrides], cwd=REPO, env=env, stdout=f,
                                 stderr=subprocess.STDOUT, timeout=600, check=False)
        assert out.returncode == 0, log.read_text()[-3000:]
        return log.read_text()

    text = hpcrl_run("agent-first")
    # the warm start: the example's demonstrations (sft.data), 2 steps with an eval before and after ...
    sft = tmp_path / "sft"
    key = json.loads((sft / "sft_key.json").read_text())
    assert key["data"]["source"] == "examples/agent_calculator/demos.jsonl" and key["data"]["num_eval"] == 2
    sft_rows = [json.loads(x) for x in (sft / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sft_rows if "eval_accuracy" in r] == [0, 2]
    assert text.index("sft: saved") < text.index("agent gateway at http://127.0.0.1:")
    # ... then the agent run on the RL prompts (data: reasoning-gym), its engine serving the warm-started
    # model; one call per episode (the random tiny model writes no tool call), trained on policy
    engine_log = engine_log_of(tmp_path / "runs" / "agent-first" / "logs" / "attempt-0")
    assert f"model {sft.resolve()}, " in engine_log  # the warm start's folder in the store, sft links to it
    steps = [r for r in rows(tmp_path, "agent-first") if r["step"] >= 0]
    assert len(steps) == 1 and steps[0]["rollout/agent_calls"] == 1 and steps[0]["rollout/agent_failed"] == 0
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    # a second run finds the warm start in its cache and trains none
    made = (sft / "model.safetensors").stat().st_mtime_ns
    text = hpcrl_run("agent-second")
    assert "was made from the same base model, data, seed, recipe and layout: using it" in text
    assert "sft: saved" not in text
    assert (sft / "model.safetensors").stat().st_mtime_ns == made
    assert len([r for r in rows(tmp_path, "agent-second") if r["step"] >= 0]) == 1


def test_a_non_executable_agent_command_is_refused_before_anything_starts(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(COMMAND_AGENT.format(python=sys.executable))  # not chmod +x
    bad = run_agent(tmp_path, "agent-cmd", f"rollout.agent.command=[{script}]", "rollout.agent.function=null")
    assert bad.returncode != 0 and "rollout.agent.command" in bad.log and "not an executable" in bad.log
    assert not (tmp_path / "runs" / "agent-cmd" / "metrics.jsonl").exists()


def test_agent_episodes_as_their_own_job_steps_on_slurm(tmp_path, slurm_cluster, monkeypatch):
    """On Slurm the gateway runs in the controller (the trainer's job step); with ``rollout.agent_step: true``
    every episode of the command agent is a job step of the run's job (sacct lists them by name), reaching the
    gateway by the controller's address; the job completes with every episode trained. (Agents run in the
    controller's process or beside it on Slurm as locally: test_agent_episodes_train.)"""
    write_agent_run(tmp_path, "agent-steps")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    state, _, logs, job_id = submit_and_wait(
        tmp_path, "run.yaml", "slurm.cpus_per_task=2", "slurm.time=00:10:00", "run.num_rollout=1",
        "rollout.agent.function=null", f"rollout.agent.command=[{sys.executable}, {EXAMPLE_COMMAND}]",
        "rollout.agent_step=true", "data.num_eval=0")  # no eval: its episodes would be job steps too
    assert state == "COMPLETED", logs
    steps = [r for r in rows(tmp_path, "agent-steps") if r["step"] >= 0]
    assert len(steps) == 1 and all(r["rollout/agent_calls"] == 1 and r["rollout/agent_failed"] == 0 for r in steps)
    import subprocess

    names = subprocess.run(["sacct", "-n", "-P", "-j", job_id, "--format=JobName,State"], capture_output=True,
                           text=True, timeout=60).stdout.split()
    agent_steps = [n for n in names if n.startswith("agent-steps-agent|")]
    assert len(agent_steps) == 2 * 2 and all(n.endswith("|COMPLETED") for n in agent_steps), names
