"""A run's config with every check the run makes on the login node: :func:`hpcrl.config.load_config` plus the
checks that read the model folder, import plug-ins and count parameters, through :data:`ENVIRONMENT`.

:mod:`hpcrl.config` is the bottom layer and imports none of these; it defines the interface
(:class:`hpcrl.config.Environment`) and runs its checks in one fixed order, calling the environment where a
check needs the world. This module, one layer above, binds hpcrl's readers to that interface. Every command
that starts, submits or validates a run loads its config here (``hpcrl validate / run / submit / sweep``,
the Slurm steps, the standalone evaluation), so ``hpcrl validate`` refuses everything the run would refuse.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from hpcrl import __version__
from hpcrl.config import Config, Environment, load_config, load_raw, resolved_text, validate
from hpcrl.config.memory import memory_lines as memory_lines_with
from hpcrl.config.train import check_teacher_tokenizers as check_teacher_tokenizers_with
from hpcrl.fsutil import atomic_write_text
from hpcrl.models.hf import same_tokenizer
from hpcrl.models.params import COUNTED_MODEL_TYPES, count_parameters, kv_cache_elements_per_token
from hpcrl.models.support import check_model_folder, routed_experts
from hpcrl.plugin_loader import PluginError, load_function


def plugin_problem(path: str) -> Optional[str]:
    """Why the plug-in ``path`` (``pkg.module.attr`` or ``path/to/file.py:attr``) does not import to a callable
    (:func:`hpcrl.plugin_loader.load_function`'s reason), or None when it does. Raises nothing else."""
    try:
        load_function(path)
    except PluginError as e:
        return e.reason
    return None


ENVIRONMENT = Environment(model_folder_problem=check_model_folder, routed_experts=routed_experts,
                          tokenizer_difference=same_tokenizer, plugin_problem=plugin_problem,
                          counted_model_types=COUNTED_MODEL_TYPES, count_parameters=count_parameters,
                          kv_cache_elements_per_token=kv_cache_elements_per_token)
"""hpcrl's model and plug-in readers, for the config checks that need them."""


def _same_tokenizer_where_present(a: str | os.PathLike, b: str | os.PathLike) -> Optional[str]:
    """:func:`hpcrl.models.hf.same_tokenizer` when both folders hold a tokenizer, else None (not yet fetched)."""
    have = [any((Path(p) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")) for p in (a, b)]
    return same_tokenizer(a, b) if all(have) else None


PLAN_ENVIRONMENT = dataclasses.replace(ENVIRONMENT,
                                       model_folder_problem=functools.partial(check_model_folder, weights=False),
                                       tokenizer_difference=_same_tokenizer_where_present)
""":data:`ENVIRONMENT` for a layout planned before the weights are downloaded (``hpcrl validate --plan``): the
model folder needs only its ``config.json`` (parsed, and its architecture supported), and a critic's or teacher's
tokenizer is compared with the policy's only where both are there."""


def load_and_check(path: str | os.PathLike | None, overrides: Iterable[str] = (), check_files: bool = True,
                   plan: bool = False) -> Config:
    """:func:`hpcrl.config.load_config` with :data:`ENVIRONMENT`: the validated, resolved config of the YAML
    file ``path`` (None: the defaults) and the ``key=value`` ``overrides``, checked as the run checks it
    (with ``check_files``: files, plug-in imports, the model folder, teachers' tokenizers, the memory
    estimate); ``plan``: with :data:`PLAN_ENVIRONMENT` (the model's weights are not checked). Raises
    ConfigError at the first problem, in :func:`hpcrl.config.validate`'s order."""
    return load_config(path, overrides, check_files=check_files, env=PLAN_ENVIRONMENT if plan else ENVIRONMENT)


def load_raw_and_check(raw: Mapping[str, Any], check_files: bool = True) -> Config:
    """:func:`hpcrl.config.load_raw` (build, validate, resolve a raw dict) with :data:`ENVIRONMENT`.
    Raises ConfigError."""
    return load_raw(raw, check_files=check_files, env=ENVIRONMENT)


def check(cfg: Config, check_files: bool = True) -> None:
    """:func:`hpcrl.config.validate` with :data:`ENVIRONMENT`. Raises ConfigError at the first problem."""
    validate(cfg, check_files=check_files, env=ENVIRONMENT)


def check_teacher_tokenizers(cfg: Config) -> None:
    """:func:`hpcrl.config.train.check_teacher_tokenizers` with :data:`ENVIRONMENT`: every existing teacher
    folder has the student's tokenizer. Raises ConfigError naming the teacher."""
    check_teacher_tokenizers_with(cfg, ENVIRONMENT)


def memory_lines(cfg: Config) -> list[str]:
    """:func:`hpcrl.config.memory.memory_lines` with :data:`ENVIRONMENT`: the per-GPU memory estimate that
    ``hpcrl validate`` and ``submit`` print (empty on CPU nodes or before the model's ``config.json``)."""
    return memory_lines_with(cfg, ENVIRONMENT)


def save_resolved(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the resolved ``cfg`` to ``run_dir/config.yaml`` atomically (temp file, fsync, ``os.replace``).

    Creates ``run_dir``. The file loads back with :func:`hpcrl.config.load_config` to an equal config. Returns
    its path; raises OSError when the folder is not writable.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "config.yaml"
    return atomic_write_text(target, resolved_text(cfg, __version__), fsync=True)
