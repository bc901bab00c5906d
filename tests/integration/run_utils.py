"""Run ``hpcrl run`` as a subprocess in a test folder and read its metrics (the loop tests: test_moe_loop,
test_moe_family_loops).

Usage::

    hpcrl_run(tmp_path, '''run: {name: x, output_dir: ...}  ...''', rewards="x_rewards")
    steps = step_rows(tmp_path / "runs", "x")
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

DIGIT_REWARD = '''
def digit_fraction(args, sample):
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)
'''
"""A reward module's source: ``digit_fraction``, the fraction of the response's characters that are digits
(in [0, 1]; a signal a tiny random policy moves within a few steps)."""


def hpcrl_run(folder: Path, config: str, *overrides: str, rewards: str, log: str = "run",
              timeout: float = 600) -> str:
    """Write :data:`DIGIT_REWARD` to ``folder/{rewards}.py`` and the YAML ``config`` (dedented) to
    ``folder/{log}.yaml``, then run ``python -m hpcrl run`` on it with ``overrides`` (``key=value``) in
    ``folder``, ``folder`` on PYTHONPATH (for ``reward_function: {rewards}.digit_fraction``), one thread.
    The output is appended to ``folder/{log}.log``, a file, not a pipe (shared-memory helpers keep pipes
    open). Fails the test with the log's tail on a non-zero exit; returns the whole log."""
    folder = Path(folder)
    (folder / f"{rewards}.py").write_text(DIGIT_REWARD)
    cfg = folder / f"{log}.yaml"
    cfg.write_text(textwrap.dedent(config))
    env = dict(os.environ, PYTHONPATH=f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    path = folder / f"{log}.log"
    from tests.hpcrl_process import run_hpcrl

    rc = run_hpcrl(["run", str(cfg), *overrides], cwd=folder, env=env, log=path, timeout=timeout)
    text = path.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    return text


def trainer_ranks(launcher_pid: int) -> list:
    """The ``psutil.Process`` of each trainer rank of the local run whose launcher (``hpcrl run``) is
    ``launcher_pid``, in rank (start) order: with ``train.nprocs > 1`` the launcher forks them from its fork
    server (:func:`hpcrl.launch_local.worker_context`), its one child running ``multiprocessing.forkserver``.
    [] before the ranks are started or once they are gone."""
    import psutil

    servers = [c for c in psutil.Process(launcher_pid).children() if "forkserver" in " ".join(c.cmdline())]
    return sorted((r for s in servers for r in s.children()), key=lambda r: r.create_time())


def step_rows(output_dir: Path, name: str) -> list[dict]:
    """The training steps' rows (``step`` >= 0, in file order) of the run ``name``'s ``metrics.jsonl`` under
    ``output_dir``."""
    rows = [json.loads(x) for x in (Path(output_dir) / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] >= 0]


def assert_steps_match_the_engine(steps: list[dict], count: int, tol: float = 1e-5) -> None:
    """``count`` steps, each with the trainer's log-probs of the rollout's tokens within ``tol`` of the
    engine's (``train/train_rollout_logprob_abs_diff``: every tensor synced) and a non-zero gradient norm."""
    print([(r["step"], r["train/train_rollout_logprob_abs_diff"]) for r in steps])
    assert len(steps) == count
    assert all(r["train/train_rollout_logprob_abs_diff"] < tol for r in steps), steps
    assert all(r["train/grad_norm"] > 0 for r in steps)


def engine_log(attempt_dir: Path, index: int = 0) -> str:
    """The text of engine ``index``'s log in a run's attempt folder (``logs/attempt-N``): ``engine-{index}.log``
    then its ``engine-{index}.port-retry-K.log`` files. An engine whose port was taken between pick and bind (by
    another test's process, beside it in the other lane) is started again on another port and logs there
    (:func:`hpcrl.rollout.engines.start_engine`), so a check of what the serving engine logged reads them all."""
    logs = [attempt_dir / f"engine-{index}.log",
            *sorted(attempt_dir.glob(f"engine-{index}.port-retry-*.log"),
                    key=lambda p: int(p.stem.rsplit("-", 1)[1]))]
    return "".join(p.read_text(errors="replace") for p in logs if p.is_file())
