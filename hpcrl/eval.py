"""Greedy evaluation of an HF causal LM on task items (the held-out accuracy every stage reports).

:func:`greedy_generate` decodes batches of prompts greedily with the KV cache (left padding plus attention
mask, ``model.generate(do_sample=False)``) and cuts each response at the first end-of-sequence token and at
the first stop string. :func:`greedy_accuracy` scores those responses with a task's scorer and returns the
mean. Prompts are tokenized with the tokenizer's defaults (``add_special_tokens=True``), the same way the SFT
demonstrations are, so a tokenizer that adds a bos token gets it in both places.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """All token ids that end a response: the tokenizer's eos plus the model's generation-config eos ids."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, gen_eos):
        if value is None:
            continue
        for i in (value if isinstance(value, (list, tuple)) else [value]):
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def cut_response(token_ids: Sequence[int], tokenizer: Any, eos_ids: Sequence[int],
                 stop: Optional[Sequence[str]] = None) -> str:
    """Decode generated ``token_ids`` up to (excluding) the first eos id, then cut at the first stop string.

    The stop string itself is not part of the result. Special tokens (e.g. padding after eos) are skipped.
    """
    ids = list(token_ids)
    eos = set(eos_ids)
    for i, t in enumerate(ids):
        if t in eos:
            ids = ids[:i]
            break
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if stop:
        cut = min((j for j in (text.find(s) for s in stop if s) if j >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
    return text


def greedy_generate(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int,
                    batch_size: int = 256, stop: Optional[Sequence[str]] = None) -> list[str]:
    """Greedy responses to ``prompts`` (one string each, cut at eos and at the first stop string).

    ``max_new_tokens`` bounds each response in tokens; ``batch_size`` is the number of prompts decoded
    together (left-padded to the longest in the batch). The model is put in eval mode for the call and its
    previous mode restored; no gradients are kept. Raises ValueError when the tokenizer has no pad and no eos
    token.
    """
    import torch

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token; batched generation needs one")
    eos_ids = eos_token_ids(model, tokenizer)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        with torch.inference_mode():
            for start in range(0, len(prompts), batch_size):
                encoded = [tokenizer(p)["input_ids"] for p in prompts[start:start + batch_size]]
                width = max(len(e) for e in encoded)
                input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
                attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
                for row, ids in enumerate(encoded):
                    input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
                    attention_mask[row, width - len(ids):] = 1
                generated = model.generate(
                    input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), do_sample=False,
                    max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_ids or None,
                    temperature=None, top_p=None, top_k=None,
                )
                for row in generated[:, width:].tolist():
                    out.append(cut_response(row, tokenizer, eos_ids, stop))
    finally:
        model.train(was_training)
    return out


def greedy_accuracy(model: Any, tokenizer: Any, items: Sequence[dict[str, Any]],
                    score_fn: Callable[[str, dict[str, Any]], float], max_new_tokens: int,
                    batch_size: int = 256, stop: Optional[Sequence[str]] = None) -> float:
    """Mean of ``score_fn(response, item)`` over ``items`` with greedy responses to ``item["prompt"]``.

    ``items`` are task items (``{"prompt": str, "label": ...}``); ``score_fn`` returns a reward in [0, 1]
    (a task's ``score``), so the result is the fraction correct for exact-match tasks. Responses are at most
    ``max_new_tokens`` tokens, cut at eos and at the first of ``stop``. Raises ValueError for no items.
    """
    if not items:
        raise ValueError("greedy_accuracy needs at least one item")
    responses = greedy_generate(model, tokenizer, [it["prompt"] for it in items], max_new_tokens,
                                batch_size=batch_size, stop=stop)
    return sum(float(score_fn(r, it)) for r, it in zip(responses, items)) / len(items)
