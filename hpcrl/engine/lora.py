"""LoRA adapters served by the CPU engine as SGLang 0.5.23 serves them (``--enable-lora``): loaded and unloaded
at run time (``/load_lora_adapter`` from a PEFT folder, ``/load_lora_adapter_from_tensors``,
``/unload_lora_adapter``), chosen per request by ``lora_path`` (an adapter's name), rows of different adapters
(and of the base model) decoded in one batch.

The adapters are PEFT's LoRA layers (:class:`peft.tuners.lora.LoraModel` injected into the engine's HF model on
the first load), and a batch's per-row adapters are PEFT's mixed-adapter batches (``adapter_names``): each LoRA
linear computes ``base(x) + scaling * B(A(x))`` for the rows of each adapter, ``base(x)`` alone for the base
model's rows (``__base__``). Loads and unloads run in the scheduler thread between steps
(:meth:`hpcrl.engine.scheduler.Scheduler.run_command`), never during a forward pass.

What follows SGLang (``srt/managers/tokenizer_control_mixin.py``, ``srt/lora/lora_manager.py``,
``lora_registry.py``; messages copied): the launch flags and their start-up refusal; a second load of a name, a
rank above ``--max-lora-rank``, a target module outside ``--lora-target-modules``, DoRA and added tokens refused
with SGLang's texts; ``--max-loaded-loras`` evicting the least recently used unpinned adapter after a load; an
unload taking the name away at once and returning when no running request uses the adapter any more (those
finish on it); ``/v1/models`` listing adapters with ``root`` their path (``__tensor__`` for tensors). What does
not: a ``/generate`` naming an unloaded adapter is refused here (SGLang reloads one it loaded from a folder);
``--max-loras-per-batch`` is accepted and reported but bounds nothing (the engine has no adapter memory pool: a
batch mixes any number); a bad tensor payload is a 400 here (SGLang's scheduler dies on it).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import threading
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import torch

from hpcrl.names import PEFT_TARGETS

TENSOR_PATH = "__tensor__"
"""The path SGLang records for an adapter loaded from tensors."""

BASE = "__base__"
"""PEFT's name for "no adapter" in a mixed batch."""

DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
"""SGLang's refusal of a load or unload by an engine started without ``--enable-lora``."""


class LoraError(ValueError):
    """A refused load or unload (SGLang's message); the endpoint answers 400 ``success: false``."""


@dataclasses.dataclass
class LoraOptions:
    """The LoRA launch flags (SGLang's names). ``max_rank`` and ``target_modules`` bound what may be loaded
    (None: any rank / the modules of the preloaded adapters, as SGLang infers them); ``paths``: ``(name,
    folder)`` of ``--lora-paths``, loaded at start."""

    enabled: bool = False
    max_rank: Optional[int] = None
    target_modules: Optional[frozenset] = None
    max_loras_per_batch: int = 8
    max_loaded_loras: Optional[int] = None
    paths: tuple = ()

    def check(self) -> None:
        """Raise ValueError for flags SGLang refuses at start-up (its messages)."""
        if not self.enabled:
            return
        if self.max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch must be > 0")
        if not self.paths and not (self.max_rank and self.target_modules):
            raise ValueError("When no initial --lora-paths is provided, you need to specify both --max-lora-rank "
                             "and --lora-target-modules for LoRA initialization.")
        if self.max_loaded_loras is not None and (self.max_loaded_loras < self.max_loras_per_batch
                                                  or self.max_loaded_loras < len(self.paths)):
            raise ValueError("--max-loaded-loras must be >= --max-loras-per-batch and >= the number of "
                             "--lora-paths")


def parse_lora_paths(values: Optional[list]) -> tuple:
    """``--lora-paths`` entries (``NAME=PATH``, ``PATH`` whose name is the path itself, or SGLang's JSON
    ``{"lora_name", "lora_path", "pinned"}``) as ``((name, path, pinned), ...)``. Raises ValueError for a JSON
    entry without those keys."""
    out = []
    for v in values or ():
        if v.lstrip().startswith("{"):
            d = json.loads(v)
            try:
                out.append((str(d["lora_name"]), str(d["lora_path"]), bool(d.get("pinned", False))))
            except KeyError as e:
                raise ValueError(f"--lora-paths {v}: needs lora_name and lora_path") from e
        elif "=" in v:
            name, path = v.split("=", 1)
            out.append((name, path, False))
        else:
            out.append((v, v, False))
    return tuple(out)


