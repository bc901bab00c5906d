"""The data buffer of a checkpoint, in HDF5 (``buffer.h5`` inside ``checkpoints/iter_XXXXXXX/``).

It holds what a resumed run needs beyond the data-source position so that nothing is lost or repeated:

* ``groups/000000 ...``: every group the data source holds back for later rollouts, in order: groups an
  aborted rollout pushed back (partial responses when ``rollout.partial_rollout``, else reset prompts) and
  finished groups the dynamic filter kept beyond the batch. One dataset per group, one UTF-8 JSON string per
  sample (``Sample.to_dict()``: tokens, response, log-probs, loss mask, reward, status, weight versions), so a
  sample comes back exactly as it was. (slime drops its partial-rollout buffer on restart; hpcrl keeps it.)
* ``trained``: ``int64 [n, 3]``, one row per sample trained so far, in training order: rollout id, group
  index, sample index (``Sample.index``, unique over the run). A resumed run appends to it, so a run's last
  checkpoint lists every sample it ever trained on: the check that each group was trained exactly once.

Attributes ``format = "hpcrl-buffer"`` and ``version``. Written by rank 0 into the checkpoint's temp folder
(the checkpoint's rename makes it atomic; its ``COMPLETE`` marker checksums it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from hpcrl.data.sample import Sample

BUFFER_FILE = "buffer.h5"
FORMAT = "hpcrl-buffer"
VERSION = 1


def trained_rows(rollout_id: int, samples: Sequence[Sample]) -> list[tuple[int, int, int]]:
    """The ``trained`` rows of one rollout step: ``(rollout_id, group_index, index)`` per sample."""
    return [(int(rollout_id), int(s.group_index), int(s.index)) for s in samples]


def write_buffer(path: str | os.PathLike, groups: Sequence[Sequence[Sample]],
                 trained: Sequence[Sequence[int]]) -> None:
    """Write the buffer file (see the module doc) to ``path``, replacing it.

    ``groups``: held-back groups, each a list of samples; ``trained``: ``[n, 3]`` rows (rollout id, group index,
    sample index). Raises OSError from h5py when the file cannot be written, TypeError for a sample whose
    fields are not JSON.
    """
    import h5py

    rows = np.asarray(trained, dtype=np.int64).reshape(-1, 3)
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        g = f.create_group("groups")
        for i, group in enumerate(groups):
            g.create_dataset(f"{i:06d}", data=[json.dumps(s.to_dict()) for s in group],
                             dtype=h5py.string_dtype("utf-8"))
        f.create_dataset("trained", data=rows, maxshape=(None, 3))


def read_buffer(path: str | os.PathLike) -> tuple[list[list[Sample]], np.ndarray]:
    """Read a buffer file: ``(groups, trained)`` with ``trained`` ``int64 [n, 3]``.

    Raises FileNotFoundError, OSError (not HDF5), ValueError for another format or version.
    """
    import h5py

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no data buffer {path}")
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT or int(f.attrs.get("version", -1)) != VERSION:
            raise ValueError(f"{path} is not an {FORMAT} v{VERSION} file "
                             f"(format {f.attrs.get('format')!r}, version {f.attrs.get('version')!r})")
        groups = [[Sample.from_dict(json.loads(x)) for x in f["groups"][name].asstr()[()]]
                  for name in sorted(f["groups"])]
        trained = np.asarray(f["trained"][()], dtype=np.int64).reshape(-1, 3)
    return groups, trained
