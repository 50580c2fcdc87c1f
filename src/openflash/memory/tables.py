"""Engram table storage: turning hash ids into table rows (spec: engram.md §3, §5; checkpoint.md §3.5, §4, §6).

Each Engram layer owns one flat table of `rows` x `dim` stored as FP8 E4M3 values plus one UE8M0 scale per 32
consecutive values of a row. A looked-up row dequantises to fp32(weight[r, d]) * 2^(scale[r, d//32] - 127), which
is then rounded to bf16 (engram.md §5). The released tables hold ~384M rows each (~101 GB per layer), so where they
live is a deployment choice; every tier below implements the same `gather` and returns bit-identical rows:

    DeviceTable   the table is part of the model's state_dict (`...engram.embed.weight` / `.scale`)
    HostTable     FP8 rows in CPU RAM (pinned when CUDA exists), rows copied to the device per lookup
    DiskTable     a memory-mapped file per layer (format below) with an LRU row cache
    ShardedTable  rows split across torch.distributed ranks in contiguous blocks (checkpoint.md §6)

Table file format (`write_table_file`, `DiskTable`), little-endian:

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
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from openflash.errors import CheckpointError, ConfigError, EngramTableError
from openflash.formats import as_uint8, dequantize_fp8_rows, encode_window_fp8
from openflash.manifest import write_manifest
from openflash.shards import INDEX_FILE, SINGLE_FILE, read_weight_map

SCALE_BLOCK = 32  # one UE8M0 scale per 32 consecutive values of a row (engram.md §5)
UE8M0_ONE = 127  # scale byte of 2^0: the padding value of sharded scale blocks (checkpoint.md §6)

TABLE_MAGIC = b"OFENGRAM"
TABLE_VERSION = 1
TABLE_HEADER_BYTES = 4096
_HEADER_PREFIX = struct.Struct("<8sII32s")  # magic, version, json length, sha256
WEIGHT_DTYPE_NAME = "float8_e4m3fn"
SCALE_DTYPE_NAME = "float8_e8m0fnu"

PLACEMENTS = ("device", "host", "disk", "sharded")


def table_file_name(layer_id: int) -> str:
    """Name of the table file of Engram layer `layer_id` inside an export folder."""
    return f"engram_layer{layer_id}.oftable"


@runtime_checkable
class EngramTable(Protocol):
    num_rows: int
    dim: int

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 [...]; returns float32 [..., dim] holding the bf16-rounded dequantized rows (engram.md §5)."""
        ...


@dataclass
class TableStats:
    """Lookup counters of one table. Hits and misses count unique rows per gather (duplicates are read once)."""

    gathers: int = 0
    rows_requested: int = 0  # ids asked for, duplicates included
    unique_rows: int = 0
    hits: int = 0  # unique rows served by the row cache
    misses: int = 0  # unique rows read from storage
    bytes_read: int = 0  # record bytes read from storage, warm-ups included
    rows_warmed: int = 0  # rows loaded into the cache by `warm` (speculation), not by a gather
    read_seconds: float = 0.0  # wall time spent reading storage

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "hit_rate": self.hit_rate}


# ----------------------------------------------------------------------------------------------------------------
# shared helpers


