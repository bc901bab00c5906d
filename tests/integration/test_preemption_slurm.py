"""Preemption on the real local Slurm cluster (issue #5 point 4): a run submitted with ``hpcrl submit`` is
interrupted five ways - preempted by a job in the higher-priority ``urgent`` partition, ``scancel --signal=USR2``,
its time limit (with requeue), ``scontrol requeue`` and SIGKILL of the trainer step - and each time it resumes
from its run folder and completes. The first four are checked for exactness against an uninterrupted local run
of the same config (bitwise-equal weights, the same samples trained in the same steps, each once): Slurm's
signal, the checkpoint and the requeue lose nothing. The time-limit run is longer and checked for "every step
once, every group once". The SIGKILL run trains LoRA adapters (issue #56 point 4) and is checked against an
uninterrupted LoRA run.

Issue #9 point 9: the signal sent to the whole job (``scancel --signal=USR2 --full``), to the batch shell only
(``--batch``), and a user's own sbatch script with ``--signal=B:USR2@N`` (preempted, so Slurm sends it now) each
checkpoint, requeue and resume exactly; before the signal, no process of the job (batch shell, srun, trainer,
router, engine, checkpoint-writer children) would die of it, and after it no step of the job ended by it.

**Batched** (issue #52): the variants that need no other job on their node (USR2, ``scontrol requeue``, SIGKILL
of the trainer step, PPO's critic, the time limit, USR2 to the whole job and to the batch shell) are submitted
at once by the module's ``batch`` fixture, each driven by its own thread in a folder of its own, and each test
reports its variant; most of their time is waiting (for steps, signals, requeues and Slurm's scheduler), which
they now do together. The two preemptions by the ``urgent`` partition, which take a whole node, run after
them one at a time.

The run is the deterministic over-sampling config of ``test_preemption_local.py`` (12 groups submitted for 4,
nonzero-std filter: the data buffer holds finished and aborted groups across the restart). The reference runs
with the job's torch threads (``THREADS``): on some CPUs (AVX2-only) 1 and 2 threads give different floats.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

from hpcrl.slurm.state import FINAL_STATES, query_states
from tests.integration.test_lora_run import LORA
from tests.integration.test_loop import REWARD_MODULE
from tests.integration.test_preemption_local import (STEPS, _cmdline, descendants, finish, full_cmdline,
                                                     start, steps_done, trained, weights, write_config)

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.timeout(900)]

HPCRL = Path(sys.executable).with_name("hpcrl")
THREADS = 1
"""Torch threads of the job's trainer and engine (``OMP_NUM_THREADS``, with ``SLURM_CPUS_PER_TASK`` of as many
CPUs), and of the local reference run: bitwise comparisons need the same thread counts on both sides. One: the
suite runs in two lanes on two cores (tests/lanes.py), where a 2-thread process beside a busy lane thrashes."""
NODE_CPUS = 2
"""CPUs of a fake node (tests/cluster/local_slurm.py): an ``urgent`` job asking for all of them must preempt the
run's job on that node."""
SLURM = [f"slurm.cpus_per_task={THREADS}", "slurm.time=00:10:00", "slurm.signal=USR2@60", "slurm.requeue=true"]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, tuple]:
    """The uninterrupted runs, locally (``hpcrl run``) with the job's threads, both at once: ``"base"``, the
    config as written, and ``"lora"``, with LoRA adapters (:data:`LORA`, issue #56 point 4: a LoRA run resumes
    exactly under Slurm's requeue too); each its exported weights and trained-sample rows."""
    folders = {key: tmp_path_factory.mktemp(f"slurm-preempt-ref-{key}") for key in ("base", "lora")}
    procs = {"base": start(folders["base"], "ref", threads=THREADS),
             "lora": start(folders["lora"], "ref", *LORA, threads=THREADS)}
    out = {}
    for key, proc in procs.items():
        assert finish(proc) == 0, (folders[key] / "ref.log").read_text()[-3000:]
        out[key] = weights(folders[key], "ref"), trained(folders[key], "ref")
    return out


@pytest.fixture(scope="module")
def reference(references) -> tuple:
    """The uninterrupted run of the config as written (:func:`references`)."""
    return references["base"]


