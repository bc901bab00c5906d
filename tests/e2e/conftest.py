"""Fixtures of the slow tier: the README's quickstart, run once per session from a fresh folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.lanes import machine

ROOT = Path(__file__).resolve().parents[2]
HPCRL = Path(sys.executable).with_name("hpcrl")


@dataclass
class QuickstartRun:
    """``hpcrl run quickstart.yaml`` in ``folder`` (a fresh copy, no cached model): exit status, wall seconds
    and output. The base model and the SFT warm start it made are in ``folder/.cache/models/``."""

    folder: Path
    returncode: int
    seconds: float
    output: str

    @property
    def base_model(self) -> Path:
        return self.folder / ".cache/models/tiny-qwen2"

    @property
    def sft_model(self) -> Path:
        return self.folder / ".cache/models/tiny-qwen2-addition-sft"


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> QuickstartRun:
    """The quickstart from a fresh folder (issue #3 point 8), the README's main command, with the machine to
    itself (tests/lanes.py): as a user runs it, its trainer and engine each take every core in their phase."""
    folder = tmp_path_factory.mktemp("quickstart")
    shutil.copy(ROOT / "configs" / "quickstart.yaml", folder / "quickstart.yaml")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("OMP_NUM_THREADS", None)  # tests/conftest.py's one thread is for the two lanes; users have none
    # a file, not a pipe: torch's shm manager keeps pipes open
    with machine(exclusive=True), open(folder / "out.log", "wb") as log:
        t0 = time.perf_counter()
        rc = subprocess.run([str(HPCRL), "run", "quickstart.yaml"], cwd=folder, env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=1800).returncode
        seconds = time.perf_counter() - t0
    return QuickstartRun(folder, rc, seconds, (folder / "out.log").read_text(errors="replace"))
