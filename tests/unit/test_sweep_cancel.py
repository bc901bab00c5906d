"""Sweeps after a cancel, without a cluster: sacct's folded rows of array tasks that never started, the reason
a point's state is UNKNOWN, which points ``--resubmit`` takes, and ``hpcrl cancel SWEEP`` (fake ``scancel``,
``squeue``, ``sacct`` on PATH). The squeue/sacct texts are what the local cluster's Slurm 22.05 printed
(``tests/integration/test_sweep_cluster.py`` runs the same on it).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.slurm import state
from hpcrl.slurm import sweep as sw
from tests.unit.test_slurm_submit import fake_bin, write
from tests.unit.test_sweep import BASE, HET, SWEEP, fake_sbatch, runner_for, work, write_metrics  # noqa: F401

SACCT_AFTER_SCANCEL = "154_0|155|CANCELLED by 0\n154_1|156|CANCELLED by 0\n154_[2-3%2]|154|CANCELLED by 0\n"
"""``sacct -n -X -P -o JobID,JobIDRaw,State -j 154`` after ``scancel 154`` of a 4-task array (%2) whose tasks
2 and 3 had not started."""
SACCT_TASK_ALONE = "157_0|CANCELLED by 0\n157_1|CANCELLED by 0\n157_3|CANCELLED by 0\n"
"""``sacct -j 157`` after ``scancel 157_2`` (pending) and later ``scancel 157``: no row of task 2 at all."""


NOT_QUEUED = "not queued (squeue)"
NO_ACCT = "sacct could not be run (not on PATH, accounting off or slurmdbd down)"


def no_record(task: int, array: str) -> str:
    """The reason given for an array task sacct has no row of while it has the array's others."""
    return (f"{NOT_QUEUED}, and sacct has no record of task {task} of array {array} though it has the "
            "array's other tasks (Slurm keeps none for a pending task cancelled by its own id: it never "
            "started)")


def acct_runner(squeue: str | None, sacct: str | None, calls: list | None = None):
    """squeue/sacct answering fixed texts (None: the command failed), recording the calls."""
    def run(argv):
        if calls is not None:
            calls.append(argv)
        return {"squeue": squeue, "sacct": sacct}[argv[0]]
    return run


# ------------------------------------------------------------------------------------------------------------
# Folded rows and reasons
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("folded,tasks", [
    ("3_[2-3%2]", ["3_2", "3_3"]),
    ("3_[2-3]", ["3_2", "3_3"]),
    ("7_[0,4-5]", ["7_0", "7_4", "7_5"]),
    ("7_[0,4-5%8]", ["7_0", "7_4", "7_5"]),
    ("8_[0-6:3]", ["8_0", "8_3", "8_6"]),
    ("9_[12]", ["9_12"]),
    ("9_4", ["9_4"]),
    ("9", ["9"]),
    ("9+1", ["9+1"]),
    ("9_[x]", ["9_[x]"]),
    ("9_[3--4]", ["9_[3--4]"]),
])
def test_expand_array_id(folded, tasks):
    assert state.expand_array_id(folded) == tasks


def test_parse_sacct_expands_folded_rows_and_a_tasks_own_row_wins():
    text = "".join(line.split("|")[0] + "|" + line.split("|")[2] + "\n" for line in
                   SACCT_AFTER_SCANCEL.splitlines())
    assert state.parse_sacct(text) == {"154_0": "CANCELLED", "154_1": "CANCELLED", "154_2": "CANCELLED",
                                       "154_3": "CANCELLED"}
    assert state.parse_sacct("154_0|RUNNING\n154_1|RUNNING\n154_[1-3%2]|PENDING\n154_[1-3%2].batch|X\n") == {
        "154_0": "RUNNING", "154_1": "RUNNING", "154_2": "PENDING", "154_3": "PENDING"}


def test_job_states_asks_sacct_for_the_arrays_and_says_why_unknown():
    calls: list = []
    sacct = "154_0|CANCELLED by 0\n154_1|CANCELLED by 0\n154_[2-3%2]|CANCELLED by 0\n" + SACCT_TASK_ALONE
    js = state.job_states(["154_3", "157_2", "157_0", "99"], acct_runner("", sacct, calls))
    assert calls[1][-1] == "154,154_3,157,157_0,157_2,99"  # the arrays too: sacct -j 154_3 finds nothing
    assert js.states == {"154_3": "CANCELLED", "157_0": "CANCELLED", "157_2": "UNKNOWN", "99": "UNKNOWN"}
    assert js.queue_checked and set(js.why_unknown) == {"157_2", "99"}
    assert js.why_unknown["157_2"] == no_record(2, "157")
    assert js.why_unknown["99"] == (f"{NOT_QUEUED}, and sacct has no record of it (accounting records "
                                    "purged, or never written)")
    js = state.job_states(["5_1"], acct_runner(None, None))
    assert js.states == {"5_1": "UNKNOWN"} and not js.queue_checked
    assert js.why_unknown["5_1"] == f"squeue could not be run (not on PATH, or it failed), and {NO_ACCT}"
    js = state.job_states(["5_1", "5_2"], acct_runner("5_1|PENDING\n", None))
    assert js.states == {"5_1": "PENDING", "5_2": "UNKNOWN"}
    assert js.why_unknown == {"5_2": f"{NOT_QUEUED}, and {NO_ACCT}"}


