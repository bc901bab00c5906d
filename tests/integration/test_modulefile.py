"""modules/hpcrl.lua under real Lmod (Debian's ``lmod`` package, installed on demand by the `lmod` fixture).

Every test runs a fresh bash with a clean environment (no venv on PATH, no HPCRL_* variables, HOME in a
temporary folder so Lmod's caches stay there) and the layouts the modulefile supports: this checkout
(``module use REPO/modules``), a site install (the file copied to ``MODULEPATH/hpcrl/<version>.lua`` with
``site_root`` edited, exactly as modules/README.md tells admins), and the Apptainer image's ``/opt/hpcrl``
(recreated in a temporary folder: the image itself cannot be built here).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import hpcrl

pytestmark = [pytest.mark.integration, pytest.mark.lmod, pytest.mark.timeout(300)]  # first use may apt-get

REPO = Path(__file__).resolve().parents[2]
MODULEFILE = REPO / "modules" / "hpcrl.lua"
VENV_HPCRL = REPO / ".venv" / "bin" / "hpcrl"
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SITE_ROOT_LINE = re.compile(r'^local site_root = ".*"$', re.M)
SED = 'sed "s|^local site_root = .*|local site_root = \\"$PREFIX\\"|"'  # as in modules/README.md


@pytest.fixture(scope="module")
def venv_hpcrl():
    """The checkout's ``.venv/bin/hpcrl`` (what .ci/install makes), the command the modulefile must find."""
    if not VENV_HPCRL.is_file():
        pytest.fail(f"{VENV_HPCRL} does not exist: the modulefile takes hpcrl from the checkout's .venv, "
                    f"which `bash .ci/install` creates", pytrace=False)
    return VENV_HPCRL


def clean_env(home: Path, modulepath: Path | str, **extra: str) -> dict[str, str]:
    env = {"HOME": str(home), "USER": "root", "LOGNAME": "root", "PATH": CLEAN_PATH, "LANG": "C.UTF-8",
           "TERM": "dumb", "MODULEPATH": str(modulepath)}
    env.update(extra)
    return env