def cancel_jobs_of(*folders: Path) -> None:
    """Cancel every job still queued or running from one of ``folders`` (a failed test leaves none behind)."""
    queued = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True, timeout=30).stdout
    left = [line.split()[0] for line in queued.splitlines() if line.split()[1:2] in [[str(f)] for f in folders]]
    if left:
        subprocess.run(["scancel", *left], timeout=30)


@pytest.fixture
def work(tmp_path, monkeypatch, slurm_cluster):
    """Submit directory with the run config and the reward module (jobs get :func:`job_env`)."""
    write_config(tmp_path)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    cancel_jobs_of(tmp_path)


Variant = Callable[[Path, tuple], None]
BATCH: dict[str, Variant] = {}
"""The variants the ``batch`` fixture runs together: name -> ``drive(work, reference)``, which submits the run
from ``work``, interrupts it and checks the result (raising on a failed check)."""


def batched(drive: Variant) -> Variant:
    """Register ``drive`` as a variant of the batch, under its name."""
    BATCH[drive.__name__] = drive
    return drive


WITH_LORA = {"killed"}
"""Variants whose run has LoRA adapters (:data:`LORA`), checked against the LoRA reference run."""


@pytest.fixture(scope="module")
def batch(tmp_path_factory, slurm_cluster, references) -> dict[str, Optional[BaseException]]:
    """Every variant of :data:`BATCH` at once, each in a thread and a folder of its own (the cluster queues
    what does not fit its CPUs); name -> what its drive raised (None: it passed)."""
    folders = {name: write_config(tmp_path_factory.mktemp(f"slurm-{name}")).parent for name in BATCH}

    def drive(name: str) -> Optional[BaseException]:
        try:
            BATCH[name](folders[name], references["lora" if name in WITH_LORA else "base"])
            return None
        except BaseException as e:  # noqa: BLE001 - pytest's failures too: the variant's test raises it
            return e

    try:
        with ThreadPoolExecutor(len(BATCH)) as pool:
            return dict(zip(BATCH, pool.map(drive, BATCH)))
    finally:
        cancel_jobs_of(*folders.values())


def report(batch: dict[str, Optional[BaseException]], name: str) -> None:
    """The variant's own outcome: what its drive raised, raised here."""
    if batch[name] is not None:
        raise batch[name]


def job_env(work: Path) -> dict[str, str]:
    """What a job of ``work`` inherits from ``hpcrl submit``: ``work`` on PYTHONPATH (its reward module) and
    :data:`THREADS` threads (the reference run's)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS=str(THREADS))


def submit(work: Path, name: str, *overrides: str) -> tuple[str, Path]:
    out = subprocess.run([str(HPCRL), "submit", "run.yaml", f"run.name={name}", *SLURM, *overrides], cwd=work,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                         env=job_env(work))
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()  # "submitted job ID (launcher): RUN_DIR"
    return words[words.index("job") + 1], Path(words[words.index("job") + 3])


def job_log(run_dir: Path, tail: int = 3000) -> str:
    """The task logs of every attempt (Slurm appends on requeue), the last ``tail`` characters of each."""
    logs = sorted((run_dir / "submitit").glob("*_log.*")) + sorted((run_dir / "logs").glob("slurm-*.out"))
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in logs)


def wait_steps(job_id: str, run_dir: Path, n: int, timeout: float = 300, queued_s: float = 1800) -> None:
    """Wait until the job's run logged ``n`` steps: ``timeout`` seconds from when the job last left the queue
    (PENDING), and at most ``queued_s`` in the queue. The batch's variants share the cluster's CPUs, so Slurm
    runs some after others: a variant's job was seen pending 300 s behind the others before it started (CI of
    e7bdf9a), and the run's own start and 2 steps then take ~30-60 s on a loaded 2-core machine."""
    start = time.monotonic()
    deadline = start + timeout
    while steps_done(run_dir) < n:
        state = query_states([job_id])[job_id]
        assert state not in FINAL_STATES, job_log(run_dir)
        if state == "PENDING":
            deadline = time.monotonic() + timeout
            assert time.monotonic() - start < queued_s, f"job {job_id} still pending after {queued_s} s"
        assert time.monotonic() < deadline, f"no {n} steps in {timeout} s of running\n{job_log(run_dir)}"
        time.sleep(0.2)