def test_run_command_takes_squeues_no_such_job_as_an_empty_answer(tmp_path, monkeypatch):
    fake_bin(tmp_path, monkeypatch,
             squeue='echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1',
             sacct='echo "sacct: error: Problem talking to the database: Connection refused" >&2; exit 1')
    assert state.run_command(["squeue", "-h", "-j", "99"]) == ""
    assert state.run_command(["sacct", "-j", "99"]) is None
    js = state.job_states(["99"])
    assert js.queue_checked and js.why_unknown["99"].startswith("not queued (squeue), and sacct could not")


def test_single_run_status_says_why_unknown(work, monkeypatch):
    fake_sbatch(work, monkeypatch)
    res = sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    run_dir = res.sweep_dir / res.points[2]
    rows = state.collect_status([run_dir], acct_runner("", "4242_0|COMPLETED\n"))
    assert rows[0].state == "UNKNOWN"
    assert state.format_table(rows).splitlines()[-1] == f"{res.points[2]}: UNKNOWN: {no_record(2, '4242')}"


# ------------------------------------------------------------------------------------------------------------
# Status, report and --resubmit after a cancel
# ------------------------------------------------------------------------------------------------------------

def test_status_report_and_resubmit_after_a_cancel_with_pending_tasks(work, monkeypatch):
    log = fake_sbatch(work, monkeypatch)
    res = sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    sdir, names = res.sweep_dir, res.points
    write_metrics(sdir / names[0], [0.1, 0.2], attempts=1)  # ran 2 steps, then cancelled
    (sdir / names[1] / "logs" / "attempt-0").mkdir()  # started, cancelled before its first step
    # task 3 was cancelled alone while pending (no record), then the array: tasks 0, 1 ran, 2 never started
    sacct = "4242_0|CANCELLED by 0\n4242_1|CANCELLED by 0\n4242_[2]|CANCELLED by 0\n"
    runner = acct_runner("", sacct)
    manifest, rows = sw.sweep_status(sdir, runner)
    table = sw.format_sweep_table(manifest, rows).splitlines()
    assert [line.split()[2] for line in table[2:6]] == ["CANCELLED", "CANCELLED", "CANCELLED", "UNKNOWN"]
    assert table[6:] == ["3 CANCELLED, 1 UNKNOWN",
                         f"{names[3]}: UNKNOWN: job 4242_3: {no_record(3, '4242')}; never started; hpcrl "
                         "sweep --resubmit brings it back"]
    sw.write_report(sdir, runner)
    with open(sdir / "report.csv", newline="") as f:
        report = list(csv.DictReader(f))
    assert [(r["state"], r["note"] != "") for r in report] == [("CANCELLED", False)] * 3 + [("UNKNOWN", True)]
    assert report[3]["note"] == rows[3].note

    again = sw.resubmit_sweep(sdir, runner=runner, environ={})
    assert again.points == names and again.job_ids == {n: f"4243_{i}" for i, n in enumerate(names)}
    assert "#SBATCH --array=0-3%2" in (sdir / "submitit" / "4243_submission.sh").read_text()
    assert len(log.read_text().splitlines()) == 2
    m = sw.read_manifest(sdir)
    assert [p["previous_job_ids"] for p in m["points"]] == [[f"4242_{i}"] for i in range(4)]


