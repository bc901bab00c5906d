"""tests/cluster/local_slurm.py without starting anything: configs, /etc/hosts edit, availability reasons."""

from __future__ import annotations

import os
from pathlib import Path

from tests.cluster import local_slurm as ls


def test_slurm_conf_has_what_the_tests_rely_on(tmp_path):
    confs = ls.render_configs(tmp_path, "pw")
    slurm = confs["slurm.conf"].splitlines()
    for line in ("AuthInfo=cred_expire=5", "SchedulerParameters=bf_interval=1,sched_interval=2",
                 "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
                 "SlurmctldParameters=preempt_send_user_signal", "GresTypes=gpu",
                 "AccountingStorageType=accounting_storage/slurmdbd",
                 f"SlurmctldPidFile={tmp_path}/run/slurmctld.pid"):
        assert line in slurm
    nodes = [x for x in slurm if x.startswith("NodeName=")]
    assert [x.split()[0] for x in nodes] == ["NodeName=n1", "NodeName=n2"]
    assert all("CPUs=2" in x and "Gres=gpu:4" in x and "RealMemory=8000" in x for x in nodes)
    parts = {x.split()[0]: x for x in slurm if x.startswith("PartitionName=")}
    assert "Default=YES" in parts["PartitionName=debug"] and "PriorityTier=1 " in parts["PartitionName=debug"]
    assert "PriorityTier=10 " in parts["PartitionName=urgent"]
    assert f"File={tmp_path}/dev/gpu[0-3]" in confs["gres.conf"]
    dbd = confs["slurmdbd.conf"].splitlines()
    assert "StoragePass=pw" in dbd and f"StoragePort={ls.MARIADB_PORT}" in dbd


def test_hosts_rewritten_in_place_once(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    inode = hosts.stat().st_ino
    monkeypatch.setattr(ls, "ETC_HOSTS", hosts)
    assert ls.ensure_hosts() is True
    assert ls.ensure_hosts() is False
    assert hosts.stat().st_ino == inode
    assert hosts.read_text().splitlines()[-1].startswith("127.0.0.1 n1 n2")


def test_unavailable_reasons(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, reason = ls.cluster_available()
    assert not ok and "root" in reason and "uid 1000" in reason
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(ls, "_missing_packages", lambda: ["slurmd"])
    monkeypatch.setattr(ls.shutil, "which", lambda name: None)
    if Path("/etc/debian_version").exists():
        ok, reason = ls.cluster_available()
        assert not ok and "apt-get" in reason


def test_cluster_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HPCRL_SLURM_DIR", str(tmp_path / "c"))
    assert ls.cluster_dir() == tmp_path / "c"
    monkeypatch.delenv("HPCRL_SLURM_DIR")
    assert ls.cluster_dir() == Path("/tmp/hpcrl-slurm").resolve()
