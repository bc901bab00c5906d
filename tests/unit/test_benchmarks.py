"""Every benchmark says which machine its figures belong to (issue #9 point 3): each script in benchmarks/
calls ``benchmarks/machine.py``'s ``machine_header`` (printed as the first line of its table), and that line
names the CPU model, its vector extensions (AVX2 / AVX-512 / AMX), the threads and the torch version.

The scripts are read with ``ast``, not run: most need minutes, an engine or the local Slurm cluster.
"""

from __future__ import annotations

import ast
import importlib.util
import mmap
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MiB = 2**20
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name not in ("machine.py", "__init__.py"))


def _benchmark(name: str):
    """``benchmarks/<name>.py`` loaded as a module (``benchmarks/`` on ``sys.path`` for its own imports:
    machine, algorithms, vs_trl)."""
    import sys

    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"hpcrl_benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _machine():
    return _benchmark("machine")


def _header_calls(tree: ast.AST) -> list[ast.Call]:
    def name(func: ast.expr) -> str:
        return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""

    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and name(n.func) == "machine_header"]


def test_the_benchmarks_are_all_checked():
    # vs_trl.py included: its header call comes from a parallel branch (issue #9), this test covers it too
    assert {"engine_throughput.py", "memory.py", "preemption.py", "profile_actor.py", "slurm_overhead.py",
            "vs_trl.py", "weight_sync.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_prints_the_machine_header(script):
    tree = ast.parse((BENCHMARKS / script).read_text(), filename=script)
    calls = _header_calls(tree)
    assert calls, f"benchmarks/{script} does not call machine_header (benchmarks/machine.py)"
    # the header must state the threads the measured processes use, not this process's default
    assert any(any(k.arg == "threads" for k in c.keywords) for c in calls), \
        f"benchmarks/{script}: machine_header(threads=...) missing"


def test_header_names_cpu_vector_extensions_threads_and_torch():
    m = _machine()
    line = m.machine_header(threads=3, precision="float32")
    assert line.startswith("# ") and "\n" not in line
    assert m.cpu_model() in line
    ext = m.vector_extensions()
    assert all(e in line for e in ext)
    assert "3 thread(s)" in line and f"torch {torch.__version__}" in line and "precision float32" in line
    assert f"{torch.get_num_threads()} thread(s)" in m.machine_header()  # default: this process's threads


def test_header_names_the_kernels_torch_uses():
    """A run with torch's kernels restricted (``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 CPU, to try AVX2
    numerics) says so: the CPU's flags alone would claim AVX-512."""
    import os
    import subprocess
    import sys

    code = (f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import machine; "
            "print(machine.machine_header())")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    line = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert line.endswith("torch kernels DEFAULT"), line
    assert f"torch kernels {torch.backends.cpu.get_cpu_capability()}" in _machine().machine_header()


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
model name\t: {model}
flags\t\t: fpu sse sse2 {flags}

processor\t: 1
model name\t: {model}
flags\t\t: fpu sse sse2 {flags}
"""


@pytest.mark.parametrize("model, flags, ext, bf16", [
    ("AMD EPYC 7B13 64-Core Processor", "avx avx2 fma", ["avx2"], "emulated"),
    ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "avx2 avx512f avx512_bf16 amx_bf16 amx_tile",
     ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"], "native"),
    ("Some CPU", "sse4_2", [], "emulated"),
])
def test_header_tells_avx2_only_from_avx512_amx(tmp_path, monkeypatch, model, flags, ext, bf16):
    m = _machine()
    (tmp_path / "cpuinfo").write_text(CPUINFO.format(vendor="x", model=model, flags=flags))
    monkeypatch.setattr(m, "Path", lambda _: tmp_path / "cpuinfo")
    assert m.cpu_model() == model and m.vector_extensions() == ext
    line = m.machine_header(threads=1)
    assert f"CPU {model}" in line and f"bf16 {bf16}" in line and "1 thread(s)" in line
    assert ("vector " + "/".join(ext)) in line if ext else "vector none of avx2" in line


def _touched_mapping(nbytes: int) -> mmap.mmap:
    """``nbytes`` of a fresh anonymous mapping, every page written: resident until closed, then unmapped.
    The tracker's test allocates this way rather than with torch, whose buffers come from the C library's
    allocator: where that allocator keeps freed memory (a library that turned its mmap threshold off, or
    fragmentation in a long test process), a new tensor reuses pages already resident and the RSS does not
    move - as in two CI runs (2026-11-25 and -26) where every phase read the same 1.56 GB."""
    m = mmap.mmap(-1, nbytes)
    page = b"\1" * mmap.PAGESIZE
    for offset in range(0, nbytes, mmap.PAGESIZE):
        m[offset:offset + mmap.PAGESIZE] = page
    return m


def _rss_lines() -> str:
    lines = Path("/proc/self/status").read_text().splitlines()
    return " ".join(line.split(":")[0] + "=" + line.split()[1] for line in lines
                    if line.startswith(("VmHWM", "VmRSS", "RssAnon", "RssFile")))


@pytest.mark.parametrize("method", ["auto", "sampled", "auto-reset-ignored"])
def test_memory_phase_peaks_charge_each_allocation_to_its_phase(method, monkeypatch):
    """benchmarks/memory.py's tracker: a phase's figure is the process's peak RSS during that phase, so a
    256 MiB buffer held only inside ``big`` shows there and not in the phase after it - with the kernel's
    high-water mark where a reset takes (``auto`` on most kernels) and with sampled RSS (every kernel; ``auto``
    falls back to it where the reset is ignored, as on one CI kernel whose mark stayed at the run's peak)."""
    memory = _benchmark("memory")
    if method == "auto-reset-ignored":  # a kernel that takes the clear_refs write and keeps the mark
        monkeypatch.setattr(memory, "_reset_hwm", lambda: None)
        method = "auto"
        assert not memory._hwm_reset_works()
    # Raise this process's lifetime mark well above what follows: a tracker that does not reset it shows the
    # same figure for every phase.
    _touched_mapping(640 * MiB).close()
    phases = memory.PhasePeaks("small", method=method)
    assert phases.method in (("VmHWM", "sampled") if method == "auto" else ("sampled",))
    phases.enter("big")
    buf = _touched_mapping(256 * MiB)
    time.sleep(0.05)  # a sampled tracker reads RSS every 1 ms
    during = _rss_lines()
    buf.close()
    phases.enter("after")
    phases.enter("end")
    small, big, after = (phases.peaks[k] for k in ("small", "big", "after"))
    why = (phases.method, small, big, after, "in big: " + during, "now: " + _rss_lines())
    assert big - small >= 200 * MiB, why
    assert big - after >= 200 * MiB, why
    with pytest.raises(ValueError, match="method='hwm'"):
        memory.PhasePeaks("x", method="hwm")


def _async_modes():
    return _benchmark("async_modes")


def test_async_modes_summary_from_metrics_rows():
    """benchmarks/async_modes.py's numbers from a run's metrics rows, against hand computations: eval seconds
    are not step time, short groups are not trained samples, the sync trainer waits for the whole rollout."""
    m = _async_modes()
    rows = [{"step": -1, "time": 100.0, "eval/accuracy": 0.1},
            {"step": 0, "time": 104.0, "timing/step_seconds": 4.0, "rollout/seconds": 3.0,
             "rollout/groups_short": 0, "rollout/lag_mean": 0.0, "rollout/lag_max": 0,
             "rollout/response_length": 10.0},
            {"step": 1, "time": 106.0, "timing/step_seconds": 2.0, "rollout/seconds": 1.0,
             "rollout/groups_short": 2, "rollout/lag_mean": 0.5, "rollout/lag_max": 1,
             "rollout/response_length": 20.0},
            {"step": 2, "time": 112.0, "timing/step_seconds": 6.0, "eval/seconds": 2.0,
             "rollout/seconds": 1.0,
             "rollout/groups_short": 1, "rollout/lag_mean": 1.0, "rollout/lag_max": 2,
             "rollout/response_length": 30.0, "eval/accuracy": 0.4}]
    out = m.summarize(rows, batch_size=8, group_size=4, warmup=1)
    assert out["steps"] == 3 and out["timed"] == 2
    assert out["samples_s"] == pytest.approx((6 * 4 + 7 * 4) / (2.0 + 4.0))
    assert out["idle"] == pytest.approx((1.0 + 1.0) / 6.0)  # no rollout_wait: the sync trainer's rollout
    assert out["stale_mean"] == pytest.approx(0.75) and out["stale_max"] == 2
    assert out["acc0"] == 0.1 and out["acc1"] == 0.4 and out["wall_s"] == 12.0
    assert out["acc_per_min"] == pytest.approx(0.4 / (12.0 / 60))
    assert out["len_trained"] == (25.0, 30.0) and out["len_sampled"] is None
    rows[2]["timing/rollout_wait_seconds"], rows[3]["timing/rollout_wait_seconds"] = 0.5, 0.0
    rows[2]["rollout/staleness_mean"], rows[2]["rollout/staleness_max"] = 1.5, 3
    out = m.summarize(rows, batch_size=8, group_size=4, warmup=1)
    assert out["idle"] == pytest.approx(0.5 / 6.0)  # async: only the wait at the boundary
    assert out["stale_mean"] == 1.5 and out["stale_max"] == 3  # token-level staleness wins over the lag
    runs = m.runs_of(["sync", "fully_async"], ["keep", "drop"])
    fa, tis = ["run.mode=fully_async"], ["algorithm.use_tis=true"]
    assert runs == [("sync", "sync", ["run.mode=sync"]),
                    ("fully_async-keep", "fully_async-keep", [*fa, "rollout.stale_policy=keep", *tis]),
                    ("fully_async-drop", "fully_async-drop", [*fa, "rollout.stale_policy=drop", *tis])]
    lines = m.table([("sync", out), ("async", {"error": 1})])
    assert "failed (1)" in lines[2] and "8.7" in lines[2]


def test_every_algorithm_row_is_a_valid_quickstart_config(tmp_path, monkeypatch):
    """benchmarks/algorithms.py's overrides of configs/quickstart.yaml pass ``hpcrl validate``'s checks (the
    rows the lead runs for an hour each must not fail at start)."""
    from hpcrl.validate import load_and_check

    rows = _benchmark("algorithms").algorithms(0.6)
    assert {"grpo", "rloo", "ppo"} <= set(rows)
    monkeypatch.chdir(tmp_path)  # the quickstart's relative model folders, created on first use: none here
    for name, overrides in rows.items():
        cfg = load_and_check(BENCHMARKS.parent / "configs" / "quickstart.yaml", overrides)
        assert cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt == 64, name
    assert load_and_check(BENCHMARKS.parent / "configs" / "quickstart.yaml",
                          rows["ppo"]).algorithm.advantage_estimator == "gae"


def test_vs_trl_lora_and_lr_side_options():
    """benchmarks/vs_trl.py's ``lora=R`` and ``lr=X`` side options (issue #56 point 5: LoRA against TRL + PEFT):
    both sides get the same adapters (rank R, alpha 2R, every PEFT module), bad values are refused."""
    from hpcrl.names import PEFT_TARGETS

    m = _benchmark("vs_trl")
    side = m.parse_side("hpcrl:lora=8,lr=3e-4,name=lora8")
    assert side["lora"] == 8 and side["lr"] == 3e-4 and side["label"] == "lora8"
    assert m.parse_side("trl:lora=16")["lora"] == 16 and "lr" not in m.parse_side("trl:lora=16")
    for bad in ("hpcrl:lora=0", "trl:lora=x", "trl:lr=-1", "hpcrl:lr=fast"):
        with pytest.raises(SystemExit, match="bad option"):
            m.parse_side(bad)
    section = m.lora_section(8)
    assert (section.rank, section.alpha, section.dropout) == (8, 16.0, 0.0)
    assert section.target_modules == list(PEFT_TARGETS)
