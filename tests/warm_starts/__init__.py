"""SFT warm starts made once by hpcrl's own SFT and shipped with the tests (issue #52 point 2).

The e2e tests whose subject is RL on a family (chat data, OPD, DeepSeek-V3, GLM-4.5, the Slurm quickstarts)
start from these instead of training their warm start again in every CI run (that was ~15 minutes of each run).
Each entry of :data:`WARM_STARTS` is a config of ``configs/`` whose warm starts (:func:`hpcrl.sft.warm_start_plan`:
the policy's, and an OPD teacher's) were made by ``hpcrl sft`` from a fresh folder and copied here, one folder per
store (``tests/warm_starts/<entry>/<basename of sft.output>/``: the HF folder, ``sft_key.json`` - the cache key
it was made under - and ``sft_metrics.jsonl``), with ``made.json`` saying how, where and when, and the sha256 of
every file.

A test calls :func:`install` to put them where the config's run looks for its cache: the base model is created at
``model.path`` and each shipped folder is placed in its store under its key's digest, with ``sft.output``
linked to it, so ``hpcrl run`` of the config finds the warm start exactly as it finds one it made itself
("sft: ... using it") and goes straight to RL.

**The base model is created with torch's AVX2 kernels** (``ATEN_CPU_CAPABILITY=avx2`` in a subprocess):
random init is not the same on every CPU. torch's ``normal_`` fills float32 tensors with its AVX2 code only in
its AVX2 kernels; the AVX-512 kernels take the scalar path, so the same seed gives another tiny model (and so
another cache key) on an AVX-512 machine than on an AVX2-only one (measured 2026-12-06: the four tiny families'
files differ between ``ATEN_CPU_CAPABILITY=avx2`` and ``default``). Every x86-64 CPU of the project's machine
kind runs the AVX2 kernels, so the base, and the key, are the same everywhere.

:func:`check` (``tests/unit/test_warm_starts.py``) fails when a config's recipe, the tiny model's definition or
anything else in the key changed since an entry was made, or a shipped file changed, and names the command that
rebuilds it::

    .venv/bin/python -m tests.warm_starts build NAME [NAME ...]    # a few minutes each, both cores
    .venv/bin/python -m tests.warm_starts check                    # what the unit test checks
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = Path(__file__).resolve().parent
MADE_FILENAME = "made.json"


@dataclass(frozen=True)
class ShippedWarmStart:
    """One config whose warm starts are shipped: ``name`` (its folder here), ``config`` (relative to the
    repository) and the ``overrides`` it is made with (none: the config as users run it)."""

    name: str
    config: str
    overrides: tuple[str, ...] = ()

    @property
    def folder(self) -> Path:
        return SHIPPED / self.name

    def build_command(self) -> str:
        return f".venv/bin/python -m tests.warm_starts build {self.name}"


WARM_STARTS = {w.name: w for w in (
    # the quickstart's SFT (tiny Qwen2, addition, to 40%): chat data, OPD's student, the Slurm quickstarts
    ShippedWarmStart("quickstart", "configs/quickstart.yaml"),
    # the same recipe on to 60%: OPD's teacher (the OPD config's own recipe, lr 3e-3 from seed 1234's model,
    # had not passed 10% after 680 steps on an AVX2 EPYC, 2026-12-06: too slow a lottery for a shipped entry)
    ShippedWarmStart("quickstart-teacher", "configs/quickstart.yaml",
                     ("sft.target_accuracy=0.6", "sft.output=.cache/models/tiny-qwen2-addition-teacher")),
    ShippedWarmStart("deepseek-v3", "configs/deepseek-v3-quickstart.yaml"),
    ShippedWarmStart("glm4-moe", "configs/glm4-moe-quickstart.yaml"),
)}
"""The shipped entries by name."""


def load(ws: ShippedWarmStart, *overrides: str):
    """The entry's config (the repository's file, its overrides, then ``overrides``), checked as a run's."""
    from hpcrl.config import load_config

    return load_config(ROOT / ws.config, [*ws.overrides, *overrides], check_files=False)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def create_base(ws: ShippedWarmStart, dest: Path, fresh: bool = False) -> Path:
    """Create the entry's base model at ``dest`` (as its run would from ``model.create``, with ``run.seed``)
    with torch's AVX2 kernels (module doc), in a subprocess; returns ``dest``. A base model of the same
    ``model`` section and seed made earlier in this process is copied instead unless ``fresh``. Raises
    CalledProcessError."""
    import dataclasses

    cfg = load(ws)
    what = json.dumps([{k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "path"}, cfg.run.seed],
                      sort_keys=True, default=str)
    made = None if fresh else _BASES.get(what)
    if made is not None and made.is_dir():
        shutil.copytree(made, dest)
        return dest
    code = ("import sys; from hpcrl.config import load_config; from hpcrl.stages import prepare_base; "
            "cfg = load_config(sys.argv[1], sys.argv[2:], check_files=False); prepare_base(cfg)")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    subprocess.run([sys.executable, "-c", code, str(ROOT / ws.config), *ws.overrides, f"model.path={dest}"],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    if not fresh:
        keep = Path(tempfile.mkdtemp(prefix="hpcrl-base-")) / "base"
        atexit.register(shutil.rmtree, keep.parent, True)
        shutil.copytree(dest, keep)
        _BASES[what] = keep
    return dest


_BASES: dict[str, Path] = {}
"""The base models :func:`create_base` made in this process, by model section and seed (copies kept aside)."""


def stores(ws: ShippedWarmStart, cfg=None) -> list[tuple[str, object]]:
    """The entry's stores as ``(folder name here, config that makes it)``: :func:`hpcrl.sft.warm_start_plan`
    of its config, each named by the basename of its ``sft.output``."""
    from hpcrl.sft import warm_start_plan

    return [(Path(c.sft.output).name, c) for _, c in warm_start_plan(cfg if cfg is not None else load(ws))]


def shipped_key(ws: ShippedWarmStart, store: str) -> dict:
    from hpcrl.sft import KEY_FILENAME

    return json.loads((ws.folder / store / KEY_FILENAME).read_text())


def install(name: str, folder: Path) -> dict[str, Path]:
    """Put entry ``name``'s warm starts where its config's run, started in ``folder``, finds them: the base
    model at ``folder/<model.path>`` (:func:`create_base`) and each store's shipped folder at
    ``folder/<sft.output>.d/<digest>/`` with ``sft.output`` linked to it. Returns ``{"base": path, <store>:
    the installed HF folder, ...}``."""
    from hpcrl.sft import WarmStartStore, key_digest

    ws = WARM_STARTS[name]
    cfg = load(ws)
    out = {"base": create_base(ws, folder / cfg.model.path)}
    for store, c in stores(ws, cfg):
        ws_store = WarmStartStore(folder / c.sft.output)
        digest = key_digest(shipped_key(ws, store))
        shutil.copytree(ws.folder / store, ws_store.folder(digest))
        ws_store.link(digest)
        out[store] = ws_store.folder(digest)
    return out


def run_from_shipped(config: str, name: str, folder: Path, *overrides: str, timeout: float = 1800
                     ) -> tuple[int, dict[str, Path]]:
    """``hpcrl run run.yaml OVERRIDES`` of ``configs/<config>`` copied into ``folder``, after :func:`install` of
    entry ``name``'s warm starts there, as a user runs it (a new interpreter, offline HF), output in
    ``folder/out.log`` (a file, not a pipe: torch's shm manager keeps pipes open). Returns ``(exit status,
    install's result)``."""
    shutil.copy(ROOT / "configs" / config, folder / "run.yaml")
    shipped = install(name, folder)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(folder / "out.log", "wb") as log:
        rc = subprocess.run([sys.executable, "-m", "hpcrl", "run", "run.yaml", *overrides], cwd=folder, env=env,
                            stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    return rc, shipped


def used_as_shipped(folder: Path, sft_output: str, shipped: dict[str, Path]) -> list[tuple[int, float]]:
    """After a run in ``folder`` of a config whose ``sft.output`` is ``sft_output``: assert that it trained no
    SFT of its own (no ``*.run`` folder in the store) and that its cache still names the folder :func:`install`
    placed (``shipped``, its return value). Returns that warm start's SFT evals, ``[(step, greedy accuracy)]``.
    Raises AssertionError otherwise."""
    sft_dir = folder / sft_output
    assert not list(sft_dir.with_name(sft_dir.name + ".d").glob("*.run")), "the run trained its own SFT"
    assert sft_dir.resolve() == shipped[sft_dir.name].resolve()
    rows = [json.loads(x) for x in (sft_dir / "sft_metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]


def check(name: str) -> list[str]:
    """What no longer matches for entry ``name``: a store not shipped, a shipped file whose sha256 is not the one
    recorded, a key that the config and a freshly created base model no longer give (with the fields that
    differ). Empty when the entry is current. Creates the base model in a temporary folder."""
    from hpcrl.sft import cache_key

    ws = WARM_STARTS[name]
    fix = f"rebuild it: {ws.build_command()}"
    made_path = ws.folder / MADE_FILENAME
    if not made_path.is_file():
        return [f"tests/warm_starts/{name} is not shipped ({MADE_FILENAME} missing); {fix}"]
    made = json.loads(made_path.read_text())
    problems = []
    cfg = load(ws)
    with tempfile.TemporaryDirectory() as tmp:
        base = create_base(ws, Path(tmp) / "base")
        for store, c in stores(ws, cfg):
            recorded = made.get("stores", {}).get(store)
            if recorded is None or not (ws.folder / store).is_dir():
                problems.append(f"tests/warm_starts/{name}/{store} is not shipped; {fix}")
                continue
            for rel, digest in recorded["files"].items():
                path = ws.folder / store / rel
                if not path.is_file() or sha256_file(path) != digest:
                    problems.append(f"tests/warm_starts/{name}/{store}/{rel} is not the file that was made; {fix}")
            want = json.loads(json.dumps(cache_key(c, base)))
            have = shipped_key(ws, store)
            if want != have:
                diff = sorted(_diff(have, want))
                problems.append(f"tests/warm_starts/{name}/{store} was made under another cache key "
                                f"(now different: {', '.join(diff)}): the recipe or the tiny model changed; {fix}")
    return problems


def _diff(a, b, prefix: str = "") -> Iterable[str]:
    """The dotted keys where two JSON objects differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in set(a) | set(b):
            yield from _diff(a.get(k), b.get(k), f"{prefix}{k}.")
    elif a != b:
        yield prefix.rstrip(".") or "(root)"


def build(name: str, keep: Optional[Path] = None) -> dict:
    """Make entry ``name`` anew: ``hpcrl sft`` of its config in a fresh folder whose base model is
    :func:`create_base`'s, then copy each store's folder here (replacing the old one) and write ``made.json``.
    ``keep``: build there instead of a temporary folder (and leave it). Returns the ``made.json`` content.
    Raises CalledProcessError when the SFT run fails."""
    import datetime

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from machine import machine_header  # benchmarks/machine.py

    ws = WARM_STARTS[name]
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=f"warm-start-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = load(ws)
    create_base(ws, work / cfg.model.path)
    shutil.copy(ROOT / ws.config, work / "run.yaml")
    hpcrl = Path(sys.executable).with_name("hpcrl")
    t0 = time.time()
    with open(work / "sft.log", "wb") as log:
        subprocess.run([str(hpcrl), "sft", "run.yaml", *ws.overrides], cwd=work, stdout=log, stderr=subprocess.STDOUT,
                       check=True, env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    seconds = time.time() - t0
    made = {"config": ws.config, "overrides": list(ws.overrides), "command": ws.build_command(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_header(threads=int(os.environ.get("OMP_NUM_THREADS") or 0) or None),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "seconds": round(seconds, 1), "stores": {}}
    for store, c in stores(ws, cfg):
        src = (work / c.sft.output).resolve()
        dst = ws.folder / store
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        curve = [json.loads(x) for x in (dst / "sft_metrics.jsonl").read_text().splitlines()]
        evals = [(r["step"], r["eval_accuracy"]) for r in curve if "eval_accuracy" in r]
        made["stores"][store] = {
            "sft_steps": evals[-1][0], "last_eval": evals[-1][1],
            "files": {p.relative_to(dst).as_posix(): sha256_file(p)
                      for p in sorted(dst.rglob("*")) if p.is_file()}}
    (ws.folder / MADE_FILENAME).write_text(json.dumps(made, indent=1) + "\n")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return made


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.warm_starts", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("build", "check", "list"))
    p.add_argument("names", nargs="*", help=f"entries (default: all): {', '.join(WARM_STARTS)}")
    p.add_argument("--keep", type=Path, help="build: in this folder, and keep it")
    a = p.parse_args(argv)
    names = a.names or list(WARM_STARTS)
    unknown = [n for n in names if n not in WARM_STARTS]
    if unknown:
        p.error(f"unknown entries {unknown}; known: {', '.join(WARM_STARTS)}")
    if a.command == "list":
        for n in names:
            made = WARM_STARTS[n].folder / MADE_FILENAME
            info = json.loads(made.read_text()) if made.is_file() else {}
            stores_ = ", ".join(f"{s} (step {v['sft_steps']}, {v['last_eval']:.3f})"
                                for s, v in info.get("stores", {}).items())
            print(f"{n}: {WARM_STARTS[n].config}: {stores_ or 'not built'}; {info.get('date', '')}")
        return 0
    if a.command == "build":
        for n in names:
            made = build(n, a.keep / n if a.keep else None)
            print(f"{n}: built in {made['seconds']:.0f} s: " + ", ".join(
                f"{s} step {v['sft_steps']} eval {v['last_eval']:.3f}" for s, v in made["stores"].items()))
        return 0
    bad = [line for n in names for line in check(n)]
    print("\n".join(bad) if bad else f"current: {', '.join(names)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
