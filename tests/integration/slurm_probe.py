"""Stand-in bootstraps for the Slurm submit tests (``HPCRL_SLURM_BOOTSTRAP=tests.integration.slurm_probe.X``).

They run inside real Slurm jobs in place of the RL loop: each records what the job step saw (Slurm variables,
host, task) in the run folder, makes ``logs/attempt-N`` like the loop does, and returns.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path


def _record(run_dir: Path) -> int:
    from hpcrl.run_setup import new_attempt_dir

    attempt = new_attempt_dir(run_dir) if os.environ.get("SLURM_PROCID", "0") == "0" else None
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("SLURM_", "HPCRL_", "SUBMITIT_")) or k == "CUDA_VISIBLE_DEVICES"}
    name = f"probe-{os.environ.get('SLURM_PROCID', '0')}-{os.environ.get('SLURM_RESTART_COUNT', '0')}.json"
    (run_dir / name).write_text(json.dumps({"host": socket.gethostname(), "env": env,
                                            "attempt": attempt.name if attempt else None}))
    if attempt is not None:
        (attempt / "probe.log").write_text(f"probe in {attempt.name}\n")
    return 0


def record(cfg, run_dir: Path) -> int:
    """Record the job step's environment and return at once."""
    return _record(run_dir)


def sleep_first_attempt(cfg, run_dir: Path) -> int:
    """Record, then sleep (up to 120 s) in the first attempt so the test can preempt it; return later ones."""
    _record(run_dir)
    if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        (run_dir / "sleeping").write_text("1")
        time.sleep(120)
    return 0
