"""Engram tables by placement: `open_tables` builds one tier per Engram layer (spec: engram.md §5).

    device   DeviceTable (memory/tiers/device.py): the table is part of the model's state_dict
    host     HostTable (tiers/host.py): FP8 rows in CPU RAM (pinned when CUDA exists)
    disk     DiskTable (tiers/disk.py): a table file per layer (table_file.py) with an LRU row cache (row_cache.py)
    sharded  ShardedTable (tiers/sharded.py): rows split across torch.distributed ranks

Every tier implements the `EngramTable` protocol (rows.py) and returns bit-identical rows. Checkpoint reading and the
export to table files live in checkpoint_tables.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from openflash.errors import CheckpointError, ConfigError, EngramTableError
from openflash.memory.checkpoint_tables import CheckpointTables
from openflash.memory.rows import EngramTable
from openflash.memory.table_file import table_file_name
from openflash.memory.tiers.disk import DiskTable
from openflash.memory.tiers.host import HostTable
from openflash.memory.tiers.sharded import ShardedTable
from openflash.model.engram_table import DeviceTable

if TYPE_CHECKING:
    import torch.distributed as dist

PLACEMENTS = ("device", "host", "disk", "sharded")


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


__all__ = ["open_tables", "PLACEMENTS"]
