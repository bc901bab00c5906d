"""Evaluation without engines (issue #34 points 2 and 3): pass@k, the eval sets and their sampling settings,
chat-format rows (message lists, system prompt and tools columns) as the rollout tokenises them, and the
config checks of ``eval`` and the chat fields. The engine path is tests/integration/test_eval_path.py.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest

from hpcrl.config import ConfigError
from hpcrl.data.chat import prompt_token_ids
from hpcrl.data.sample import Sample, Status
from hpcrl.data.datasets import DataError, load_datasets
from hpcrl.rollout import evaluate as ev
from hpcrl.rollout.rollout import tokenize_prompt
from hpcrl.validate import load_and_check

BASE = """\
run: {name: ev}
model: {create: tiny-qwen2, path: MODEL}
data: {source: addition, num_train: 50, num_eval: 20}
rollout: {max_new_tokens: 8, stop: ["\\n"]}
train: {lr_warmup_steps: 0}
"""

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}({{ m['content'] }}){% else %}"
            "{{ m['content'] }}{% endif %}{% endfor %}{% if tools %}{% for t in tools %}"
            "({{ t['function']['name'] }}){% endfor %}{% endif %}")
"""Renders the system text and each tool's name in parentheses (the tiny tokenizer's characters only)."""


def config(tmp_path: Path, *overrides: str, text: str = BASE, model: Path | None = None):
    (tmp_path / "run.yaml").write_text(text.replace("MODEL", str(model or tmp_path / "tiny")))
    return load_and_check(tmp_path / "run.yaml", list(overrides))


@pytest.fixture
def chat_model(tiny_model_dir, tmp_path) -> Path:
    out = tmp_path / "tiny-chat"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


# ------------------------------------------------------------------------------------------------------------
# pass@k and the metrics of a set
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 0), (4, 1), (4, 3), (5, 2), (8, 8)])
def test_pass_at_k_is_the_chance_a_random_k_subset_has_a_correct_one(n, c):
    responses = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(responses, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert math.isclose(ev.pass_at_k(n, c, k), brute)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        ev.pass_at_k(n, c, n + 1)


def test_pass_ks():
    assert [ev.pass_ks(n) for n in (1, 2, 3, 4, 6, 8)] == [[1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 6],
                                                           [1, 2, 4, 8]]


def done(reward: float, length: int, status=Status.COMPLETED) -> Sample:
    s = Sample(reward=reward, status=status)
    s.append_response_tokens(list(range(length)), [0.0] * length, trainable=True, text="x")
    return s


def test_set_metrics_default_and_named():
    groups = [[done(1.0, 2), done(0.0, 4), done(1.0, 2), done(0.0, 8, Status.TRUNCATED)],
              [done(0.0, 2), done(0.0, 2), done(0.0, 2), done(0.5, 2)]]
    named = ev.EvalSet("hard", [{}, {}], None, 4, {})
    m = ev.set_metrics(named, groups)
    assert m["eval/hard/accuracy"] == pytest.approx(2.5 / 8)
    assert m["eval/hard/pass@1"] == pytest.approx((0.5 + 0.0) / 2)  # a 0.5 reward is not a pass
    assert m["eval/hard/pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/hard/response_length"] == pytest.approx(24 / 8)
    assert m["eval/hard/truncated"] == pytest.approx(1 / 8) and m["eval/hard/num"] == 2
    default = ev.EvalSet("default", [{}, {}], None, 4, {})
    assert set(ev.set_metrics(default, groups)) == {k.replace("hard/", "") for k in m}


# ------------------------------------------------------------------------------------------------------------
# Eval sets from the config
# ------------------------------------------------------------------------------------------------------------

def test_eval_sets_and_their_sampling_settings(tmp_path, tiny_model_dir):
    rows = tmp_path / "hard.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n"
                            for i in range(9)))
    cfg = config(tmp_path, "eval.n_samples=2", "eval.temperature=0.6",
                 f"eval.sets=[{{name: file, source: {rows}, num: 5, max_new_tokens: 3}},"
                 "{name: gen, source: addition, num: 30, n_samples: 4, temperature: 1.0, top_p: 0.9,"
                 " task_kwargs: {digits: 1}}]", model=tiny_model_dir)
    data = load_datasets(cfg)
    sets = ev.eval_sets(cfg, data)
    assert [(s.name, s.n_samples) for s in sets] == [("default", 2), ("file", 2), ("gen", 4)]
    assert [s.prefix for s in sets] == ["eval/", "eval/file/", "eval/gen/"]
    assert sets[0].items == data.eval and len(sets[1].items) == 5
    assert all(len(it["prompt"]) == 4 for it in sets[2].items)  # 1-digit addition: "3+4="
    train = {it["prompt"] for it in data.train}
    assert not any(it["prompt"] in train for it in sets[2].items)  # held out of train
    p = [s.params for s in sets]
    assert (p[0]["temperature"], p[0]["top_p"], p[0]["top_k"], p[0]["max_new_tokens"]) == (0.6, 1.0, -1, 8)
    assert (p[1]["temperature"], p[1]["max_new_tokens"]) == (0.6, 3)
    assert (p[2]["temperature"], p[2]["top_p"], p[2]["max_new_tokens"]) == (1.0, 0.9, 8)
    assert all(q["stop"] == ["\n"] and q["no_stop_trim"] is True for q in p)  # the rollout's stop rules
    groups = ev.eval_groups(sets[2], 7, ev.EVAL_INDEX_BASE)
    assert [len(g) for g in groups] == [4] * len(sets[2].items)
    assert groups[0][0].index == ev.EVAL_INDEX_BASE and groups[-1][-1].rollout_id == 7
    cfg = config(tmp_path, "data.num_eval=0", model=tiny_model_dir)
    assert ev.eval_sets(cfg, load_datasets(cfg)) == []


@pytest.mark.parametrize("override,field,words", [
    ("eval.sets=[{name: default, source: addition}]", "eval.sets[0].name", "is the name of the eval set"),
    ("eval.sets=[{name: a, source: addition}, {name: a, source: addition}]", "eval.sets[1].name",
     "names two eval sets"),
    ("eval.sets=[{name: 'a b', source: addition}]", "eval.sets[0].name", "must be a metric name"),
    ("eval.sets=[{name: a}]", "eval.sets[0].source", "is required"),
    ("eval.sets=[{name: a, source: nope.jsonl}]", "eval.sets[0].source", "no such data file"),
    ("eval.sets=[{name: a, source: addition, n_samples: 0}]", "eval.sets[0].n_samples", "must be >= 1"),
    ("eval.top_p=0", "eval.top_p", "must be in (0, 1]"),
    ("eval.temperature=-1", "eval.temperature", "must be >= 0"),
    ("data.system_key=system", "data.system_key", "data.apply_chat_template is false"),
    ("data.tools_key=tools", "data.tools_key", "data.apply_chat_template is false"),
])
def test_eval_and_chat_config_errors(tmp_path, override, field, words):
    with pytest.raises(ConfigError) as e:
        config(tmp_path, override)
    assert e.value.field == field and words in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------------------
# Chat-format rows
# ------------------------------------------------------------------------------------------------------------

def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_rows_system_and_tools_tokenised_as_the_rollout_does(tmp_path, chat_model):
    tools = [{"type": "function", "function": {"name": "9", "parameters": {}}}]
    rows = write_rows(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "user", "content": "1+2="}], "label": "3", "sys": "0", "tools": tools},
        {"prompt": "2+2=", "label": "4", "tools": json.dumps(tools)},  # a string prompt: one user message
        {"prompt": [{"role": "system", "content": "5"}, {"role": "user", "content": "3+3="}], "label": "6",
         "sys": "0"},  # has a system message: the column's is not added
    ] * 2)
    cfg = config(tmp_path, f"data.source={rows}", "data.num_eval=3", "data.apply_chat_template=true",
                 "data.system_key=sys", "data.tools_key=tools", model=chat_model)
    data = load_datasets(cfg)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    texts = []
    for item in data.train:
        s = Sample(prompt=item["prompt"], label=item["label"], metadata=item["metadata"])
        tokenize_prompt(tok, s, cfg.data.apply_chat_template)
        texts.append(tok.decode(s.tokens))
        assert s.tokens == prompt_token_ids(tok, item["prompt"], True, item["metadata"].get("tools"))
    assert texts == ["(0)1+2=(9)", "2+2=(9)", "(5)3+3="]


def test_chat_rows_refused_on_the_login_node(tmp_path, chat_model, tiny_model_dir):
    from hpcrl.data.datasets import check_data

    row = {"prompt": [{"role": "user", "content": "1+2="}], "label": "3"}
    rows = write_rows(tmp_path / "chat.jsonl", [row] * 4)
    cfg = config(tmp_path, f"data.source={rows}", "data.num_eval=1", model=chat_model)
    with pytest.raises(ConfigError, match=r"chat.jsonl:1: prompt is a chat message list, but "
                                          r"data.apply_chat_template is false; set "
                                          r"data.apply_chat_template=true"):
        check_data(cfg)
    cfg = config(tmp_path, f"data.source={rows}", "data.num_eval=1", "data.apply_chat_template=true",
                 model=tiny_model_dir)
    with pytest.raises(ConfigError, match="data.apply_chat_template=True: the tokenizer of .* has no chat "
                                          "template"):
        check_data(cfg)
    bad = write_rows(tmp_path / "bad.jsonl", [{"prompt": "1+2=", "label": "3", "tools": {"x": 1}}] * 4)
    cfg = config(tmp_path, f"data.source={bad}", "data.num_eval=1", "data.apply_chat_template=true",
                 "data.tools_key=tools", model=chat_model)
    with pytest.raises(DataError, match="bad.jsonl:1: tools 'tools' is not a list of tool schemas"):
        load_datasets(cfg)


def test_chat_rows_from_parquet(tmp_path, chat_model):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tools = json.dumps([{"type": "function", "function": {"name": "7", "parameters": {}}}])
    table = pa.table({"prompt": [[{"role": "user", "content": f"{i}+1="}] for i in range(6)],
                      "label": [str(i + 1) for i in range(6)], "sys": ["0"] * 6, "tools": [tools] * 6})
    pq.write_table(table, tmp_path / "chat.parquet")
    cfg = config(tmp_path, f"data.source={tmp_path / 'chat.parquet'}", "data.num_eval=2",
                 "data.apply_chat_template=true", "data.system_key=sys", "data.tools_key=tools", model=chat_model)
    data = load_datasets(cfg)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    s = Sample(prompt=data.eval[0]["prompt"], metadata=data.eval[0]["metadata"])
    tokenize_prompt(tok, s, True)
    assert len(data.train) == 4 and tok.decode(s.tokens) == "(0)4+1=(7)"


def test_hpcrl_eval_targets(tmp_path, tiny_model_dir):
    from hpcrl.standalone_eval import resolve_target

    with pytest.raises(ConfigError, match="is an HF model folder, and says nothing of what to evaluate it on"):
        resolve_target(str(tiny_model_dir))
    with pytest.raises(ConfigError, match="is not a run folder"):
        resolve_target(str(tmp_path))
    (tmp_path / "run.yaml").write_text(BASE.replace("MODEL", str(tmp_path / "tiny")))
    t = resolve_target(str(tiny_model_dir), str(tmp_path / "run.yaml"), ["eval.n_samples=3"])
    assert t.model == tiny_model_dir and t.checkpoint is None and t.cfg.eval.n_samples == 3
    assert t.cfg.model.path == str(tiny_model_dir) and t.output == Path("eval") / tiny_model_dir.name
    run = tmp_path / "runs" / "r"
    (run / "checkpoints" / "iter_0000004").mkdir(parents=True)
    (run / "config.yaml").write_text(BASE.replace("MODEL", str(tiny_model_dir)))
    t = resolve_target(str(run))
    assert t.checkpoint is None and t.label == "model"  # no complete checkpoint: the starting model
    t = resolve_target(str(run / "checkpoints" / "iter_0000004"), output=str(tmp_path / "out"))
    assert t.checkpoint == run / "checkpoints" / "iter_0000004" and t.output == tmp_path / "out"
