"""The CPU engine serves LoRA adapters as SGLang 0.5.23 does (issue #56 point 3): loaded from a PEFT folder and
from tensors, chosen per row by ``lora_path`` in one batch, their log-probs those of HF transformers + PEFT,
listed in ``/v1/models``, refused and unloaded with SGLang's messages, an unload waiting for the requests that
run on the adapter."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.integration.engine_utils import EngineProcess, http_json

pytestmark = pytest.mark.integration

SEQ = [5, 17, 3, 12, 9, 11, 7, 12, 20, 2]
SAME = 1e-6
"""The same log-probs from batches of other sizes: a matrix product's rounding may depend on the batch's row count
on some CPUs (the engine is not batch-invariant without --enable-deterministic-inference); an adapter that leaks
into a row, or one left behind, moves them by more than 1e-2."""


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < SAME


def _peft_model(tiny_model_dir, config):
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return peft.get_peft_model(model, config)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two random PEFT adapters of the tiny model (B not zero): ``a1`` rank 4 on every dense linear, saved as a
    folder; ``a2`` rank 8 on q/v, as tensors; and ``big`` rank 16 (over the engine's --max-lora-rank 8)."""
    import peft
    from peft import get_peft_model_state_dict

    out = {}
    for name, rank, targets, seed in [("a1", 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"], 1),
                                      ("a2", 8, ["q_proj", "v_proj"], 2), ("big", 16, ["q_proj"], 3)]:
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        model = _peft_model(tiny_model_dir, config)
        with torch.no_grad():  # PEFT's random init is small: make the adapter move the log-probs
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.mul_(20)
        folder = tmp_path_factory.mktemp("adapters") / name
        model.save_pretrained(folder)
        state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([SEQ])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[torch.arange(len(SEQ) - 1), torch.tensor(SEQ[1:])]
        out[name] = {"folder": folder, "state": state, "config": config.to_dict(), "logprobs": lp.tolist()}
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora-engine") / "engine.log"
    with EngineProcess(tiny_model_dir, ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"],
                       log_path=log) as e:
        yield e


def _post(engine, path, body, timeout=60):
    return http_json("POST", engine.url + path, body, timeout=timeout)


def _logprobs(engine, loras):
    status, body = _post(engine, "/generate", {
        "input_ids": [SEQ] * len(loras), "lora_path": loras,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}, "return_logprob": True,
        "logprob_start_len": 0})
    assert status == 200, body
    return [[t[0] for t in r["meta_info"]["input_token_logprobs"][1:]] for r in body]


def _config(adapter):
    c = {k: v for k, v in adapter["config"].items() if k in ("r", "lora_alpha", "target_modules", "peft_type")}
    c["target_modules"] = sorted(c["target_modules"])
    return c


def _load_tensors(engine, name, adapter, timeout=60):
    """``/load_lora_adapter_from_tensors`` of ``adapter`` (the fixture's PEFT state) as ``name``: status, body."""
    from hpcrl.engine.serialize import serialize_tensor_dict

    return _post(engine, "/load_lora_adapter_from_tensors", {
        "lora_name": name, "config_dict": _config(adapter),
        "serialized_named_tensors": [serialize_tensor_dict(list(adapter["state"].items()))]}, timeout=timeout)


