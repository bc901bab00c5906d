"""Real SGLang on a CPU-only machine, for hpcrl's SGLang tier (issue #53): how it is installed and run.

Test infrastructure, like the local Slurm cluster (``tests/cluster``): every workaround SGLang needs on a machine
without a GPU is here, each with its reason, and nowhere in ``hpcrl/``. Facts behind them: ``sglang-on-cpu.md``
in the project's shared reference notes (measured on 2-core AMD EPYCs, AVX-512 and AVX2-only, no AMX).

**Which SGLang.** 0.5.23, the wheel ``.ci/install`` already puts into ``.venv`` (``--no-deps``) for the
conformance tests of SGLang's request schema: the newest release, and it keeps the weight-update session
(``/begin_weight_update`` ... ``/end_weight_update``, first in 0.5.21). It declares torch 2.14.1; it serves
on the project's torch 2.13.0 (and transformers 5.25) without a difference seen.

**Where its runtime lives.** SGLang's declared dependencies pull flashinfer, sglang-kernel, cuda-python,
nvidia-* and more, none of which runs on a CPU. What the server imports on CPU is installed with ``--no-deps``
into a prefix of its own, :data:`PREFIX` (``.venv/sglang-cpu``), which only the SGLang server processes get on
their ``PYTHONPATH`` (:func:`engine_env`; hpcrl passes it through ``rollout.engine_env``). So triton and the
CUDA build of torchvision, which the trainer must not see (torch's compiler stack and transformers probe for
them), stay out of hpcrl's own processes. Install: ``python tests/sglang_cpu/__init__.py install`` (what
``bash .ci/install --sglang`` runs; ~1.2 GB, a few seconds from uv's cache, ~1-2 min from nothing).

The workarounds, each with its reason:

1. ``SGLANG_USE_CPU_ENGINE=1`` in the server's environment: without it ``--device cpu`` fails with
   ``No module named 'vllm'``. (hpcrl sets it itself for a CPU launch: :func:`hpcrl.rollout.engines.engine_env`.)
2. ``triton==3.9.0`` (``--no-deps``): SGLang imports it at module level everywhere; on CPU no Triton kernel is
   ever launched. A fake ``triton`` module fails: torch's inductor introspects the real one.
3. ``torchvision==0.28.0`` (``--no-deps``; transformers' image utilities, which SGLang imports, need it): PyPI
   has only its CUDA build, whose import dies with ``operator torchvision::nms does not exist`` at the two
   ``@torch.library.register_fake("torchvision::nms"/"qnms")`` lines of ``torchvision/_meta_registrations.py``.
   :func:`patch_torchvision` makes those two registrations conditional on ``torchvision.extension._has_ops()``.
4. ``sgl_kernel``: PyPI's wheels are CUDA-only. SGLang's CPU path imports ``*_cpu`` ops at module level; the
   stand-in package :data:`STUB` (its docstring says what it does) raises on every call and records it in
   ``$HPCRL_SGL_KERNEL_CALLS``; the tier asserts nothing was called.
5. The packages SGLang's server imports on CPU, found by importing ``sglang.srt.entrypoints.http_server`` until
   it succeeded: :data:`RUNTIME_PACKAGES`.
6. ``sitecustomize`` in :data:`STUB`: SGLang's LoRA code allocates pinned host memory, which torch refuses without
   an accelerator (an engine started with ``--enable-lora`` dies); pinning becomes a no-op in the servers (the
   module's docstring says how). With it SGLang serves LoRA adapters on a CPU with its ``torch_native`` backend
   (hpcrl chooses it on a CPU: :func:`hpcrl.rollout.engines.sglang_cpu_args`).

Launch flags (hpcrl builds them for ``rollout.engine: sglang`` on a machine without CUDA:
:func:`hpcrl.rollout.engines.engine_command`): ``--device cpu``, ``--dtype float32`` (``auto`` loads an fp32
checkpoint as fp16: log-probs then 1.5e-4 off HF fp32), ``--max-total-tokens`` (without it the KV pool takes
~0.72 of free RAM, ~15 GB here) and one torch thread per server (two on shared cores: 10-35x slower).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ROOT / ".venv" / "sglang-cpu"
"""Where SGLang's CPU runtime is installed (``--target``): on the SGLang servers' ``PYTHONPATH`` only."""
STUB = Path(__file__).resolve().parent / "stub"
"""The folder holding the ``sgl_kernel`` stand-in package and the servers' ``sitecustomize`` (workaround 6), on the
servers' ``PYTHONPATH`` after :data:`PREFIX`."""
SGLANG_VERSION = "0.5.23"
RUNTIME_PACKAGES = (
    # the server's own imports
    "uvloop==0.23.0", "pyzmq==27.3.0", "pybase64==1.5.1", "sentencepiece==0.2.3", "prometheus-client==0.26.0",
    "partial-json-parser==0.2.1.1.post7", "interegular==0.3.3", "python-multipart==0.0.34", "scipy==1.17.1",
    "compressed-tensors==0.20.1", "loguru==0.7.3", "xgrammar==0.2.9", "apache-tvm-ffi==0.1.15.post2",
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
    "soundfile==0.14.0", "cffi==2.1.1", "pycparser==3.12", "dill==0.4.1",
    # IPython (imported by SGLang's utilities) and what it imports
    "ipython==9.19.1", "traitlets==5.16.1", "pygments==2.21.0", "prompt-toolkit==3.0.53", "jedi==0.20.1",
    "parso==0.8.7", "decorator==5.3.2", "matplotlib-inline==0.2.2", "stack-data==0.6.3", "executing==2.3.0",
    "asttokens==3.0.2", "pure-eval==0.2.4", "wcwidth==0.9.5", "pexpect==4.9.0", "ptyprocess==0.7.0",
    "ipython-pygments-lexers==1.1.1",
    # workarounds 2 and 3 of the module docstring
    "triton==3.9.0", "torchvision==0.28.0",
)
"""Installed with ``--no-deps`` into :data:`PREFIX` (pinned: the set that was measured to serve)."""
MARKER = PREFIX / ".installed"
_NMS_LINE = re.compile(r'^@torch\.library\.register_fake\("torchvision::(nms|qnms)"\)$', re.M)


