"""Typed run configuration: one YAML file per run, defaults in one place, dotted overrides.

Every field of a run lives in one of the dataclasses below, with its default. A YAML file names only the
fields it changes; ``key=value`` overrides on the command line (``rollout.batch_size=16``) are applied on top.
``load_config`` returns a validated, resolved :class:`Config`; any bad input raises :class:`ConfigError`
whose message is one line naming the field, the value and the fix. Config is the bottom layer: it imports
nothing of hpcrl but itself and :mod:`hpcrl.names`, so the checks that read the model or import plug-ins
reach them through an :class:`Environment` a caller passes; :func:`hpcrl.validate.load_and_check` loads a
config with every check a run makes, and :func:`hpcrl.validate.save_resolved` writes the resolved config into
the run folder (:func:`resolved_text`).

YAML is read YAML-1.2 style: ``3e-5`` is a float, ``12:00:00`` is a string (not sexagesimal 43200) and ``010``
is a string (not octal 8); duplicate keys are errors.

Free-form sections (``sglang``, ``megatron``) are passed through: ``sglang`` keys become SGLang server flags
(``enable_memory_saver: true`` -> ``--enable-memory-saver``), ``megatron`` keys go to megatron-core's
``TransformerConfig`` / ``OptimizerConfig``.

Modules: :mod:`~hpcrl.config.schema` (the root :class:`Config`), one module per group of sections with their
checks (:mod:`~hpcrl.config.run`, :mod:`~hpcrl.config.rollout`, :mod:`~hpcrl.config.train`,
:mod:`~hpcrl.config.slurm`, :mod:`~hpcrl.config.evaluation`, :mod:`~hpcrl.config.tracking`),
:mod:`~hpcrl.config.coerce` (typed conversion, overrides),
:mod:`~hpcrl.config.load` (the loading stages), :mod:`~hpcrl.config.errors`, :mod:`~hpcrl.config.checks`,
:mod:`~hpcrl.config.yaml_io`, :mod:`~hpcrl.config.environment`, :mod:`~hpcrl.config.cpus` (CPU-list syntax),
:mod:`~hpcrl.config.memory` (the per-GPU memory estimate). Everything public is importable from ``hpcrl.config``.
"""

from __future__ import annotations

from hpcrl.config.errors import (FILE_FIELD, OVERRIDE_FIELD, MIB, ConfigError)
from hpcrl.config.environment import (Environment)
from hpcrl.config.schema import (Config)
from hpcrl.config.run import (RunSection, ModelSection, DataSection, SFTSection)
from hpcrl.config.lora import (LoraSection, PEFT_TARGETS)
from hpcrl.config.rollout import (RolloutSection, BUILTIN_REWARD_FUNCTIONS, BUILTIN_DYNAMIC_FILTERS)
from hpcrl.config.train import (TrainSection, AlgorithmSection, CheckpointSection, GROUP_ESTIMATORS)
from hpcrl.config.weights import (WeightsSection)
from hpcrl.config.critic import (CriticSection, check_critic)
from hpcrl.config.slurm import (SlurmGroup, SlurmSection, SweepSection, SIGNAL_RE, slurm_time_seconds)
from hpcrl.config.evaluation import (EvalSection, EvalSetSection, DEFAULT_EVAL_SET)
from hpcrl.config.tracking import (WandbSection)
from hpcrl.config.coerce import (parse_override, set_dotted, apply_override, apply_overrides)
from hpcrl.config.load import (read_config_file, load_config, build, load_raw, config_to_dict, config_to_yaml,
                               resolve, resolved_text, check_sweep, validate)
from hpcrl.config.checks import (BUILTIN_DATA_SOURCES, DATA_FILE_SUFFIXES)
from hpcrl.names import REMOTE_RM_PREFIX
from hpcrl.config.yaml_io import (YamlDumper, parse_yaml)

__all__ = [
    "FILE_FIELD",
    "OVERRIDE_FIELD",
    "MIB",
    "ConfigError",
    "Environment",
    "Config",
    "RunSection",
    "ModelSection",
    "DataSection",
    "SFTSection",
    "LoraSection",
    "PEFT_TARGETS",
    "RolloutSection",
    "BUILTIN_REWARD_FUNCTIONS",
    "BUILTIN_DYNAMIC_FILTERS",
    "TrainSection",
    "AlgorithmSection",
    "CriticSection",
    "check_critic",
    "WeightsSection",
    "CheckpointSection",
    "GROUP_ESTIMATORS",
    "SlurmGroup",
    "SlurmSection",
    "SweepSection",
    "SIGNAL_RE",
    "slurm_time_seconds",
    "EvalSection",
    "EvalSetSection",
    "DEFAULT_EVAL_SET",
    "WandbSection",
    "parse_override",
    "set_dotted",
    "apply_override",
    "apply_overrides",
    "read_config_file",
    "load_config",
    "build",
    "load_raw",
    "config_to_dict",
    "config_to_yaml",
    "resolve",
    "resolved_text",
    "check_sweep",
    "validate",
    "BUILTIN_DATA_SOURCES",
    "DATA_FILE_SUFFIXES",
    "REMOTE_RM_PREFIX",
    "YamlDumper",
    "parse_yaml",
]
