"""What every Engram table tier shares: the `EngramTable` protocol and lookup counters (spec: engram.md §5). The
row format and its decoding are the model's (model/engram_table.py).

Each Engram layer owns one flat table of `rows` x `dim` stored as FP8 E4M3 values plus one UE8M0 scale per 32
consecutive values of a row. A looked-up row dequantises to fp32(weight[r, d]) * 2^(scale[r, d//32] - 127); every
tier (memory/tiers/) returns bit-identical rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class EngramTable(Protocol):
    num_rows: int
    dim: int

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 [...]; returns float32 [..., dim] holding the bf16-rounded dequantized rows (engram.md §5)."""
        ...

    def problem(self) -> str | None:
        """Why this table cannot serve rows now (a file gone or truncated under it), or None; cheap, and safe to
        call from another thread (a server's /health)."""
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


def output_device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)
