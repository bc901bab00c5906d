#!/usr/bin/env python3
"""A real Slurm 22.05 cluster on one Debian machine, for hpcrl's tests and for development.

As root on Debian this installs Slurm, munge, slurmdbd and MariaDB from Debian packages (only when missing),
writes every config and state file into one folder of its own (``/tmp/hpcrl-slurm`` or ``$HPCRL_SLURM_DIR``),
symlinks ``/etc/slurm/{slurm,gres,slurmdbd}.conf`` to it, and starts munged, MariaDB, slurmdbd, slurmctld and
one slurmd per fake node (``n1``, ``n2``: 2 CPUs, 8000 MB, 4 fake GPUs each, the GPUs being character devices
that are copies of /dev/null). Partitions: ``debug`` (default) and ``urgent`` (higher PriorityTier; its jobs
preempt ``debug`` jobs, which get their ``--signal`` and are requeued).

Command line (stdlib only, so it runs with any python3)::

    python tests/cluster/local_slurm.py start    # install if needed, start, wait until nodes are idle
    python tests/cluster/local_slurm.py status   # daemons, PIDs and node states; exit 1 when not up
    python tests/cluster/local_slurm.py stop     # scancel all jobs, stop the daemons this script started

From Python: :func:`start_cluster`, :func:`stop_cluster`, :func:`cluster_available`, :func:`cluster_status`.
Facts behind the choices: ``local-slurm.md`` in the project's shared reference notes; see README.md here.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CLUSTER_NAME = "localcluster"
NODES = ("n1", "n2")
CPUS_PER_NODE = 2
GPUS_PER_NODE = 4
MEMORY_MB_PER_NODE = 8000
PARTITIONS = ("debug", "urgent")
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818  # default; each fake node nK overrides it with Port=17000+K
SLURMD_NODE_PORT_BASE = 17000
SLURMDBD_PORT = 6819
MARIADB_PORT = 13306
DB_USER = "slurm"
DB_NAME = "slurm_acct_db"

APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "slurmdbd", "mariadb-server")
# One program per package that must exist after installing; checked before deciding to run apt-get.
REQUIRED_PROGRAMS = {
    "slurmctld": "/usr/sbin/slurmctld",
    "slurmd": "/usr/sbin/slurmd",
    "slurm-client": "/usr/bin/sbatch",
    "munge": "/usr/sbin/munged",
    "slurmdbd": "/usr/sbin/slurmdbd",
    "mariadb-server": "/usr/sbin/mariadbd",
}
ETC_SLURM = Path("/etc/slurm")
ETC_HOSTS = Path("/etc/hosts")
MUNGE_PIDFILE = Path("/run/munge/munged.pid")
MUNGE_KEY = Path("/etc/munge/munge.key")

# Daemon name -> the /proc/PID/comm it must show (comm is cut to 15 characters by the kernel).
COMM = {"munged": "munged", "mariadbd": "mariadbd", "slurmdbd": "slurmdbd", "slurmctld": "slurmctld",
        "schedtick": "schedtick"}
COMM.update({f"slurmd-{n}": "slurmd" for n in NODES})
START_ORDER = ("munged", "mariadbd", "slurmdbd", "slurmctld", "schedtick", *(f"slurmd-{n}" for n in NODES))
TICK_SECONDS = 3.0
"""How often :func:`tick` touches the ``debug`` partition (see there)."""


class ClusterError(RuntimeError):
    """The local cluster could not be installed, configured, started or stopped (the message says which step
    failed and ends with the tail of the relevant log)."""


@dataclass
class ClusterInfo:
    """What :func:`start_cluster` brought up.

    Attributes:
        directory: the cluster's own folder (config in ``etc/``, pid files in ``run/``, logs in ``log/``).
        cluster_name: Slurm's ClusterName.
        nodes: fake node names, every one resolvable (``/etc/hosts``).
        partitions: partition names; the first is the default.
        cpus_per_node: CPUs of each node.
        gpus_per_node: fake GPUs (``gres/gpu``) of each node.
        memory_mb_per_node: RealMemory of each node, in MB.
        pids: daemon name (``munged``, ``mariadbd``, ``slurmdbd``, ``slurmctld``, ``slurmd-n1``, ...) -> PID.
        started: daemons this call started (empty when everything was already up).
        installed: True when this call ran apt-get.
        seconds: wall-clock seconds this call took.
    """

    directory: Path
    cluster_name: str = CLUSTER_NAME
    nodes: tuple[str, ...] = NODES
    partitions: tuple[str, ...] = PARTITIONS
    cpus_per_node: int = CPUS_PER_NODE
    gpus_per_node: int = GPUS_PER_NODE
    memory_mb_per_node: int = MEMORY_MB_PER_NODE
    pids: dict[str, int] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    installed: bool = False
    seconds: float = 0.0

    def to_json(self) -> str:
        """The info as a JSON object (paths as strings)."""
        d = asdict(self)
        d["directory"] = str(self.directory)
        return json.dumps(d, indent=2)


# ----------------------------------------------------------------------------------------------- paths


def cluster_dir(directory: str | os.PathLike | None = None) -> Path:
    """The cluster's folder: ``directory`` if given, else ``$HPCRL_SLURM_DIR``, else ``/tmp/hpcrl-slurm``."""
    return Path(directory or os.environ.get("HPCRL_SLURM_DIR") or "/tmp/hpcrl-slurm").resolve()


