"""ShardedTable: rows split across torch.distributed ranks in contiguous blocks (checkpoint.md §6)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from openflash.errors import EngramTableError
from openflash.formats import as_uint8
from openflash.memory.rows import CountedTable, TableStats, output_device
from openflash.memory.table_file import row_reader
from openflash.model.engram_table import SCALE_BLOCK, UE8M0_ONE, check_ids, check_row_format, decode_rows


def shard_block_rows(num_rows: int, world_size: int) -> int:
    """Rows per rank: contiguous blocks of ceil(rows / world_size); the last block is padded (checkpoint.md §6)."""
    return -(-num_rows // world_size)


def shard_rows(weight: Any, scale: Any, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s block of rows as uint8 (weight, scale), padded to the block size with weight 0 and scale
    byte 127 (= 2^0), so padded rows decode to 0 (checkpoint.md §6). Accepts tensors or safetensors slices."""
    (rows, dim), read_w = row_reader(weight, "Engram weight")
    _, read_s = row_reader(scale, "Engram scale")
    block = shard_block_rows(rows, world_size)
    start, stop = min(rows, rank * block), min(rows, (rank + 1) * block)
    w = torch.zeros((block, dim), dtype=torch.uint8)
    s = torch.full((block, dim // SCALE_BLOCK), UE8M0_ONE, dtype=torch.uint8)
    if stop > start:
        w[:stop - start] = torch.from_numpy(read_w(start, stop))
        s[:stop - start] = torch.from_numpy(read_s(start, stop))
    return w, s


class ShardedTable(CountedTable):
    """Rows split across the ranks of a process group; every rank gets the full rows (engram.md §5).

    All ranks must call `gather` together with the same ids, as in tensor-parallel inference. Each rank looks up
    the ids in its block (others read local row 0 and are zeroed) and an all-reduce(sum) combines them. The sum
    runs on the raw FP8/UE8M0 bytes: exactly one rank contributes a nonzero record per id, so the sum is that
    record, bit for bit, and a quarter of the bytes of summing decoded fp32 rows travel.
    """

    collective = True  # (a lost peer fails the collective itself: no `problem` to report ahead)

    def __init__(self, local_weight: torch.Tensor, local_scale: torch.Tensor, num_rows: int,
                 group: "dist.ProcessGroup | None" = None, device: torch.device | str | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.num_rows = int(num_rows)
        self.block_rows = shard_block_rows(self.num_rows, self.world_size)
        self.device = output_device(device)
        w8, s8 = as_uint8(local_weight), as_uint8(local_scale)
        rows, self.dim = check_row_format(w8, s8, "Engram ShardedTable")
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
        (rows, _), _ = row_reader(weight, "Engram weight")
        w, s = shard_rows(weight, scale, rank, world_size)
        return cls(w, s, rows, group=group, device=device)

    @property
    def row_bytes(self) -> int:
        return self.dim + self.dim // SCALE_BLOCK

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(self.device)
        if flat.device.type == "cpu":
            check_ids(flat, self.num_rows, f"Engram ShardedTable (rank {self.rank})")
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
