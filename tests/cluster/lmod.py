#!/usr/bin/env python3
"""Real Lmod on a Debian machine, for the test of hpcrl's modulefile (modules/hpcrl.lua).

As root on Debian this installs the Debian package ``lmod`` (only when Lmod is missing) and says how to run
it: the bash init script that defines the ``module`` shell function (``/usr/share/lmod/lmod/init/bash`` on
Debian) and the Lmod program behind it (``$LMOD_CMD``, ``.../libexec/lmod``). Nothing is started or kept
running: Lmod is a command, not a daemon.

Command line (stdlib only, so it runs with any python3)::

    python tests/cluster/lmod.py          # install if missing, print the init script, LMOD_CMD and version

From Python: :func:`lmod_available`, :func:`ensure_lmod` (returns :class:`Lmod`), :meth:`Lmod.shell`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

APT_PACKAGE = "lmod"
# Lmod's own install folders (LMOD_PKG), most likely first: Debian/Ubuntu's package, Lmod's default prefix,
# EasyBuild/RPM-style installs. $LMOD_PKG of the calling environment goes before them.
LMOD_PKG_CANDIDATES = ("/usr/share/lmod/lmod", "/opt/apps/lmod/lmod", "/usr/local/lmod/lmod",
                       "/opt/lmod/lmod")


class LmodError(RuntimeError):
    """Lmod could not be found or installed (the message says which step failed and why)."""


@dataclass(frozen=True)
class Lmod:
    """How to run an installed Lmod.

    Attributes:
        init: the bash init script; sourcing it defines the ``module`` and ``ml`` shell functions.
        cmd: Lmod's program (``$LMOD_CMD``): ``cmd bash load X`` prints the bash code that ``module load X``
            evaluates.
        version: Lmod's version (e.g. ``8.6.19``), or ``""`` when it could not be read.
        installed: True when this process ran apt-get to install it.
    """

    init: Path
    cmd: Path
    version: str = ""
    installed: bool = False

    def shell(self, script: str, *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
              timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``script`` in a fresh non-login bash that has sourced Lmod's init script first.

        ``bash --noprofile --norc`` is used so that nothing of the machine's or the user's dot files changes
        the result; the script sees exactly ``env`` (default: a copy of ``os.environ``) plus what the init
        script sets (``LMOD_CMD``, ``MODULESHOME``, ...; it leaves ``MODULEPATH`` alone). Output is captured
        as text; the exit status is the script's.
        """
        return subprocess.run(
            ["bash", "--noprofile", "--norc", "-c", f'source "{self.init}" >/dev/null || exit 97\n{script}'],
            capture_output=True, text=True, env=dict(os.environ) if env is None else env, cwd=cwd,
            timeout=timeout, stdin=subprocess.DEVNULL)

    def to_json(self) -> str:
        """The info as a JSON object (paths as strings)."""
        d = asdict(self)
        d["init"], d["cmd"] = str(self.init), str(self.cmd)
        return json.dumps(d, indent=2)


def find_lmod() -> Lmod | None:
    """The installed Lmod (init script and program both present), or None. Installs and runs nothing."""
    candidates = [os.environ["LMOD_PKG"]] if os.environ.get("LMOD_PKG") else []
    for pkg in dict.fromkeys([*candidates, *LMOD_PKG_CANDIDATES]):
        init, cmd = Path(pkg) / "init" / "bash", Path(pkg) / "libexec" / "lmod"
        if init.is_file() and cmd.is_file():
            return Lmod(init=init, cmd=cmd, version=_version(init))
    return None


def _version(init: Path) -> str:
    # The init script exports LMOD_VERSION="X.Y.Z"; reading it avoids running Lmod (which prints to stderr).
    try:
        for line in init.read_text(errors="replace").splitlines():
            if line.startswith("LMOD_VERSION="):
                return line.split("=", 1)[1].strip().strip("\"'")
    except OSError:
        pass
    return ""


def lmod_available() -> tuple[bool, str]:
    """Whether this machine has Lmod or can install it, and if not, why.

    Lmod already installed: yes, on any machine. Otherwise it needs root on Linux with Debian
    (``/etc/debian_version``) and ``apt-get``. Installs and changes nothing.

    Returns:
        ``(True, "")`` or ``(False, reason)`` where reason is one sentence a test failure can show.
    """
    if find_lmod() is not None:
        return True, ""
    if not sys.platform.startswith("linux"):
        return False, f"Lmod is not installed and installing it needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, (f"Lmod is not installed and installing the Debian package {APT_PACKAGE!r} needs root; "
                       f"this process runs as uid {os.geteuid()}")
    if not Path("/etc/debian_version").exists():
        return False, (f"Lmod is not installed and installing it needs Debian (no /etc/debian_version): this "
                       f"helper installs the Debian package {APT_PACKAGE!r}")
    if shutil.which("apt-get") is None:
        return False, f"Lmod is not installed and apt-get (to install {APT_PACKAGE!r}) is not on PATH"
    return True, ""


def _apt(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    except subprocess.TimeoutExpired as e:
        raise LmodError(f"{' '.join(cmd)} did not finish in {timeout:g} s") from e


def install_lmod() -> bool:
    """Install the Debian package ``lmod`` when Lmod is missing (``apt-get install --no-install-recommends``).

    ``apt-get update`` runs only when that install fails (e.g. empty package lists), and then the install is
    tried once more.

    Returns:
        True when apt-get installed it, False when Lmod was already there.

    Raises:
        LmodError: the machine cannot install it (the reason from :func:`lmod_available`), apt-get failed
            (with its output's tail), or Lmod is still not found afterwards.
    """
    if find_lmod() is not None:
        return False
    ok, reason = lmod_available()
    if not ok:
        raise LmodError(reason)
    # Another apt-get (e.g. the Slurm fixture of a parallel test session) may hold dpkg's lock: wait for it.
    wait = ["-o", "DPkg::Lock::Timeout=300"]
    cmd = ["apt-get", *wait, "install", "-y", "-q", "--no-install-recommends", APT_PACKAGE]
    p = _apt(cmd, timeout=600)
    if p.returncode != 0:
        u = _apt(["apt-get", *wait, "update", "-q"], timeout=600)
        if u.returncode != 0:
            raise LmodError(f"apt-get install {APT_PACKAGE} failed, and so did apt-get update (exit "
                            f"{u.returncode}):\n{(u.stdout + u.stderr)[-2000:]}")
        p = _apt(cmd, timeout=600)
        if p.returncode != 0:
            raise LmodError(f"apt-get install {APT_PACKAGE} failed (exit {p.returncode}), also after apt-get "
                            f"update:\n{(p.stdout + p.stderr)[-2000:]}")
    if find_lmod() is None:
        raise LmodError(f"apt-get installed {APT_PACKAGE!r} but no Lmod init script was found under "
                        f"{', '.join(dict.fromkeys(LMOD_PKG_CANDIDATES))}")
    return True


def ensure_lmod() -> Lmod:
    """Lmod, installed first when missing (see :func:`install_lmod`).

    Raises:
        LmodError: as :func:`install_lmod`.
    """
    installed = install_lmod()
    lmod = find_lmod()
    assert lmod is not None  # install_lmod raised otherwise
    return Lmod(init=lmod.init, cmd=lmod.cmd, version=lmod.version, installed=installed)


def main(argv: list[str] | None = None) -> int:
    """Install Lmod when missing and print how to run it (JSON); exit 1 with the reason when it cannot."""
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        lmod = ensure_lmod()
    except LmodError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(lmod.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
