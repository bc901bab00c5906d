"""SFT on the Megatron trainer (hpcrl.train.supervised) at world size 1, on the real tiny Qwen2: one optimizer
step equals Hugging Face's model + ``torch.optim.AdamW`` + gradient clipping on the same batch to 1e-6 (padded
and packed micro-batches alike, over several micro-batches), and demonstrations (hpcrl.data.demonstrations)
train exactly the tokens the chat template renders for the assistant."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.unit.test_actor import make_config, plain_loop, tp1  # noqa: E402,F401 (fixture)

CHATML = ("{% set tag = {'system': '1', 'user': '2', 'assistant': '3', 'tool': '4'} %}"
          "{% for m in messages %}({{ tag[m['role']] }}){{ m['content'] }}{% if m.get('tool_calls') %}"
          "{% for c in m['tool_calls'] %}*{{ c['function']['name'] }}{% endfor %}{% endif %}-{% endfor %}"
          "{% if add_generation_prompt %}(3){% endif %}")
"""A ChatML-like template in the tiny tokenizer's characters: ``(N)`` role tags, ``*name`` tool calls, ``-``
ending each turn."""


def demos(model_dir, n: int = 12, seed: int = 5):
    from transformers import AutoTokenizer

    from hpcrl.data.demonstrations import demonstration
    from hpcrl.data.tasks import make_task

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    items = make_task("addition").generate(n, seed=seed)
    return [demonstration(tok, it, False, index=i) for i, it in enumerate(items)]


EPS = 1.0
"""Adam's eps on both sides (megatron ``adam_eps``): with it the first step is about ``lr * g``, not
``lr * sign(g)``, so float rounding in tiny gradients does not decide an update's sign (as
tests/unit/test_megatron_bridge.py compares the RL step); the loss and the gradient norm are compared too."""


def hf_step(model_dir, samples, lr: float) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One step of the HF model: mean cross entropy over the batch's trained tokens, AdamW (betas 0.9/0.999,
    no weight decay), gradient norm clipped to 1.0 (the SFT recipe's). Returns loss, grad norm, weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0)
    nll, count = 0.0, 0
    for s in samples:
        logits = model(input_ids=torch.tensor([s.tokens])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
        mask = torch.tensor([0.0] * (len(s.tokens) - 1 - s.response_length) + [float(m) for m in s.loss_mask])
        nll = nll - (logp * mask).sum()
        count += int(mask.sum())
    loss = nll / count
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss), float(norm), {n: p.detach() for n, p in model.named_parameters()}


def sft_config(batch_size: int, lr: float = 1.0, tp: int = 1, nprocs: int = 1, **layout):
    """The config of the step compared with :func:`hf_step`: the SFT recipe at peak lr ``lr`` over 100 steps,
    ``batch_size`` demonstrations a step, Adam eps :data:`EPS`, the trainer at TP ``tp`` over ``nprocs``
    ranks (tests/integration/test_megatron_tp2.py takes it to two ranks)."""
    cfg = make_config(**{"sft.lr": lr, "sft.steps": 100, "sft.batch_size": batch_size,
                         "train.tensor_parallel_size": tp, "train.nprocs": nprocs, **layout})
    cfg.megatron = {"adam_eps": EPS}
    return cfg


@pytest.mark.parametrize("layout,lr_scale", [({"train.micro_batch_size": 5}, 1.0),
                                             ({"train.max_tokens_per_microbatch": 64}, 0.25)],
                         ids=["padded", "packed-lr-decay"])
def test_one_sft_step_equals_hf_adamw(tp1, tiny_model_dir, layout, lr_scale):
    """One step equals HF + AdamW at the recipe's lr (times ``lr_scale``: a step of ``sft.anneal_steps``'
    decay, which the SFT loop passes) to 1e-6, padded and packed."""
    from hpcrl import sft_recipe as sft
    from hpcrl.train.bridge import export_hf_weights
    from hpcrl.train.supervised import SupervisedTrainer

    samples = demos(tiny_model_dir)
    cfg = sft_config(len(samples), **layout)
    trainer = SupervisedTrainer(cfg, tiny_model_dir)
    m = trainer.train(7, samples, lr_scale=lr_scale)
    lr = sft.lr_at(7, 100, 1.0) * lr_scale
    assert m["train/lr"] == lr and m["train/tokens"] == sum(sum(s.loss_mask) for s in samples)
    loss, norm, want = hf_step(tiny_model_dir, samples, lr)
    assert m["train/loss"] == pytest.approx(loss, rel=1e-5) and m["train/grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert norm > 1.0  # the clip was exercised
    got = {n: t for n, t in export_hf_weights(trainer.ddp_model)}
    before = {n: t for n, t in export_hf_weights(SupervisedTrainer(cfg, tiny_model_dir).ddp_model)}
    assert got.keys() <= want.keys()
    assert max(float((got[n] - before[n]).abs().max()) for n in got) > 1e-2  # the step moved the weights
    worst = max(float((got[n] - want[n]).abs().max()) for n in got)
    assert worst < 1e-6, worst


@pytest.mark.parametrize("layout", [{"train.micro_batch_size": 5}, {"train.max_tokens_per_microbatch": 64}],
                         ids=["padded", "packed"])
def test_sft_steps_through_megatron_schedule_equal_the_plain_loop(tp1, tiny_model_dir, layout):
    """Issue #54 point 2: three SFT steps through megatron-core's schedule (several micro-batches each) give
    the very losses, grad norms and weights of the plain loop (tests/unit/test_actor.py)."""
    from hpcrl.train.bridge import export_hf_weights
    from hpcrl.train.supervised import SupervisedTrainer

    samples = demos(tiny_model_dir)

    def run():
        trainer = SupervisedTrainer(sft_config(len(samples), **layout), tiny_model_dir)
        timing = ("train/seconds", "train/tokens_per_s")
        rows = [{k: v for k, v in trainer.train(step, samples).items() if k not in timing} for step in range(3)]
        return rows, {n: t.clone() for n, t in export_hf_weights(trainer.ddp_model)}

    rows, weights = run()
    with plain_loop():
        ref_rows, ref_weights = run()
    assert rows == ref_rows and all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)


def test_conversation_masks_follow_the_chat_template(tiny_model_dir):
    """Multi-turn with a tool call: the trained tokens are exactly each assistant turn as the template renders
    it (content, tool calls, end-of-turn marker), nothing of system, user, tool results or generation
    prompts; a prompt + label row trains the label and eos; a template that rewrites earlier turns is refused."""
    from transformers import AutoTokenizer

    from hpcrl.data.demonstrations import DemonstrationError, conversation_tokens, demonstration

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = CHATML
    messages = [{"role": "system", "content": "1+1"}, {"role": "user", "content": "12+3="},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "7", "arguments": "{}"}}]},
                {"role": "tool", "content": "15"}, {"role": "assistant", "content": "15"}]
    tokens, mask = conversation_tokens(tok, messages)
    text = tok.apply_chat_template(messages, tokenize=False)
    assert tokens == list(tok(text, add_special_tokens=False)["input_ids"])
    trained = "".join(tok.decode([t]) for t, m in zip(tokens, mask) if m)
    assert trained == "*7-15-"  # the two assistant turns (tool call, then answer) with their turn ends
    s = demonstration(tok, {"prompt": messages, "label": None, "metadata": {}}, True)
    assert s.tokens == tokens and s.loss_mask == mask[len(tokens) - s.response_length:]
    plain = demonstration(tok, {"prompt": "12+3=", "label": 15, "metadata": {}}, False)
    assert plain.response_length == 3 and plain.tokens[-1] == tok.eos_token_id and plain.loss_mask == [1, 1, 1]
    tok.chat_template = ("{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}"
                         "({{ m['content'] }})-{% endif %}{% endfor %}")  # drops earlier answers
    with pytest.raises(DemonstrationError, match="not a prefix"):
        conversation_tokens(tok, messages)
    with pytest.raises(DemonstrationError, match="no label"):
        demonstration(tok, {"prompt": "12+3=", "label": None, "metadata": {}}, False)