def test_adapters_load_serve_and_unload_as_sglang(engine, adapters, tiny_model_dir):
    a1, a2 = adapters["a1"], adapters["a2"]
    status, body = _post(engine, "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(a1["folder"])})
    assert status == 200 and body["success"] and body["loaded_adapters"] == {"a1": str(a1["folder"])}, body
    status, body = _load_tensors(engine, "a2", a2)
    assert status == 200 and body["loaded_adapters"] == {"a1": str(a1["folder"]), "a2": "__tensor__"}, body

    # one batch, three rows: the base model, a1, a2; each as HF transformers + PEFT computes it
    base, one, two = _logprobs(engine, [None, "a1", "a2"])
    assert max(abs(x - y) for x, y in zip(one, a1["logprobs"])) < 1e-5
    assert max(abs(x - y) for x, y in zip(two, a2["logprobs"])) < 1e-5
    assert max(abs(x - y) for x, y in zip(base, one)) > 1e-2  # the adapters change the model
    assert same(_logprobs(engine, [None])[0], base)  # a row without adapter is the base model's, batched or not

    # a mixed batch samples what each adapter alone samples (greedy)
    def greedy(loras):
        status, body = _post(engine, "/generate", {"input_ids": [SEQ[:4]] * len(loras), "lora_path": loras,
                                                    "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                        "ignore_eos": True}})
        assert status == 200, body
        return [r["output_ids"] for r in body]
    mixed = greedy([None, "a1", "a2"])
    assert mixed == greedy([None]) + greedy(["a1"]) + greedy(["a2"])

    status, body = http_json("GET", engine.url + "/v1/models")
    cards = {c["id"]: c for c in body["data"]}
    assert cards["a1"]["root"] == str(a1["folder"]) and cards["a2"]["root"] == "__tensor__"
    assert cards["a1"]["parent"] == body["data"][0]["id"]

    # SGLang's refusals
    status, body = _post(engine, "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(a1["folder"])})
    assert status == 400 and body["error_message"] == "Failed to load LoRA adapter a1 because it is already loaded"
    status, body = _post(engine, "/load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["big"]["folder"])})
    assert status == 400 and "with rank 16 is incompatible" in body["error_message"], body
    status, body = _post(engine, "/generate", {"input_ids": SEQ, "lora_path": "nope"})
    assert status == 400 and "Got LoRA adapter that has never been loaded: nope" in str(body), body
    status, body = _post(engine, "/unload_lora_adapter", {"lora_name": "nope"})
    assert status == 400 and body["error_message"].startswith("LoRA with name nope does not exist."), body

    status, body = _post(engine, "/unload_lora_adapter", {"lora_name": "a1"})
    assert status == 200 and body["loaded_adapters"] == {"a2": "__tensor__"}, body
    status, body = _post(engine, "/generate", {"input_ids": SEQ, "lora_path": "a1"})
    assert status == 400, body
    now_two, now_base = _logprobs(engine, ["a2", None])
    assert same(now_two, two) and same(now_base, base)  # the others are untouched
    status, body = _post(engine, "/unload_lora_adapter", {"lora_name": "a2"})
    assert status == 200 and body["loaded_adapters"] == {}
    assert same(_logprobs(engine, [None])[0], base)  # every adapter gone: the base model


def test_an_unload_waits_for_the_requests_on_its_adapter(engine, adapters):
    """SGLang's unload takes the name away at once and returns when the requests running on the adapter have
    finished; they finish on it, whole."""
    status, body = _load_tensors(engine, "slow", adapters["a2"])
    assert status == 200, body
    done = {}

    def generate():
        done["answer"] = _post(engine, "/generate", {"input_ids": SEQ, "lora_path": "slow", "sampling_params": {
            "max_new_tokens": 120, "temperature": 0, "ignore_eos": True}}, timeout=120)
        done["at"] = time.monotonic()

    t = threading.Thread(target=generate)
    t.start()
    deadline = time.monotonic() + 30
    while http_json("GET", engine.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)
    status, body = _post(engine, "/unload_lora_adapter", {"lora_name": "slow"}, timeout=120)
    unloaded = time.monotonic()
    t.join(120)
    assert status == 200, body
    gen_status, answer = done["answer"]
    assert gen_status == 200 and answer["meta_info"]["finish_reason"]["type"] == "length", answer
    assert len(answer["output_ids"]) == 120 and done["at"] <= unloaded


def test_a_load_waits_for_an_unload_of_the_same_name(engine, adapters):
    """A load of a name whose unload waits for its requests runs after that unload (one LoRA update at a time, as
    SGLang's ``lora_update_lock``): the new adapter keeps its layers and serves (without the lock it passed the
    duplicate check while the name was away and the unload then dropped its layers)."""
    a1 = adapters["a1"]
    assert _load_tensors(engine, "again", adapters["a2"])[0] == 200
    answers = {}
    generating = threading.Thread(target=lambda: answers.update(generate=_post(engine, "/generate", {
        "input_ids": SEQ, "lora_path": "again",
        "sampling_params": {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}}, timeout=120)))
    generating.start()
    deadline = time.monotonic() + 30
    while http_json("GET", engine.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)
    unloading = threading.Thread(target=lambda: answers.update(
        unload=_post(engine, "/unload_lora_adapter", {"lora_name": "again"}, timeout=120)))
    unloading.start()
    while any(m["id"] == "again" for m in http_json("GET", engine.url + "/v1/models")[1]["data"]):
        assert time.monotonic() < deadline, "the unload never took the name away"
        time.sleep(0.01)
    status, body = _load_tensors(engine, "again", a1, timeout=120)  # while the unload waits on the old one
    unloading.join(120)
    generating.join(120)
    assert status == 200, body
    assert answers["unload"][0] == 200 and answers["generate"][0] == 200, answers
    got = _logprobs(engine, ["again"])[0]  # the new adapter's layers (HF + PEFT's log-probs), not dropped
    assert max(abs(x - y) for x, y in zip(got, a1["logprobs"])) < 1e-5
    assert _post(engine, "/unload_lora_adapter", {"lora_name": "again"})[0] == 200
