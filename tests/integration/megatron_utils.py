"""The shared harness of the two-process megatron tests (test_megatron_tp2, test_megatron_moe,
test_glm4_moe_parallel, test_deepseek_v3_tp2, test_megatron_mistral).

Each of those files is a pytest module and, run as a script on 2 or 4 ranks (:func:`run_two_ranks`), the
worker that writes ``rank{r}.pt`` per rank; the tests compare what the ranks computed with HF transformers. Here:
loading a tests/unit module as the helpers (``h``), launching the ranks and loading their results, and
the checks every such file makes on an export and on one optimizer step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from engine_utils import free_port, load_file_module

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "tests" / "unit"


def unit_helpers(name: str = "test_megatron_bridge") -> ModuleType:
    """Load ``tests/unit/{name}.py`` as a module (tests/ is not a package on the torchrun worker's path:
    the repo root goes onto ``sys.path`` first, as the family modules import
    ``tests.unit.test_megatron_bridge``)."""
    return load_file_module(UNIT / f"{name}.py", f"hpcrl_tests_{name}_helpers", ROOT)


def run_two_ranks(script: str | os.PathLike, args: list[str], out: Path, timeout: float = 600,
                  nprocs: int = 2) -> list[dict]:
    """Run ``script args --out out`` as ``nprocs`` ranks (2 unless said) with torchrun's variables (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: gloo on a free
    loopback port), one thread per rank, and return each rank's ``out/rank{r}.pt``, rank 0 first.

    The ranks are forked from this test process's fork server (:func:`hpcrl.launch_local.worker_context`, as
    ``hpcrl run`` starts its trainer processes): torch, megatron-core and the trainer are imported once per
    test process instead of once per rank, and no torchrun agent is started (issue #52: ~12 CPU-seconds of a
    2-rank job were imports). The script runs as ``__main__`` (:func:`runpy.run_path`), its output in
    ``out/rank{r}.log``. Fails the test with the logs' tails when a rank exits non-zero (the others are
    stopped) or after ``timeout`` seconds."""
    from multiprocessing import connection

    from hpcrl.launch_local import worker_context

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = worker_context()
    procs = [ctx.Process(target=_rank_main, args=(str(script), [*args, "--out", str(out)], r, nprocs, port,
                                                  str(out / f"rank{r}.log")), name=f"rank-{r}")
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    alive = list(procs)
    try:
        while alive and time.monotonic() < deadline:
            connection.wait([p.sentinel for p in alive], timeout=1.0)
            alive = [p for p in alive if p.exitcode is None]
            if any(p.exitcode for p in procs if p.exitcode is not None):
                break  # one failed: the others would wait for it in a collective
    finally:
        for p in procs:
            if p.exitcode is None:
                p.terminate()
            p.join()
    codes = [p.exitcode for p in procs]
    if codes != [0] * nprocs:
        tails = "\n".join(f"--- rank {r} (exit {c}):\n" + (out / f"rank{r}.log").read_text(errors="replace")[-4000:]
                          for r, c in enumerate(codes))
        pytest.fail(f"{script} failed on {nprocs} ranks (exit codes {codes}; timeout {timeout} s):\n{tails}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


def _rank_main(script: str, argv: list[str], rank: int, world_size: int, port: int, log: str) -> None:
    """One rank of :func:`run_two_ranks`: stdout and stderr to ``log``, torchrun's variables, one thread, then
    ``script`` as ``__main__`` with ``argv`` (its folder first on ``sys.path``, as ``python script`` has it)."""
    import runpy
    import warnings

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


def assert_export_bitwise(export: dict[str, torch.Tensor], hf: dict[str, torch.Tensor]) -> None:
    """A rank's HF export has exactly the checkpoint's names and every tensor bitwise equal to it."""
    assert sorted(export) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(export[name], tensor), name


def one_step(path: str | os.PathLike, train, megatron: dict, loss_fn) -> dict:
    """A worker's optimizer step as :func:`assert_step_matches` reads it: the trainer's model and optimizer from
    the HF folder ``path`` (``train`` section, ``megatron`` dict), one ``train_step`` of ``loss_fn`` on one
    micro-batch; ``step`` (its result), ``sp`` (whether the model is sequence-parallel), ``after`` (the HF export
    after the step)."""
    from hpcrl.train import bridge, model as tmodel

    ddp_model, optimizer = tmodel.setup_model_and_optimizer(path, train, megatron)
    step = tmodel.train_step(ddp_model, optimizer, loss_fn, [None])
    return dict(step=step, sp=bridge.unwrap_model(ddp_model).config.sequence_parallel,
                after=dict(bridge.export_hf_weights(ddp_model)))


def assert_step_matches(run: dict, ref_loss: float, ref_norm: float, ref_state: dict[str, torch.Tensor],
                        weights_atol: float = 1e-6) -> None:
    """One rank's optimizer step (``run``: ``step`` from ``train_step`` and the ``after`` export) against HF +
    AdamW's (``hf_train_step``): the update succeeded, same names, loss and grad norm to rel 1e-5, every
    weight after the step within ``weights_atol`` (the five worst named in the failure)."""
    assert run["step"]["update_successful"]
    assert sorted(run["after"]) == sorted(ref_state)
    diffs = {k: (run["after"][k] - ref_state[k]).abs().max().item() for k in ref_state}
    worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert run["step"]["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert run["step"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5), (run["step"], worst)
    assert max(diffs.values()) < weights_atol, worst


def helpers_fixture(name: str = "test_megatron_bridge"):
    """A module-scoped pytest fixture ``h``: :func:`unit_helpers` of ``name``, skipping the module's tests
    where megatron-core is not installed. Use as ``h = helpers_fixture(...)`` at module level."""

    @pytest.fixture(scope="module", name="h")
    def fixture():
        pytest.importorskip("megatron.core")
        return unit_helpers(name)

    return fixture


def dirs_args(dirs: dict) -> list[str]:
    """The worker's ``--dirs JSON`` arguments for ``{kind: HF folder}`` (for :func:`run_two_ranks`)."""
    return ["--dirs", json.dumps({k: str(v) for k, v in dirs.items()})]


def worker_main(worker, flag: str, help: str) -> None:
    """The ``__main__`` of a two-process megatron test file (the torchrun worker of :func:`run_two_ranks`):
    parse ``flag`` (``--path``: one HF folder, passed on as is; ``--dirs``: JSON ``{kind: HF folder}``,
    passed on as a dict; ``help`` says which) and ``--out DIR``, then call ``worker(folders, out)``. Raises
    ValueError for another flag."""
    import argparse

    if flag not in ("--path", "--dirs"):
        raise ValueError(f"flag {flag!r} is not a worker flag (--path or --dirs)")
    parser = argparse.ArgumentParser(description=worker.__doc__)
    parser.add_argument(flag, required=True, help=help)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    folders = args.path if flag == "--path" else json.loads(args.dirs)
    worker(folders, args.out)
