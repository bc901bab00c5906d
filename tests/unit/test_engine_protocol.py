"""``/generate`` parsing as SGLang 0.5.23 parses it (issue #16 point 2), with the tiny model's real character
tokenizer: context rules with and without ``--allow-auto-truncate``, refused and accepted "off" values,
per-input options, rid prefixes."""

from __future__ import annotations

import pytest

from hpcrl.engine import protocol
from hpcrl.models.tiny import build_char_tokenizer

TOK = build_char_tokenizer()
VOCAB, CTX = len(TOK), 32


def parse(body, **kw):
    return protocol.parse_generate(body, TOK, VOCAB, CTX, **kw)


def test_context_overflow_is_refused_unless_auto_truncate():
    long = {"input_ids": [3] * 20, "sampling_params": {"max_new_tokens": 20}}
    with pytest.raises(protocol.RequestError, match="You requested a total of 40 tokens"):
        parse(long)
    assert parse(long, allow_auto_truncate=True).rows[0].params.max_new_tokens == 12
    assert parse({"input_ids": [3] * 20}).rows[0].params.max_new_tokens == 12  # the default is shortened
    with pytest.raises(protocol.RequestError, match=r"The input \(32 tokens\) is longer"):
        parse({"input_ids": [3] * 32})
    row = parse({"input_ids": [3] * 40}, allow_auto_truncate=True).rows[0]
    assert len(row.prompt_ids) == CTX - 1 and row.params.max_new_tokens == 1


def test_off_values_pass_and_on_values_are_refused():
    ok = {"frequency_penalty": 0.0, "presence_penalty": 0, "repetition_penalty": 1.0, "logit_bias": {},
          "stop_regex": None, "spaces_between_special_tokens": True, "beam_width": None, "choice": []}
    parse({"text": "1", "sampling_params": ok})
    for key, value in (("repetition_penalty", 1.1), ("spaces_between_special_tokens", False),
                       ("beam_width", 4), ("regex", "a+"), ("stream_interval", 8)):
        with pytest.raises(protocol.RequestError, match=key):
            parse({"text": "1", "sampling_params": {key: value}})
    with pytest.raises(protocol.ContractError, match="unknown field `top_n`"):
        parse({"text": "1", "sampling_params": {"top_n": 3}})
    parse({"text": "1", "lora_path": None, "return_hidden_states": False, "priority": None})
    with pytest.raises(protocol.RequestError, match="priority"):
        parse({"text": "1", "priority": 5})


def test_rids_per_input_options_and_duplicates():
    spec = parse({"text": ["1", "2", "3"], "rid": "r", "top_logprobs_num": 3, "return_logprob": True})
    assert [r.rid for r in spec.rows] == ["r_0", "r_1", "r_2"] and {r.top_logprobs_num for r in spec.rows} == {3}
    spec = parse({"text": "1", "rid": "r", "sampling_params": {"n": 2}})
    assert [r.rid for r in spec.rows] == ["r-0", "r-1"] and {r.base_rid for r in spec.rows} == {"r"}
    with pytest.raises(protocol.RequestError, match="Duplicate request IDs"):
        parse({"text": ["1", "2"], "rid": ["a", "a"]})
    with pytest.raises(protocol.RequestError, match="2 entries for 3 inputs"):
        parse({"text": ["1", "2", "3"], "logprob_start_len": [0, 0]})
    spec = parse({"input_ids": [[3, 4], [5]], "return_logprob": [False, True], "logprob_start_len": [None, 0]})
    assert [(r.return_logprob, r.logprob_start_len) for r in spec.rows] == [(False, -1), (True, 0)]


def test_chat_prompts_tokenize_to_ids_not_a_dict():
    """transformers 5's ``apply_chat_template(tokenize=True)`` returns a dict unless ``return_dict=False``: the
    rollout's chat prompts must be the template's token ids (the same ids the engine's chat endpoint renders)."""
    from hpcrl.data.sample import Sample
    from hpcrl.engine.openai_api import render_chat
    from hpcrl.rollout.rollout import tokenize_prompt

    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}={% endif %}"
    messages = [{"role": "user", "content": "12+3"}]
    sample = Sample(prompt=messages)
    tokenize_prompt(tok, sample, apply_chat_template=True)
    assert sample.tokens == render_chat(tok, tok.chat_template, messages) == tok("12+3\n=")["input_ids"]
