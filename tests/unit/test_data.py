"""Dataset files (JSONL/Parquet, malformed rows), the train/eval split, and the resumable DataSource."""

from __future__ import annotations

import json
import logging
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrl.config import Config
from hpcrl.data.sample import Sample, Status
from hpcrl.data.source import DataSource
from hpcrl.data.datasets import DataError, load_datasets, read_jsonl, read_parquet
from hpcrl.data.tasks import ReasoningGymTask, VerifierTask

# ---------------------------------------------------------------------------------------------- files


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_read_jsonl(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    f = write_lines(tmp_path / "d.jsonl", [
        json.dumps({"question": "1+1=", "answer": "2", "source": "a"}),
        "",
        json.dumps({"question": chat, "answer": 3, "metadata": {"k": 1}}),
        json.dumps({"question": "no label"}),
    ])
    items = read_jsonl(f, prompt_key="question", label_key="answer")
    assert items == [
        {"prompt": "1+1=", "label": "2", "metadata": {"source": "a"}},
        {"prompt": chat, "label": 3, "metadata": {"k": 1}},
        {"prompt": "no label", "label": None, "metadata": {}},
    ]


BAD_ROWS = [
    ("{not json", "bad JSON"),
    ("[1, 2]", "row is a JSON list, not an object"),
    ('{"text": "x", "label": "1"}', "no prompt key 'prompt' (keys: label, text)"),
    ('{"prompt": 7, "label": "1"}', "prompt 'prompt' is a int, not a string"),
    ('{"prompt": [{"content": "no role"}]}', "prompt 'prompt' is a list"),
    ('{"prompt": "   "}', "prompt 'prompt' is empty"),
]


@pytest.mark.parametrize("bad,what", BAD_ROWS)
def test_jsonl_bad_row_error(tmp_path, bad, what):
    good = json.dumps({"prompt": "1+1=", "label": "2"})
    f = write_lines(tmp_path / "d.jsonl", [good, "", bad, good])  # the bad row is on line 3
    with pytest.raises(DataError) as ei:
        read_jsonl(f)
    e = ei.value
    assert (e.path, e.line) == (str(f), 3)
    msg = str(e)
    assert msg.startswith(f"data error: {f}:3: ") and what in msg and "; " in msg and "\n" not in msg
    assert "on_bad_row: skip" in msg


def test_jsonl_bad_rows_skipped_and_logged(tmp_path, caplog):
    good = [json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) for i in range(3)]
    f = write_lines(tmp_path / "d.jsonl", [good[0], BAD_ROWS[0][0], good[1], BAD_ROWS[2][0], good[2]])
    with caplog.at_level(logging.WARNING, logger="hpcrl.data.datasets"):
        items = read_jsonl(f, on_bad_row="skip")
    assert [i["prompt"] for i in items] == ["0+1=", "1+1=", "2+1="]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{f}:2: bad JSON" in w for w in warnings)
    assert any(f"{f}:4: no prompt key" in w for w in warnings)
    assert any("skipped 2 malformed of 5 rows" in w for w in warnings)


