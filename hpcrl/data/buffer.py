"""The data buffer of a checkpoint, in HDF5 (``buffer.h5`` inside ``checkpoints/iter_XXXXXXX/``).

It holds what a resumed run needs beyond the data-source position so that nothing is lost or repeated:

* ``groups/``: every group the data source holds back for later rollouts, in order: groups an aborted
  rollout pushed back (partial responses when ``rollout.partial_rollout``, else reset prompts) and finished
  groups the dynamic filter kept beyond the batch. Stored as columns over all ``n`` held-back samples, group
  after group (version 2):

  ================================  ==================  =================================================
  ``group_sizes``                   ``int64 [G]``       samples per group (the columns split by it)
  ``group_index``, ``index``,       ``int64 [n]``       ``Sample`` fields of the same names
  ``rollout_id``, ``response_length``
  ``status``                        ``str [n]``         ``Status`` value (``"completed"``, ``"aborted"``, ...)
  ``reward``                        ``float64 [n]``     the reward; NaN when None or a dict (then in ``fields``)
  ``tokens`` / ``tokens_len``       ``int64 [sum]`` / ``[n]``  prompt + response token ids, concatenated
  ``loss_mask`` / ``loss_mask_len`` ``int8 [sum]`` / ``[n]``   response loss mask, concatenated
  ``rollout_log_probs`` / ``..._len`` ``float64 [sum]`` / ``[n]``  response log-probs, concatenated
  ``teacher_log_probs`` / ``..._len`` ``float64 [sum]`` / ``[n]``  OPD teachers' log-probs (absent in older
                                                        files: read as empty)
  ``segments`` / ``segments_len``   ``int64 [sum]`` / ``[n]``  ``Sample.segments`` (agent episodes split into
                                                        chains; absent in older files: read as empty)
  ``rollout_token_versions`` /      ``int64 [sum]`` / ``[n]``  the weight version of each response token
  ``..._len``                                           (absent in older files: read as empty)
  ``fields``                        ``str [n]``         JSON of the free-form rest: prompt, label, response
                                                        text, weight versions, metadata, a dict reward
  ================================  ==================  =================================================

  so a sample comes back exactly as it was (float64 holds the Python floats of log-probs and rewards
  exactly). slime drops its partial-rollout buffer on restart; hpcrl keeps it.
* ``pending/`` (async runs only, same columns as ``groups/``): the next rollout, finished at the step boundary
  with the weights before the checkpoint's step, so a resumed async run trains on exactly what the
  uninterrupted one would have (its metrics are in ``state.json`` ``pending``).
* ``trained``: ``int64 [n, 3]``, one row per sample trained so far, in training order: rollout id, group
  index, sample index (``Sample.index``, unique over the run). A resumed run appends to it, so a run's last
  checkpoint lists every sample it ever trained on: the check that each group was trained exactly once.

Attributes ``format = "hpcrl-buffer"`` and ``version``. Version 1 files (one JSON string per sample, one
dataset per group) are still read. Written by rank 0 into the checkpoint's temp folder (the checkpoint's
rename makes it atomic; its ``COMPLETE`` marker checksums it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from hpcrl.data.sample import Sample

BUFFER_FILE = "buffer.h5"
FORMAT = "hpcrl-buffer"
VERSION = 2
READABLE_VERSIONS = (1, 2)
_INT_COLUMNS = ("group_index", "index", "rollout_id", "response_length")
_RAGGED = {"tokens": np.int64, "loss_mask": np.int8, "rollout_log_probs": np.float64,
           "teacher_log_probs": np.float64, "segments": np.int64, "rollout_token_versions": np.int64}
_FREE_FIELDS = ("prompt", "label", "response", "weight_versions", "metadata", "rollout_routed_experts")


def trained_rows(rollout_id: int, samples: Sequence[Sample]) -> list[tuple[int, int, int]]:
    """The ``trained`` rows of one rollout step: ``(rollout_id, group_index, index)`` per sample."""
    return [(int(rollout_id), int(s.group_index), int(s.index)) for s in samples]


class TrainedRows:
    """``(rollout id, group index, sample index)`` of every sample trained so far, in training order (the
    buffer file's ``trained``). A stateful object for the checkpoint manager that keeps its state in files
    (:class:`hpcrl.checkpoint.manager.FileStateful`): ``state_dict()`` is ``{"rows": int64 [n, 3]}``, all of
    it in the buffer file."""

    file_keys = ("rows",)

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []

    def extend(self, rollout_id: int, samples: Sequence[Sample]) -> None:
        """Record that ``samples`` were trained on in rollout step ``rollout_id``."""
        self.rows.extend(trained_rows(rollout_id, samples))

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"rows": np.asarray(self.rows, dtype=np.int64).reshape(-1, 3)}

    def load_state_dict(self, state: dict) -> None:
        self.rows = [tuple(r) for r in np.asarray(state["rows"], dtype=np.int64).reshape(-1, 3).tolist()]

    def save_files(self, state: dict, folder: Path) -> None:
        """Write ``state["rows"]`` as the buffer file's ``trained`` in checkpoint folder ``folder``."""
        write_trained(Path(folder) / BUFFER_FILE, state["rows"])

    def load_files(self, state: dict, folder: Path) -> dict:
        """``state`` with ``"rows"`` from the buffer file in ``folder`` (none for a checkpoint without it)."""
        return {**state, "rows": read_trained(Path(folder) / BUFFER_FILE)}


def write_buffer(path: str | os.PathLike, groups: Sequence[Sequence[Sample]],
                 trained: Sequence[Sequence[int]], pending: Optional[Sequence[Sequence[Sample]]] = None) -> None:
    """Write the buffer file (version 2, see the module doc) to ``path``, replacing it.

    ``groups``: held-back groups, each a list of samples; ``trained``: ``[n, 3]`` rows (rollout id, group index,
    sample index); ``pending``: the finished next rollout of an async run (``pending/``, same columns as
    ``groups/``), or None. Raises OSError from h5py when the file cannot be written, TypeError for a sample
    whose free-form fields (label, metadata, ...) are not JSON.
    """
    Path(path).unlink(missing_ok=True)
    write_groups_part(path, "groups", groups)
    if pending is not None:
        write_groups_part(path, "pending", pending)
    write_trained(path, trained)


def open_for_part(path: str | os.PathLike):
    """The buffer file at ``path`` opened to add a part (``groups/``, ``pending/``, ``trained``): created with
    the format attributes when new. Each stateful writes its own part (:func:`write_groups_part`,
    :func:`write_trained`); the parts together make the file :func:`write_buffer` writes at once."""
    import h5py

    f = h5py.File(path, "a")
    if "format" not in f.attrs:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
    return f


def write_groups_part(path: str | os.PathLike, part: str, groups: Sequence[Sequence[Sample]]) -> None:
    """Add ``groups`` (lists of samples) as the buffer file's ``part`` (``"groups"`` or ``"pending"``, the
    columns of the module doc). Raises what :func:`write_buffer` raises; ValueError when the part exists."""
    with open_for_part(path) as f:
        _write_groups(f.create_group(part), groups)


def write_trained(path: str | os.PathLike, trained: Sequence[Sequence[int]]) -> None:
    """Add the ``trained`` rows (``int64 [n, 3]``) to the buffer file."""
    with open_for_part(path) as f:
        rows = np.asarray(trained, dtype=np.int64).reshape(-1, 3)
        f.create_dataset("trained", data=rows, maxshape=(None, 3))


def read_groups_part(path: str | os.PathLike, part: str) -> Optional[list[list[Sample]]]:
    """The groups of the buffer file's ``part`` (``"groups"``: version 1 or 2; ``"pending"``), or None when
    the file or the part is absent. Raises OSError (not HDF5), ValueError for another format or version."""
    import h5py

    if not Path(path).exists():
        return None
    with h5py.File(path, "r") as f:
        version = _check_format(f, path)
        if part not in f:
            return None
        return _read_groups_v1(f[part]) if version == 1 else _read_groups(f[part])


def read_trained(path: str | os.PathLike) -> np.ndarray:
    """The buffer file's ``trained`` rows, ``int64 [n, 3]`` (``[0, 3]`` when the file is absent). Raises what
    :func:`read_groups_part` raises, KeyError for a file without them."""
    import h5py

    if not Path(path).exists():
        return np.zeros((0, 3), dtype=np.int64)
    with h5py.File(path, "r") as f:
        _check_format(f, path)
        return np.asarray(f["trained"][()], dtype=np.int64).reshape(-1, 3)


def _check_format(f, path) -> int:
    version = int(f.attrs.get("version", -1))
    if f.attrs.get("format") != FORMAT or version not in READABLE_VERSIONS:
        raise ValueError(f"{path} is not an {FORMAT} file of version {READABLE_VERSIONS} "
                         f"(format {f.attrs.get('format')!r}, version {f.attrs.get('version')!r})")
    return version


def _write_groups(g, groups: Sequence[Sequence[Sample]]) -> None:
    import h5py

    samples = [s for grp in groups for s in grp]
    text = h5py.string_dtype("utf-8")
    g.create_dataset("group_sizes", data=np.asarray([len(x) for x in groups], dtype=np.int64).reshape(-1))
    for name in _INT_COLUMNS:
        g.create_dataset(name, data=np.asarray([getattr(s, name) for s in samples], dtype=np.int64).reshape(-1))
    g.create_dataset("status", data=[s.status.value for s in samples], dtype=text, shape=(len(samples),))
    g.create_dataset("reward", data=np.asarray([_float_reward(s.reward) for s in samples],
                                               dtype=np.float64).reshape(-1))
    for name, dtype in _RAGGED.items():
        values = [getattr(s, name) for s in samples]
        g.create_dataset(name, data=np.asarray([v for vs in values for v in vs], dtype=dtype).reshape(-1))
        g.create_dataset(f"{name}_len", data=np.asarray([len(v) for v in values], dtype=np.int64).reshape(-1))
    g.create_dataset("fields", data=[json.dumps(_free_fields(s)) for s in samples], dtype=text,
                     shape=(len(samples),))


def _float_reward(reward) -> float:
    return float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else float("nan")


def _free_fields(s: Sample) -> dict:
    out = {k: getattr(s, k) for k in _FREE_FIELDS}
    if not isinstance(s.reward, (int, float)) or isinstance(s.reward, bool):
        out["reward"] = s.reward  # None or a dict of named rewards
    return out


def read_buffer(path: str | os.PathLike) -> tuple[list[list[Sample]], np.ndarray]:
    """Read a buffer file of version 1 or 2: ``(groups, trained)`` with ``trained`` ``int64 [n, 3]``.

    Raises FileNotFoundError, OSError (not HDF5), ValueError for another format or version, KeyError for a
    file without a part.
    """
    if not Path(path).exists():
        raise FileNotFoundError(f"no data buffer {path}")
    groups = read_groups_part(path, "groups")
    if groups is None:
        raise KeyError(f"{path} has no 'groups'")
    return groups, read_trained(path)


def read_pending(path: str | os.PathLike) -> Optional[list[list[Sample]]]:
    """The ``pending/`` groups of a buffer file (an async run's finished next rollout), or None when it has
    none. Raises what :func:`read_buffer` raises."""
    read_buffer(path)  # the file, its format and version, and its other parts
    return read_groups_part(path, "pending")


def _read_groups_v1(g) -> list[list[Sample]]:
    """Version 1: one dataset per group, one ``Sample.to_dict()`` JSON string per sample."""
    return [[Sample.from_dict(json.loads(x)) for x in g[name].asstr()[()]] for name in sorted(g)]


def _read_groups(g) -> list[list[Sample]]:
    cols = {name: g[name][()].tolist() for name in _INT_COLUMNS}
    status = g["status"].asstr()[()].tolist()
    reward = g["reward"][()].tolist()
    fields = [json.loads(x) for x in g["fields"].asstr()[()].tolist()]
    ragged = {}
    for name in _RAGGED:
        if name not in g:  # written before the column existed (teacher_log_probs, segments): empty for all
            ragged[name] = [[] for _ in status]
            continue
        flat, lengths = g[name][()].tolist(), g[f"{name}_len"][()]
        ends = np.cumsum(lengths).tolist()
        ragged[name] = [flat[e - n:e] for e, n in zip(ends, lengths.tolist())]
    samples = []
    for i in range(len(status)):
        free = fields[i]
        d = {**{k: cols[k][i] for k in _INT_COLUMNS}, **{k: ragged[k][i] for k in _RAGGED},
             "status": status[i], "reward": free.pop("reward") if "reward" in free else reward[i], **free}
        samples.append(Sample.from_dict(d))
    out, start = [], 0
    for n in g["group_sizes"][()].tolist():
        out.append(samples[start:start + n])
        start += n
    return out
