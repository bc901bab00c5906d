"""Agent sessions without processes (issue #17): prompt reuse and trajectory building with the tiny model's real
character tokenizer, the Hermes tool-call parser, and the login-node checks of ``rollout.agent``."""

from __future__ import annotations

import json
import os

import pytest

from hpcrl.agent.session import Call, build_trajectories, extend_prompt
from hpcrl.agent.tools import parse_tool_calls
from hpcrl.models.tiny import build_char_tokenizer

TOK = build_char_tokenizer()


def encode(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def call(rendered, output_text, parent=None, end_text="", prompt=None, output=None):
    """A recorded call: the rendered prompt, the reply text the agent got, the ids (by default their encoding,
    plus the eos id when ``end_text`` says the reply ended on it)."""
    output = output if output is not None else encode(output_text) + ([TOK.eos_token_id] if end_text else [])
    return Call(prompt_ids=prompt if prompt is not None else encode(rendered), output_ids=output,
                output_log_probs=[-0.5] * len(output), weight_version="3", finish_reason="stop",
                text=output_text, rendered=rendered, end_text=end_text, parent=parent)


def test_a_resent_history_reuses_the_generated_ids_and_masks_the_rest():
    # the policy generated "2", a hidden <s> and eos: ids that re-tokenising the reply text "2" cannot give back
    first = call("1+1\n=", "2", end_text="</s>", output=encode("2") + [TOK.bos_token_id, TOK.eos_token_id])
    calls = [first]
    rendered = "1+1\n=2</s>\n3+4\n="  # the agent resent the reply and asked again; the template closes it
    ids, parent = extend_prompt(calls, rendered, encode)
    assert parent == 0 and ids == first.ids + encode("\n3+4\n=")  # eos not duplicated, <s> kept
    calls.append(call(rendered, "7", parent=0, end_text="</s>", prompt=ids))
    (t,) = build_trajectories(calls)
    assert t.prompt_ids == encode("1+1\n=") and t.calls == [0, 1]
    assert t.response_ids == first.output_ids + encode("\n3+4\n=") + calls[1].output_ids
    assert t.loss_mask == [1, 1, 1] + [0] * 6 + [1, 1]
    assert t.log_probs == [-0.5] * 3 + [0.0] * 6 + [-0.5, -0.5] and t.weight_versions == ["3", "3"]


def test_a_rewritten_history_starts_a_new_chain():
    calls = [call("1+1\n=", "2")]
    ids, parent = extend_prompt(calls, "1+1\n=3\n2+2\n=", encode)  # the reply was changed
    assert parent is None and ids == encode("1+1\n=3\n2+2\n=")
    calls.append(call("1+1\n=3\n2+2\n=", "4"))
    chains = build_trajectories(calls)
    assert [c.calls for c in chains] == [[0], [1]]
    assert chains[1].prompt_ids == ids and chains[1].loss_mask == [1]


def test_the_longest_matching_call_is_extended():
    calls = [call("1\n=", "2")]
    calls.append(call("1\n=2\n3\n=", "4", parent=0, prompt=calls[0].ids + encode("\n3\n=")))
    ids, parent = extend_prompt(calls, "1\n=2\n3\n=4\n5\n=", encode)
    assert parent == 1 and ids[:len(calls[1].ids)] == calls[1].ids
    with pytest.raises(ValueError, match="does not extend"):
        build_trajectories([call("1", "2"), call("9", "7", parent=0)])


def test_hermes_tool_calls_become_openai_tool_calls():
    text = 'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute." and len(calls) == 1
    fn = calls[0]["function"]
    assert fn["name"] == "calculator" and json.loads(fn["arguments"]) == {"expression": "12*7"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse_tool_calls("<tool_call>not json</tool_call> 84") == ("<tool_call>not json</tool_call> 84", [])
    with pytest.raises(ValueError, match="unknown tool parser"):
        parse_tool_calls("x", "qwen25")


def test_agent_config_is_checked_on_the_login_node(tmp_path):
    from hpcrl.config import ConfigError
    from hpcrl.validate import load_and_check

    def check(*overrides):
        return load_and_check(None, [f"model.path={tmp_path / 'm'}", "model.create=tiny-qwen2", *overrides])

    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\necho 1\n")
    with pytest.raises(ConfigError, match="rollout.agent.command.*not an executable"):
        check(f"rollout.agent.command=[{script}]")
    os.chmod(script, 0o755)
    assert check(f"rollout.agent.command=[{script}]").rollout.agent.enabled
    with pytest.raises(ConfigError, match="rollout.agent"):
        check(f"rollout.agent.command=[{script}]", "rollout.agent.function=os.getcwd")
    with pytest.raises(ConfigError, match="rollout.agent.timeout_s"):
        check(f"rollout.agent.command=[{script}]", "rollout.agent.timeout_s=0")
    with pytest.raises(ConfigError, match="rollout.agent.function"):
        check("rollout.agent.function=no_such_module.agent")


def test_agent_step_needs_a_command_and_a_slurm_job(tmp_path):
    from hpcrl.agent.runner import agent_step_prefix
    from hpcrl.config import ConfigError
    from hpcrl.validate import load_and_check

    with pytest.raises(ConfigError, match="rollout.agent_step"):
        load_and_check(None, [f"model.path={tmp_path / 'm'}", "model.create=tiny-qwen2", "rollout.agent_step=true",
                              "rollout.agent.function=os.getcwd"])
    assert agent_step_prefix("r-agent", 1, {"SLURM_JOB_ID": "42"}) == [
        "srun", "--jobid=42", "--overlap", "--mem=0", "--ntasks=1", "--nodes=1", "--kill-on-bad-exit=1", "--quiet",
        "--job-name=r-agent", "--het-group=1"]
    with pytest.raises(RuntimeError, match="needs a Slurm job"):
        agent_step_prefix("r-agent", None, {})
