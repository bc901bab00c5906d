"""The local Slurm cluster (tests/cluster/local_slurm.py) against real slurmctld/slurmd/slurmdbd.

Each job runs a few seconds; the cluster is started once per session by the `slurm_cluster` fixture.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slurm, pytest.mark.timeout(180)]

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


def sh(*cmd: str, timeout: float = 60) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}{p.stderr}"
    return p.stdout


def wait_final_state(job_id: str, timeout: float = 60) -> str:
    """Poll sacct until the job is in a final state (sacct can lag a second behind a fresh job)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                             text=True, timeout=15).stdout.split()
        state = out[0].split()[0] if out else ""
        if state in FINAL_STATES:
            return state
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not finished after {timeout} s (sacct state {state!r})")


def wait_idle(nodes, timeout: float = 30) -> dict[str, str]:
    """Node states once every node is idle (a job that just ended may leave a node `comp` for a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        states = dict(line.split()[:2] for line in sh("sinfo", "-h", "-N", "-o", "%N %t").splitlines())
        if all(states.get(n) == "idle" for n in nodes) or time.monotonic() > deadline:
            return states
        time.sleep(0.3)


def test_nodes_idle_with_fake_gpus(slurm_cluster):
    wait_idle(slurm_cluster.nodes)
    rows = {}
    for line in sh("sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t %G %c").splitlines():
        node, state, gres, cpus = line.split()
        rows[node] = (state, gres, int(cpus))
    assert rows == {n: ("idle", "gpu:4", 2) for n in ("n1", "n2")}
    for n in slurm_cluster.nodes:  # torch.distributed and submitit use the node names as host names
        assert socket.gethostbyname(n) == "127.0.0.1"


def test_config_partitions_and_scheduler(slurm_cluster):
    conf = sh("scontrol", "show", "config")
    assert "bf_interval=1,sched_interval=2" in conf
    assert "cred_expire=5" in conf
    assert "preempt_send_user_signal" in conf
    assert any(line.split() == ["PreemptMode", "=", "REQUEUE"] for line in conf.splitlines())
    assert any(line.split()[:3] == ["AccountingStorageType", "=", "accounting_storage/slurmdbd"]
               for line in conf.splitlines())
    debug = sh("scontrol", "show", "partition", "debug")
    urgent = sh("scontrol", "show", "partition", "urgent")
    assert "Default=YES" in debug and "PriorityTier=1 " in debug
    assert "PriorityTier=10 " in urgent


def test_sbatch_gres_sets_cuda_visible_devices(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    job_id = sh("sbatch", "--parsable", "-p", "debug", "--gres=gpu:2", "-t", "1", "-o", str(out),
                "--wrap", "echo CVD=$CUDA_VISIBLE_DEVICES NODE=$SLURMD_NODENAME").strip().split(";")[0]
    assert wait_final_state(job_id) == "COMPLETED"
    text = out.read_text()
    assert "CVD=0,1 " in text, text
    # accounting recorded the job with its GPUs
    tres = sh("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "AllocTRES").strip()
    assert "gres/gpu=2" in tres, tres


def test_more_gpus_than_a_node_has_is_rejected(slurm_cluster):
    p = subprocess.run(["sbatch", "-p", "debug", "--gres=gpu:5", "-N", "1", "--wrap", "true"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode != 0
    assert "Requested node configuration is not available" in p.stderr, p.stderr


def test_submitit_function_job(slurm_cluster, tmp_path):
    import submitit

    def add(a, b):  # local function: cloudpickle ships it by value
        return a + b, os.environ["SLURM_JOB_PARTITION"], os.environ["SLURMD_NODENAME"]

    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(slurm_partition="debug", timeout_min=2, cpus_per_task=1, slurm_mem="500M")
    job = executor.submit(add, 2, 3)
    total, partition, node = job.result()
    assert (total, partition) == (5, "debug")
    assert node in slurm_cluster.nodes
    assert wait_final_state(str(job.job_id)) == "COMPLETED"


def test_srun_two_nodes(slurm_cluster):
    out = sh("srun", "-p", "debug", "-N", "2", "--ntasks-per-node=1", "-t", "1",
             "bash", "-c", "echo $SLURMD_NODENAME $SLURM_JOB_NODELIST", timeout=90)
    lines = sorted(out.split("\n")[:-1])
    assert [line.split()[0] for line in lines] == ["n1", "n2"], out
    assert {line.split()[1] for line in lines} == {"n[1-2]"}, out


def test_start_is_idempotent(slurm_cluster):
    from tests.cluster.local_slurm import cluster_status, start_cluster

    t0 = time.monotonic()
    again = start_cluster(slurm_cluster.directory)
    elapsed = time.monotonic() - t0
    assert again.started == []
    assert again.installed is False
    assert again.pids == slurm_cluster.pids
    # a second start only reads the daemons' state (a few scontrol calls of ~0.1 s); starting them takes
    # 10-20 s, so 3 s tells the two apart on a loaded machine too
    assert elapsed < 3.0, f"second start took {elapsed:.1f} s"
    st = cluster_status(slurm_cluster.directory)
    assert st["up"] and st["daemons"] == slurm_cluster.pids
    for name, pid in slurm_cluster.pids.items():
        assert Path(f"/proc/{pid}/comm").read_text().strip() == name.split("-")[0]


def test_a_requeued_het_job_restarts_promptly(slurm_cluster, tmp_path):
    """Het jobs start only from the backfill scheduler, which runs only after a state change: without the
    cluster's ``schedtick`` daemon a requeued het job waited 30-172 s on this idle cluster; with it ~7 s
    (``cred_expire=5`` + a tick). The het-job requeue tests of hpcrl depend on it for their run time."""
    script = tmp_path / "het.sh"
    script.write_text("#!/bin/bash\n#SBATCH --requeue -t 2 -n1 -c1 -w n1\n#SBATCH hetjob\n#SBATCH -n1 -c1 -w n2\n"
                      "sleep 120\n")
    job = sh("sbatch", "--parsable", "-o", str(tmp_path / "slurm-%j.out"), str(script)).strip().split(";")[0]
    try:
        def running() -> bool:
            return sh("squeue", "-h", "-j", job, "-o", "%T").split() == ["RUNNING", "RUNNING"]

        deadline = time.monotonic() + 60
        while not running():
            assert time.monotonic() < deadline, "the het job did not start"
            time.sleep(0.5)
        sh("scontrol", "requeue", job)
        t0 = time.monotonic()
        while running():  # until Slurm has taken it down
            assert time.monotonic() - t0 < 20, "the requeue did not stop the het job"
            time.sleep(0.2)
        while not running():
            assert time.monotonic() - t0 < 30, f"the requeued het job is still pending after 30 s: " \
                                               f"{sh('squeue', '-h', '-j', job, '-o', '%T %r')}"
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], timeout=30)