def wait_final(job_id: str, run_dir: Path, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while (state := query_states([job_id])[job_id]) not in FINAL_STATES:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=30)
            pytest.fail(f"job {job_id} still {state} after {timeout} s\n{job_log(run_dir)}")
        time.sleep(0.5)
    return state


def attempts(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "logs").glob("attempt-*"))


def node_of(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


SLOW_REWARD_MODULE = REWARD_MODULE + '''
import os
import time
_fast = digit_fraction
def digit_fraction(args, sample):
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) < ATTEMPTS and not (UNTIL and os.path.exists(UNTIL)):
        time.sleep(SECONDS)  # a floor under each step's time, whatever the CPU
    return _fast(args, sample)
'''
SENT = "signal-sent"
"""The file (in the test's folder) a test writes once its signal or requeue was sent: :func:`slow_steps` with
``until_sent`` ends the floor there."""


def slow_steps(work: Path, seconds_per_sample: float = 0.03, attempts: int = 1000,
               until_sent: bool = False) -> None:
    """Put a floor under each step's time (a reward that sleeps ``seconds_per_sample`` per sample, ~1.5 s a
    step at the default; the values are the same, so the reference still holds) in the job's first
    ``attempts`` attempts (``SLURM_RESTART_COUNT``): preemption by the ``urgent`` partition waits for Slurm's
    scheduler, and at full speed the 8-step run could finish before the signal came; a time-limit run must
    outlast its first allocation on a fast CPU too, and may finish at full speed. ``until_sent``: the floor
    ends once :func:`signal_sent` wrote ``work/signal-sent`` (the steps after the signal run at full speed)."""
    until = str(work / SENT) if until_sent else None
    (work / "loop_rewards.py").write_text(SLOW_REWARD_MODULE.replace("SECONDS", repr(seconds_per_sample))
                                          .replace("ATTEMPTS", str(int(attempts))).replace("UNTIL", repr(until)))


def signal_sent(work: Path) -> None:
    """Tell the job's reward (:func:`slow_steps` with ``until_sent``) that the test's signal or requeue went out."""
    (work / SENT).write_text("")


SIGNAL_FLOOR_S = 0.1
"""Seconds per sample of the first attempt's floor until the signal is sent (~4.8 s a step of 48 samples): a
variant that acts after step 2 or 3 must find the job still running. At full speed the 8-step run did its last
6 steps in 13 s on a loaded machine (CI of e7bdf9a), while the test, one of eight threads, polls, reads the
job's processes and calls scancel; the critic variant's run once ended before its USR2 came (CI of 38d7799).
With the floor the test has ~6 x 4.8 s, and the run goes at full speed once the signal is out."""


def check_exact(work: Path, name: str, reference) -> None:
    ref_weights, ref_rows = reference
    rows = trained(work, name)
    np.testing.assert_array_equal(rows, ref_rows)  # the same samples, in the same steps, each once
    got = weights(work, name)
    assert all(got[k].equal(ref_weights[k]) for k in ref_weights), "the resumed run diverged"


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"step": -1' not in line]


def finish_and_check(work: Path, job_id: str, run_dir: Path, reference, min_attempts: int = 2) -> None:
    assert wait_final(job_id, run_dir) == "COMPLETED", job_log(run_dir)
    assert len(attempts(run_dir)) >= min_attempts, (attempts(run_dir), job_log(run_dir))
    assert metric_steps(run_dir) == list(range(STEPS))  # one metrics line per step, none repeated
    check_exact(work, run_dir.name, reference)


@batched
def usr2(work: Path, reference) -> None:
    slow_steps(work, SIGNAL_FLOOR_S, attempts=1, until_sent=True)
    job_id, run_dir = submit(work, "usr2")
    wait_steps(job_id, run_dir, 2)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    signal_sent(work)
    finish_and_check(work, job_id, run_dir, reference)
    log = job_log(run_dir, tail=10**6)
    assert "(signal)" in log and "requeueing job" in log


def test_preempted_by_urgent_partition_resumes_exactly(work, reference):
    slow_steps(work)
    job_id, run_dir = submit(work, "preempted")
    wait_steps(job_id, run_dir, 2)
    node = node_of(job_id)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", node, "-c", str(NODE_CPUS), "-t", "1",
                             "-o", str(work / "urgent.out"), "--wrap", "sleep 5"],
                            capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    finish_and_check(work, job_id, run_dir, reference)
    assert wait_final(urgent, work) == "COMPLETED"
    states = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-o", "State", "-j", job_id], capture_output=True,
                            text=True, timeout=30).stdout.split()
    assert "PREEMPTED" in states or "REQUEUED" in states, states  # Slurm's preemption, not our own requeue
    assert "(signal)" in job_log(run_dir, tail=10**6)  # preempt_send_user_signal: USR2 came first, we checkpointed


