"""Where a checkpoint's tensors are: the shard index (`model.safetensors.index.json`, its `weight_map` read once and
checked), each tensor's location from the safetensors headers, and positioned reads of those bytes (`ShardReader`).

A shard name comes from a file anyone may have written, so it must name a file inside the checkpoint folder: an
absolute path, a `..` step or a link that leads elsewhere is refused, never opened (checkpoint.md §1).
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from openflash.errors import CheckpointError

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def shard_path(folder: Path, name: object, index: Path) -> Path:
    """The file a weight_map entry names, if it lies inside `folder`."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{index}: weight_map names an invalid shard file {name!r}")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(f"{index}: weight_map names {name!r}, outside the checkpoint folder (shards must be "
                              f"files in {folder})")
    path = folder / relative
    if path.exists() and not path.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"{index}: shard {name!r} is a link that leads outside the checkpoint folder "
                              f"({path.resolve()})")
    return path


def read_weight_map(folder: Path) -> dict[str, Path]:
    """tensor name -> shard file of an index; every shard inside `folder`."""
    index = folder / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map'): {exc}") from None
    resolved: dict[str, Path] = {}
    for tensor, name in weight_map.items():
        resolved[tensor] = shard_path(folder, name, index)
    return resolved


# ---- where each tensor's bytes are (positioned reads without mapping the files) ----------------------------------

DIRECT_ALIGN = 4096  # O_DIRECT reads whole logical blocks into aligned memory; 4 KiB covers the usual block sizes
_ST_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu", "I8": "int8", "U8": "uint8", "BF16": "bfloat16",
              "F16": "float16", "F32": "float32", "I64": "int64", "I32": "int32", "BOOL": "bool"}


@dataclass(frozen=True)
class TensorLocation:
    path: Path
    offset: int  # absolute byte offset of the tensor's data in the file
    nbytes: int
    dtype: str  # safetensors name (F8_E4M3, I8, BF16, ...)
    shape: tuple[int, ...]

    def read(self, fd: int, direct: bool = False) -> "torch.Tensor":
        """The tensor, read with os.pread from an open descriptor of `path` (CheckpointError if the file is
        shorter than its header says). direct: `fd` was opened with O_DIRECT, which reads whole aligned blocks into
        an aligned buffer: the blocks around the tensor are read and the tensor is a view into them."""
        import torch

        start = self.offset - self.offset % DIRECT_ALIGN if direct else self.offset
        stop = -(-(self.offset + self.nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN if direct else self.offset + self.nbytes
        buffer = torch.empty(stop - start + (DIRECT_ALIGN if direct else 0), dtype=torch.uint8)
        skip = -buffer.data_ptr() % DIRECT_ALIGN if direct else 0
        view, done = memoryview(buffer.numpy())[skip: skip + stop - start], 0  # read straight into the tensor
        while start + done < self.offset + self.nbytes:
            n = os.preadv(fd, [view[done:]], start + done)
            if n == 0:
                raise CheckpointError(f"{self.path}: truncated: {self.nbytes} bytes at offset {self.offset} expected, "
                                      f"{max(0, start + done - self.offset)} read")
            done += n
        flat = buffer[skip + self.offset - start: skip + self.offset - start + self.nbytes]
        return flat.view(getattr(torch, _ST_DTYPES[self.dtype])).view(self.shape)


class ShardReader:
    """Reads tensors of a checkpoint by positioned reads, one descriptor per shard file, opened on first use (safe
    from several threads). direct: open the shards with O_DIRECT (Linux), reading past the page cache: nothing of
    the shards is kept in RAM beyond what the caller holds (benchmarks/expert_reads.py measures both)."""

    def __init__(self, direct: bool = False) -> None:
        if direct and not hasattr(os, "O_DIRECT"):
            raise CheckpointError("direct reads (O_DIRECT) are not available on this system")
        self.direct = direct
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def read(self, loc: TensorLocation) -> "torch.Tensor":
        with self._lock:
            fd = self._fds.get(loc.path)
            if fd is None:
                try:
                    fd = self._fds[loc.path] = os.open(loc.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
                except OSError as exc:
                    why = " (the file system refuses O_DIRECT)" if self.direct and exc.errno == errno.EINVAL else ""
                    raise CheckpointError(f"{loc.path}: cannot open: {exc.strerror}{why}") from None
        return loc.read(fd, self.direct)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self) -> None:  # a load that raised midway still releases its descriptors
        self.close()


_ST_ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4,
                "I64": 8}


def tensor_locations(folder: Path) -> dict[str, TensorLocation]:
    """name -> location of every tensor of a checkpoint folder (single file or index), from the safetensors
    headers alone (no file is mapped: a sparse 94 GiB table costs nothing). CheckpointError names a missing shard,
    a damaged header, or an index that disagrees with the shards."""
    index, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if index.exists():
        weight_map = read_weight_map(folder)
        files = sorted(set(weight_map.values()))
    elif single.exists():
        weight_map, files = None, [single]
    else:
        raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
    out: dict[str, TensorLocation] = {}
    for path in files:
        if not path.exists():
            raise CheckpointError(f"{path}: shard listed in {INDEX_FILE} is missing")
        out.update(_header(path))
    if weight_map is not None and set(weight_map) != set(out):
        listed, found = set(weight_map), set(out)
        raise CheckpointError(f"{index}: weight_map and shard contents disagree (e.g. listed but absent: "
                              f"{sorted(listed - found)[:5]}; present but unlisted: {sorted(found - listed)[:5]})")
    return out


def _header(path: Path) -> dict[str, TensorLocation]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 2 <= length <= min(size - 8, 100 << 20):
                raise ValueError(f"header length {length} does not fit the {size}-byte file")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (start, stop) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if dtype not in _ST_DTYPES:
                raise ValueError(f"tensor {name} has dtype {dtype}, which openflash does not read")
            count = 1
            for d in shape:
                count *= d
            if not 0 <= start <= stop <= size - 8 - length or stop - start != count * _ST_ITEMSIZE[dtype]:
                raise ValueError(f"tensor {name}: data offsets [{start}, {stop}) do not hold {dtype} {list(shape)} "
                                 f"in the file")
            out[name] = TensorLocation(path, 8 + length + start, stop - start, dtype, shape)
        return out
    except (OSError, struct.error, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors header: {exc}") from None
