"""Shared fixtures: a tiny real model created once per test session, an offline HF environment, the local
Slurm cluster (tests/cluster/local_slurm.py) and real Lmod (tests/cluster/lmod.py)."""

from __future__ import annotations

import os
import sys

import pytest

# per-test wall/CPU records with HPCRL_TEST_TIMING=DIR (tests/timing.py); two lanes under xdist (tests/lanes.py)
pytest_plugins = ["tests.timing", "tests.lanes"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch/OpenMP thread in every process the tests start (engines, trainers, Slurm job steps inherit it): the
# suite runs in two lanes on two cores (tests/lanes.py), and a process with two OpenMP threads beside a busy
# lane thrashes (measured 2026-12-06: the quickstart's engine 0.38 -> 1.78 s a rollout step with 2 threads).
# Tests that need other counts set them; the README quickstart's fixture runs as users run it, without it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No curves.png at the end of the suite's runs (hpcrl.metrics.CURVES_ENV: matplotlib's import and the drawing,
# ~1.3-1.5 s of CPU a run, a few hundred runs); the tests of the curves set HPCRL_CURVES=1 for their runs.
os.environ.setdefault("HPCRL_CURVES", "0")
if "torch" in sys.modules:  # imported before this file (by a plugin): its thread pool may not have read it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An HF folder with a random tiny Qwen2 (~1M params) and the character tokenizer (seed 0)."""
    from hpcrl.models.tiny import create_tiny_qwen2

    return create_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)


SKIP_SLURM_ENV = "HPCRL_SKIP_SLURM_TESTS"
KEEP_SLURM_ENV = "HPCRL_KEEP_SLURM"


def pytest_collection_modifyitems(config, items):
    """Every test that uses the `slurm_cluster` fixture carries the `slurm` marker (select with -m slurm)."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)


def _skip_or_fail(ok: bool, reason: str, skip_env: str, thing: str, tests: str) -> None:
    """The policy of the fixtures for real system software: ``skip_env=1`` skips (on any machine); else, where
    ``thing`` cannot run here, the tests fail with the reason."""
    if os.environ.get(skip_env) == "1":
        why = f": {reason}" if not ok else f" ({thing} could run here)"
        pytest.skip(f"{skip_env}=1{why}")
    if not ok:
        pytest.fail(f"{tests} cannot run here: {reason}. Set {skip_env}=1 to skip them.", pytrace=False)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The real local Slurm cluster (tests/cluster/local_slurm.py), started once per session; yields its
    ClusterInfo.

    Installs the Debian packages on first use (root on Debian). Where the machine cannot run it (not root,
    no apt-get, not Debian) the tests using this fixture fail with the reason, unless HPCRL_SKIP_SLURM_TESTS=1
    is set: then they are skipped (that variable skips them on any machine). The cluster is stopped at the
    end of the session only if this session started all of its daemons; HPCRL_KEEP_SLURM=1 leaves it running.
    """
    from tests.cluster.local_slurm import ClusterError, cluster_available, start_cluster, stop_cluster

    _skip_or_fail(*cluster_available(), SKIP_SLURM_ENV, "the local cluster", "the Slurm tests")
    try:
        info = start_cluster()
    except ClusterError as e:
        pytest.fail(f"the local Slurm cluster did not start: {e}", pytrace=False)
    yield info
    # Only a cluster that this session started from nothing is stopped (a munged that is not ours is never).
    if info.started and set(info.started) == set(info.pids) and os.environ.get(KEEP_SLURM_ENV) != "1":
        stop_cluster(info.directory)


SKIP_LMOD_ENV = "HPCRL_SKIP_LMOD_TESTS"


@pytest.fixture(scope="session")
def lmod():
    """Real Lmod (tests/cluster/lmod.py): the Debian package ``lmod`` is installed on first use when missing
    (root on Debian); yields an ``Lmod`` (its bash init script, ``$LMOD_CMD``, version, ``shell(script)``).

    Same policy as `slurm_cluster`: where Lmod is missing and cannot be installed (not root, no apt-get, not
    Debian) the tests using this fixture fail with the reason, unless HPCRL_SKIP_LMOD_TESTS=1 is set: then
    they are skipped (that variable skips them on any machine). Nothing is started, so nothing is stopped.
    """
    from tests.cluster.lmod import LmodError, ensure_lmod, lmod_available

    _skip_or_fail(*lmod_available(), SKIP_LMOD_ENV, "Lmod", "the Lmod tests")
    try:
        return ensure_lmod()
    except LmodError as e:
        pytest.fail(f"Lmod could not be installed: {e}", pytrace=False)