@batched
def requeued(work: Path, reference) -> None:
    """``scontrol requeue`` sends no USR2 (SIGTERM, then SIGKILL after KillWait): the steps since the last
    checkpoint are lost and redone exactly."""
    slow_steps(work, SIGNAL_FLOOR_S, attempts=1, until_sent=True)
    job_id, run_dir = submit(work, "requeued", "checkpoint.save_interval=2")
    wait_steps(job_id, run_dir, 3)
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
    signal_sent(work)
    finish_and_check(work, job_id, run_dir, reference)


@batched
def killed(work: Path, reference) -> None:
    """SIGKILL of the trainer step, then ``scontrol requeue``: a run with LoRA adapters (issue #56 point 4) resumes
    from its last checkpoint (the adapters and their optimizer) and ends bitwise equal to the uninterrupted LoRA
    run, the requeued job's engine serving the synced adapters again."""
    slow_steps(work, SIGNAL_FLOOR_S, attempts=1, until_sent=True)
    job_id, run_dir = submit(work, "killed", "checkpoint.save_interval=1", *LORA)
    wait_steps(job_id, run_dir, 3)
    subprocess.run(["scancel", "--signal=KILL", f"{job_id}.0"], check=True, timeout=30)  # step 0: the trainer
    signal_sent(work)
    assert wait_final(job_id, run_dir, timeout=120) == "FAILED"
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)  # what the user (or a site) does
    time.sleep(1)
    finish_and_check(work, job_id, run_dir, reference)
    last = run_dir / "logs" / attempts(run_dir)[-1]
    engine_log = "".join(p.read_text(errors="replace") for p in last.rglob("engine*.log"))
    assert "LoRA adapter hpcrl-policy-" in engine_log, job_log(run_dir)  # the requeued engine serves adapters


@batched
def critic(work: Path, reference) -> None:
    """PPO with the critic on a rank of its own in het group 1 (``slurm.critic``; the colocated run becomes a
    het job): the controller starts it as a job step there, USR2 checkpoints actor and critic (the critic's
    step outlives the signal until then) and the requeued job starts a new critic step that resumes from
    ``dist_critic/``; every step is trained and logged once, with the critic's metrics."""
    from hpcrl.checkpoint import find_latest_checkpoint, read_marker

    # The signal must land before the run ends: at full speed the 5 steps left after the second took ~4 s
    # (CI of 38d7799: the run finished in one attempt before scancel's USR2 reached it). A floor of ~1.5 s a
    # step in the first attempt (slow_steps) leaves >= 7 s after step 2, whatever the CPU, for the 0.2 s poll,
    # squeue and scancel; the second attempt runs at full speed.
    steps = 7
    slow_steps(work, attempts=1)
    job_id, run_dir = submit(work, "critic", "algorithm.advantage_estimator=gae", f"run.num_rollout={steps}",
                             f"slurm.critic={{nodes: 1, cpus_per_task: {THREADS}}}", "critic.nprocs=1")
    wait_steps(job_id, run_dir, 2)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    assert wait_final(job_id, run_dir) == "COMPLETED", job_log(run_dir)
    assert len(attempts(run_dir)) >= 2 and "(signal)" in job_log(run_dir, tail=10**6)
    assert metric_steps(run_dir) == list(range(steps))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("critic/value_loss" in r and "critic/wait_seconds" in r for r in rows if r["step"] >= 0)
    assert read_marker(find_latest_checkpoint(run_dir))["models"]["critic"]["optimizer"] == "saved"
    for attempt in attempts(run_dir):  # each attempt's critic step ran (in its own group) and resumed
        log = (run_dir / "logs" / attempt / "critic-0.log").read_text()
        assert "Traceback" not in log, log[-3000:]
    assert "resumed from" in job_log(run_dir, tail=10**6)


