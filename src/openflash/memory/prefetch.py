"""Engram row prefetch: fetch every Engram layer's rows while the layers before it run (engram.md §5).

The hash ids of a step depend only on token ids, so as soon as a batch's ids are known, `EngramPrefetcher.submit`
starts gathering the rows of all Engram layers on a background thread, first layer first. When the model reaches
Engram layer j it calls `Prefetch.rows(j)`, which blocks only if those rows have not arrived yet and records how
long it waited. Errors in the background gather come back as EngramTableError at `rows()`, never as garbage rows.

`speculate` warms DiskTable row caches with the hash ids of likely next tokens (which the engine computes), on a
separate thread, so a speculation never delays a real prefetch.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping

import torch

from openflash.errors import EngramTableError
from openflash.memory.tables import DiskTable, EngramTable


@dataclass
class PrefetchStats:
    """Totals over the prefetcher's life."""

    prefetches: int = 0
    rows_gathered: int = 0  # ids gathered (duplicates included), all layers
    wait_seconds: dict[int, float] = field(default_factory=dict)  # per layer position: time `rows()` blocked
    waits: dict[int, int] = field(default_factory=dict)  # per layer position: `rows()` calls
    speculations: int = 0
    speculations_skipped: int = 0  # dropped because the previous one was still running
    rows_warmed: int = 0


class Prefetch:
    """The rows of one submitted batch of hash ids, arriving layer by layer."""

    def __init__(self, futures: dict[int, Future], shape: tuple[int, int, int], stats: PrefetchStats,
                 lock: threading.Lock) -> None:
        self._futures = futures
        self._shape = shape  # (B, S, C)
        self._stats, self._lock = stats, lock
        self.wait_seconds: dict[int, float] = {}

    def rows(self, layer_position: int) -> torch.Tensor:
        """Rows of Engram layer `layer_position`: float32 [B, S, C, dim]. Blocks only until they arrive."""
        if layer_position not in self._futures:
            raise EngramTableError(f"Engram prefetch has no layer position {layer_position}; "
                                   f"it holds {sorted(self._futures)}")
        start = time.perf_counter()
        try:
            rows = self._futures[layer_position].result()
        except EngramTableError:
            raise
        except Exception as exc:  # anything else from the background gather is still a table failure
            raise EngramTableError(f"Engram prefetch of layer position {layer_position} failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
        waited = time.perf_counter() - start
        self.wait_seconds[layer_position] = self.wait_seconds.get(layer_position, 0.0) + waited
        with self._lock:
            self._stats.wait_seconds[layer_position] = self._stats.wait_seconds.get(layer_position, 0.0) + waited
            self._stats.waits[layer_position] = self._stats.waits.get(layer_position, 0) + 1
        return rows.reshape(*self._shape, rows.shape[-1])

    def done(self) -> bool:
        """True when every layer's rows have arrived (or failed)."""
        return all(f.done() for f in self._futures.values())


class EngramPrefetcher:
    """Gathers Engram rows ahead of the layers that need them, on one background worker thread.

    tables: one table per Engram layer, keyed by layer position j (the index into engram_layer_ids, which is also
    the L index of the hash ids). device: where the rows go (None: wherever the table puts them).
    """

    def __init__(self, tables: Mapping[int, EngramTable], device: torch.device | str | None = None) -> None:
        self.tables = dict(tables)
        self.device = None if device is None else torch.device(device)
        self.stats = PrefetchStats()
        self._lock = threading.Lock()
        # One worker: a batch's layers are fetched in order, and table I/O parallelism lives inside the tables.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="engram-prefetch")
        self._speculator = ThreadPoolExecutor(1, thread_name_prefix="engram-speculate")
        self._speculation: Future | None = None

    def _gather(self, position: int, ids: torch.Tensor) -> torch.Tensor:
        rows = self.tables[position].gather(ids)
        if self.device is not None:
            rows = rows.to(self.device, non_blocking=True)
        return rows

    def submit(self, hash_ids: torch.Tensor) -> Prefetch:
        """Start gathering the rows of int64 hash ids [B, S, L, C] (L = number of Engram layers)."""
        if hash_ids.dim() != 4 or hash_ids.shape[2] != len(self.tables):
            raise EngramTableError(f"Engram prefetch expects hash ids [B, S, L={len(self.tables)}, C], got "
                                   f"shape {list(hash_ids.shape)}")
        batch, seq, _, cols = hash_ids.shape
        ids = hash_ids.detach().cpu() if any(isinstance(t, DiskTable) for t in self.tables.values()) else hash_ids
        futures = {j: self._worker.submit(self._gather, j, ids[:, :, j].contiguous()) for j in sorted(self.tables)}
        with self._lock:
            self.stats.prefetches += 1
            self.stats.rows_gathered += hash_ids.numel()
        return Prefetch(futures, (batch, seq, cols), self.stats, self._lock)

    def speculate(self, candidate_hash_ids: torch.Tensor) -> Future:
        """Warm DiskTable row caches with the hash ids [..., L, C] of likely next tokens, in the background.

        Returns at once; the future's result is the number of rows newly cached (0 when skipped because the
        previous speculation is still running, or when no table has a row cache)."""
        if candidate_hash_ids.dim() < 2 or candidate_hash_ids.shape[-2] != len(self.tables):
            raise EngramTableError(f"Engram speculation expects hash ids [..., L={len(self.tables)}, C], got "
                                   f"shape {list(candidate_hash_ids.shape)}")
        with self._lock:
            busy = self._speculation is not None and not self._speculation.done()
            if busy:
                self.stats.speculations_skipped += 1
        if busy:
            skipped: Future = Future()
            skipped.set_result(0)
            return skipped
        ids = candidate_hash_ids.detach().cpu()
        future = self._speculator.submit(self._warm, ids)
        with self._lock:
            self._speculation = future
            self.stats.speculations += 1
        return future

    def _warm(self, ids: torch.Tensor) -> int:
        warmed = 0
        for j, table in sorted(self.tables.items()):
            if isinstance(table, DiskTable):
                warmed += table.warm(ids[..., j, :])
        with self._lock:
            self.stats.rows_warmed += warmed
        return warmed

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._speculator.shutdown(wait=True)

    def __enter__(self) -> "EngramPrefetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["EngramPrefetcher", "Prefetch", "PrefetchStats"]