def read_adapter_folder(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(adapter_config.json, tensors)`` of a PEFT adapter folder (``adapter_model.safetensors``, or
    ``adapter_model.bin``). Raises OSError (SGLang's text for a missing config: ``[Errno 2] No such file or
    directory: '.../adapter_config.json'``) and ValueError for a folder without weights."""
    folder = Path(path)
    config = json.loads((folder / "adapter_config.json").read_text())
    st, binary = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if st.exists():
        from safetensors.torch import load_file

        return config, load_file(str(st))
    if binary.exists():
        return config, torch.load(str(binary), map_location="cpu", weights_only=True)
    raise ValueError(f"{folder} has no adapter_model.safetensors (nor adapter_model.bin)")


def _targets(config: Mapping) -> frozenset:
    t = config.get("target_modules")
    if isinstance(t, str):
        return frozenset(PEFT_TARGETS) if t in ("all", "all-linear") else frozenset([t])
    return frozenset(t or ())


@dataclasses.dataclass
class _Adapter:
    path: str
    pinned: bool


class EngineAdapters:
    """The LoRA adapters of one engine: the registry (HTTP side, any thread) and PEFT's layers in the model
    (scheduler thread). ``model``: the engine's HF causal LM; ``options``: the launch flags.

    Registry order is least recently used first (a request naming an adapter moves it last), as SGLang's."""

    def __init__(self, model: torch.nn.Module, options: LoraOptions):
        self.model = model
        self.options = options
        self._registry: collections.OrderedDict[str, _Adapter] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._tuner = None  # peft LoraModel, injected on the first load

    @property
    def enabled(self) -> bool:
        return self.options.enabled

    # ------------------------------------------------------------------ registry (any thread)
    def loaded(self) -> dict[str, str]:
        """``{name: path}`` of the loaded adapters (SGLang's ``loaded_adapters``), least recently used first."""
        with self._lock:
            return {n: a.path for n, a in self._registry.items()}

    def check_request(self, names: list[Optional[str]]) -> None:
        """Refuse a ``/generate`` whose rows name adapters (``names``: one per row, None for the base model) that
        this engine cannot serve, with SGLang's messages; mark the named ones recently used. Raises
        :class:`hpcrl.engine.protocol.RequestError` (400)."""
        from hpcrl.engine.protocol import RequestError

        wanted = [n for n in names if n]
        if not wanted:
            return
        if not self.enabled:
            raise RequestError(f"LoRA adapter '{wanted[0]}' was requested, but LoRA is not enabled. Please launch "
                               "the server with --enable-lora flag and preload adapters using --lora-paths or "
                               "/load_lora_adapter endpoint.")
        distinct = list(dict.fromkeys(names))
        if self.options.max_loaded_loras is not None and len(distinct) > self.options.max_loaded_loras:
            raise RequestError(f"Received request with {len(distinct)} unique loras requested but max loaded "
                               f"loras is {self.options.max_loaded_loras}")
        with self._lock:
            for name in dict.fromkeys(wanted):
                if name not in self._registry:
                    raise RequestError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                       f"All loaded adapters: {self._registry.keys()}.")
                self._registry.move_to_end(name)

    def register(self, name: str, config: Mapping, path: str, pinned: bool = False) -> None:
        """Check a new adapter against the flags and the registry (SGLang's ``validate_new_adapter``) before its
        tensors are loaded. Raises :class:`LoraError`."""
        if not self.enabled:
            raise LoraError(DISABLED)
        try:
            rank, targets = int(config["r"]), _targets(config)
            config["lora_alpha"]
        except KeyError as e:
            raise LoraError(str(e)) from e
        if config.get("added_tokens") or config.get("added_tokens_config"):
            raise LoraError(f"Failed to load {name} because LoRA serving currently doesn't support adapters that "
                            "add tokens to the vocabulary")
        if config.get("use_dora"):
            raise LoraError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
        with self._lock:
            if name in self._registry:
                raise LoraError(f"Failed to load LoRA adapter {name} because it is already loaded")
        allowed = self.options.target_modules
        if (self.options.max_rank is not None and rank > self.options.max_rank) or \
                (allowed is not None and "all" not in allowed and not targets <= allowed) or \
                not targets <= frozenset(PEFT_TARGETS):
            raise LoraError(f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory "
                            "pool configuration. Please ensure that the LoRA adapter's rank is within the "
                            "configured `--max-lora-rank` and that the target modules are included in "
                            "`--lora-target-modules`.")
        if pinned and sum(a.pinned for a in self._registry.values()) >= self.options.max_loras_per_batch - 1:
            raise LoraError(f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all "
                            "slots in the LoRA memory pool to avoid starvation for unpinned adapters and base "
                            "models. Please increase your `--max-loras-per-batch` or load it as unpinned LoRA "
                            "adapters.")

    def load(self, name: str, config: Mapping, path: str, pinned: bool,
             tensors: Callable[[], Mapping[str, torch.Tensor]]) -> list[str]:
        """Load adapter ``name``: checked (:meth:`register`), then ``tensors()`` put in the model
        (:meth:`load_weights`; run it in the scheduler thread, or before serving), then registered (:meth:`add`).
        Returns the names to evict. Raises :class:`LoraError` (SGLang's messages), and what ``tensors`` raises."""
        self.register(name, config, path, pinned)
        self.load_weights(name, config, tensors())
        return self.add(name, path, pinned)

    def add(self, name: str, path: str, pinned: bool = False) -> list[str]:
        """Register a loaded adapter; returns the names to evict (least recently used unpinned ones while more
        than ``--max-loaded-loras`` are loaded). Raises :class:`LoraError` when none can be evicted (SGLang's
        message; the new adapter stays)."""
        with self._lock:
            self._registry[name] = _Adapter(path, pinned)
            cap, evict = self.options.max_loaded_loras, []
            if cap is None:
                return evict
            unpinned = [n for n, a in self._registry.items() if not a.pinned and n != name]
            while len(self._registry) - len(evict) > cap:
                if not unpinned:
                    raise LoraError("Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. LoRA "
                                    f"registry is: {self._registry!r}")
                evict.append(unpinned.pop(0))
            return evict

    def remove(self, name: str) -> None:
        """Take ``name`` out of the registry (new requests can no longer use it; running ones go on). Raises
        :class:`LoraError` for an unknown name (SGLang's message)."""
        if not self.enabled:
            raise LoraError(DISABLED)
        with self._lock:
            if name not in self._registry:
                raise LoraError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self._registry.keys()}")
            del self._registry[name]

    # ------------------------------------------------------------------ the model (scheduler thread)
    def load_weights(self, name: str, config: Mapping, tensors: Mapping[str, torch.Tensor]) -> None:
        """Inject adapter ``name`` into the model (PEFT LoRA layers on its ``target_modules``) and copy
        ``tensors`` (PEFT's saved names, ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``,
        whole) into it, cast to the model's dtype. Raises :class:`LoraError` naming a tensor the adapter lacks,
        one no layer takes, or a shape that does not fit (the half-loaded adapter is removed)."""
        import peft
        from peft.tuners.lora import LoraModel

        lora_config = peft.LoraConfig(r=int(config["r"]), lora_alpha=config["lora_alpha"],
                                      target_modules=sorted(_targets(config)), lora_dropout=0.0, bias="none",
                                      use_rslora=bool(config.get("use_rslora", False)))
        if self._tuner is None:
            self._tuner = LoraModel(self.model, {name: lora_config}, name)
        else:
            self._tuner.peft_config[name] = lora_config
            self._tuner.inject_adapter(self.model, name)
        self._tuner.eval()  # (PEFT's mixed batches refuse a module in training mode)
        try:
            self._copy(name, tensors)
        except Exception:
            self.delete(name)
            raise

    @torch.no_grad()
    def _copy(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        from peft.tuners.lora import LoraLayer

        layers = {path: m for path, m in self.model.named_modules()
                  if isinstance(m, LoraLayer) and name in m.lora_A}
        used = set()
        for path, layer in layers.items():
            for which in ("lora_A", "lora_B"):
                key = f"base_model.model.{path}.{which}.weight"
                if key not in tensors:
                    raise LoraError(f"the adapter's tensors lack {key}")
                target = getattr(layer, which)[name].weight
                t = tensors[key]
                if tuple(t.shape) != tuple(target.shape):
                    raise LoraError(f"{key} has shape {tuple(t.shape)}, the model takes {tuple(target.shape)}")
                target.copy_(t.to(target.dtype))
                used.add(key)
        extra = sorted(set(tensors) - used)
        if extra:
            raise LoraError(f"no layer of the model takes {extra[:4]}")

    def delete(self, name: str) -> None:
        """Remove adapter ``name``'s layers from the model (PEFT's ``delete_adapter``); a no-op for a name the
        model does not hold."""
        if self._tuner is not None and name in self._tuner.peft_config:
            self._tuner.delete_adapter(name)

    @contextlib.contextmanager
    def applied(self, names: list[Optional[str]]) -> Iterator[None]:
        """Run the model's forward passes in the block with row ``i`` through adapter ``names[i]`` (None: the
        base model). A no-op while no adapter is in the model."""
        if self._tuner is None or not self._tuner.peft_config:
            yield
            return
        with self._tuner._enable_peft_forward_hooks(adapter_names=[n or BASE for n in names]):
            yield