def test_resubmit_takes_an_unknown_point_only_when_not_queued_and_not_done(work, monkeypatch):
    fake_sbatch(work, monkeypatch)
    res = sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    sdir, names = res.sweep_dir, res.points
    write_metrics(sdir / names[0], [0.5] * 10)  # every step (run.num_rollout: 10): done, record purged
    write_metrics(sdir / names[1], [0.5] * 4)  # 4 of 10 steps, record purged
    states = sw.sweep_states(sw.read_manifest(sdir), acct_runner("4242_2|RUNNING\n4242_3|PENDING\n", ""))
    assert states.states == dict(zip(names, ["UNKNOWN", "UNKNOWN", "RUNNING", "PENDING"]))
    points = sw.read_manifest(sdir)["points"]
    taken = [sw.resubmittable(p, states.states[p["name"]], True) for p in points]
    assert taken == [False, True, False, False]
    assert not sw.resubmittable(points[1], "UNKNOWN", False)  # squeue failed: it may still be queued
    dry = sw.resubmit_sweep(sdir, dry_run=True, runner=acct_runner("4242_2|RUNNING\n4242_3|PENDING\n", ""),
                            environ={})
    assert dry.points == [names[1]]
    none = sw.resubmit_sweep(sdir, dry_run=True, runner=acct_runner(None, None), environ={})
    assert none.points == []
    manifest, rows = sw.sweep_status(sdir, acct_runner("4242_2|RUNNING\n4242_3|PENDING\n", ""))
    assert rows[0].note.endswith("10 steps done") and rows[1].note.endswith(
        "4 steps done; hpcrl sweep --resubmit brings it back")


# ------------------------------------------------------------------------------------------------------------
# hpcrl cancel SWEEP
# ------------------------------------------------------------------------------------------------------------

def test_plan_cancel_whole_sweep_points_and_het(work, monkeypatch):
    fake_sbatch(work, monkeypatch)
    res = sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    m = sw.read_manifest(res.sweep_dir)
    names = res.points
    live = acct_runner("4242_1|RUNNING\n4242_2|PENDING\n4242_3|PENDING\n", "4242_0|COMPLETED\n")
    plan = sw.plan_cancel(m, runner=live)
    assert plan.job_ids == ["4242"] and plan.points == names[1:]
    assert plan.lines == [f"job array 4242: {names[1]} (RUNNING), {names[2]} (PENDING), {names[3]} (PENDING)"]
    plan = sw.plan_cancel(m, [names[0], names[3]], runner=live)
    assert plan.job_ids == ["4242_3"] and plan.lines == [f"job 4242_3: {names[3]} (PENDING)"]
    assert sw.plan_cancel(m, runner=acct_runner("", "4242_[0-3%2]|CANCELLED by 0\n")).job_ids == []
    # squeue failed: an UNKNOWN point may still run, so its array is cancelled (scancel is silent if not)
    assert sw.plan_cancel(m, runner=acct_runner(None, None)).job_ids == ["4242"]
    # a point resubmitted into a second array: both arrays
    m["points"][0].update(job_id="4250_0", array_job_id="4250", task_index=0)
    plan = sw.plan_cancel(m, runner=acct_runner("4250_0|PENDING\n4242_1|RUNNING\n", ""))
    assert plan.job_ids == ["4250", "4242"]

    het = sw.submit_sweep(write(work / "het.yaml", HET), environ={}, runner=runner_for({}))
    assert list(het.job_ids.values()) == ["4243", "4244"]
    plan = sw.plan_cancel(sw.read_manifest(het.sweep_dir), runner=acct_runner(
        "4243+0|RUNNING\n4243+1|RUNNING\n4244+0|PENDING\n4244+1|PENDING\n", ""))
    assert plan.job_ids == ["4243", "4244"] and plan.lines == [f"job 4243: {het.points[0]} (RUNNING)",
                                                               f"job 4244: {het.points[1]} (PENDING)"]


