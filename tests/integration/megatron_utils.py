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
from pathlib import Path
from types import ModuleType

import pytest
import torch

from engine_utils import load_file_module, run_ranks

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "tests" / "unit"


def unit_helpers(name: str = "test_megatron_bridge") -> ModuleType:
    """Load ``tests/unit/{name}.py`` as a module (tests/ is not a package on the torchrun worker's path:
    the repo root goes onto ``sys.path`` first, as the family modules import
    ``tests.unit.test_megatron_bridge``)."""
    return load_file_module(UNIT / f"{name}.py", f"hpcrl_tests_{name}_helpers", ROOT)


def run_two_ranks(script: str | os.PathLike, args: list[str], out: Path, timeout: float = 600,
                  nprocs: int = 2) -> list[dict]:
    """Run ``script args --out out`` on ``nprocs`` ranks (2 unless said; :func:`engine_utils.run_ranks`: forked,
    torchrun's variables, gloo on a free loopback port, one thread per rank) and return each rank's
    ``out/rank{r}.pt``, rank 0 first. Fails the test with the ranks' log tails when one exits non-zero or after
    ``timeout`` seconds."""
    run_ranks(script, args, out, nprocs, timeout)
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]


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


def model_parallel_at(tp: int = 1, pp: int = 1) -> None:
    """A worker's megatron-core model parallelism at ``tp`` x ``pp`` (data parallel: the rest), seeded 1234 as
    every worker seeds it: initialised when there is none, destroyed and initialised again when the sizes
    differ, left alone when they are these."""
    from megatron.core import parallel_state

    from hpcrl.train import parallel

    if parallel_state.model_parallel_is_initialized():
        if (tp, pp) == (parallel_state.get_tensor_model_parallel_world_size(),
                        parallel_state.get_pipeline_model_parallel_world_size()):
            return
        parallel_state.destroy_model_parallel()
    parallel.initialize_model_parallel(tp=tp, pp=pp)
    parallel.model_parallel_cuda_manual_seed(1234)


def dirs_args(dirs: dict) -> list[str]:
    """The worker's ``--dirs JSON`` arguments for ``{kind: HF folder}`` (for :func:`run_two_ranks`)."""
    return ["--dirs", json.dumps({k: str(v) for k, v in dirs.items()})]


def worker_main(worker, flag: str, help: str) -> None:
    """The ``__main__`` of a two-process megatron test file (the rank worker of :func:`run_two_ranks`):
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
