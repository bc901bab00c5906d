"""``slurm.container``: every job step runs inside an Apptainer/Singularity image.

A step's command ``CMD ...`` becomes::

    apptainer exec [--nv] --bind RUN_FOLDER,WORKDIR[,...] [--env KEY=VALUE ...] IMAGE CMD ...

* ``--nv`` when the step's group has GPUs (``slurm.gpus_per_node`` for the trainer,
  ``slurm.rollout.gpus_per_node`` for the rollout group of a disaggregated job). ``CUDA_VISIBLE_DEVICES`` and
  every ``SLURM_*`` variable pass into the container unchanged (Apptainer keeps the host environment), so the
  devices are the ones Slurm gave the step.
* ``--bind``: the run folder, the submit directory (relative model/data paths and the job's working
  directory), the nearest existing folder of every absolute path the config reads or writes outside those two
  (``model.path``, ``sft.output``, data files, OPD teachers), and the comma-separated folders in ``$HPCRL_CONTAINER_BINDS``
  (e.g. ``/scratch,/etc/slurm`` for sites whose steps call Slurm commands from inside the image).
* ``--env``: for torch-memory-saver in a colocated GPU trainer, ``LD_PRELOAD`` = the preload library inside
  the image (:data:`TMS_PRELOAD_IN_IMAGE`, made by ``singularity/hpcrl.def``; ``$HPCRL_TMS_PRELOAD`` overrides
  it), ``TMS_INIT_ENABLE=1`` and ``TMS_INIT_ENABLE_CPU_BACKUP=1``; every ``TMS_*`` variable of the submitting
  shell is passed too and wins. ``LD_PRELOAD`` is set only inside the container, never for the host's srun.
* The runtime is ``apptainer`` unless ``$HPCRL_CONTAINER_RUNTIME`` names another (``singularity``).

All functions are pure: the environment is an argument, so the same inputs give the same command line.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Mapping, Optional

from hpcrl.config import Config

TMS_PRELOAD_IN_IMAGE = "/opt/hpcrl/lib/torch_memory_saver_preload.so"
"""Path of torch-memory-saver's LD_PRELOAD hook inside the hpcrl image (a symlink made by hpcrl.def)."""
RUNTIME_ENV = "HPCRL_CONTAINER_RUNTIME"
BINDS_ENV = "HPCRL_CONTAINER_BINDS"
TMS_PRELOAD_ENV = "HPCRL_TMS_PRELOAD"


def _is_under(path: Path, parent: Path) -> bool:
    try:
        path.relative_to(parent)
        return True
    except ValueError:
        return False


def _nearest_existing(path: Path) -> Optional[Path]:
    for p in (path, *path.parents):
        if p.exists():
            return None if p == Path(p.anchor) else p
    return None


def container_binds(cfg: Config, run_dir: str | os.PathLike, cwd: str | os.PathLike,
                    environ: Mapping[str, str]) -> list[str]:
    """Host folders bound into the container, in a fixed order without repeats (see the module doc).

    Args:
        cfg: the run's config.
        run_dir: absolute run folder.
        cwd: the submit (working) directory of the job.
        environ: environment to read ``$HPCRL_CONTAINER_BINDS`` from.
    """
    run_dir, cwd = Path(run_dir), Path(cwd)
    binds: list[str] = [str(run_dir), str(cwd)]
    data_files = [p for p in (cfg.data.source, cfg.data.eval_source or "")
                  if p.endswith((".jsonl", ".parquet"))]
    teachers = [t.path for t in cfg.algorithm.opd.teachers]
    for p in (cfg.model.path, cfg.sft.output, cfg.model.gguf_file or "", *data_files, *teachers):
        if not p or not os.path.isabs(p):
            continue
        path = Path(p)
        if _is_under(path, run_dir) or _is_under(path, cwd):
            continue
        near = _nearest_existing(path)
        if near is not None:
            binds.append(str(near))
    binds += [b.strip() for b in environ.get(BINDS_ENV, "").split(",") if b.strip()]
    return list(dict.fromkeys(binds))


def container_env(cfg: Config, role: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables set inside the container with ``--env`` for a step of ``role`` (``trainer``/``rollout``).

    A colocated GPU trainer gets torch-memory-saver's ``LD_PRELOAD`` and ``TMS_INIT_ENABLE(_CPU_BACKUP)=1``;
    ``TMS_*`` variables of ``environ`` are always passed and override those defaults. Sorted by name.
    """
    env: dict[str, str] = {}
    if role == "trainer" and cfg.run.placement == "colocate" and cfg.slurm.gpus_per_node > 0:
        env["LD_PRELOAD"] = environ.get(TMS_PRELOAD_ENV, TMS_PRELOAD_IN_IMAGE)
        env["TMS_INIT_ENABLE"] = "1"
        env["TMS_INIT_ENABLE_CPU_BACKUP"] = "1"
    env.update({k: v for k, v in environ.items() if k.startswith("TMS_")})
    return dict(sorted(env.items()))


def group_has_gpus(cfg: Config, role: str) -> bool:
    """Whether the step of ``role`` runs on GPUs (and so gets ``--nv``)."""
    if role == "rollout" and cfg.run.placement == "disaggregate" and cfg.slurm.rollout is not None:
        return cfg.slurm.rollout.gpus_per_node > 0
    if role == "critic" and cfg.slurm.critic is not None:
        return cfg.slurm.critic.gpus_per_node > 0
    return cfg.slurm.gpus_per_node > 0


def container_prefix(cfg: Config, run_dir: str | os.PathLike, role: str = "trainer",
                     cwd: str | os.PathLike | None = None,
                     environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The argv prefix that runs a step of ``role`` inside ``slurm.container``; ``[]`` without a container.

    Args:
        cfg: the run's config.
        run_dir: absolute run folder (bound into the container).
        role: ``trainer`` (het group 0 / the colocated allocation), ``rollout`` or ``critic`` (its het group).
        cwd: working directory of the job (default: the current one).
        environ: environment to read hpcrl's and torch-memory-saver's variables from (default ``os.environ``).

    Returns:
        e.g. ``["apptainer", "exec", "--nv", "--bind", "/runs/x,/home/u/proj", "--env", "LD_PRELOAD=...",
        "/images/hpcrl.sif"]``; append the command.
    """
    image = cfg.slurm.container
    if not image:
        return []
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    argv = [environ.get(RUNTIME_ENV, "apptainer"), "exec"]
    if group_has_gpus(cfg, role):
        argv.append("--nv")
    argv += ["--bind", ",".join(container_binds(cfg, run_dir, cwd, environ))]
    for key, value in container_env(cfg, role, environ).items():
        argv += ["--env", f"{key}={value}"]
    argv.append(image if "://" in image else os.path.abspath(image))
    return argv


def shell_join(argv: list[str]) -> str:
    """``argv`` as one shell-quoted command line."""
    return " ".join(shlex.quote(a) for a in argv)
