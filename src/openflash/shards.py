"""The safetensors shard index (`model.safetensors.index.json`): its `weight_map`, read once and checked.

A shard name comes from a file anyone may have written, so it must name a file inside the checkpoint folder: an
absolute path, a `..` step or a link that leads elsewhere is refused, never opened (checkpoint.md §1).
"""

from __future__ import annotations

import json
from pathlib import Path

from openflash.errors import CheckpointError

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
