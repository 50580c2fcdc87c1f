"""What every Engram table tier shares: the `EngramTable` protocol, lookup counters and the FP8 row decoding
(spec: engram.md §3, §5).

Each Engram layer owns one flat table of `rows` x `dim` stored as FP8 E4M3 values plus one UE8M0 scale per 32
consecutive values of a row. A looked-up row dequantises to fp32(weight[r, d]) * 2^(scale[r, d//32] - 127); every
tier (memory/tiers/) returns bit-identical rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from openflash.errors import EngramTableError
from openflash.formats import dequantize_fp8_rows

SCALE_BLOCK = 32  # one UE8M0 scale per 32 consecutive values of a row (engram.md §5)
UE8M0_ONE = 127  # scale byte of 2^0: the padding value of sharded scale blocks (checkpoint.md §6)


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


def decode_rows(weight_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """FP8 rows + UE8M0 row scales (uint8) -> fp32 holding the bf16-rounded values (engram.md §5)."""
    return dequantize_fp8_rows(weight_u8, scale_u8).to(torch.bfloat16).to(torch.float32)


def check_ids(ids: torch.Tensor, num_rows: int, where: str) -> None:
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


def check_row_format(weight_u8: torch.Tensor, scale_u8: torch.Tensor, where: str) -> tuple[int, int]:
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


def output_device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)