def hpcrl(args, cwd, env):
    script = Path(sys.executable).with_name("hpcrl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "hpcrl"]
    return subprocess.run(cmd + args, cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", **env))


def live_then_ended(work: Path, monkeypatch, live: str) -> Path:
    """Fake squeue/sacct/scancel: squeue lists ``live`` (``ID|STATE`` lines) until scancel runs, then the
    cancelled tasks once more as COMPLETING, then nothing; sacct has them CANCELLED after that. Returns the
    scancel log (one line of arguments per call)."""
    log, polls = work / "scancel.log", work / "polls"
    rows = live.replace("\n", "\\n")
    ending = "".join(f"{line.split('|')[0]}|COMPLETING\\n" for line in live.splitlines())
    ended = "".join(f"{line.split('|')[0]}|CANCELLED by 0\\n" for line in live.splitlines())
    fake_bin(work, monkeypatch,
             squeue=f'if [ ! -f {log} ]; then printf "{rows}"; exit 0; fi; '
                    f'n=$(cat {polls} 2>/dev/null || echo 0); echo $((n + 1)) > {polls}; '
                    f'if [ "$n" = 0 ]; then printf "{ending}"; fi',
             sacct=f'if [ -f {log} ]; then printf "{ended}"; fi', scancel=f'echo "$@" >> {log}')
    return log


def test_cli_cancel_sweep_prints_cancels_and_waits_for_the_tasks_to_end(work, monkeypatch):
    fake_sbatch(work, monkeypatch)
    res = sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    sdir, names = res.sweep_dir, res.points
    env = {"PATH": f"{work / 'fakebin'}:/usr/bin:/bin"}
    log = live_then_ended(work, monkeypatch,
                          "4242_0|RUNNING\n4242_1|RUNNING\n4242_2|PENDING\n4242_3|PENDING\n")
    out = hpcrl(["cancel", "runs/lrs", "--dry-run"], work, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"would cancel 4 of 4 points of sweep lrs ({sdir}):",
                                       f"  job array 4242: {names[0]} (RUNNING), {names[1]} (RUNNING), "
                                       f"{names[2]} (PENDING), {names[3]} (PENDING)"]
    assert not log.exists()
    out = hpcrl(["cancel", "lrs"], work, env)  # a sweep's name under --output-dir
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"cancelling 4 of 4 points of sweep lrs ({sdir}):",
        f"  job array 4242: {names[0]} (RUNNING), {names[1]} (RUNNING), {names[2]} (PENDING), {names[3]} "
        "(PENDING)",
        f"cancelled 4242 (4 CANCELLED); bring the points back with: hpcrl sweep --resubmit {sdir}"]
    assert log.read_text() == "4242\n" and (work / "polls").read_text() == "2\n"  # COMPLETING, then ended
    out = hpcrl(["cancel", str(sdir)], work, env)
    assert out.returncode == 0
    assert out.stdout == f"nothing to cancel in {sdir}: no point is queued or running (4 CANCELLED)\n"

    log.unlink()
    (work / "polls").unlink()
    live_then_ended(work, monkeypatch, "4242_2|PENDING\n4242_3|PENDING\n")
    out = hpcrl(["cancel", str(sdir), "--points", f"{names[2]},{names[3]}"], work, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:3] == [f"  job 4242_2: {names[2]} (PENDING)",
                                            f"  job 4242_3: {names[3]} (PENDING)"]
    assert log.read_text() == "4242_2 4242_3\n"
    out = hpcrl(["cancel", str(sdir / names[0]), "--points", names[0]], work, env)
    assert out.returncode == 2 and out.stderr.startswith("hpcrl cancel --points: needs a sweep folder")
    out = hpcrl(["cancel", str(sdir), "--points", "nope"], work, env)
    assert out.returncode == 2 and "'nope' is not a point of" in out.stderr
    out = hpcrl(["cancel", str(sdir / names[0])], work, env)  # one point is a run folder: its task only
    assert out.returncode == 0 and out.stdout.startswith("cancelled job 4242_0")
    assert log.read_text().splitlines()[-1] == "4242_0"


def test_cli_cancel_sweep_tasks_that_do_not_end_and_a_refused_scancel(work, monkeypatch):
    fake_sbatch(work, monkeypatch)
    res = sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    sdir, names = res.sweep_dir, res.points
    env = {"PATH": f"{work / 'fakebin'}:/usr/bin:/bin"}
    fake_bin(work, monkeypatch, squeue='printf "4242_1|COMPLETING\\n"', sacct="exit 0", scancel="exit 0")
    out = hpcrl(["cancel", str(sdir), "--wait", "1.5"], work, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == (f"still ending after 1.5 s: {names[1]} (COMPLETING); --resubmit "
                                           "takes them once hpcrl status shows them ended")
    out = hpcrl(["sweep", "--resubmit", str(sdir), "--dry-run"], work, env)  # the others: UNKNOWN, never ran
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[0] == ("hpcrl sweep --resubmit: left out 1 points still queued or "
                                          f"running: {names[1]} (COMPLETING); resubmit them once hpcrl "
                                          "status shows them ended")
    assert f"would resubmit 3 points ({names[0]}; {names[2]}; {names[3]})" in out.stderr

    denied = "scancel: error: Kill job error on job id 4242: Access denied"
    fake_bin(work, monkeypatch, squeue='printf "4242_1|RUNNING\\n"', scancel=f'echo "{denied}" >&2; exit 1')
    out = hpcrl(["cancel", str(sdir)], work, env)
    assert out.returncode == 1 and out.stderr.splitlines() == [f"hpcrl cancel: scancel 4242 failed: {denied}"]
    assert out.stdout.splitlines()[1] == f"  job array 4242: {names[1]} (RUNNING)"  # printed before scancel