def patch_torchvision(prefix: Path = PREFIX) -> int:
    """Workaround 3: guard the two ``register_fake`` lines of torchvision's ``_meta_registrations.py`` in
    ``prefix`` by ``torchvision.extension._has_ops()``. Returns how many lines it changed (0 when done already).
    Raises FileNotFoundError when torchvision is not installed there."""
    path = prefix / "torchvision" / "_meta_registrations.py"
    text = path.read_text()
    new, n = _NMS_LINE.subn(r'@(torch.library.register_fake("torchvision::\1") '
                            r'if torchvision.extension._has_ops() else (lambda f: f))', text)
    if n:
        path.write_text(new)
    return n


def install(prefix: Path = PREFIX, python: str = sys.executable) -> None:
    """Install SGLang's CPU runtime into ``prefix`` (uv, ``--no-deps``), patch torchvision, and check that the
    server's entry module imports with :func:`engine_env`. Idempotent (a marker file keeps the package list).
    Raises CalledProcessError when uv or the import check fails."""
    wanted = "\n".join(RUNTIME_PACKAGES)
    if not (MARKER.exists() and MARKER.read_text() == wanted):
        if prefix.exists():
            shutil.rmtree(prefix)
        uv = Path(python).with_name("uv")
        subprocess.run([str(uv), "pip", "install", "-q", "--python", python, "--target", str(prefix), "--no-deps",
                        *RUNTIME_PACKAGES], check=True)
        patch_torchvision(prefix)
        check(python)
        MARKER.write_text(wanted)


def check(python: str = sys.executable) -> None:
    """Import SGLang's HTTP server module as a server process would (:func:`engine_env`). Raises
    CalledProcessError with its output when it fails."""
    out = subprocess.run([python, "-c", "import sglang.srt.entrypoints.http_server"],
                         env=dict(os.environ, **engine_env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-3000:])  # the import error: a package RUNTIME_PACKAGES lacks, most often
        out.check_returncode()


def available() -> bool:
    """Whether :func:`install` has run here (SGLang's CPU runtime is in :data:`PREFIX`)."""
    return MARKER.exists()


def engine_env(calls_file: str | os.PathLike | None = None) -> dict[str, str]:
    """What an SGLang server process needs in its environment on this machine: :data:`PREFIX` and :data:`STUB`
    on ``PYTHONPATH`` (ahead of the inherited one), ``SGLANG_USE_CPU_ENGINE=1``, and ``calls_file`` as
    ``HPCRL_SGL_KERNEL_CALLS`` (where the ``sgl_kernel`` stand-in records a call)."""
    path = os.pathsep.join(p for p in (str(PREFIX), str(STUB), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "SGLANG_USE_CPU_ENGINE": "1"}
    if calls_file is not None:
        env["HPCRL_SGL_KERNEL_CALLS"] = str(calls_file)
    return env


if __name__ == "__main__":
    if sys.argv[1:] == ["env"]:  # for `hpcrl run ... rollout.engine=sglang "rollout.engine_env=$(...)"`
        import json

        print(json.dumps(engine_env(), separators=(",", ":")))
        sys.exit(0)
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python tests/sglang_cpu/__init__.py install | env")
    install()
    print(f"SGLang {SGLANG_VERSION}'s CPU runtime installed in {PREFIX}")