def test_jsonl_whole_file_errors(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        read_jsonl(tmp_path / "missing.jsonl")
    f = write_lines(tmp_path / "bad.jsonl", ["{bad"])
    with pytest.raises(DataError, match=r"no usable rows \(1 rows, 1 malformed\)") as ei:
        read_jsonl(f, on_bad_row="skip")
    assert ei.value.line is None


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_read_parquet_and_bad_rows(tmp_path, caplog):
    f = write_parquet(tmp_path / "d.parquet", [
        {"q": "a", "a": "1", "extra": 1},
        {"q": None, "a": "2", "extra": 2},
        {"q": "c", "a": None, "extra": 3},
    ])
    with pytest.raises(DataError) as ei:
        read_parquet(f, prompt_key="q", label_key="a")
    assert (ei.value.path, ei.value.line) == (str(f), 2) and "is a NoneType" in str(ei.value)
    with caplog.at_level(logging.WARNING, logger="hpcrl.data.datasets"):
        items = read_parquet(f, prompt_key="q", label_key="a", on_bad_row="skip")
    assert items == [{"prompt": "a", "label": "1", "metadata": {"extra": 1}},
                     {"prompt": "c", "label": None, "metadata": {"extra": 3}}]
    assert any(f"{f}:2:" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match="no prompt key 'prompt'"):
        read_parquet(f)
    notpq = write_lines(tmp_path / "x.parquet", ["hello"])
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_parquet(notpq)


# ---------------------------------------------------------------------------------------------- splits


def cfg_with(**data):
    cfg = Config()
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_load_datasets_generator():
    cfg = cfg_with(source="addition", num_train=300, num_eval=50, task_kwargs={"digits": 1})
    ds = load_datasets(cfg)
    assert len(ds.train) == 300 and ds.task.name == "addition"
    train_prompts = {i["prompt"] for i in ds.train}
    assert ds.eval and not train_prompts & {i["prompt"] for i in ds.eval}
    # only 81 one-digit problems: 300 draws cover them all -> eval shrinks (documented), never overlaps
    assert len(ds.eval) < 50
    assert load_datasets(cfg).train == ds.train  # deterministic in run.seed

    cfg = cfg_with(source="reasoning_gym:chain_sum", num_train=30, num_eval=10, task_kwargs={"few_shot": 1})
    ds = load_datasets(cfg)
    assert isinstance(ds.task, ReasoningGymTask) and len(ds.train) == 30 and 8 <= len(ds.eval) <= 10
    assert ds.task.score(ds.eval[0]["label"], ds.eval[0]) == 1.0


def test_load_datasets_file(tmp_path):
    rows = [json.dumps({"prompt": f"p{i}", "label": str(i)}) for i in range(10)]
    f = write_lines(tmp_path / "train.jsonl", rows)
    ds = load_datasets(cfg_with(source=str(f), num_eval=3))
    assert [i["prompt"] for i in ds.train] == [f"p{i}" for i in range(7)]
    assert [i["prompt"] for i in ds.eval] == ["p7", "p8", "p9"]
    assert isinstance(ds.task, VerifierTask) and ds.task.verifier == "exact_match"
    assert ds.task.score("7", ds.eval[0]) == 1.0

    ev = write_lines(tmp_path / "eval.jsonl", [json.dumps({"prompt": "e", "label": "1"})])
    cfg = cfg_with(source=str(f), eval_source=str(ev), num_eval=3)
    cfg.rollout.reward_function = "math_answer"
    ds = load_datasets(cfg)
    assert len(ds.train) == 10 and [i["prompt"] for i in ds.eval] == ["e"]
    assert ds.task.verifier == "math_answer" and ds.task.score("the answer is 1.0", ds.eval[0]) == 1.0

    with pytest.raises(DataError, match="cannot hold out data.num_eval=10"):
        load_datasets(cfg_with(source=str(f), num_eval=10))
    with pytest.raises(DataError, match="file not found"):
        load_datasets(cfg_with(source=str(tmp_path / "nope.jsonl")))


# ---------------------------------------------------------------------------------------------- DataSource


def make_items(n):
    return [{"prompt": f"p{i}", "label": str(i), "metadata": {"i": i}} for i in range(n)]


def served_prompts(groups):
    return [g[0].prompt for g in groups]


def test_source_groups_and_epochs():
    items = make_items(7)
    src = DataSource(items, n_samples_per_prompt=3, seed=5, shuffle=True)
    groups = src.get_samples(3) + src.get_samples(6)  # the second request crosses into epoch 1
    assert src.epoch == 1 and src.offset == 2
    for g in groups:
        assert len(g) == 3 and len({s.group_index for s in g}) == 1 and len({s.prompt for s in g}) == 1
        assert g[0].label == g[0].prompt[1:] and g[0].metadata == {"i": int(g[0].prompt[1:])}
        assert g[0].metadata is not g[1].metadata  # deep copies
    assert [s.index for g in groups for s in g] == list(range(27))
    assert [g[0].group_index for g in groups] == list(range(9))
    assert sorted(served_prompts(groups[:7])) == sorted(i["prompt"] for i in items)  # epoch 0: each once
    assert served_prompts(groups[:7]) != served_prompts(DataSource(items, 3, seed=6).get_samples(7))
    in_order = served_prompts(DataSource(items, 1, shuffle=False).get_samples(8))
    assert in_order == [f"p{i}" for i in range(7)] + ["p0"]
    assert src.get_samples(0) == []


def test_source_every_prompt_once_per_epoch():
    items = make_items(13)
    src = DataSource(items, n_samples_per_prompt=1, seed=0)
    rng = random.Random(0)
    served = []
    while len(served) < 13 * 5:
        served += served_prompts(src.get_samples(rng.randint(1, 9)))
    for e in range(5):
        assert sorted(served[13 * e:13 * (e + 1)]) == sorted(i["prompt"] for i in items)
    assert len({tuple(served[13 * e:13 * (e + 1)]) for e in range(5)}) == 5  # a new order each epoch


@pytest.mark.parametrize("trial", range(6))
def test_source_exact_continuation_after_state_round_trip(trial):
    rng = random.Random(trial)
    items = make_items(rng.randint(1, 11))
    n = rng.randint(1, 3)
    requests = [rng.randint(0, 7) for _ in range(12)]
    reference = DataSource(items, n, seed=trial)
    expected = [[(g[0].prompt, g[0].group_index, [s.index for s in g]) for g in reference.get_samples(k)]
                for k in requests]
    for cut in sorted({rng.randint(0, len(requests)), len(items) % len(requests), 0}):
        src = DataSource(items, n, seed=trial)
        got = [[(g[0].prompt, g[0].group_index, [s.index for s in g]) for g in src.get_samples(k)]
               for k in requests[:cut]]
        state = json.loads(json.dumps(src.state_dict()))  # plain JSON
        resumed = DataSource(items, n, seed=999)  # the saved seed wins
        resumed.load_state_dict(state)
        got += [[(g[0].prompt, g[0].group_index, [s.index for s in g]) for g in resumed.get_samples(k)]
                for k in requests[cut:]]
        assert got == expected, f"cut at request {cut}"


def test_source_epoch_boundary_state():
    items = make_items(4)
    ref = served_prompts(DataSource(items, 1, seed=1).get_samples(12))
    src = DataSource(items, 1, seed=1)
    first = served_prompts(src.get_samples(4))  # exactly one epoch: offset == len(items)
    resumed = DataSource(items, 1, seed=1)
    resumed.load_state_dict(src.state_dict())
    assert first + served_prompts(resumed.get_samples(8)) == ref


def test_source_push_back_and_state():
    items = make_items(5)
    src = DataSource(items, n_samples_per_prompt=2, seed=3)
    groups = src.get_samples(3)
    partial = groups[1]
    for s in partial:
        s.status = Status.ABORTED
        s.append_response_tokens([5, 6], [-0.1, -0.2], text="ab")
    src.add_samples([partial])
    state = json.loads(json.dumps(src.state_dict()))
    ref_next = src.get_samples(3)
    # pushed back: served first, the same samples
    assert all(a is b for a, b in zip(ref_next[0], partial, strict=True))
    assert [s.index for s in ref_next[0]] == [2, 3]
    resumed = DataSource(items, 2, seed=3)
    resumed.load_state_dict(state)
    got = resumed.get_samples(3)
    assert [s.to_dict() for g in got for s in g] == [s.to_dict() for g in ref_next for s in g]
    assert got[0][0].status == Status.ABORTED and got[0][0].response == "ab"
    with pytest.raises(ValueError, match="expected 2"):
        src.add_samples([partial[:1]])
    with pytest.raises(ValueError, match="mixes group_index"):
        src.add_samples([[Sample(group_index=0), Sample(group_index=1)]])


def test_source_rejects_changed_data_and_bad_args():
    src = DataSource(make_items(5), 1)
    state = src.state_dict()
    with pytest.raises(ValueError, match="the data changed"):
        DataSource(make_items(6), 1).load_state_dict(state)
    with pytest.raises(ValueError, match="the data changed"):
        DataSource(make_items(4) + [{"prompt": "other"}], 1).load_state_dict(state)
    with pytest.raises(ValueError):
        DataSource([], 1)
    with pytest.raises(ValueError):
        DataSource(make_items(2), 0)
