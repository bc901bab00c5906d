"""The batch script's signal forwarding (issue #9 point 9), run by a real bash with real signals: the shell
survives the preemption signal, passes it on to the step, and exits with the step's own status. (On the local
Slurm cluster: ``tests/integration/test_preemption_slurm.py``.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.slurm.executor import forward_signal_lines

# The "step": counts USR2s into a file, exits 75 after the first one (like a checkpointed trainer), else 0.
STEP = """
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
got = []
signal.signal(signal.SIGUSR2, lambda *a: (got.append(1), out.write_text(str(len(got)))))
Path(sys.argv[2]).write_text("ready")
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline and not got:
    time.sleep(0.01)
time.sleep(0.2)
sys.exit(75 if got else 0)
"""


def _script(tmp_path: Path, body: list[str]) -> Path:
    (tmp_path / "step.py").write_text(STEP)
    path = tmp_path / "job.sh"
    path.write_text("\n".join(["#!/bin/bash", "set -uo pipefail", *body]) + "\n")
    return path


def _run(tmp_path: Path, body: list[str], signals: int) -> tuple[int, str, Path]:
    """Run ``body`` in bash, send it ``signals`` USR2s once the step is up; (status, output, count file)."""
    script = _script(tmp_path, body)
    ready = tmp_path / "ready"
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.01)
    for _ in range(signals):
        os.kill(proc.pid, signal.SIGUSR2)  # the batch shell only, as scancel --batch / --signal=B:USR2@N
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=30)
    return proc.returncode, out, tmp_path / "count"


def _step_command(tmp_path: Path, seconds: float) -> str:
    return f"{sys.executable} {tmp_path / 'step.py'} {tmp_path / 'count'} {tmp_path / 'ready'} {seconds}"


@pytest.mark.parametrize("signals", [1, 3])
def test_shell_survives_passes_the_signal_on_and_exits_with_the_steps_status(tmp_path, signals):
    body = forward_signal_lines(_step_command(tmp_path, 20), "USR2") + ['exit "$hpcrl_rc"']
    rc, out, count = _run(tmp_path, body, signals)
    assert rc == 75, out  # the step's status, not 128+12 (killed) or 140 (wait cut short by the trap)
    assert count.read_text() == str(signals)
    assert out.count("the batch shell got SIGUSR2") == signals


def test_without_a_signal_the_status_is_the_steps():
    out = subprocess.run(["bash", "-c", "\n".join(forward_signal_lines("(exit 3)", "USR2") + ['exit "$hpcrl_rc"'])],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 3 and out.stdout == ""


def test_plain_foreground_srun_dies_of_it(tmp_path):
    """What the scripts did before: the shell dies of USR2 while its foreground step runs (which never hears)."""
    rc, _, count = _run(tmp_path, [_step_command(tmp_path, 2)], 1)
    assert rc == -signal.SIGUSR2 and not count.exists()


def test_bad_signal_name():
    with pytest.raises(ValueError, match="USR2"):
        forward_signal_lines("srun x", "USR2; rm -rf /")
