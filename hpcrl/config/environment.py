"""What config's environment checks read beyond the config and plain files, as an interface config defines and
a layer above it fills (:data:`hpcrl.validate.ENVIRONMENT`), so that :mod:`hpcrl.config` imports nothing of
hpcrl's models or plug-in loader.

:func:`hpcrl.config.validate` and :func:`hpcrl.config.load_config` take one as ``env``; with ``check_files``
and an ``env`` they run every login-node check, in the order they always ran. Without ``env`` the checks
that need one are skipped (the model folder's support rules, routed experts, tokenizers, plug-in imports and
the parameter counts of the memory estimate); files are still checked for existence.

``Config`` in the annotations is :class:`hpcrl.config.schema.Config`, not imported (see
:mod:`hpcrl.config.checks`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional


@dataclass(frozen=True)
class Environment:
    """The model and plug-in readers the environment checks call (each raises nothing it is not documented to).

    Every field is a plain function; :data:`hpcrl.validate.ENVIRONMENT` binds hpcrl's own."""

    model_folder_problem: Callable[[str], Optional[tuple[str, str]]]
    """``(problem, fix)`` that keeps an HF folder from being trained, or None
    (:func:`hpcrl.models.support.check_model_folder`)."""
    routed_experts: Callable[[Mapping[str, Any]], int]
    """Routed experts per MoE layer of a ``config.json`` dict, 0 for a dense model
    (:func:`hpcrl.models.support.routed_experts`)."""
    tokenizer_difference: Callable[[Path, Path], Optional[str]]
    """None when two HF folders have the same tokenizer, else a short reason
    (:func:`hpcrl.models.hf.same_tokenizer`)."""
    plugin_problem: Callable[[str], Optional[str]]
    """Why a plug-in path does not import to a callable, or None when it does
    (:func:`hpcrl.plugin_loader.load_function`'s ``PluginError.reason``)."""
    counted_model_types: tuple[str, ...]
    """HF ``model_type`` values :attr:`count_parameters` knows (:data:`hpcrl.models.params.COUNTED_MODEL_TYPES`)."""
    count_parameters: Callable[[Mapping[str, Any]], Any]
    """The parameters of a ``config.json`` dict as a ``ParamCount`` (fields ``embedding``, ``output``, ``dense``,
    ``attention``, ``replicated``, ``expert``, ``total``; :func:`hpcrl.models.params.count_parameters`)."""
    kv_cache_elements_per_token: Callable[[Mapping[str, Any], int], int]
    """KV-cache elements of one token on one GPU at an attention-TP size
    (:func:`hpcrl.models.params.kv_cache_elements_per_token`)."""
