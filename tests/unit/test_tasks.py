"""Built-in tasks: the addition CI task and reasoning-gym tasks (determinism, prompts, scorers)."""

from __future__ import annotations

import json

import pytest

from hpcrl.data.tasks import AdditionTask, ReasoningGymTask, VerifierTask, make_task, reasoning_gym_seed

RG_TASKS = ["basic_arithmetic", "chain_sum", "countdown", "gsm_symbolic"]


def test_addition_deterministic_and_scored():
    task = make_task("addition", digits=2)
    assert isinstance(task, AdditionTask)
    a, b = task.generate(20, seed=7), task.generate(20, seed=7)
    assert a == b
    assert a != task.generate(20, seed=8)
    for it in a:
        x, y = it["prompt"].rstrip("=").split("+")
        assert 10 <= int(x) <= 99 and 10 <= int(y) <= 99
        assert it["label"] == str(int(x) + int(y))
        assert task.score(it["label"], it) == 1.0
        assert task.score(f" {it['label']}\n", it) == 1.0
        assert task.score(str(int(it["label"]) + 1), it) == 0.0


@pytest.fixture(scope="module")
def rg_tasks():
    return {name: make_task(f"reasoning_gym:{name}") for name in RG_TASKS}


@pytest.mark.parametrize("name", RG_TASKS)
def test_reasoning_gym_task_deterministic_and_scored(rg_tasks, name):
    task = rg_tasks[name]
    assert isinstance(task, ReasoningGymTask) and task.name == f"reasoning_gym:{name}"
    items = task.generate(6, seed=3)
    assert items == task.generate(6, seed=3)
    assert [i["prompt"] for i in items] != [i["prompt"] for i in task.generate(6, seed=4)]
    for it in items:
        assert set(it) == {"prompt", "label", "metadata"}
        entry = it["metadata"]["reasoning_gym"]
        assert it["prompt"] == entry["question"] and it["label"] == entry["answer"]
        assert task.score(it["label"], it) == 1.0
        assert task.score(f" {it['label']}\nQ: the next question", it) == 1.0  # raw few-shot continuation
        assert task.score(f"I think so.\n<answer>{it['label']}</answer>", it) == 1.0
        # The entry survives a JSON round trip (checkpointed buffers) and a fresh task instance scores it.
        again = json.loads(json.dumps(it))
        assert make_task(f"reasoning_gym:{name}").score(it["label"], again) == 1.0
    wrong = "1 + 2" if name == "countdown" else "123456789"
    assert task.score(wrong, items[0]) == 0.0
    # binary: false keeps reasoning-gym's partial credit (format rewards) for parsable wrong answers.
    raw = make_task(f"reasoning_gym:{name}", binary=False)
    assert raw.score(items[0]["label"], items[0]) == 1.0
    assert 0.0 <= raw.score(wrong, items[0]) < 0.1
    if name == "countdown":
        assert raw.score(wrong, items[0]) == pytest.approx(0.05)
    assert task.score("", items[0]) == 0.0


def test_reasoning_gym_seed_windows_do_not_overlap(rg_tasks):
    # reasoning-gym's own seeds 5 and 6 share all but one item; hpcrl's hashed seeds do not.
    task = rg_tasks["chain_sum"]
    assert reasoning_gym_seed("chain_sum", 5) != reasoning_gym_seed("chain_sum", 6) - 1
    def keys(seed):
        return {json.dumps(i["metadata"]["reasoning_gym"]["metadata"], sort_keys=True)
                for i in task.generate(40, seed=seed)}

    a, b = keys(5), keys(6)
    assert len(a & b) <= 2