def decode_rows(weight_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """FP8 rows + UE8M0 row scales (uint8) -> fp32 holding the bf16-rounded values (engram.md §5)."""
    return dequantize_fp8_rows(weight_u8, scale_u8).to(torch.bfloat16).to(torch.float32)


def _check_ids(ids: torch.Tensor, num_rows: int, where: str) -> None:
    """Out-of-range ids mean the hash layout and the table disagree; numpy would wrap negatives silently."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise EngramTableError(f"{where}: hash ids must be int64, got {ids.dtype}")
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise EngramTableError(
            f"{where}: hash id {bad} is outside the table's {num_rows} rows (hash layout and table do not match)"
        )


def _check_row_format(weight_u8: torch.Tensor, scale_u8: torch.Tensor, where: str) -> tuple[int, int]:
    if weight_u8.dim() != 2 or scale_u8.dim() != 2:
        raise EngramTableError(f"{where}: weight and scale must be 2-D, got {list(weight_u8.shape)} and "
                               f"{list(scale_u8.shape)}")
    rows, dim = weight_u8.shape
    if dim % SCALE_BLOCK != 0:
        raise EngramTableError(f"{where}: row width {dim} is not a multiple of {SCALE_BLOCK}")
    if tuple(scale_u8.shape) != (rows, dim // SCALE_BLOCK):
        raise EngramTableError(f"{where}: scale has shape {list(scale_u8.shape)}, expected "
                               f"[{rows}, {dim // SCALE_BLOCK}] for weight [{rows}, {dim}]")
    return rows, dim


def _output_device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


# ----------------------------------------------------------------------------------------------------------------
# DeviceTable


class DeviceTable(nn.Module):
    """The table as model weights: `weight` (and `scale`) are part of the model's state_dict.

    storage="fp8": `weight` float8_e4m3fn [rows, dim] and `scale` float8_e8m0fnu [rows, dim/32], exactly as the
    checkpoint stores them (frozen parameters). storage="fp32": a trainable fp32 `weight` for training from scratch;
    its gather is a plain differentiable embedding lookup without bf16 rounding. When another tier takes over the
    rows (EngramMemory.attach), `release` frees them here.
    """

    def __init__(self, num_rows: int, dim: int, storage: str = "fp8", device: torch.device | str | None = None,
                 init_std: float = 1.0) -> None:
        super().__init__()
        if storage not in ("fp8", "fp32"):
            raise ConfigError(f"Engram table storage must be 'fp8' or 'fp32', got {storage!r}")
        if dim % SCALE_BLOCK != 0:
            raise ConfigError(f"engram_head_dim {dim} is not a multiple of {SCALE_BLOCK} (one scale per 32 values)")
        self.num_rows, self.dim, self.storage, self.init_std = int(num_rows), int(dim), storage, init_std
        self.released: str | None = None  # the tier that took over the rows (see `release`)
        if storage == "fp8":
            self.weight = nn.Parameter(torch.zeros(num_rows, dim, dtype=torch.float8_e4m3fn, device=device),
                                       requires_grad=False)
            # Byte 127 = 2^0, so a fresh table decodes to zeros rather than to whatever empty memory held.
            scale = torch.full((num_rows, dim // SCALE_BLOCK), UE8M0_ONE, dtype=torch.uint8, device=device)
            self.scale = nn.Parameter(scale.view(torch.float8_e8m0fnu), requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(num_rows, dim, dtype=torch.float32, device=device))
            self.scale = None
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random init of a trainable table (a training choice, not part of the spec: engram.md §9.3)."""
        if self.storage == "fp32" and self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=self.init_std)

    @property
    def row_bytes(self) -> int:
        """Bytes one row occupies in this storage (264 for the released fp8 rows of 256 values)."""
        return self.dim + self.dim // SCALE_BLOCK if self.storage == "fp8" else 4 * self.dim

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        if self.released is not None:
            raise EngramTableError(f"this Engram table's rows were moved to the {self.released!r} tier; look them "
                                   f"up through the EngramMemory attached to the model (model.row_source)")
        if self.storage == "fp32":
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1).to(self.weight.device)
        if flat.device.type == "cpu":  # on an accelerator index_select asserts on bad ids; a CPU check is free
            _check_ids(flat, self.num_rows, "Engram DeviceTable")
        rows = decode_rows(as_uint8(self.weight).index_select(0, flat), as_uint8(self.scale).index_select(0, flat))
        return rows.reshape(*ids.shape, self.dim)

    forward = gather

    @torch.no_grad()
    def to_fp8(self) -> "DeviceTable":
        """This table in checkpoint row format (per-row 1x32 UE8M0 blocks), e.g. to save in the official layout."""
        if self.storage == "fp8":
            return self
        return DeviceTable.from_fp32(self.weight.detach())

    @classmethod
    @torch.no_grad()
    def from_fp32(cls, weight: torch.Tensor) -> "DeviceTable":
        """Quantize an fp32 [rows, dim] table to FP8 rows with one UE8M0 scale per 32 values of a row.

        Uses the act_quant rule (quant_and_cache.md §2.1: power-of-two ceiling of amax/448, RNE, saturating),
        which formats exposes for any per-32 FP8 row format as `encode_window_fp8`."""
        q, scale = encode_window_fp8(weight.detach().float())
        return cls.from_fp8(q, scale)

    @classmethod
    @torch.no_grad()
    def from_fp8(cls, weight: torch.Tensor, scale: torch.Tensor) -> "DeviceTable":
        """Wrap checkpoint tensors (float8, or their uint8 bytes) as a frozen fp8 table, sharing their memory."""
        w8, s8 = as_uint8(weight), as_uint8(scale)
        rows, dim = _check_row_format(w8, s8, "Engram DeviceTable")
        table = cls(rows, dim, storage="fp8", device="meta")  # meta: allocate nothing, then adopt the tensors
        table.weight = nn.Parameter(w8.view(torch.float8_e4m3fn), requires_grad=False)
        table.scale = nn.Parameter(s8.view(torch.float8_e8m0fnu), requires_grad=False)
        return table

    @torch.no_grad()
    def release(self, placement: str) -> None:
        """Free the rows: another tier (host / disk / sharded) serves them from now on.

        The weight (and scale) become empty [0, dim] tensors of the same dtype and device, so the memory is really
        returned while `.to(device)` keeps working. A released table cannot be gathered from or saved: the
        model's state_dict() (and so save_checkpoint) raises EngramTableError. Save before attaching a tier.
        """
        if self.released is not None:
            return
        self.released = placement
        self.weight = nn.Parameter(self.weight.new_empty((0, self.dim)), requires_grad=False)
        if self.scale is not None:
            self.scale = nn.Parameter(self.scale.new_empty((0, self.dim // SCALE_BLOCK)), requires_grad=False)
        self.register_state_dict_pre_hook(_refuse_released_state_dict)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "DeviceTable":
        # Module.to(dtype) / .float() / .bfloat16() cast every floating-point tensor, float8 included, which would
        # silently decode the stored FP8 rows into a 2-4x larger table. FP8 storage follows device moves only.
        if self.storage == "fp8":
            probe = fn(torch.empty(0, dtype=torch.float8_e4m3fn, device=self.weight.device))
            if isinstance(probe, torch.Tensor) and probe.dtype != torch.float8_e4m3fn:
                return super()._apply(lambda t: t.to(probe.device), recurse)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"rows={self.num_rows}, dim={self.dim}, storage={self.storage}"


def _refuse_released_state_dict(module: DeviceTable, prefix: str, keep_vars: bool) -> None:
    raise EngramTableError(f"{prefix}weight: this Engram table was released to the {module.released!r} tier "
                           f"(EngramMemory.attach), so the model cannot be saved with its tables; save the "
                           f"checkpoint before attaching a tier, or use the exported table files")


# ----------------------------------------------------------------------------------------------------------------
# HostTable


class HostTable:
    """FP8 rows and scales in CPU RAM; each gather copies only the looked-up rows (264 B each) to `device`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, device: torch.device | str | None = None,
                 pin_memory: bool | None = None) -> None:
        w8, s8 = as_uint8(weight).cpu().contiguous(), as_uint8(scale).cpu().contiguous()
        self.num_rows, self.dim = _check_row_format(w8, s8, "Engram HostTable")
        self.device = _output_device(device)
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        if self.pinned:
            w8, s8 = w8.pin_memory(), s8.pin_memory()
        self.weight, self.scale = w8, s8
        self.stats = TableStats()

    @classmethod
    def from_device_table(cls, table: DeviceTable, device: torch.device | str | None = None) -> "HostTable":
        if table.storage != "fp8":
            raise EngramTableError("a HostTable holds FP8 rows; call DeviceTable.to_fp8() on an fp32 table first")
        return cls(table.weight.detach(), table.scale.detach(), device=device)

    @property
    def row_bytes(self) -> int:
        return self.dim + self.dim // SCALE_BLOCK

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        _check_ids(flat, self.num_rows, "Engram HostTable")
        n = flat.numel()
        # Gather straight into pinned staging memory so the copy to the accelerator can overlap (non_blocking).
        w = torch.empty((n, self.dim), dtype=torch.uint8, pin_memory=self.pinned)
        s = torch.empty((n, self.dim // SCALE_BLOCK), dtype=torch.uint8, pin_memory=self.pinned)
        torch.index_select(self.weight, 0, flat, out=w)
        torch.index_select(self.scale, 0, flat, out=s)
        w = w.to(self.device, non_blocking=self.pinned)
        s = s.to(self.device, non_blocking=self.pinned)
        self.stats.gathers += 1
        self.stats.rows_requested += n
        return decode_rows(w, s).reshape(*ids.shape, self.dim)


# ----------------------------------------------------------------------------------------------------------------
# Table files


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


def _row_source(source: Any, name: str) -> tuple[tuple[int, int], Callable[[int, int], np.ndarray]]:
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
    (rows, dim), read_w = _row_source(weight_u8, f"{path}: weight")
    (srows, sdim), read_s = _row_source(scale_u8, f"{path}: scale")
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


# ----------------------------------------------------------------------------------------------------------------
# DiskTable


class RowCache:
    """LRU cache of table records with a capacity in bytes. Not thread-safe: the owning table locks around it."""

    def __init__(self, capacity_bytes: int, record_bytes: int) -> None:
        self.capacity_rows = max(0, int(capacity_bytes) // record_bytes)
        # np.empty only reserves address space; pages are touched as rows are cached.
        self._store = np.empty((self.capacity_rows, record_bytes), dtype=np.uint8)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # row id -> slot, least recently used first

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, row: int) -> bool:
        return row in self._slot_of

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where absent; hits become most recently used."""
        slots = np.full(len(ids), -1, dtype=np.int64)
        if not self._slot_of:
            return slots
        for i, row in enumerate(ids.tolist()):
            slot = self._slot_of.get(row)
            if slot is not None:
                self._slot_of.move_to_end(row)
                slots[i] = slot
        return slots

    def read(self, slots: np.ndarray) -> np.ndarray:
        return self._store[slots]

    def insert(self, ids: np.ndarray, records: np.ndarray) -> int:
        """Add rows not yet cached, evicting the least recently used; returns how many were added."""
        if self.capacity_rows == 0:
            return 0
        added = 0
        # Only the last `capacity_rows` of a huge batch can survive anyway.
        for row, record in zip(ids[-self.capacity_rows:].tolist(), records[-self.capacity_rows:]):
            if row in self._slot_of:
                continue
            if len(self._slot_of) < self.capacity_rows:
                slot = len(self._slot_of)
            else:
                _, slot = self._slot_of.popitem(last=False)
            self._store[slot] = record
            self._slot_of[row] = slot
            added += 1
        return added

    def clear(self) -> None:
        self._slot_of.clear()


class DiskTable:
    """A table file read with positioned reads (os.preadv), an LRU row cache and a small pool of reader threads.

    Rows are gathered by unique id (each row read once per call, runs of consecutive rows in one read), served from
    the cache when present, otherwise read from the file; preadv releases the GIL, so the pool overlaps I/O. Reads
    rather than a memory mapping: a mapped file that shrinks under the process turns the next access into SIGBUS,
    which kills it; a read just comes back short, and that becomes an EngramTableError naming the file.
    """

    def __init__(self, path: Path, header: TableHeader, cache_bytes: int = 0, io_threads: int = 4,
                 device: torch.device | str | None = None, parallel_min_rows: int = 512) -> None:
        self.path, self.header = path, header
        self.num_rows, self.dim = header.rows, header.dim
        self.record_bytes = header.record_bytes
        self.device = _output_device(device)
        self.io_threads = max(1, int(io_threads))
        self.parallel_min_rows = parallel_min_rows
        self.stats = TableStats()
        self.cache = RowCache(cache_bytes, self.record_bytes)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._fd: int | None = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # rows are scattered: kernel read-ahead would only waste I/O
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    @classmethod
    def open(cls, path: str | Path, expected_rows: int | None, expected_dim: int | None,
             expected_fingerprint: str | None, cache_bytes: int = 0, io_threads: int = 4,
             device: torch.device | str | None = None) -> "DiskTable":
        """Open and verify a table file. An expected_* of None skips that check (inspection tools only)."""
        path = Path(path)
        header = read_table_header(path)
        if expected_fingerprint is not None and header.layout_fingerprint != expected_fingerprint:
            raise EngramTableError(f"{path}: Engram hash layout fingerprint mismatch: file has "
                                   f"{header.layout_fingerprint!r}, the model expects {expected_fingerprint!r} "
                                   f"(table exported for a different Engram config)")
        if expected_rows is not None and header.rows != expected_rows:
            raise EngramTableError(f"{path}: table has {header.rows} rows, the model expects {expected_rows}")
        if expected_dim is not None and header.dim != expected_dim:
            raise EngramTableError(f"{path}: table rows have dim {header.dim}, the model expects {expected_dim}")
        size = path.stat().st_size
        if size < header.file_bytes:
            raise EngramTableError(f"{path}: truncated: {size} bytes, expected {header.file_bytes} "
                                   f"(header {header.data_offset} + {header.rows} rows x {header.record_bytes} B)")
        if size > header.file_bytes:
            raise EngramTableError(f"{path}: {size - header.file_bytes} unexpected bytes after the last row "
                                   f"(expected {header.file_bytes} bytes)")
        return cls(path, header, cache_bytes=cache_bytes, io_threads=io_threads, device=device)

    @property
    def row_bytes(self) -> int:
        return self.record_bytes

    # -- reads ---------------------------------------------------------------------------------------------

    def _read_range(self, ids: np.ndarray) -> np.ndarray:
        """Records of sorted unique `ids`: one positioned read per run of consecutive rows."""
        records = np.empty((len(ids), self.record_bytes), dtype=np.uint8)
        cuts = np.flatnonzero(np.diff(ids) != 1) + 1
        for start, end in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(ids)]))):
            first, last = int(ids[start]), int(ids[end - 1])
            self._read_at(self.header.data_offset + first * self.record_bytes,
                          memoryview(records[start:end]).cast("B"), first, last)
        return records

    def read_records(self, first: int, count: int) -> np.ndarray:
        """Raw records [count, record_bytes] of rows first..first+count-1, bypassing the cache (inspection)."""
        if not 0 <= first <= first + count <= self.num_rows:
            raise EngramTableError(f"{self.path}: rows {first}..{first + count - 1} are outside 0..{self.num_rows - 1}")
        return self._read_range(np.arange(first, first + count, dtype=np.int64))

    def _read_at(self, offset: int, buffer: memoryview, first: int, last: int) -> None:
        """Fill `buffer` from the file at `offset` (rows first..last), or fail naming the file."""
        fd, done = self._fd, 0
        if fd is None:
            raise EngramTableError(f"{self.path}: the table is closed")
        while done < len(buffer):
            try:
                n = os.preadv(fd, [buffer[done:]], offset + done)
            except OSError as exc:
                raise EngramTableError(f"{self.path}: read error in rows {first}..{last}: {exc}") from exc
            if n == 0:
                size = os.fstat(fd).st_size
                raise EngramTableError(f"{self.path}: truncated while in use: rows {first}..{last} lie past its end "
                                       f"(the file has {size} bytes now, {self.header.file_bytes} expected)")
            done += n

    def _read_rows(self, ids: np.ndarray) -> np.ndarray:
        """Records of sorted unique `ids`, split over the thread pool when many are needed."""
        start = time.perf_counter()
        if len(ids) >= self.parallel_min_rows and self.io_threads > 1:
            with self._lock:  # gathers and warm-ups may arrive from different threads
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="engram-io")
            parts = [p for p in np.array_split(ids, self.io_threads) if len(p)]
            records = np.concatenate(list(self._pool.map(self._read_range, parts)))
        else:
            records = self._read_range(ids)
        with self._lock:
            self.stats.read_seconds += time.perf_counter() - start
            self.stats.bytes_read += records.nbytes
        return records

    def _records(self, unique_ids: np.ndarray, count: bool) -> tuple[np.ndarray, int]:
        """(records of sorted unique ids, number of rows newly put in the cache). `count`: a gather's lookup
        (counted as hits / misses) rather than a warm-up."""
        if self._fd is None:
            raise EngramTableError(f"{self.path}: the table is closed")
        records = np.empty((len(unique_ids), self.record_bytes), dtype=np.uint8)
        with self._lock:
            slots = self.cache.lookup(unique_ids)
            miss = slots < 0
            if not miss.all():
                records[~miss] = self.cache.read(slots[~miss])
        if miss.any():
            records[miss] = self._read_rows(unique_ids[miss])
        with self._lock:
            added = self.cache.insert(unique_ids[miss], records[miss])
            if count:
                self.stats.hits += int((~miss).sum())
                self.stats.misses += int(miss.sum())
            else:
                self.stats.rows_warmed += added
        return records, added

    def _unique_ids(self, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        flat = ids.reshape(-1).cpu()
        _check_ids(flat, self.num_rows, f"{self.path}")
        return np.unique(flat.numpy().astype(np.int64, copy=False), return_inverse=True)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = self._unique_ids(ids)
        records, _ = self._records(unique, count=True)
        with self._lock:
            self.stats.gathers += 1
            self.stats.rows_requested += ids.numel()
            self.stats.unique_rows += len(unique)
        # Decode the unique records once, on the output device (264 B per row cross the bus, not 4*dim).
        rec = torch.from_numpy(records).to(self.device)
        rows = decode_rows(rec[:, :self.dim], rec[:, self.dim:])
        inverse = torch.from_numpy(inverse.reshape(-1)).to(self.device)
        return rows.index_select(0, inverse).reshape(*ids.shape, self.dim)

    def warm(self, ids: torch.Tensor) -> int:
        """Load rows into the row cache ahead of need (speculation); returns how many were newly cached."""
        if self.cache.capacity_rows == 0:
            return 0
        unique, _ = self._unique_ids(ids)
        return self._records(unique, count=False)[1]

    def clear_cache(self) -> None:
        with self._lock:
            self.cache.clear()

    def drop_page_cache(self) -> bool:
        """Ask the kernel to forget this file's cached pages (cold-cache benchmarks). Best effort: returns True
        when the advice call succeeded; the kernel may still keep pages that are in use."""
        try:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return True
        except (OSError, AttributeError, TypeError):
            return False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DiskTable":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------------
# ShardedTable


def shard_block_rows(num_rows: int, world_size: int) -> int:
    """Rows per rank: contiguous blocks of ceil(rows / world_size); the last block is padded (checkpoint.md §6)."""
    return -(-num_rows // world_size)


def shard_rows(weight: Any, scale: Any, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s block of rows as uint8 (weight, scale), padded to the block size with weight 0 and scale
    byte 127 (= 2^0), so padded rows decode to 0 (checkpoint.md §6). Accepts tensors or safetensors slices."""
    (rows, dim), read_w = _row_source(weight, "Engram weight")
    _, read_s = _row_source(scale, "Engram scale")
    block = shard_block_rows(rows, world_size)
    start, stop = min(rows, rank * block), min(rows, (rank + 1) * block)
    w = torch.zeros((block, dim), dtype=torch.uint8)
    s = torch.full((block, dim // SCALE_BLOCK), UE8M0_ONE, dtype=torch.uint8)
    if stop > start:
        w[:stop - start] = torch.from_numpy(read_w(start, stop))
        s[:stop - start] = torch.from_numpy(read_s(start, stop))
    return w, s


class ShardedTable:
    """Rows split across the ranks of a process group; every rank gets the full rows (engram.md §5).

    All ranks must call `gather` together with the same ids, as in tensor-parallel inference. Each rank looks up
    the ids in its block (others read local row 0 and are zeroed) and an all-reduce(sum) combines them. The sum
    runs on the raw FP8/UE8M0 bytes: exactly one rank contributes a nonzero record per id, so the sum is that
    record, bit for bit, and a quarter of the bytes of summing decoded fp32 rows travel.
    """

    def __init__(self, local_weight: torch.Tensor, local_scale: torch.Tensor, num_rows: int,
                 group: "dist.ProcessGroup | None" = None, device: torch.device | str | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.num_rows = int(num_rows)
        self.block_rows = shard_block_rows(self.num_rows, self.world_size)
        self.device = _output_device(device)
        w8, s8 = as_uint8(local_weight), as_uint8(local_scale)
        rows, self.dim = _check_row_format(w8, s8, "Engram ShardedTable")
        if rows != self.block_rows:
            raise EngramTableError(f"Engram ShardedTable: rank {self.rank} holds {rows} rows, expected the "
                                   f"padded block of {self.block_rows} = ceil({self.num_rows} / {self.world_size})")
        self.weight, self.scale = w8.to(self.device), s8.to(self.device)
        self.stats = TableStats()

    @classmethod
    def from_full(cls, weight: Any, scale: Any, group: "dist.ProcessGroup | None" = None,
                  device: torch.device | str | None = None) -> "ShardedTable":
        """Keep only this rank's block of a full table (tensors or safetensors slices, read lazily)."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        (rows, _), _ = _row_source(weight, "Engram weight")
        w, s = shard_rows(weight, scale, rank, world_size)
        return cls(w, s, rows, group=group, device=device)

    @property
    def row_bytes(self) -> int:
        return self.dim + self.dim // SCALE_BLOCK

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(self.device)
        if flat.device.type == "cpu":
            _check_ids(flat, self.num_rows, f"Engram ShardedTable (rank {self.rank})")
        local = flat - self.rank * self.block_rows
        mine = (local >= 0) & (local < self.block_rows)
        local = torch.where(mine, local, torch.zeros_like(local))
        records = torch.cat([self.weight.index_select(0, local), self.scale.index_select(0, local)], dim=1)
        records.mul_(mine.unsqueeze(1).to(torch.uint8))
        dist.all_reduce(records, op=dist.ReduceOp.SUM, group=self.group)
        self.stats.gathers += 1
        self.stats.rows_requested += flat.numel()
        rows = decode_rows(records[:, :self.dim], records[:, self.dim:])
        return rows.reshape(*ids.shape, self.dim)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint reading and export


@dataclass(frozen=True)
class EngramTableSpec:
    """What a checkpoint's config says about its Engram tables."""

    layer_ids: list[int]
    num_rows: list[int]
    dim: int
    max_ngram: int
    n_heads: int
    engram_vocab_size: int
    compressed_vocab_size: int

    def layout_fingerprint(self) -> str:
        """Fingerprint of the prime layout (rows of each hash column), from the hashing module.

        EngramHashLayout.create also takes the compressed vocab size and pad id, which seed the hash multipliers
        but not the layout; the fingerprint covers the layout only, so the pad id passed here (0) is irrelevant.
        """
        from openflash.memory.hashing import EngramHashLayout

        layout = EngramHashLayout.create(layer_ids=self.layer_ids, engram_vocab_size=self.engram_vocab_size,
                                         max_ngram=self.max_ngram, n_heads=self.n_heads,
                                         compressed_vocab_size=self.compressed_vocab_size, pad_compressed_id=0,
                                         expected_num_embeddings=self.num_rows)
        return layout.layout_fingerprint()


_SPEC_KEYS = {"engram_layer_ids": list, "engram_num_embeddings": list, "engram_head_dim": int,
              "engram_max_ngram_size": int, "engram_n_heads": int, "engram_vocab_size": int,
              "engram_compressed_vocab_size": int}


def read_engram_spec(checkpoint_dir: str | Path) -> EngramTableSpec:
    """Engram table settings from `config.json` (HF layout with `text_config`, or the flat reference layout)."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint config not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON: {exc}") from exc
    text = data.get("text_config", data)
    missing = [key for key in _SPEC_KEYS if key not in text]
    if missing:
        raise CheckpointError(f"{path}: missing Engram config keys {missing}")
    for key, kind in _SPEC_KEYS.items():
        if not isinstance(text[key], kind) or isinstance(text[key], bool):
            raise CheckpointError(f"{path}: {key} must be {kind.__name__}, got {text[key]!r}")
    layer_ids = [int(x) for x in text["engram_layer_ids"]]
    num_rows = [int(x) for x in text["engram_num_embeddings"]]
    if len(layer_ids) != len(num_rows):
        raise CheckpointError(f"{path}: engram_num_embeddings has {len(num_rows)} entries for "
                              f"{len(layer_ids)} engram_layer_ids")
    return EngramTableSpec(layer_ids=layer_ids, num_rows=num_rows, dim=int(text["engram_head_dim"]),
                           max_ngram=int(text["engram_max_ngram_size"]), n_heads=int(text["engram_n_heads"]),
                           engram_vocab_size=int(text["engram_vocab_size"]),
                           compressed_vocab_size=int(text["engram_compressed_vocab_size"]))


def engram_tensor_names(layer_id: int) -> tuple[str, str]:
    return f"layers.{layer_id}.engram.embed.weight", f"layers.{layer_id}.engram.embed.scale"


_FLOAT_TABLE_DTYPES = ("F32", "BF16", "F16")


class _QuantizedFloatRows:
    """A float Engram table (as `openflash train` saves it: fp32, no scale tensor) read as the checkpoint's FP8 row
    format, chunk by chunk: `codes` and `scales` are two row sources over one quantization of each chunk."""

    def __init__(self, source: Any, dim: int) -> None:
        self.source, self.rows, self.dim = source, int(source.get_shape()[0]), dim
        self._chunk: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None

    def _quantized(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._chunk is None or self._chunk[0] != (start, stop):
            # the rule DeviceTable.to_fp8 uses, so an exported table equals the quantized in-memory one
            codes, scales = encode_window_fp8(self.source[start:stop].float())
            self._chunk = ((start, stop), codes, scales)
        return self._chunk[1], self._chunk[2]

    class _Part:
        def __init__(self, owner: "_QuantizedFloatRows", which: int, width: int) -> None:
            self.owner, self.which, self.width = owner, which, width

        def get_shape(self) -> list[int]:
            return [self.owner.rows, self.width]

        def __getitem__(self, rows: slice) -> torch.Tensor:
            start, stop, _ = rows.indices(self.owner.rows)
            return self.owner._quantized(start, stop)[self.which]

    def parts(self) -> tuple[Any, Any]:
        return self._Part(self, 0, self.dim), self._Part(self, 1, self.dim // SCALE_BLOCK)


class CheckpointTables:
    """Lazy access to the Engram tables of a safetensors checkpoint (one file, or shards + index json).

    Tables are FP8 rows with UE8M0 scales (the official layout), or float without a scale (checkpoints that
    `openflash train` writes), which are quantized to FP8 rows as they are read."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        from safetensors import safe_open

        self.dir = Path(checkpoint_dir)
        self.spec = read_engram_spec(self.dir)
        index, single = self.dir / INDEX_FILE, self.dir / SINGLE_FILE
        if index.is_file():
            weight_map = read_weight_map(self.dir)
        elif single.is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        wanted = [name for lid in self.spec.layer_ids for name in engram_tensor_names(lid)]
        if weight_map is not None:
            present = [name for name in wanted if name in weight_map]
            files = {name: weight_map[name] for name in present}
        else:
            files = {name: single for name in wanted}
        self._handles: dict[Path, Any] = {}
        self._slices: dict[str, Any] = {}
        missing = []
        for name, file in files.items():
            if file not in self._handles:
                if not file.is_file():
                    raise CheckpointError(f"checkpoint shard not found: {file} (holds {name})")
                try:
                    self._handles[file] = safe_open(str(file), framework="pt")
                except Exception as exc:  # safetensors raises its own error types for bad headers
                    raise CheckpointError(f"{file}: cannot open safetensors file: {exc}") from exc
            if name in self._handles[file].keys():
                self._slices[name] = self._handles[file].get_slice(name)
        self._float: dict[int, _QuantizedFloatRows] = {}
        for lid in self.spec.layer_ids:
            weight_name, scale_name = engram_tensor_names(lid)
            weight = self._slices.get(weight_name)
            if weight is not None and scale_name not in self._slices and weight.get_dtype() in _FLOAT_TABLE_DTYPES:
                self._float[lid] = _QuantizedFloatRows(weight, self.spec.dim)
            else:
                missing += [name for name in (weight_name, scale_name) if name not in self._slices]
        if missing:
            raise CheckpointError(f"{self.dir}: missing Engram tensors {missing}")
        for position, lid in enumerate(self.spec.layer_ids):
            self._check(lid, self.spec.num_rows[position])

    def _check(self, layer_id: int, rows: int) -> None:
        dim = self.spec.dim
        for name, dtype, shape in zip(engram_tensor_names(layer_id), ("F8_E4M3", "F8_E8M0"),
                                      ([rows, dim], [rows, dim // SCALE_BLOCK])):
            if layer_id in self._float:
                if name.endswith(".scale"):
                    continue
                dtype = self._slices[name].get_dtype()  # any float dtype; quantized when read
            found_shape, found_dtype = list(self._slices[name].get_shape()), self._slices[name].get_dtype()
            if found_dtype == "U8" and dtype == "F8_E8M0":
                found_dtype = dtype  # the same bits, as some writers store UE8M0 scales
            if found_shape != shape or found_dtype != dtype:
                raise CheckpointError(f"{self.dir}: tensor {name} is {found_dtype} {found_shape}, expected "
                                      f"{dtype} {shape} (engram_num_embeddings / engram_head_dim in config.json)")

    def slices(self, layer_id: int) -> tuple[Any, Any]:
        """(weight, scale) row sources of one layer in the FP8 row format; index them with [start:stop]."""
        if layer_id in self._float:
            return self._float[layer_id].parts()
        w, s = engram_tensor_names(layer_id)
        return self._slices[w], self._slices[s]

    def load(self, layer_id: int, chunk_rows: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole table as uint8 CPU tensors, read in chunks (no second full-size copy)."""
        (rows, dim), read_w = _row_source(self.slices(layer_id)[0], "weight")
        _, read_s = _row_source(self.slices(layer_id)[1], "scale")
        w = torch.empty((rows, dim), dtype=torch.uint8)
        s = torch.empty((rows, dim // SCALE_BLOCK), dtype=torch.uint8)
        for start in range(0, rows, chunk_rows):
            stop = min(rows, start + chunk_rows)
            w[start:stop] = torch.from_numpy(read_w(start, stop))
            s[start:stop] = torch.from_numpy(read_s(start, stop))
        return w, s


@dataclass(frozen=True)
class ExportedTable:
    layer_id: int
    path: Path
    rows: int
    bytes: int
    seconds: float


def export_engram_tables(checkpoint_dir: str | Path, out_dir: str | Path, chunk_rows: int = 1 << 16,
                         on_table: Callable[[ExportedTable], None] | None = None,
                         on_rows: Callable[[int, int, int], None] | None = None) -> list[Path]:
    """Write `engram_layer{L}.oftable` for every Engram layer of a checkpoint, streaming rows in chunks.

    on_table(result) is called after each file; on_rows(layer_id, rows_done, rows_total) after each chunk."""
    checkpoint = CheckpointTables(checkpoint_dir)
    try:
        fingerprint = checkpoint.spec.layout_fingerprint()
    except ConfigError as exc:
        raise CheckpointError(f"{Path(checkpoint_dir) / 'config.json'}: {exc}") from exc
    out_dir = Path(out_dir)
    paths = []
    for layer_id, rows in zip(checkpoint.spec.layer_ids, checkpoint.spec.num_rows):
        start, done = time.perf_counter(), [0]

        def progress(n: int) -> None:  # called synchronously per chunk, so layer_id / rows are this layer's
            done[0] += n
            if on_rows is not None:
                on_rows(layer_id, done[0], rows)

        path = out_dir / table_file_name(layer_id)
        weight, scale = checkpoint.slices(layer_id)
        header = write_table_file(path, weight, scale, fingerprint, chunk_rows=chunk_rows, on_rows=progress)
        paths.append(path)
        if on_table is not None:
            on_table(ExportedTable(layer_id, path, header.rows, header.file_bytes, time.perf_counter() - start))
    write_manifest(out_dir)
    return paths


# ----------------------------------------------------------------------------------------------------------------
# Factory


def open_tables(placement: str, *, layer_ids: Sequence[int], num_rows: Sequence[int], dim: int,
                device: torch.device | str | None = None,
                device_tables: Mapping[int, DeviceTable] | None = None,
                checkpoint_dir: str | Path | None = None,
                table_dir: str | Path | None = None, layout_fingerprint: str | None = None,
                cache_bytes: int = 0, io_threads: int = 4,
                group: "dist.ProcessGroup | None" = None) -> dict[int, EngramTable]:
    """Tables for every Engram layer, keyed by layer position (index into engram_layer_ids and into the L
    dimension of the hash ids).

    Sources: `device_tables` (the model's DeviceTables, keyed by position) or `checkpoint_dir` for device / host /
    sharded; `table_dir` (+ `layout_fingerprint`) of exported files for disk.
    """
    if placement not in PLACEMENTS:
        raise ConfigError(f"unknown Engram placement {placement!r}; choose one of {list(PLACEMENTS)}")
    if len(layer_ids) != len(num_rows):
        raise ConfigError(f"{len(num_rows)} table sizes for {len(layer_ids)} Engram layers")
    if placement == "disk":
        if table_dir is None or layout_fingerprint is None:
            raise ConfigError("Engram placement 'disk' needs a table folder (from `openflash engram export`) "
                              "and the model's layout fingerprint")
        return {j: DiskTable.open(Path(table_dir) / table_file_name(lid), num_rows[j], dim, layout_fingerprint,
                                  cache_bytes=cache_bytes, io_threads=io_threads, device=device)
                for j, lid in enumerate(layer_ids)}
    if device_tables is None and checkpoint_dir is None:
        raise ConfigError(f"Engram placement {placement!r} needs the model's tables or a checkpoint folder")
    checkpoint = CheckpointTables(checkpoint_dir) if device_tables is None else None
    if checkpoint is not None and list(checkpoint.spec.layer_ids) != list(layer_ids):
        raise CheckpointError(f"{checkpoint_dir}: Engram layers {checkpoint.spec.layer_ids}, the model has "
                              f"{list(layer_ids)}")
    tables: dict[int, EngramTable] = {}
    for j, lid in enumerate(layer_ids):
        if device_tables is not None:
            source = device_tables[j]
            if source.num_rows != num_rows[j] or source.dim != dim:
                raise EngramTableError(f"Engram layer {lid}: table is [{source.num_rows}, {source.dim}], expected "
                                       f"[{num_rows[j]}, {dim}]")
        if placement == "device":
            tables[j] = source.to(device) if device_tables is not None else \
                DeviceTable.from_fp8(*checkpoint.load(lid)).to(device)
        elif placement == "host":
            tables[j] = HostTable.from_device_table(source, device) if device_tables is not None else \
                HostTable(*checkpoint.load(lid), device=device)
        else:
            if device_tables is not None and source.storage != "fp8":
                raise EngramTableError(f"Engram layer {lid}: a ShardedTable holds FP8 rows; call "
                                       f"DeviceTable.to_fp8() on the fp32 table first")
            weight, scale = (source.weight.detach(), source.scale.detach()) if device_tables is not None else \
                checkpoint.slices(lid)
            tables[j] = ShardedTable.from_full(weight, scale, group=group, device=device)
    return tables


__all__ = [
    "EngramTable", "TableStats", "DeviceTable", "HostTable", "DiskTable", "ShardedTable", "RowCache",
    "TableHeader", "read_table_header", "write_table_file", "table_file_name", "decode_rows",
    "shard_block_rows", "shard_rows", "EngramTableSpec", "read_engram_spec", "CheckpointTables",
    "ExportedTable", "export_engram_tables", "open_tables", "PLACEMENTS",
]
