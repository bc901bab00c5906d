"""Reading W&B's offline run files (``RUN/wandb/offline-run-*/run-<id>.wandb``) in tests, with wandb's own
protobuf ``Record`` (``wandb.proto.wandb_internal_pb2``).

wandb 0.31 writes these files from its Go core and ships no Python reader, so the framing is read here: W&B's
LevelDB-style log (``wandb-core``'s ``leveldb`` writer): a 7-byte header (``:W&B``, magic 0xBEE1 little
endian, version 0), then 32 KiB blocks of records, each with a 7-byte header (CRC-32 of the type byte and the
data, little endian; length, 2 bytes; type 1 full, 2 first, 3 middle, 4 last); a block's tail shorter than a
header is zero padding. A torn record at the end (an attempt killed while writing) ends the file.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> Iterator[Any]:
    """The ``Record`` protos of one ``.wandb`` file, in the order they were written."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + n]
        if kind == 0 or len(chunk) < n or zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            return
        pos += HEADER + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts + chunk if kind == 4 else chunk)
            parts = b""
            yield record
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk


def item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: Path) -> list[dict[str, Any]]:
    """The history rows of one ``.wandb`` file (values decoded from their JSON), in order."""
    return [{item_key(i): json.loads(i.value_json) for i in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def wandb_files(run_dir: Path) -> list[Path]:
    """The ``.wandb`` file of every offline run under ``run_dir/wandb``, oldest first."""
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*/*.wandb"))