@batched
def timelimit(work: Path, reference) -> None:
    """A 2-minute limit with ``USR2@40`` (Slurm may send it up to 60 s early) on a run that needs more than
    one such allocation (no filter, so late steps, all correct, still train): each attempt checkpoints before
    its limit (signal, or our own deadline) and is requeued."""
    # An attempt has at most ~80 s of steps (the signal comes 40-60 s before the limit) and each step of the
    # first at least ~1 s (a reward sleeping 20 ms for each sample): 82 steps need 2 attempts however fast the
    # CPU (the CI of 943244c did 300 unfloored steps in 55 s, one attempt). The second runs at full speed: its
    # ~35 floored steps took 41 s, unfloored ~10 s (2026-11-26; 48 steps in the first attempt).
    steps = 82
    slow_steps(work, seconds_per_sample=0.02, attempts=1)
    job_id, run_dir = submit(work, "timelimit", f"run.num_rollout={steps}", "slurm.time=00:02:00",
                             "slurm.signal=USR2@40", "rollout.dynamic_filter=null")  # the filter runs dry late
    assert wait_final(job_id, run_dir, timeout=840) == "COMPLETED", job_log(run_dir)
    assert len(attempts(run_dir)) >= 2, job_log(run_dir)
    assert metric_steps(run_dir) == list(range(steps))
    rows = trained(work, "timelimit", steps)
    assert sorted(set(rows[:, 0].tolist())) == list(range(steps))
    assert len(set(rows[:, 2].tolist())) == len(rows)  # each sample trained once
    sacct = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-o", "State", "-j", job_id], capture_output=True,
                           text=True, timeout=30).stdout.split()
    assert "TIMEOUT" not in sacct, sacct  # it left before the limit each time


# ---------------------------------------------------------------------------- issue #9 point 9: who gets USR2
def job_processes(job_id: str) -> dict[int, str]:
    """PID -> command line of every process of the job on this machine: the descendants of its slurmstepds
    (``slurmstepd: [ID.batch]``, ``[ID.0]``, ...; the fake nodes are local)."""
    stepds = [int(p.name) for p in Path("/proc").iterdir()
              if p.name.isdigit() and _cmdline(int(p.name)).startswith(f"slurmstepd: [{job_id}.")]
    return {pid: full_cmdline(pid) for s in stepds for pid in descendants(s)}


def _sigmasks(status_file: Path) -> dict[str, int]:
    rows = dict(line.split(":", 1) for line in status_file.read_text().splitlines() if ":" in line)
    return {k: int(rows[k], 16) for k in ("SigBlk", "SigIgn", "SigCgt")}


SIGTIMEDWAIT = {"x86_64": 128, "aarch64": 137}.get(os.uname().machine)
"""Syscall number of rt_sigtimedwait: a thread in it (srun's signal thread) takes the signals it waits for, which
show as unblocked in its mask meanwhile."""


def dies_of(pid: int, signum: int) -> bool:
    """Whether ``signum`` sent to process ``pid`` would terminate it: not ignored, no handler, and some thread
    neither blocks it nor waits for it in ``sigwait`` (a process-directed signal goes to any thread that does not
    block it). False if the process has exited."""
    bit = 1 << (signum - 1)
    try:
        masks = _sigmasks(Path(f"/proc/{pid}/status"))
        if (masks["SigIgn"] | masks["SigCgt"]) & bit:
            return False
        for t in Path(f"/proc/{pid}/task").iterdir():
            if not _sigmasks(t / "status")["SigBlk"] & bit:
                call = (t / "syscall").read_text().split()
                if not (call and call[0] == str(SIGTIMEDWAIT)):
                    return True
        return False
    except OSError:
        return False


def check_no_process_dies_of_usr2(job_id: str) -> None:
    """Every process of the running job survives USR2: it blocks, ignores or handles it."""
    procs = job_processes(job_id)
    kinds = " ".join(procs.values())
    assert any("/bin/bash" in c or c.startswith("bash") for c in procs.values()), procs  # the batch shell
    assert "router" in kinds and "hpcrl.engine.server" in kinds, procs  # the router renames itself
    doomed = [cmd[:200] for pid, cmd in procs.items() if dies_of(pid, signal.SIGUSR2)]
    assert not doomed, f"these processes of job {job_id} would die of USR2: {doomed}"