def _pidfile(d: Path, name: str) -> Path:
    # munged writes its own pid file under /run/munge; the copy in run/ marks that *we* started it.
    return d / "run" / f"{name}.pid"


# ----------------------------------------------------------------------------------------- availability


def cluster_available() -> tuple[bool, str]:
    """Whether this machine can run the local cluster, and if not, why.

    Needs Linux, root (packages, /etc/slurm, /etc/hosts, mknod, slurmd) and Debian (``/etc/debian_version``)
    with ``apt-get``, or the packages already installed. Starts and changes nothing.

    Returns:
        ``(True, "")`` or ``(False, reason)`` where reason is one sentence a test failure can show.
    """
    if not sys.platform.startswith("linux"):
        return False, f"the local Slurm cluster needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, (f"the local Slurm cluster needs root (to install Debian packages, write /etc/slurm "
                       f"and /etc/hosts, mknod fake GPUs and run slurmd); this process runs as uid "
                       f"{os.geteuid()}")
    if not Path("/etc/debian_version").exists():
        return False, ("the local Slurm cluster needs Debian (no /etc/debian_version): it installs Debian "
                       "packages")
    if _missing_packages() and shutil.which("apt-get") is None:
        return False, ("the local Slurm cluster needs apt-get to install "
                       + ", ".join(_missing_packages()) + " (apt-get is not on PATH)")
    return True, ""


def _missing_packages() -> list[str]:
    return [pkg for pkg, prog in REQUIRED_PROGRAMS.items() if not Path(prog).exists()]


# ----------------------------------------------------------------------------------------------- helpers


def _run(cmd: list[str], *, check: bool = True, timeout: float = 60, env: dict | None = None,
         input: str | None = None) -> subprocess.CompletedProcess:
    """Run a short command, capture its output; never used for daemons (they could hold the pipes open)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, input=input,
                           stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"{' '.join(cmd)} did not finish in {timeout:g} s") from e
    except FileNotFoundError as e:
        raise ClusterError(f"{cmd[0]} not found: {e}") from e
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return p


def _spawn_daemon(cmd: list[str], log: Path) -> None:
    """Start a daemon with no pipes to us: stdin /dev/null, stdout and stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        rc = subprocess.call(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=60)
    if rc != 0:
        raise ClusterError(f"{' '.join(cmd)} exited with {rc}\n{_tail(log)}")


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return f"({path} cannot be read)"
    return f"--- last lines of {path} ---\n" + "\n".join(lines)


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _live_pid(d: Path, name: str) -> int | None:
    """PID of our daemon ``name`` if its pid file names a live process with the right /proc/PID/comm."""
    pid = _read_pid(_pidfile(d, name))
    if pid is None or _comm(pid) != COMM[name] or _is_zombie(pid):
        return None
    return pid


