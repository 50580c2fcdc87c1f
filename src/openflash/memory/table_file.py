"""The Engram table file (`openflash engram export`, read by the disk tier), little-endian:

    [0, 4096)   header: magic b"OFENGRAM" | u32 version | u32 json length | sha256(magic, version, json) | json
                json = {rows, dim, weight_dtype, scale_dtype, scale_block, record_bytes, data_offset,
                        layout_fingerprint}
    [4096, ...) rows x record_bytes: record r = weight[r, :dim] bytes, then scale[r, :dim/32] bytes

A record (264 B for dim 256) is one contiguous read, which is what random row access wants.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from openflash.errors import EngramTableError
from openflash.formats import as_uint8
from openflash.model.engram_table import SCALE_BLOCK

TABLE_MAGIC = b"OFENGRAM"
TABLE_VERSION = 1
TABLE_HEADER_BYTES = 4096
_HEADER_PREFIX = struct.Struct("<8sII32s")  # magic, version, json length, sha256
WEIGHT_DTYPE_NAME = "float8_e4m3fn"
SCALE_DTYPE_NAME = "float8_e8m0fnu"


def table_file_name(layer_id: int) -> str:
    """Name of the table file of Engram layer `layer_id` inside an export folder."""
    return f"engram_layer{layer_id}.oftable"





@dataclass(frozen=True)
class TableHeader:
    rows: int
    dim: int
    layout_fingerprint: str
    weight_dtype: str = WEIGHT_DTYPE_NAME
    scale_dtype: str = SCALE_DTYPE_NAME
    scale_block: int = SCALE_BLOCK
    data_offset: int = TABLE_HEADER_BYTES

    @property
    def record_bytes(self) -> int:
        return self.dim + self.dim // self.scale_block

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.rows * self.record_bytes

    def encode(self) -> bytes:
        body = json.dumps({"rows": self.rows, "dim": self.dim, "weight_dtype": self.weight_dtype,
                           "scale_dtype": self.scale_dtype, "scale_block": self.scale_block,
                           "record_bytes": self.record_bytes, "data_offset": self.data_offset,
                           "layout_fingerprint": self.layout_fingerprint}, sort_keys=True).encode()
        if _HEADER_PREFIX.size + len(body) > self.data_offset:
            raise EngramTableError(f"table header of {len(body)} bytes does not fit in {self.data_offset} bytes "
                                   f"(layout fingerprint too long?)")
        digest = _header_digest(TABLE_VERSION, body)
        head = _HEADER_PREFIX.pack(TABLE_MAGIC, TABLE_VERSION, len(body), digest) + body
        return head + bytes(self.data_offset - len(head))


def _header_digest(version: int, body: bytes) -> bytes:
    return hashlib.sha256(TABLE_MAGIC + struct.pack("<I", version) + body).digest()


def read_table_header(path: str | Path) -> TableHeader:
    """Parse and verify a table file's header; raises EngramTableError naming the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise EngramTableError(f"Engram table file not found: {path}")
    with open(path, "rb") as f:
        raw = f.read(TABLE_HEADER_BYTES)
    if len(raw) < _HEADER_PREFIX.size:
        raise EngramTableError(f"{path}: truncated: {len(raw)} bytes, too short for a table header")
    magic, version, body_len, digest = _HEADER_PREFIX.unpack_from(raw)
    if magic != TABLE_MAGIC:
        raise EngramTableError(f"{path}: not an openflash Engram table file (magic {magic!r}, "
                               f"expected {TABLE_MAGIC!r})")
    if version != TABLE_VERSION:
        raise EngramTableError(f"{path}: table format version {version}, this openflash reads version "
                               f"{TABLE_VERSION}; re-export it with `openflash engram export`")
    body = raw[_HEADER_PREFIX.size:_HEADER_PREFIX.size + body_len]
    if len(body) != body_len or _header_digest(version, body) != digest:
        raise EngramTableError(f"{path}: header checksum mismatch (corrupt or truncated header)")
    try:
        meta = json.loads(body)
        header = TableHeader(rows=int(meta["rows"]), dim=int(meta["dim"]),
                             layout_fingerprint=str(meta["layout_fingerprint"]), weight_dtype=meta["weight_dtype"],
                             scale_dtype=meta["scale_dtype"], scale_block=int(meta["scale_block"]),
                             data_offset=int(meta["data_offset"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise EngramTableError(f"{path}: malformed header: {exc}") from exc
    if (header.weight_dtype, header.scale_dtype, header.scale_block) != (WEIGHT_DTYPE_NAME, SCALE_DTYPE_NAME,
                                                                          SCALE_BLOCK):
        raise EngramTableError(f"{path}: unsupported row format {header.weight_dtype} / {header.scale_dtype} per "
                               f"{header.scale_block}; expected {WEIGHT_DTYPE_NAME} / {SCALE_DTYPE_NAME} per "
                               f"{SCALE_BLOCK}")
    if header.rows < 1 or header.dim < SCALE_BLOCK or header.dim % SCALE_BLOCK or meta.get("record_bytes") != \
            header.record_bytes or header.data_offset < _HEADER_PREFIX.size + body_len:
        raise EngramTableError(f"{path}: inconsistent header {meta}")
    return header


def row_reader(source: Any, name: str) -> tuple[tuple[int, int], Callable[[int, int], np.ndarray]]:
    """(shape, read(start, stop) -> uint8 ndarray) over a tensor, an ndarray or a safetensors slice."""
    if isinstance(source, np.ndarray):
        shape = source.shape
        read = lambda a, b: np.ascontiguousarray(source[a:b]).view(np.uint8)  # noqa: E731
    elif isinstance(source, torch.Tensor):
        shape = tuple(source.shape)
        read = lambda a, b: as_uint8(source[a:b]).cpu().contiguous().numpy()  # noqa: E731
    elif hasattr(source, "get_shape"):  # safetensors PySafeSlice: reads only the sliced bytes
        shape = tuple(source.get_shape())
        read = lambda a, b: as_uint8(source[a:b]).contiguous().numpy()  # noqa: E731
    else:
        raise TypeError(f"{name}: cannot read rows from {type(source).__name__}")
    if len(shape) != 2:
        raise EngramTableError(f"{name} must be 2-D, got shape {list(shape)}")
    return (int(shape[0]), int(shape[1])), read


def write_table_file(path: str | Path, weight_u8: Any, scale_u8: Any, layout_fingerprint: str,
                     chunk_rows: int = 1 << 16, on_rows: Callable[[int], None] | None = None) -> TableHeader:
    """Write a table file, streaming `chunk_rows` rows at a time (the source is never loaded whole).

    weight_u8 / scale_u8: [rows, dim] / [rows, dim/32] uint8 (or float8) tensors, ndarrays, or safetensors slices.
    `on_rows(n)` is called after each chunk of n rows (progress). The file appears atomically: it is written as
    `<path>.partial`, synced, and renamed when complete.
    """
    path = Path(path)
    (rows, dim), read_w = row_reader(weight_u8, f"{path}: weight")
    (srows, sdim), read_s = row_reader(scale_u8, f"{path}: scale")
    if dim % SCALE_BLOCK or (srows, sdim) != (rows, dim // SCALE_BLOCK) or rows < 1:
        raise EngramTableError(f"{path}: weight [{rows}, {dim}] and scale [{srows}, {sdim}] are not FP8 rows with "
                               f"one scale per {SCALE_BLOCK} values")
    header = TableHeader(rows=rows, dim=dim, layout_fingerprint=layout_fingerprint)
    partial = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(partial, "wb") as f:
            f.write(header.encode())
            for start in range(0, rows, chunk_rows):
                stop = min(rows, start + chunk_rows)
                records = np.empty((stop - start, header.record_bytes), dtype=np.uint8)
                records[:, :dim] = read_w(start, stop)
                records[:, dim:] = read_s(start, stop)
                f.write(records.data)
                if on_rows is not None:
                    on_rows(stop - start)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise EngramTableError(f"{path}: cannot write table file: {exc}") from exc
    return header
