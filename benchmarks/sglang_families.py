"""Which tiny model families real SGLang serves on this CPU, and how exactly (issue #53 point 6).

For each family (``--families``; hpcrl's tiny MoE/MLA models: Qwen3-MoE, GLM-4.5, DeepSeek-V3, and the dense
Qwen2 for reference), created here from hpcrl's own definitions (:mod:`hpcrl.models.tiny`), starts SGLang as
``hpcrl run`` would (:func:`hpcrl.rollout.engines.spawn_engine`, SGLang's CPU line, one thread, its runtime
from ``tests/sglang_cpu``), once plain and once with ``--enable-return-routed-experts`` (routing replay) for
the MoE families, asks for 8 sampled tokens of one prompt with their log-probs, and compares them with HF
transformers' fp32 forward of the same tokens. Prints one row per start: seconds to ``/health`` or the last
error line of SGLang's log, the largest |SGLang - HF| log-prob, whether routed experts came back, and whether
SGLang called an op of the ``sgl_kernel`` stand-in. Needs ``bash .ci/install --sglang``::

    python benchmarks/sglang_families.py [--families qwen2 qwen3-moe glm4-moe deepseek-v3]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, also under `python -m`
sys.path.insert(0, str(ROOT))  # tests.sglang_cpu, tests.integration.engine_utils
from machine import machine_header  # noqa: E402

PROMPT = [1, 5, 9, 12, 3]


def creators() -> dict:
    """Family name -> hpcrl's tiny-model creator."""
    from hpcrl.models import tiny

    return {"qwen2": tiny.create_tiny_qwen2, "qwen3-moe": tiny.create_tiny_qwen3_moe,
            "glm4-moe": tiny.create_tiny_glm4_moe, "deepseek-v3": tiny.create_tiny_deepseek_v3}


def last_error(log: Path) -> str:
    """The last line of ``log`` naming an exception (SGLang's child tracebacks end with one)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
             if ("Error" in ln or "Exception" in ln) and "Ignore import error" not in ln]
    return lines[-1][:200] if lines else "(no error line)"


def try_family(path: Path, extra: dict, work: Path, tag: str) -> dict:
    """Start SGLang on ``path`` with ``extra`` flags and measure one sampled generation against HF."""
    from tests import sglang_cpu
    from tests.integration.engine_utils import full_logprobs, http_json, max_diff
    from hpcrl.rollout.engines import spawn_engine, wait_engine

    calls = work / f"{tag}.calls"
    log = work / f"{tag}.log"
    cfg = SimpleNamespace(engine="sglang", engine_env=sglang_cpu.engine_env(calls))
    t0 = time.perf_counter()
    eng = spawn_engine(cfg, {"random_seed": 1, **extra}, path, engine="sglang", log_path=log, cpus=[0])
    try:
        try:
            wait_engine(eng, startup_timeout_s=600)
        except Exception:  # noqa: BLE001 - what SGLang said is the result
            return {"start": "did not start", "error": last_error(log)}
        out = {"start": f"{time.perf_counter() - t0:.0f} s"}
        body = {"input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}}
        if extra.get("enable_return_routed_experts"):
            body["return_routed_experts"] = True
        status, got = http_json("POST", eng.url + "/generate", body, timeout=600)
        if status != 200:
            return {**out, "error": f"HTTP {status}: {str(got)[:160]}"}
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
        ids = got["output_ids"]
        lps = [t[0] for t in got["meta_info"]["output_token_logprobs"]]
        out["gap"] = f"{max_diff([lps], [full_logprobs(hf, PROMPT, ids)]):.2e}"
        out["experts"] = "yes" if got["meta_info"].get("routed_experts") is not None else "no"
        return out
    finally:
        eng.stop()
        out_calls = calls.read_text().strip() if calls.exists() else ""
        if out_calls:
            print(f"{tag}: sgl_kernel ops called: {out_calls[:200]}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=["qwen2", "qwen3-moe", "glm4-moe", "deepseek-v3"])
    args = p.parse_args(argv)
    from tests import sglang_cpu

    if not sglang_cpu.available():
        sys.exit("SGLang's CPU runtime is not installed: bash .ci/install --sglang")
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcrl-families-") as tmp:
        work = Path(tmp)
        for fam in args.families:
            path = work / fam
            creators()[fam](path)
            variants = [("plain", {})] + ([] if fam == "qwen2" else
                                          [("routed experts", {"enable_return_routed_experts": True})])
            for label, extra in variants:
                rows.append((fam, label, try_family(path, extra, work, f"{fam}-{label.replace(' ', '-')}")))
    print(machine_header(threads=1, precision="float32 (SGLang --dtype float32, HF fp32)"))
    print(f"# SGLang {sglang_cpu.SGLANG_VERSION} on CPU 0, one thread; 8 sampled tokens of one prompt against HF's "
          f"log-probs; {started:%Y-%m-%d %H:%M} UTC")
    print("| family | flags | start | max |SGLang - HF| log-prob | routed experts returned | error |")
    print("|---|---|---|---|---|---|")
    for fam, label, r in rows:
        print(f"| {fam} | {label} | {r.get('start', '')} | {r.get('gap', '')} | {r.get('experts', '')} | "
              f"{r.get('error', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
