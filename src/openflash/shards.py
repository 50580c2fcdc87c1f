"""The safetensors shard index (`model.safetensors.index.json`): its `weight_map`, read once and checked.

A shard name comes from a file anyone may have written, so it must name a file inside the checkpoint folder: an
absolute path, a `..` step or a link that leads elsewhere is refused, never opened (checkpoint.md §1).
"""

from __future__ import annotations

import json
import os
import struct
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

_ST_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu", "I8": "int8", "U8": "uint8", "BF16": "bfloat16",
              "F16": "float16", "F32": "float32", "I64": "int64", "I32": "int32", "BOOL": "bool"}


@dataclass(frozen=True)
class TensorLocation:
    path: Path
    offset: int  # absolute byte offset of the tensor's data in the file
    nbytes: int
    dtype: str  # safetensors name (F8_E4M3, I8, BF16, ...)
    shape: tuple[int, ...]

    def read(self, fd: int) -> "torch.Tensor":
        """The tensor, read with os.pread from an open descriptor of `path` (CheckpointError if the file is
        shorter than its header says)."""
        import torch

        data = os.pread(fd, self.nbytes, self.offset)
        if len(data) != self.nbytes:
            raise CheckpointError(f"{self.path}: truncated: {self.nbytes} bytes at offset {self.offset} expected, "
                                  f"{len(data)} read")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(getattr(torch, _ST_DTYPES[self.dtype])).view(self.shape)


def tensor_locations(folder: Path) -> dict[str, TensorLocation]:
    """name -> location of every tensor of a checkpoint folder (single file or index), from the safetensors
    headers alone."""
    index, single = folder / INDEX_FILE, folder / SINGLE_FILE
    files = sorted(set(read_weight_map(folder).values())) if index.exists() else [single]
    out: dict[str, TensorLocation] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, struct.error, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read its safetensors header: {exc}") from None
        base = 8 + length
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, stop = info["data_offsets"]
            if info["dtype"] not in _ST_DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}, which openflash does not read")
            out[name] = TensorLocation(path, base + start, stop - start, info["dtype"], tuple(info["shape"]))
    return out