def _wait_for(pred, timeout: float, what: str, log: Path | None = None, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = f"\n{_tail(log)}" if log else ""
            raise ClusterError(f"timed out after {timeout:g} s waiting for {what}{tail}")
        time.sleep(interval)


@contextlib.contextmanager
def _lock(d: Path):
    """One start/stop at a time per cluster folder (several pytest sessions may start it together)."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------------- install


def install_packages() -> bool:
    """Install the Debian packages (``apt-get install -y --no-install-recommends ...``) that are missing.

    Runs ``apt-get update`` first only when the package lists are empty or the install fails without it.
    Services are not started by apt here (no systemd / policy-rc.d); this module starts them.

    Returns:
        True when apt-get ran, False when everything was already installed.

    Raises:
        ClusterError: apt-get is missing or failed.
    """
    missing = _missing_packages()
    if not missing:
        return False
    if shutil.which("apt-get") is None:
        raise ClusterError(f"packages {', '.join(missing)} are missing and apt-get is not on PATH")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
    lists = Path("/var/lib/apt/lists")
    if not any(lists.glob("*Packages*")):
        _run(["apt-get", "update", "-q"], env=env, timeout=600)
    p = _run(cmd, env=env, timeout=900, check=False)
    if p.returncode != 0:
        _run(["apt-get", "update", "-q"], env=env, timeout=600)
        _run(cmd, env=env, timeout=900)
    still = _missing_packages()
    if still:
        raise ClusterError(f"apt-get ran but {', '.join(still)} still missing")
    return True


# ------------------------------------------------------------------------------------------------ config


def render_configs(d: Path, db_password: str) -> dict[str, str]:
    """The text of ``slurm.conf``, ``gres.conf`` and ``slurmdbd.conf`` for cluster folder ``d``.

    Pure function (writes nothing); keys are the file names.
    """
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={SLURMD_NODE_PORT_BASE + i} "
        f"CPUs={CPUS_PER_NODE} RealMemory={MEMORY_MB_PER_NODE} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
        for i, n in enumerate(NODES, start=1))
    slurm_conf = f"""\
# Written by hpcrl tests/cluster/local_slurm.py; rewritten on every start. Do not edit.
ClusterName={CLUSTER_NAME}
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=5
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmdSpoolDir={d}/spool/slurmd-%n
StateSaveLocation={d}/spool/ctld
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldPort={SLURMCTLD_PORT}
SlurmdPort={SLURMD_PORT}
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={SLURMDBD_PORT}
AccountingStorageTRES=gres/gpu
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
KillWait=5
MinJobAge=600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
GresTypes=gpu
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""
    last = len(NODES)
    gres_conf = f"""\
# Written by hpcrl tests/cluster/local_slurm.py. Fake GPUs: char devices 1,3 (copies of /dev/null).
AutoDetect=off
NodeName=n[1-{last}] Name=gpu File={d}/dev/gpu[0-{GPUS_PER_NODE - 1}]
"""
    slurmdbd_conf = f"""\
# Written by hpcrl tests/cluster/local_slurm.py.
AuthType=auth/munge
DbdHost=localhost
DbdPort={SLURMDBD_PORT}
SlurmUser=root
PidFile={d}/run/slurmdbd.pid
LogFile={d}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={MARIADB_PORT}
StorageUser={DB_USER}
StoragePass={db_password}
StorageLoc={DB_NAME}
"""
    return {"slurm.conf": slurm_conf, "gres.conf": gres_conf, "slurmdbd.conf": slurmdbd_conf}


def _db_password(d: Path) -> str:
    f = d / "etc" / "db-password"
    if not f.exists():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(secrets.token_hex(12))
        f.chmod(0o600)
    return f.read_text().strip()


def write_configs(d: Path) -> bool:
    """Create the folder layout and fake GPUs, write the configs, symlink them from /etc/slurm.

    Returns:
        True when any config text changed (running Slurm daemons must then be restarted).

    Raises:
        OSError: a file could not be written (e.g. not root).
    """
    for sub in ("etc", "run", "log", "dev", "spool/ctld", "mysql", *(f"spool/slurmd-{n}" for n in NODES)):
        (d / sub).mkdir(parents=True, exist_ok=True)
    for i in range(GPUS_PER_NODE):
        gpu = d / "dev" / f"gpu{i}"
        if gpu.exists() and not stat.S_ISCHR(gpu.stat().st_mode):
            gpu.unlink()
        if not gpu.exists():
            os.mknod(gpu, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        os.chmod(gpu, 0o666)
    changed = False
    for name, text in render_configs(d, _db_password(d)).items():
        path = d / "etc" / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed = True
        os.chown(path, 0, 0)  # SlurmUser=root; slurmdbd refuses a slurmdbd.conf readable by others
        path.chmod(0o600 if name == "slurmdbd.conf" else 0o644)
        ETC_SLURM.mkdir(parents=True, exist_ok=True)
        link = ETC_SLURM / name
        if link.is_symlink() and os.readlink(link) == str(path):
            continue
        if link.exists() and not link.is_symlink():
            link.rename(link.with_name(name + ".hpcrl-backup"))
        link.unlink(missing_ok=True)
        link.symlink_to(path)
    return changed


def ensure_hosts() -> bool:
    """Make the fake node names resolve: add ``127.0.0.1 n1 n2`` to /etc/hosts if a name is missing.

    The file is rewritten in place (same inode): in containers it is often a bind mount that cannot be
    replaced by rename.

    Returns:
        True when /etc/hosts was changed.
    """
    text = ETC_HOSTS.read_text()
    names = set()
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if fields and fields[0] == "127.0.0.1":
            names.update(fields[1:])
    if all(n in names for n in NODES):
        return False
    with open(ETC_HOSTS, "r+") as f:
        f.seek(0, os.SEEK_END)
        f.write(("" if text.endswith("\n") or not text else "\n") + "127.0.0.1 " + " ".join(NODES)
                + "  # hpcrl local Slurm cluster\n")
    return True


# ----------------------------------------------------------------------------------------------- daemons


def _munge_works() -> bool:
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        if enc.returncode != 0:
            return False
        dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=5)
        return dec.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_munged(d: Path) -> int | None:
    """Start munged unless a working one (ours or the system's) runs; returns our PID or None."""
    if _munge_works():
        return None
    if not MUNGE_KEY.exists():
        _run(["mungekey", "--create", "--keyfile", str(MUNGE_KEY)])
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
    for p in (Path("/run/munge"), Path("/var/log/munge"), Path("/var/lib/munge")):
        p.mkdir(parents=True, exist_ok=True)
        shutil.chown(p, "munge", "munge")
    MUNGE_PIDFILE.unlink(missing_ok=True)
    _spawn_daemon(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--force"], d / "log" / "munged.out")
    munge_log = Path("/var/log/munge/munged.log")
    pid = _wait_for(lambda: _read_pid(MUNGE_PIDFILE), 10, "munged's pid file", munge_log)
    _pidfile(d, "munged").write_text(f"{pid}\n")
    _wait_for(_munge_works, 10, "munge to encode and decode", munge_log)
    return pid


def _mysql(d: Path, sql: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return _run(["mariadb", "--no-defaults", f"--socket={d}/run/mysqld.sock", "-uroot", "-e", sql],
                timeout=timeout)


def _start_mariadb(d: Path) -> int:
    datadir = d / "mysql"
    log = d / "log" / "mariadb.log"
    if not (datadir / "mysql").is_dir():
        _run(["mariadb-install-db", "--no-defaults", f"--datadir={datadir}", "--user=root",
              "--auth-root-authentication-method=socket", "--skip-test-db"], timeout=120)
    sock = d / "run" / "mysqld.sock"
    sock.unlink(missing_ok=True)
    _pidfile(d, "mariadbd").unlink(missing_ok=True)
    # setsid -f: detached in its own session, re-parented to init, no pipes to us.
    _spawn_daemon(["setsid", "-f", "mariadbd", "--no-defaults", f"--datadir={datadir}", "--user=root",
                   "--bind-address=127.0.0.1", f"--port={MARIADB_PORT}", f"--socket={sock}",
                   f"--pid-file={_pidfile(d, 'mariadbd')}", f"--log-error={log}",
                   "--innodb-buffer-pool-size=64M", "--innodb-lock-wait-timeout=900",
                   "--innodb-log-file-size=64M", "--performance-schema=OFF", "--skip-log-bin"],
                  d / "log" / "mariadbd.out")
    pid = _wait_for(lambda: _live_pid(d, "mariadbd"), 60, "MariaDB's pid file", log)

    def ready():
        return subprocess.run(["mariadb", "--no-defaults", f"--socket={sock}", "-uroot", "-e", "SELECT 1"],
                              capture_output=True, timeout=10).returncode == 0
    _wait_for(ready, 60, "MariaDB to accept connections", log, interval=0.2)
    pw = _db_password(d)
    _mysql(d, "".join(
        f"CREATE USER IF NOT EXISTS '{DB_USER}'@'{h}' IDENTIFIED BY '{pw}';"
        f"ALTER USER '{DB_USER}'@'{h}' IDENTIFIED BY '{pw}';"
        f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'{h}';" for h in ("localhost", "127.0.0.1")))
    return pid


def _sacctmgr_ok() -> bool:
    return subprocess.run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=15).returncode == 0


def _foreign_pids(comm: str, ours: set[int]) -> list[int]:
    """PIDs of live processes named ``comm`` that are not in ``ours`` (e.g. a cluster from another folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in ours and _comm(int(entry.name)) == comm \
                and not _is_zombie(int(entry.name)):
            found.append(int(entry.name))
    return found


def _refuse_foreign_slurm(running: dict[str, int]) -> None:
    """Two clusters on one machine would fight over ports 6817/6819 and /etc/slurm: refuse with the PIDs."""
    for comm in ("slurmctld", "slurmdbd"):
        others = _foreign_pids(comm, set(running.values()))
        if others:
            raise ClusterError(f"another {comm} runs (PID {', '.join(map(str, others))}) that this cluster "
                               f"folder did not start (a cluster in another $HPCRL_SLURM_DIR, or the "
                               f"system's); stop it first")


def _start_slurmdbd(d: Path) -> int:
    _pidfile(d, "slurmdbd").unlink(missing_ok=True)
    _spawn_daemon(["/usr/sbin/slurmdbd"], d / "log" / "slurmdbd.out")
    log = d / "log" / "slurmdbd.log"
    pid = _wait_for(lambda: _live_pid(d, "slurmdbd"), 30, "slurmdbd's pid file", log)
    _wait_for(_sacctmgr_ok, 30, "slurmdbd to answer sacctmgr", log, interval=0.2)
    return pid


def _ensure_cluster_registered() -> None:
    out = _run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"]).stdout.split()
    if CLUSTER_NAME not in out:
        _run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME])


def _start_slurmctld(d: Path) -> int:
    _pidfile(d, "slurmctld").unlink(missing_ok=True)
    _spawn_daemon(["/usr/sbin/slurmctld", "-i"], d / "log" / "slurmctld.out")
    log = d / "log" / "slurmctld.log"
    pid = _wait_for(lambda: _live_pid(d, "slurmctld"), 30, "slurmctld's pid file", log)

    def ping():
        return subprocess.run(["scontrol", "ping"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=10).stdout.count("UP") > 0
    _wait_for(ping, 30, "slurmctld to answer `scontrol ping`", log, interval=0.2)
    return pid


def tick(d: Path) -> None:
    """The ``schedtick`` daemon: every :data:`TICK_SECONDS` a no-op ``scontrol update PartitionName=debug
    State=UP`` while slurmctld runs.

    Why: heterogeneous jobs are started only by the backfill scheduler, and Slurm's backfill runs only when
    job, node or partition state changed since its last pass. On this otherwise idle cluster a requeued het job
    whose begin time (``cred_expire`` after the requeue) passes with nothing else happening waits for some
    unrelated event: 30-172 s measured (12 s with this tick), which made the het-job requeue tests take minutes
    at random. A busy real cluster changes state all the time. Runs as ``python3 local_slurm.py tick``."""
    Path("/proc/self/comm").write_text(COMM["schedtick"])
    _pidfile(d, "schedtick").write_text(f"{os.getpid()}\n")
    while _live_pid(d, "slurmctld") is not None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["scontrol", "update", "PartitionName=debug", "State=UP"], capture_output=True,
                           stdin=subprocess.DEVNULL, timeout=10)
        time.sleep(TICK_SECONDS)


def _start_tick(d: Path) -> int:
    _pidfile(d, "schedtick").unlink(missing_ok=True)
    log = d / "log" / "schedtick.out"
    with open(log, "ab") as out:
        subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "tick", "--dir", str(d)],
                         stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    return _wait_for(lambda: _live_pid(d, "schedtick"), 30, "the schedtick pid file", log)


def _start_slurmd(d: Path, node: str) -> int:
    name = f"slurmd-{node}"
    _pidfile(d, name).unlink(missing_ok=True)
    _spawn_daemon(["/usr/sbin/slurmd", "-N", node], d / "log" / f"{name}.out")
    return _wait_for(lambda: _live_pid(d, name), 30, f"{name}'s pid file", d / "log" / f"{name}.log")


def node_states() -> dict[str, str]:
    """Node name -> Slurm state (``idle``, ``mix``, ``alloc``, ``down*``, ...) from ``sinfo``; {} on error."""
    try:
        p = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=10,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if p.returncode != 0:
        return {}
    states = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


READY_STATES = {"idle", "mix", "alloc", "comp"}  # "mix"/"alloc": busy with jobs, only when already up


def _wait_nodes(d: Path, timeout: float, idle_only: bool) -> None:
    want = {"idle"} if idle_only else READY_STATES
    deadline = time.monotonic() + timeout
    resumed = False
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = node_states()
        if all(states.get(n) in want for n in NODES):
            return
        # A node that Slurm set DOWN/DRAIN in an earlier life (e.g. killed slurmd) and that now responds.
        bad = [n for n in NODES if states.get(n, "").rstrip("*$~#@") in {"down", "drain", "drng", "fail"}
               and not states.get(n, "").endswith("*")]
        if bad and not resumed:
            subprocess.run(["scontrol", "update", f"nodename={','.join(bad)}", "state=resume"],
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=10)
            resumed = True
        time.sleep(0.2)
    logs = "\n".join(_tail(d / "log" / f"slurmd-{n}.log", 8) for n in NODES)
    raise ClusterError(f"timed out after {timeout:g} s waiting for nodes {', '.join(NODES)} to be "
                       f"{'idle' if idle_only else 'up'}; sinfo says {states or 'nothing'}\n"
                       f"{_tail(d / 'log' / 'slurmctld.log', 15)}\n{logs}")


# ------------------------------------------------------------------------------------------------ public


def running_daemons(directory: str | os.PathLike | None = None) -> dict[str, int]:
    """Daemons of this cluster that run now, started by this module: name -> PID (pid file + /proc check)."""
    d = cluster_dir(directory)
    return {name: pid for name in START_ORDER if (pid := _live_pid(d, name)) is not None}


def start_cluster(directory: str | os.PathLike | None = None, timeout: float = 120.0) -> ClusterInfo:
    """Install (when missing), configure and start the local cluster; wait until every node is idle.

    Idempotent: with everything up it only checks (about 1 s); with the packages present but daemons down
    it starts the missing ones (a few seconds). A config that changed since the daemons started (e.g. a new
    version of this file) restarts the Slurm daemons.

    Args:
        directory: the cluster folder; default ``$HPCRL_SLURM_DIR`` or ``/tmp/hpcrl-slurm``.
        timeout: seconds to wait for the nodes to become idle after the daemons are up.

    Returns:
        A :class:`ClusterInfo`.

    Raises:
        ClusterError: the machine cannot run it (not root, no apt-get, not Debian; the reason from
            :func:`cluster_available`), or a step failed (message names it, with the log's tail), or nodes
            were not idle within ``timeout`` seconds.
    """
    t0 = time.monotonic()
    ok, reason = cluster_available()
    if not ok:
        raise ClusterError(reason)
    d = cluster_dir(directory)
    with _lock(d):
        installed = install_packages()
        running = running_daemons(d)
        _refuse_foreign_slurm(running)  # before /etc/slurm is pointed here
        changed = write_configs(d)
        ensure_hosts()
        if changed:  # the Slurm daemons must re-read their config
            for name in reversed(START_ORDER):
                if name.startswith("slurm") and name in running:
                    _stop_pid(name, running.pop(name))
        if "schedtick" in running and "slurmctld" not in running:  # it ends with slurmctld: start it afresh
            _stop_pid("schedtick", running.pop("schedtick"))
        started: list[str] = []
        pids = dict(running)
        # munged may be the system's (not ours): then it is used and never stopped.
        if "munged" not in running:
            pid = _start_munged(d)
            if pid is not None:
                pids["munged"] = pid
                started.append("munged")
        if "mariadbd" not in running:
            pids["mariadbd"] = _start_mariadb(d)
            started.append("mariadbd")
        if "slurmdbd" not in running:
            pids["slurmdbd"] = _start_slurmdbd(d)
            started.append("slurmdbd")
            _ensure_cluster_registered()
        if "slurmctld" not in running:
            pids["slurmctld"] = _start_slurmctld(d)
            started.append("slurmctld")
        if "schedtick" not in running:
            pids["schedtick"] = _start_tick(d)
            started.append("schedtick")
        for node in NODES:
            name = f"slurmd-{node}"
            if name not in running:
                pids[name] = _start_slurmd(d, node)
                started.append(name)
        _wait_nodes(d, timeout, idle_only=bool(started))
    return ClusterInfo(directory=d, pids=pids, started=started, installed=installed,
                       seconds=time.monotonic() - t0)


def _stop_pid(name: str, pid: int, timeout: float = 15.0) -> None:
    """SIGTERM a daemon we started (after checking /proc/PID/comm), SIGKILL it after ``timeout`` s."""
    if _comm(pid) != COMM[name]:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _comm(pid) != COMM[name] or _is_zombie(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _cancel_all_jobs(timeout: float = 20.0) -> None:
    """scancel every job, wait until squeue is empty (so no slurmstepd is left behind)."""
    def jobs() -> list[str] | None:
        p = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, timeout=10,
                           stdin=subprocess.DEVNULL)
        return p.stdout.split() if p.returncode == 0 else None
    ids = jobs()
    if not ids:
        return
    subprocess.run(["scancel", *ids], capture_output=True, stdin=subprocess.DEVNULL, timeout=15)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and jobs():
        time.sleep(0.2)


def stop_cluster(directory: str | os.PathLike | None = None) -> list[str]:
    """Cancel all jobs, then stop the daemons this module started, newest first, by PID.

    Only PIDs from this cluster's own pid files are signalled, each after checking ``/proc/PID/comm``; a
    munged this module did not start is left running. Packages, config, database and Slurm state stay, so
    the next :func:`start_cluster` is quick. Each daemon gets SIGTERM and, after 15 s, SIGKILL.

    Returns:
        Names of the daemons that were stopped (empty when none ran).
    """
    d = cluster_dir(directory)
    if not d.exists():
        return []
    with _lock(d):
        running = running_daemons(d)
        if "slurmctld" in running:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                _cancel_all_jobs()
        for name in reversed(START_ORDER):
            if name in running:
                _stop_pid(name, running[name])
        _pidfile(d, "munged").unlink(missing_ok=True)
    return [n for n in reversed(START_ORDER) if n in running]


def cluster_status(directory: str | os.PathLike | None = None) -> dict:
    """Running daemons (name -> PID) and node states, without changing anything.

    Returns:
        ``{"directory": str, "daemons": {name: pid}, "nodes": {node: state}, "up": bool}``; ``up`` is True
        when every Slurm daemon runs and every node is idle, mixed or allocated.
    """
    d = cluster_dir(directory)
    daemons = running_daemons(d) if d.exists() else {}
    nodes = node_states() if "slurmctld" in daemons else {}
    slurm = {"slurmdbd", "slurmctld", *(f"slurmd-{n}" for n in NODES)}
    up = slurm <= daemons.keys() and all(nodes.get(n) in READY_STATES for n in NODES)
    return {"directory": str(d), "daemons": daemons, "nodes": nodes, "up": up}


def main(argv: list[str] | None = None) -> int:
    """Command line: ``start``, ``stop``, ``status`` (or ``tick``, the daemon :func:`start_cluster` starts);
    returns the exit status (1 on error / not up)."""
    ap = argparse.ArgumentParser(prog="local_slurm.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("start", "stop", "status", "tick"))
    ap.add_argument("--dir", default=None,
                    help="cluster folder (default $HPCRL_SLURM_DIR or /tmp/hpcrl-slurm)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for idle nodes (start)")
    args = ap.parse_args(argv)
    try:
        if args.action == "start":
            info = start_cluster(args.dir, timeout=args.timeout)
            print(info.to_json())
            what = f"started {', '.join(info.started)}" if info.started else "already up"
            print(f"local Slurm cluster {what} in {info.seconds:.1f} s"
                  f"{' (packages installed)' if info.installed else ''}", file=sys.stderr)
        elif args.action == "tick":
            tick(cluster_dir(args.dir))
        elif args.action == "stop":
            t0 = time.monotonic()
            stopped = stop_cluster(args.dir)
            print(f"stopped {', '.join(stopped) or 'nothing'} in {time.monotonic() - t0:.1f} s")
        else:
            st = cluster_status(args.dir)
            print(json.dumps(st, indent=2))
            return 0 if st["up"] else 1
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
