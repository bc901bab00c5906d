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
    """The quickstart from a fresh folder (issue #3 point 8), the README's main command, in its lane with one
    torch thread a process like every process of the suite (tests/conftest.py): a user's run gives the trainer
    and the engine every core in their phase, which on 2 cores made its GRPO steps 7% faster and its SFT steps
    no faster (0.681 against 0.733 s, ~0.57 against 0.553 s), and beside the other lane it thrashes."""
    folder = tmp_path_factory.mktemp("quickstart")
    shutil.copy(ROOT / "configs" / "quickstart.yaml", folder / "quickstart.yaml")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HPCRL_CURVES="1")  # as users run it: with its curves.png (the suite's other runs skip it)
    # a file, not a pipe: torch's shm manager keeps pipes open
    with open(folder / "out.log", "wb") as log:
        t0 = time.perf_counter()
        rc = subprocess.run([str(HPCRL), "run", "quickstart.yaml"], cwd=folder, env=env, stdout=log,
                            stderr=subprocess.STDOUT, timeout=1800).returncode
        seconds = time.perf_counter() - t0
    return QuickstartRun(folder, rc, seconds, (folder / "out.log").read_text(errors="replace"))
