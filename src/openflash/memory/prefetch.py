"""Engram row prefetch: fetch every Engram layer's rows while the layers before it run (engram.md §5).

The hash ids of a step depend only on token ids, so as soon as a batch's ids are known, `EngramPrefetcher.submit`
starts gathering the rows of all Engram layers on a background thread, first layer first. When the model reaches
Engram layer j it calls `Prefetch.rows(j)`, which blocks only if those rows have not arrived yet and records how
long it waited. Errors in the background gather come back as EngramTableError at `rows()`, never as garbage rows.

`speculate` warms DiskTable row caches with the hash ids of likely next tokens (which the engine computes), on a
separate thread, so a speculation never delays a real prefetch.

On CUDA the background gathers run on a side stream: `rows()` makes the consumer's stream wait for the copy (an
event, no host sync), so host-to-device copies overlap the layers before the Engram layer. `gather` runs one
synchronous lookup on the worker, behind whatever is queued there (collectives of a ShardedTable must be issued in
the same order on every rank, so all of its lookups go through this one thread).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from openflash.errors import EngramTableError
from openflash.memory.rows import EngramTable


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
    fetch_seconds: dict[int, float] = field(default_factory=dict)  # per layer position: background gather time


@dataclass
class _OnStream:
    """Rows produced on a CUDA side stream, with the event that marks their completion."""

    rows: torch.Tensor
    event: "torch.cuda.Event"

    def ready(self) -> torch.Tensor:
        stream = torch.cuda.current_stream(self.rows.device)
        stream.wait_event(self.event)  # the consumer's stream waits on the GPU; the host does not block
        self.rows.record_stream(stream)  # keep the side stream's memory alive until the consumer is done
        return self.rows


def _table_error(position: int, exc: Exception) -> EngramTableError:
    if isinstance(exc, EngramTableError):
        return exc
    return EngramTableError(f"Engram prefetch of layer position {position} failed: {type(exc).__name__}: {exc}")


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
        except CancelledError as exc:
            raise EngramTableError(f"Engram prefetch of layer position {layer_position} was cancelled") from exc
        except Exception as exc:  # anything from the background gather is a table failure
            error = _table_error(layer_position, exc)
            if error is exc:
                raise
            raise error from exc
        if isinstance(rows, _OnStream):
            rows = rows.ready()
        waited = time.perf_counter() - start
        self.wait_seconds[layer_position] = self.wait_seconds.get(layer_position, 0.0) + waited
        with self._lock:
            self._stats.wait_seconds[layer_position] = self._stats.wait_seconds.get(layer_position, 0.0) + waited
            self._stats.waits[layer_position] = self._stats.waits.get(layer_position, 0) + 1
        return rows.reshape(*self._shape, rows.shape[-1])

    def done(self) -> bool:
        """True when every layer's rows have arrived (or failed)."""
        return all(f.done() for f in self._futures.values())

    def cancel(self) -> int:
        """Drop the layers whose gather has not started (their rows() then raises); returns how many."""
        return sum(f.cancel() for f in self._futures.values())