def run(lmod, script: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    p = lmod.shell(script, env=env, cwd=cwd)
    print(f"--- script ---\n{script}\n--- exit {p.returncode} ---\n{p.stdout}\n--- stderr ---\n{p.stderr}")
    return p


def values(stdout: str) -> dict[str, str]:
    """``key=value`` lines the scripts echo (the first ``=`` splits)."""
    return dict(line.split("=", 1) for line in stdout.splitlines() if re.match(r"^[a-z_]+=", line))


LOAD_UNLOAD = """
echo "before=$(command -v hpcrl || echo none)"
module load {name} && hpcrl --version && which hpcrl || exit 10
echo "home=$HPCRL_HOME"
echo "loaded=$(module -t list 2>&1 | tr '\\n' ' ')"
module unload hpcrl || exit 11
echo "after=$(command -v hpcrl || echo none)"
echo "path=$PATH"
echo "home_after=${{HPCRL_HOME-unset}}"
"""


def check_load_unload(p: subprocess.CompletedProcess, expected_hpcrl: Path, expected_home: Path, loaded: str,
                      path_before: str = CLEAN_PATH, home_after: str = "unset") -> dict[str, str]:
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    v = values(p.stdout)
    assert f"hpcrl {hpcrl.__version__}" in lines  # `hpcrl --version` printed exactly this
    assert str(expected_hpcrl) in lines  # `which hpcrl`
    assert v["home"] == str(expected_home)
    assert v["loaded"].split() == [loaded]
    assert v["path"] == path_before  # unload removed exactly what load added
    assert v["home_after"] == home_after
    return v


def test_checkout_load_version_which_unload(lmod, venv_hpcrl, tmp_path):
    """`module use REPO/modules; module load hpcrl` puts the checkout's venv hpcrl on PATH; unload undoes
    it."""
    p = run(lmod, LOAD_UNLOAD.format(name="hpcrl"), clean_env(tmp_path, REPO / "modules"), tmp_path)
    v = check_load_unload(p, venv_hpcrl, REPO, loaded="hpcrl")
    assert v["before"] == "none" and v["after"] == "none"


def test_checkout_in_a_login_shell(lmod, venv_hpcrl, tmp_path):
    """How users get `module`: a login shell (`bash -lc`) that runs Debian's /etc/profile.d/lmod.sh."""
    if not Path("/etc/profile.d/lmod.sh").is_file():
        pytest.skip("no /etc/profile.d/lmod.sh (Lmod not from the Debian package): no login hook to test")
    env = clean_env(tmp_path, REPO / "modules")
    p = subprocess.run(["bash", "-lc", "module load hpcrl && hpcrl --version && which hpcrl"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines()[-2:] == [f"hpcrl {hpcrl.__version__}", str(venv_hpcrl)]


def test_help_whatis_avail(lmod, tmp_path):
    script = "module help hpcrl 2>&1; echo '@@'; module whatis hpcrl 2>&1; echo '@@'; module -t avail 2>&1"
    p = run(lmod, script, clean_env(tmp_path, REPO / "modules"), tmp_path)
    assert p.returncode == 0, p.stderr
    help_text, whatis_text, avail = p.stdout.split("@@")  # Lmod writes these to stderr, hence 2>&1
    assert 'Module Specific Help for "hpcrl"' in help_text
    for words in ("hpcrl submit run.yaml", "hpcrl status", "hpcrl run run.yaml", "HPCRL_HOME", "apptainer"):
        assert words in help_text, words
    assert re.search(r"^hpcrl\s*: Name: hpcrl$", whatis_text, re.M)
    assert re.search(r"^hpcrl\s*: Description: .*Slurm", whatis_text, re.M)
    assert "hpcrl" in avail.split()


def test_site_install_as_readme_says(lmod, venv_hpcrl, tmp_path):
    """The admin's steps from modules/README.md: a venv under the site root, the modulefile copied to
    MODULEPATH/hpcrl/<version>.lua with site_root edited; users then `module load hpcrl[/<version>]`."""
    site_root = tmp_path / "apps" / "hpcrl" / hpcrl.__version__
    (site_root / "venv" / "bin").mkdir(parents=True)
    # Stands for `python3 -m venv SITE_ROOT/venv && SITE_ROOT/venv/bin/pip install hpcrl` (too slow here).
    (site_root / "venv" / "bin" / "hpcrl").symlink_to(venv_hpcrl)
    modulepath = tmp_path / "apps" / "modulefiles"
    (modulepath / "hpcrl").mkdir(parents=True)
    assert len(SITE_ROOT_LINE.findall(MODULEFILE.read_text())) == 1, "README's sed edits this one line"
    readme = (REPO / "modules" / "README.md").read_text()
    assert SED in readme, "the test runs the sed line of modules/README.md"
    dest = modulepath / "hpcrl" / f"{hpcrl.__version__}.lua"
    env = {"PATH": CLEAN_PATH, "PREFIX": str(site_root), "SRC": str(MODULEFILE), "DEST": str(dest)}
    subprocess.run(["bash", "-c", f'{SED} "$SRC" > "$DEST"'], check=True, timeout=30, env=env)
    assert f'local site_root = "{site_root}"' in dest.read_text().splitlines()

    env = clean_env(tmp_path, modulepath)
    for name in ("hpcrl", f"hpcrl/{hpcrl.__version__}"):
        p = run(lmod, LOAD_UNLOAD.format(name=name), env, tmp_path)
        check_load_unload(p, site_root / "venv" / "bin" / "hpcrl", site_root,
                          loaded=f"hpcrl/{hpcrl.__version__}")
    p = run(lmod, "module -t avail", env, tmp_path)
    assert f"hpcrl/{hpcrl.__version__}" in (p.stdout + p.stderr).split()


def test_image_layout(lmod, venv_hpcrl, tmp_path):
    """The container variant: inside the image (singularity/hpcrl.def) hpcrl lives in /opt/hpcrl with the
    command in /opt/hpcrl/bin, the unchanged modulefile in /opt/hpcrl/modules, and %environment already sets
    HPCRL_HOME and PATH. Loading finds that layout; unloading leaves the image's own settings in place."""
    opt = tmp_path / "opt" / "hpcrl"
    for sub in ("modules", "hpcrl", "bin", "sbatch"):
        (opt / sub).mkdir(parents=True)
    shutil.copy(MODULEFILE, opt / "modules" / "hpcrl.lua")
    shutil.copy(REPO / "hpcrl" / "__init__.py", opt / "hpcrl" / "__init__.py")
    (opt / "bin" / "hpcrl").symlink_to(venv_hpcrl)  # hpcrl.def: ln -sf "$(command -v hpcrl)" /opt/hpcrl/bin/

    # Without the image's %environment (someone runs `module use /opt/hpcrl/modules` by hand):
    p = run(lmod, LOAD_UNLOAD.format(name="hpcrl"), clean_env(tmp_path, opt / "modules"), tmp_path)
    check_load_unload(p, opt / "bin" / "hpcrl", opt, loaded="hpcrl")

    # With it: HPCRL_HOME and PATH were set before the load, and stay after the unload.
    image_path = f"{opt / 'bin'}:{CLEAN_PATH}"
    env = clean_env(tmp_path, opt / "modules", PATH=image_path, HPCRL_HOME=str(opt))
    p = run(lmod, LOAD_UNLOAD.format(name="hpcrl"), env, tmp_path)
    v = check_load_unload(p, opt / "bin" / "hpcrl", opt, loaded="hpcrl", path_before=image_path,
                          home_after=str(opt))
    assert v["after"] == str(opt / "bin" / "hpcrl")


def test_hpcrl_root_wins_and_unload_undoes_it(lmod, venv_hpcrl, tmp_path):
    """$HPCRL_ROOT at load time picks another install; unloading undoes that load even after HPCRL_ROOT
    changed (the modulefile then goes by the HPCRL_HOME its load set)."""
    other = tmp_path / "other"
    (other / ".venv" / "bin").mkdir(parents=True)
    (other / ".venv" / "bin" / "hpcrl").symlink_to(venv_hpcrl)
    script = """
export HPCRL_ROOT={other}
module load hpcrl && hpcrl --version && which hpcrl || exit 10
echo "home=$HPCRL_HOME"
unset HPCRL_ROOT
module unload hpcrl || exit 11
echo "path=$PATH"
""".format(other=other)
    p = run(lmod, script, clean_env(tmp_path, REPO / "modules"), tmp_path)
    assert p.returncode == 0, p.stderr
    assert str(other / ".venv" / "bin" / "hpcrl") in p.stdout.splitlines()
    assert values(p.stdout) == {"home": str(other), "path": CLEAN_PATH}


def test_missing_install_fails_with_a_message(lmod, tmp_path):
    script = 'module load hpcrl; echo "rc=$?"; echo "path=$PATH"; echo "loaded=$(module -t list 2>&1)"'
    env = clean_env(tmp_path, REPO / "modules", HPCRL_ROOT=str(tmp_path / "nowhere"))
    p = run(lmod, script, env, tmp_path)
    v = values(p.stdout)
    assert v["rc"] != "0" and v["path"] == CLEAN_PATH and "hpcrl" not in v["loaded"]
    message = " ".join(p.stderr.split())  # Lmod wraps its messages at 80 columns
    assert f"hpcrl: no hpcrl command in {tmp_path / 'nowhere' / 'bin'}" in message
    assert "Set HPCRL_ROOT" in message and "site_root" in message
