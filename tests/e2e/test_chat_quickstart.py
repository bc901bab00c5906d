"""The quickstart's task as chat-format data, end to end (issue #34 points 2 and 3), and ``hpcrl eval`` of the
quickstart's own run.

* Chat data: 3-digit additions as JSONL rows whose prompt is a message list (with a system message), the
  quickstart's SFT model (shipped: ``tests/warm_starts/quickstart``) with a chat template added (it renders the user's text as the SFT saw it), trained by
  GRPO for a few steps and evaluated on a chat eval file, greedy and as a sampled named set with pass@k. The
  same model evaluated by ``hpcrl eval`` on the same items as plain strings scores what the chat run's first
  eval scored: the chat template reaches the engine as the prompt the model knows.
* ``hpcrl eval RUN`` of the quickstart run evaluates its last checkpoint with the run's config and gets the
  run's last ``eval/accuracy`` (same weights, same items, same code).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.warm_starts import WARM_STARTS

ROOT = Path(__file__).resolve().parents[2]
HPCRL = Path(sys.executable).with_name("hpcrl")
TEMPLATE = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def hpcrl(cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    with open(cwd / "out.log", "ab") as log:
        rc = subprocess.run([str(HPCRL), *args], cwd=cwd, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                            timeout=timeout, check=False).returncode
    return subprocess.CompletedProcess(args, rc, (cwd / "out.log").read_text(errors="replace"))


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_quickstart_task_as_chat_data(tmp_path):
    from hpcrl.data.tasks import make_task

    model = tmp_path / "sft-chat"
    shutil.copytree(WARM_STARTS["quickstart"].folder / "tiny-qwen2-addition-sft", model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    task = make_task("addition")

    def chat(items):
        return [{"prompt": [{"role": "system", "content": "You add numbers."},
                            {"role": "user", "content": it["prompt"]}], "label": it["label"]} for it in items]

    train, held = task.generate(2000, seed=11), task.generate(100, seed=12)
    for name, items in (("train.jsonl", chat(train)), ("eval-chat.jsonl", chat(held)), ("eval-raw.jsonl", held)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in items))
    overrides = [f"model.path={model}", "sft.enabled=false", "data.source=train.jsonl",
                 "data.eval_source=eval-chat.jsonl", "data.apply_chat_template=true", "run.num_rollout=4",
                 "run.name=chat", "rollout.eval_interval=2", "train.lr_warmup_steps=0",
                 "eval.sets=[{name: sampled, source: eval-chat.jsonl, num: 40, n_samples: 4, temperature: 1.0}]"]
    shutil.copy(ROOT / "configs" / "quickstart.yaml", tmp_path / "quickstart.yaml")
    out = hpcrl(tmp_path, "run", "quickstart.yaml", *overrides)
    assert out.returncode == 0, out.stdout[-3000:]
    got = rows(tmp_path / "runs" / "chat" / "metrics.jsonl")
    evals = [r for r in got if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [-1, 1, 3] and [r["step"] for r in got if r["step"] >= 0] == [0, 1, 2, 3]
    first = evals[0]
    assert first["eval/accuracy"] >= 0.3, first  # the SFT model adds through the chat template
    assert first["eval/num"] == 100 and first["eval/sampled/num"] == 40
    assert first["eval/sampled/pass@4"] >= first["eval/sampled/pass@2"] >= first["eval/sampled/pass@1"]
    assert first["eval/sampled/pass@1"] == pytest.approx(first["eval/sampled/accuracy"])  # 0/1 rewards

    # the same model and items as plain strings, evaluated standalone: the same greedy accuracy
    out = hpcrl(tmp_path, "eval", str(model), "quickstart.yaml", *overrides[1:2], "data.source=eval-raw.jsonl",
                "data.eval_source=eval-raw.jsonl", "--output", "eval-raw")
    assert out.returncode == 0, out.stdout[-3000:]
    raw = json.loads((tmp_path / "eval-raw" / "eval.json").read_text())["metrics"]
    assert raw["eval/num"] == 100 and raw["eval/accuracy"] == pytest.approx(first["eval/accuracy"], abs=0.02)


@pytest.mark.slow
def test_hpcrl_eval_of_the_quickstart_run_gets_its_last_eval(quickstart_run):
    assert quickstart_run.returncode == 0, quickstart_run.output[-3000:]
    folder = quickstart_run.folder
    last = [r for r in rows(folder / "runs" / "quickstart" / "metrics.jsonl") if "eval/accuracy" in r][-1]
    out = hpcrl(folder, "eval", "runs/quickstart")
    assert out.returncode == 0, out.stdout[-3000:]
    [ckpt] = [p for p in (folder / "runs" / "quickstart" / "checkpoints").iterdir() if p.name.startswith("iter_")]
    result = json.loads((folder / "runs" / "quickstart" / "eval" / ckpt.name / "eval.json").read_text())
    print(f"run's last eval {last['eval/accuracy']:.3f}, hpcrl eval {result['metrics']['eval/accuracy']:.3f}")
    assert result["metrics"]["eval/num"] == last["eval/num"]
    assert result["metrics"]["eval/accuracy"] == pytest.approx(last["eval/accuracy"], abs=0.01)
    assert "SET" in out.stdout and "default" in out.stdout