class _Candidates(Prefetch):
    """A Prefetch whose batch shape is known only once the worker has hashed the candidates."""

    def __init__(self, futures: dict[int, Future], hashed: Future, stats: PrefetchStats,
                 lock: threading.Lock) -> None:
        super().__init__(futures, (0, 0, 0), stats, lock)
        self._hashed = hashed

    def rows(self, layer_position: int) -> torch.Tensor:
        if layer_position in self._futures:
            try:
                ids = self._hashed.result()
            except Exception as exc:
                raise EngramTableError(f"Engram speculation could not hash its candidates: "
                                       f"{type(exc).__name__}: {exc}") from exc
            self._shape = (ids.shape[0], 1, ids.shape[-1])
        return super().rows(layer_position)


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
        # A side stream when rows land on a CUDA device, so their copies overlap the compute stream.
        targets = [self.device] + [getattr(t, "device", None) for t in self.tables.values()]
        cuda = next((torch.device(d) for d in targets if d is not None and torch.device(d).type == "cuda"), None)
        self._stream = torch.cuda.Stream(cuda) if cuda is not None else None

    def _gather(self, position: int, ids: torch.Tensor) -> torch.Tensor | _OnStream:
        start = time.perf_counter()
        if self._stream is None:
            rows = self._gather_rows(position, ids)
        else:
            with torch.cuda.stream(self._stream):
                rows = self._gather_rows(position, ids)
                event = torch.cuda.Event()
                event.record(self._stream)
            rows = _OnStream(rows, event)
        with self._lock:
            self.stats.fetch_seconds[position] = self.stats.fetch_seconds.get(position, 0.0) + \
                time.perf_counter() - start
        return rows

    def _gather_rows(self, position: int, ids: torch.Tensor) -> torch.Tensor:
        rows = self.tables[position].gather(ids)
        if self.device is not None:
            rows = rows.to(self.device, non_blocking=True)
        return rows

    def gather(self, position: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ids [...] for layer position `position`, gathered now on the worker (after anything queued)."""
        if position not in self.tables:
            raise EngramTableError(f"Engram prefetcher has no layer position {position}; "
                                   f"it holds {sorted(self.tables)}")
        try:
            rows = self._worker.submit(self._gather, position, ids).result()
        except Exception as exc:
            error = _table_error(position, exc)
            if error is exc:
                raise
            raise error from exc
        return rows.ready() if isinstance(rows, _OnStream) else rows

    def submit(self, hash_ids: torch.Tensor) -> Prefetch:
        """Start gathering the rows of int64 hash ids [B, S, L, C] (L = number of Engram layers)."""
        if hash_ids.dim() != 4 or hash_ids.shape[2] != len(self.tables):
            raise EngramTableError(f"Engram prefetch expects hash ids [B, S, L={len(self.tables)}, C], got "
                                   f"shape {list(hash_ids.shape)}")
        batch, seq, _, cols = hash_ids.shape
        ids = hash_ids.detach().cpu() if any(t.host_ids for t in self.tables.values()) else hash_ids
        futures = {j: self._worker.submit(self._gather, j, ids[:, :, j].contiguous()) for j in sorted(self.tables)}
        with self._lock:
            self.stats.prefetches += 1
            self.stats.rows_gathered += hash_ids.numel()
        return Prefetch(futures, (batch, seq, cols), self.stats, self._lock)

    def submit_candidates(self, compute_hash_ids: Callable[[], torch.Tensor], groups: int) -> list[Prefetch]:
        """Speculative prefetch: `compute_hash_ids()` runs on the worker and returns hash ids [B, G, L, C] (G =
        `groups` candidates per batch row, likeliest first); then the rows are gathered group by group, so the
        likeliest candidates arrive first. Returns one Prefetch per group, each of shape (B, 1, C).

        Hashing on the worker keeps it off the caller's thread, which has a step to finish."""
        hashed = self._worker.submit(compute_hash_ids)

        def gather(position: int, group: int) -> torch.Tensor | _OnStream:
            ids = hashed.result()  # done: the worker ran it first
            if ids.dim() != 4 or ids.shape[1] != groups or ids.shape[2] != len(self.tables):
                raise EngramTableError(f"Engram speculation expects hash ids [B, G={groups}, "
                                       f"L={len(self.tables)}, C], got shape {list(ids.shape)}")
            return self._gather(position, ids[:, group, position].unsqueeze(1).contiguous())

        prefetches = []
        for group in range(groups):
            futures = {j: self._worker.submit(gather, j, group) for j in sorted(self.tables)}
            prefetches.append(_Candidates(futures, hashed, self.stats, self._lock))
        with self._lock:
            self.stats.speculations += 1
        return prefetches

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
