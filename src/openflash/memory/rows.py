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
    """What an Engram memory (placement.py, prefetch.py) needs of a table, whatever tier holds its rows."""

    num_rows: int
    dim: int
    collective: bool  # gathers are collectives every rank calls in one order (they stay on one worker)
    host_ids: bool  # gathers read host storage: hand them CPU ids

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 [...]; returns float32 [..., dim] holding the bf16-rounded dequantized rows (engram.md §5)."""
        ...

    def warm(self, ids: torch.Tensor) -> int:
        """Load rows into the table's cache ahead of need (speculation); how many were newly cached (0 without
        a cache)."""
        ...

    def counters(self) -> dict[str, Any] | None:
        """Lookup counters (TableStats.as_dict), or None where the table keeps none (the model's own)."""
        ...

    def reset_counters(self) -> None:
        ...

    def problem(self) -> str | None:
        """Why this table cannot serve rows now (a file gone or truncated under it), or None; cheap, and safe to
        call from another thread (a server's /health)."""
        ...

    def close(self) -> None:
        """Release the files and threads the table holds (nothing for rows in memory)."""
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


class CountedTable:
    """The EngramTable defaults of a tier that keeps lookup counters and its rows in memory: no collective, no
    cache to warm, nothing to release, never unavailable. Tiers override what differs."""

    collective = False
    host_ids = False
    stats: TableStats

    def warm(self, ids: torch.Tensor) -> int:
        return 0

    def counters(self) -> dict[str, Any] | None:
        return self.stats.as_dict()

    def reset_counters(self) -> None:
        self.stats = TableStats()

    def problem(self) -> str | None:
        return None

    def close(self) -> None:
        pass


def output_device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)