def check_no_step_ended_by_usr2(job_id: str) -> None:
    """sacct, every step of every attempt (batch shell, trainer, rollout step): no exit code names SIGUSR2."""
    rows = subprocess.run(["sacct", "-n", "-D", "-P", "-o", "JobID,State,ExitCode", "-j", job_id],
                          capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    assert any(".batch" in r for r in rows) and any(r.split("|")[0].endswith(".0") for r in rows), rows
    assert not [r for r in rows if r.split("|")[2].split(":")[1] == str(int(signal.SIGUSR2))], rows


def usr2_to_the_shell(work: Path, reference, scope: str) -> None:
    """``scancel --signal=USR2 --full`` (batch shell, srun and every step) and ``--batch`` (the batch shell
    only): the shell's trap passes it on to the trainer step; nothing of the job dies of it."""
    slow_steps(work, SIGNAL_FLOOR_S, attempts=1, until_sent=True)
    job_id, run_dir = submit(work, f"usr2-{scope}", "checkpoint.save_interval=1")  # writer children exist
    wait_steps(job_id, run_dir, 2)
    check_no_process_dies_of_usr2(job_id)
    subprocess.run(["scancel", "--signal=USR2", f"--{scope}", job_id], check=True, timeout=30)
    signal_sent(work)
    finish_and_check(work, job_id, run_dir, reference)
    log = job_log(run_dir, tail=10**6)
    assert "the batch shell got SIGUSR2" in log and "(signal)" in log and "requeueing job" in log
    check_no_step_ended_by_usr2(job_id)


@batched
def usr2_full(work: Path, reference) -> None:
    usr2_to_the_shell(work, reference, "full")


@batched
def usr2_batch(work: Path, reference) -> None:
    usr2_to_the_shell(work, reference, "batch")


@pytest.mark.parametrize("scope", ["full", "batch"])
def test_usr2_to_the_batch_shell_too_checkpoints_requeues_and_resumes_exactly(batch, scope):
    report(batch, f"usr2_{scope}")


def test_own_sbatch_with_batch_signal_preempted_resumes_exactly(work, reference):
    """A user's own sbatch script (the plain template, ``--signal=B:USR2@60``: Slurm signals the batch shell
    only) preempted by the ``urgent`` partition (``preempt_send_user_signal``: the signal comes at once)."""
    slow_steps(work)
    out = subprocess.run([str(HPCRL), "submit", "run.yaml", "run.name=bsig", *SLURM, "--plain", "--dry-run"],
                         cwd=work, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                         env=job_env(work))
    assert out.returncode == 0, out.stderr
    run_dir = work / "runs" / "bsig"
    script = (run_dir / "submission.sbatch").read_text()
    assert "#SBATCH --signal=USR2@60\n" in script
    (run_dir / "own.sbatch").write_text(script.replace("--signal=USR2@60", "--signal=B:USR2@60"))
    job_id = subprocess.run(["sbatch", "--parsable", str(run_dir / "own.sbatch")], cwd=work, capture_output=True,
                            text=True, timeout=60, check=True, env=job_env(work)).stdout.strip()
    wait_steps(job_id, run_dir, 2)
    check_no_process_dies_of_usr2(job_id)
    node = node_of(job_id)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", node, "-c", str(NODE_CPUS), "-t", "1",
                             "-o", str(work / "urgent.out"), "--wrap", "sleep 5"],
                            capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    finish_and_check(work, job_id, run_dir, reference)
    assert wait_final(urgent, work) == "COMPLETED"
    log = job_log(run_dir, tail=10**6)
    assert "the batch shell got SIGUSR2" in log and "(signal)" in log, log
    check_no_step_ended_by_usr2(job_id)


# ------------------------------------------------------------------ the batched variants' tests
def test_scancel_usr2_checkpoints_requeues_and_resumes_exactly(batch):
    report(batch, "usr2")


def test_scontrol_requeue_without_signal_resumes_from_last_checkpoint(batch):
    report(batch, "requeued")


def test_sigkill_of_trainer_step_then_requeue_resumes_exactly(batch):
    report(batch, "killed")


def test_ppo_critic_in_its_own_het_group_survives_usr2(batch):
    report(batch, "critic")


def test_time_limit_requeues_and_completes(batch):
    report(batch, "timelimit")