def test_few_shot_prompt_format():
    task = make_task("reasoning_gym:basic_arithmetic", few_shot=3)
    items = task.generate(4, seed=0)
    prefixes = set()
    for it in items:
        p = it["prompt"]
        assert p.startswith("Q: ") and p.endswith("\nA:")
        lines = p.split("\n")
        assert len(lines) == 8
        assert [ln[:3] for ln in lines] == ["Q: ", "A: "] * 3 + ["Q: ", "A:"]
        assert lines[-2] == "Q: " + it["metadata"]["reasoning_gym"]["question"].strip()
        prefixes.add("\n".join(lines[:6]))
        assert task.score(f" {it['label']}\nQ: next", it) == 1.0
    assert len(prefixes) == 1  # the same shots for every prompt
    # the shots are solved examples: their answers score 1.0 against their own questions
    lines = items[0]["prompt"].split("\n")
    assert all(ln.startswith("A: ") and ln[3:] for ln in lines[1:6:2])


def test_generic_reasoning_gym_name_and_config():
    task = make_task("reasoning_gym:chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    for it in task.generate(5, seed=1):
        assert it["metadata"]["reasoning_gym"]["metadata"]["num_terms"] == 2
        assert task.score(it["label"], it) == 1.0
    task = make_task("reasoning_gym:leg_counting")
    it = task.generate(1, seed=0)[0]
    assert task.score(it["label"], it) == 1.0


@pytest.mark.parametrize("name,match", [
    ("nope", r"unknown task 'nope'; known: addition, repeat, reasoning_gym:<name>"),
    ("reasoning_gym:countdwn", r"did you mean countdown"),
])
def test_unknown_task_lists_known(name, match):
    with pytest.raises(ValueError, match=match) as ei:
        make_task(name)
    assert "reasoning_gym:gsm_symbolic" in str(ei.value) and "\n" not in str(ei.value)


def test_bad_task_kwargs():
    with pytest.raises(ValueError, match="bad dataset config"):
        make_task("reasoning_gym:chain_sum", bogus=1)
    with pytest.raises(ValueError, match="bad task_kwargs"):
        make_task("addition", bogus=1)


def test_verifier_task():
    t = VerifierTask("math_answer")
    assert t.score("so the answer is 12.", {"label": "12"}) == 1.0
    assert VerifierTask().score("12", {"label": "12"}) == 1.0
    assert VerifierTask().score("13", {"label": "12"}) == 0.0
    with pytest.raises(TypeError):
        t.generate(1, 0)
    with pytest.raises(ValueError, match="unknown verifier"):
        VerifierTask("bleu")


def test_repeat_task_long_tailed_deterministic_and_scored():
    """The long-tailed workload of benchmarks/async_modes.py: seeded, answers spread >= 10x in length (one
    token per digit with the tiny model's tokenizer), most answers short, exact match scores."""
    from hpcrl.data.tasks import RepeatTask
    from hpcrl.models.tiny import build_char_tokenizer

    task = make_task("repeat")
    assert isinstance(task, RepeatTask) and task.name == "repeat"
    items = task.generate(2000, seed=5)
    assert items == task.generate(2000, seed=5) and items != task.generate(2000, seed=6)
    tok = build_char_tokenizer()
    lengths = sorted(len(tok(it["label"], add_special_tokens=False)["input_ids"]) for it in items)
    assert lengths[0] == 2 and lengths[-1] == 40  # the bounds are reached: a 20x spread
    assert lengths[-1] / lengths[0] >= 10
    median, p90 = lengths[len(lengths) // 2], lengths[int(0.9 * len(lengths))]
    assert median <= 12 and p90 >= 25  # log-uniform: a long tail, not a uniform spread (median would be 21)
    for it in items[:50]:
        assert it["prompt"] == it["label"] + "=" and it["label"].isdigit()
        assert task.score(it["label"], it) == 1.0 and task.score(f" {it['label']}\n", it) == 1.0
        assert task.score(it["label"][:-1], it) == 0.0 and task.score(it["label"] + "0", it) == 0.0
    short = make_task("repeat", min_digits=3, max_digits=5).generate(200, seed=1)
    assert {len(it["label"]) for it in short} == {3, 4, 5}
    with pytest.raises(ValueError, match="min_digits"):
        make_task("repeat", min_digits=5, max_digits=4)
