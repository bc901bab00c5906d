"""The data source the rollout loop pulls prompt groups from (slime's ``RolloutDataSourceWithBuffer``).

Items are visited epoch by epoch. Epoch ``e`` visits them in the order ``permutation(seed, e)`` (numpy
``default_rng([seed, e])``; identity order when ``shuffle`` is off). A position ``(epoch, offset)`` says how
far the visit has got; a request that crosses the end of an epoch takes the rest of that epoch and then the
start of the next, so every prompt is served exactly once per epoch, none skipped, none repeated (veRL issue
#7401 skipped the tail of an epoch).

Each served prompt becomes a group of ``n_samples_per_prompt`` :class:`~hpcrl.data.sample.Sample` copies
sharing ``group_index = epoch * len(items) + offset`` (the prompt's position in the epoch order, made unique
across epochs: ``group_index % len(items)`` is the position, ``group_index // len(items)`` the epoch) and each
with its own ``index`` from a counter that is part of the state. Groups pushed back with :meth:`add_samples`
(partial rollouts) are served first, before new prompts, in the order they were pushed.

:meth:`state_dict` / :meth:`load_state_dict` capture position, seed, counter and pushed-back groups (as plain
dicts) so that a resumed source continues exactly where the saved one was.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Optional, Sequence

import numpy as np

from hpcrl.data.sample import Sample

STATE_VERSION = 1


def _fingerprint(items: Sequence[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for it in items:
        p = it["prompt"]
        h.update((p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str)).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


class DataSource:
    """Epoch-aware, seeded, resumable source of prompt groups.

    ``items``: ``{"prompt", "label"?, "metadata"?}`` dicts (not copied; do not mutate them afterwards).
    ``n_samples_per_prompt``: samples per group (slime ``--n-samples-per-prompt``). ``seed`` and ``shuffle``:
    per-epoch permutation (slime ``--rollout-seed`` / ``--rollout-shuffle``). Raises ValueError for no items
    or ``n_samples_per_prompt < 1``.
    """

    def __init__(self, items: Sequence[dict[str, Any]], n_samples_per_prompt: int, seed: int = 0,
                 shuffle: bool = True):
        if not items:
            raise ValueError("DataSource needs at least one item")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.items = items
        self.n_samples_per_prompt = n_samples_per_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        """Current epoch (0-based)."""
        self.offset = 0
        """Prompts of the current epoch already served."""
        self.sample_counter = 0
        """Next ``Sample.index``."""
        self.buffer: list[list[Sample]] = []
        """Pushed-back groups, served first."""
        self._fingerprint = _fingerprint(items)
        self._order: Optional[np.ndarray] = None
        self._order_epoch = -1

    def __len__(self) -> int:
        """Number of distinct prompts (items)."""
        return len(self.items)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Item indices in the visiting order of ``epoch``: ``default_rng([seed, epoch]).permutation``."""
        if self._order_epoch != epoch or self._order is None:
            n = len(self.items)
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                           else np.arange(n))
            self._order_epoch = epoch
        return self._order

    def _new_group(self, item_index: int) -> list[Sample]:
        item = self.items[item_index]
        group_index = self.epoch * len(self.items) + self.offset
        group = []
        for _ in range(self.n_samples_per_prompt):
            group.append(Sample(group_index=group_index, index=self.sample_counter,
                                prompt=copy.deepcopy(item["prompt"]), label=copy.deepcopy(item.get("label")),
                                metadata=copy.deepcopy(item.get("metadata") or {})))
            self.sample_counter += 1
        return group

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """The next ``num_groups`` groups: pushed-back groups first, then new prompts (crossing epochs as
        needed). Raises ValueError for ``num_groups < 0``."""
        if num_groups < 0:
            raise ValueError(f"num_groups must be >= 0, got {num_groups}")
        take = min(num_groups, len(self.buffer))
        out, self.buffer = self.buffer[:take], self.buffer[take:]
        while len(out) < num_groups:
            if self.offset >= len(self.items):
                self.epoch += 1
                self.offset = 0
            order = self.epoch_order(self.epoch)
            out.append(self._new_group(int(order[self.offset])))
            self.offset += 1
        return out

    def add_samples(self, groups: Sequence[Sequence[Sample]]) -> None:
        """Push back groups (e.g. aborted partial rollouts), served first by the next :meth:`get_samples`.

        Raises ValueError unless each group has ``n_samples_per_prompt`` samples sharing one ``group_index``
        (slime asserts the same).
        """
        for g in groups:
            if len(g) != self.n_samples_per_prompt:
                raise ValueError(f"pushed-back group has {len(g)} samples, "
                                 f"expected {self.n_samples_per_prompt}")
            if len({s.group_index for s in g}) != 1:
                raise ValueError("pushed-back group mixes group_index values "
                                 f"{sorted({s.group_index for s in g})}")
        self.buffer.extend(list(g) for g in groups)

    def state_dict(self, with_buffer: bool = True) -> dict[str, Any]:
        """Plain-JSON state: version, epoch, offset, seed, shuffle, sample counter, item count and
        fingerprint, and (``with_buffer``) the pushed-back groups as ``Sample.to_dict()`` lists; without it,
        the caller saves :attr:`buffer` itself (a checkpoint's ``buffer.h5``, :mod:`hpcrl.data.buffer`)."""
        state = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "n_samples_per_prompt": self.n_samples_per_prompt,
            "sample_counter": self.sample_counter,
            "num_items": len(self.items),
            "fingerprint": self._fingerprint,
        }
        if with_buffer:
            state["buffer"] = [[s.to_dict() for s in g] for g in self.buffer]
        return state

    file_keys = ("buffer",)
    """The part of :meth:`state_dict` a checkpoint keeps in files (:meth:`save_files`), not ``state.json``."""

    def save_files(self, state: dict[str, Any], folder) -> None:
        """Write ``state["buffer"]`` (the pushed-back groups of :meth:`state_dict`) as the ``groups/`` of the
        buffer file in checkpoint folder ``folder`` (:mod:`hpcrl.data.buffer`). Raises what
        :func:`hpcrl.data.buffer.write_groups_part` raises."""
        save_buffer_files(state, folder)

    def load_files(self, state: dict[str, Any], folder) -> dict[str, Any]:
        """``state`` (the rest, from ``state.json``) with ``"buffer"`` read back from the buffer file in
        ``folder`` (no groups when the checkpoint has none)."""
        return load_buffer_files(state, folder)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` output (its ``seed`` and ``shuffle`` win over the constructor's;
        a state saved without its buffer leaves :attr:`buffer` empty; the buffer's samples may be
        ``Sample.to_dict()`` dicts or samples, as the checkpoint's ``buffer.h5`` returns them).

        Raises ValueError when the items differ from the saved ones (count or prompt fingerprint) or the state
        version is unknown, since the saved position would then point at other prompts.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data source state version {state.get('version')!r} is not {STATE_VERSION}")
        if state["num_items"] != len(self.items) or state["fingerprint"] != self._fingerprint:
            raise ValueError(f"data source state was saved for {state['num_items']} items "
                             f"(fingerprint {state['fingerprint']}); these are {len(self.items)} items "
                             f"(fingerprint {self._fingerprint}): the data changed since the checkpoint")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.seed = state["seed"]
        self.shuffle = bool(state["shuffle"])
        self.sample_counter = int(state["sample_counter"])
        self.buffer = [[d if isinstance(d, Sample) else Sample.from_dict(d) for d in g]
                       for g in state.get("buffer", [])]
        self._order, self._order_epoch = None, -1


def save_buffer_files(state: dict[str, Any], folder) -> None:
    """Write a data source state's ``"buffer"`` (pushed-back groups, samples or their dicts) as the ``groups/``
    of the buffer file in checkpoint folder ``folder`` (:mod:`hpcrl.data.buffer`). Raises what
    :func:`hpcrl.data.buffer.write_groups_part` raises."""
    from pathlib import Path

    from hpcrl.data.buffer import BUFFER_FILE, write_groups_part

    groups = [[s if isinstance(s, Sample) else Sample.from_dict(s) for s in g] for g in state["buffer"]]
    write_groups_part(Path(folder) / BUFFER_FILE, "groups", groups)


def load_buffer_files(state: dict[str, Any], folder) -> dict[str, Any]:
    """``state`` with ``"buffer"`` read back from the ``groups/`` of the buffer file in ``folder`` (no groups
    when the checkpoint has none)."""
    from pathlib import Path

    from hpcrl.data.buffer import BUFFER_FILE, read_groups_part

    return {**state, "buffer": read_groups_part(Path(folder) / BUFFER_FILE, "groups") or []}
