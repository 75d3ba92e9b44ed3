"""Read the records of an offline W&B run (``run-<id>.wandb``) back, to test what a run logged.

W&B 0.31 dropped its Python reader (the Go core reads these files), but the format is the
LevelDB log it documents in ``wandb/sdk/internal/datastore.py`` of earlier releases: a 7-byte
header (``:W&B``, magic 0xBEE1, version), then 32 KiB blocks of records, each with a 7-byte
header (crc32, length, kind: 1 full, 2 first, 3 middle, 4 last), each payload one protobuf
``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path} is not a W&B run file (header {data[:7]!r})")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        else:  # zero-filled tail of the last block
            break


def offline_run_records(run_dir: str | Path) -> dict:
    """``{"history": [{key: value_json}, ...], "run": Record.run, "summary": {key: value_json}}`` of one
    ``offline-run-*`` directory (summary: the last value written for each key)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = Path(run_dir).glob("run-*.wandb")
    out = {"history": [], "run": None, "summary": {}}
    for payload in _payloads(path):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append(
                {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            )
        elif kind == "run":
            out["run"] = record.run
        elif kind == "summary":
            out["summary"].update(
                {item.key or "/".join(item.nested_key): item.value_json for item in record.summary.update}
            )
    return out
