"""DiskTable: a table file (memory/table_file.py) read with positioned reads, an LRU row cache, reader threads."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from openflash.errors import EngramTableError
from openflash.memory.row_cache import RowCache
from openflash.memory.rows import CountedTable, TableStats, output_device
from openflash.memory.table_file import TableHeader, read_table_header
from openflash.model.engram_table import check_ids, decode_rows


class DiskTable(CountedTable):
    """A table file read with positioned reads (os.pread), an LRU row cache and a small pool of reader threads.

    Rows are gathered by unique id (each row read once per call, runs of consecutive rows in one read), served from
    the cache when present, otherwise read from the file; pread releases the GIL, so the pool overlaps I/O. Reads
    rather than a memory mapping: a mapped file that shrinks under the process turns the next access into SIGBUS,
    which kills it; a read just comes back short, and that becomes an EngramTableError naming the file.
    """

    host_ids = True

    def __init__(self, path: Path, header: TableHeader, cache_bytes: int = 0, io_threads: int = 4,
                 device: torch.device | str | None = None, parallel_min_rows: int = 512) -> None:
        self.path, self.header = path, header
        self.num_rows, self.dim = header.rows, header.dim
        self.record_bytes = header.record_bytes
        self.device = output_device(device)
        self.io_threads = max(1, int(io_threads))
        self.parallel_min_rows = parallel_min_rows
        self.stats = TableStats()
        self.cache = RowCache(cache_bytes, self.record_bytes)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._fd: int | None = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):  # rows are scattered: kernel read-ahead would only waste I/O
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    @classmethod
    def open(cls, path: str | Path, expected_rows: int | None, expected_dim: int | None,
             expected_fingerprint: str | None, cache_bytes: int = 0, io_threads: int = 4,
             device: torch.device | str | None = None) -> "DiskTable":
        """Open and verify a table file. An expected_* of None skips that check (inspection tools only)."""
        path = Path(path)
        header = read_table_header(path)
        if expected_fingerprint is not None and header.layout_fingerprint != expected_fingerprint:
            raise EngramTableError(f"{path}: Engram hash layout fingerprint mismatch: file has "
                                   f"{header.layout_fingerprint!r}, the model expects {expected_fingerprint!r} "
                                   f"(table exported for a different Engram config)")
        if expected_rows is not None and header.rows != expected_rows:
            raise EngramTableError(f"{path}: table has {header.rows} rows, the model expects {expected_rows}")
        if expected_dim is not None and header.dim != expected_dim:
            raise EngramTableError(f"{path}: table rows have dim {header.dim}, the model expects {expected_dim}")
        size = path.stat().st_size
        if size < header.file_bytes:
            raise EngramTableError(f"{path}: truncated: {size} bytes, expected {header.file_bytes} "
                                   f"(header {header.data_offset} + {header.rows} rows x {header.record_bytes} B)")
        if size > header.file_bytes:
            raise EngramTableError(f"{path}: {size - header.file_bytes} unexpected bytes after the last row "
                                   f"(expected {header.file_bytes} bytes)")
        return cls(path, header, cache_bytes=cache_bytes, io_threads=io_threads, device=device)

    @property
    def row_bytes(self) -> int:
        return self.record_bytes

    # -- reads ---------------------------------------------------------------------------------------------

    def _read_range(self, ids: np.ndarray) -> np.ndarray:
        """Records of sorted unique `ids` (read-only): one positioned read per run of consecutive rows, issued from a
        list comprehension (~1 us per run; a loop over memoryviews costs 3x that), checked for short reads."""
        fd = self._fd
        if fd is None:
            raise EngramTableError(f"{self.path}: the table is closed")
        cuts = np.flatnonzero(np.diff(ids) != 1) + 1
        bounds = np.concatenate(([0], cuts, [len(ids)]))
        offsets = (self.header.data_offset + ids[bounds[:-1]] * self.record_bytes).tolist()
        sizes = (np.diff(bounds) * self.record_bytes).tolist()
        try:
            chunks = [os.pread(fd, n, offset) for offset, n in zip(offsets, sizes)]
        except OSError as exc:
            raise EngramTableError(f"{self.path}: read error in rows {int(ids[0])}..{int(ids[-1])}: {exc}") from exc
        data = b"".join(chunks)
        if len(data) != len(ids) * self.record_bytes:  # a regular file reads short only past its end
            run = next(r for r, (chunk, n) in enumerate(zip(chunks, sizes)) if len(chunk) != n)
            first, last = int(ids[bounds[run]]), int(ids[bounds[run + 1] - 1])
            raise EngramTableError(f"{self.path}: truncated while in use: rows {first}..{last} lie past its end "
                                   f"(the file has {os.fstat(fd).st_size} bytes now, {self.header.file_bytes} "
                                   f"expected)")
        return np.frombuffer(data, dtype=np.uint8).reshape(len(ids), self.record_bytes)

    def read_records(self, first: int, count: int) -> np.ndarray:
        """Raw records [count, record_bytes] of rows first..first+count-1, bypassing the cache (inspection)."""
        if not 0 <= first <= first + count <= self.num_rows:
            raise EngramTableError(f"{self.path}: rows {first}..{first + count - 1} are outside 0..{self.num_rows - 1}")
        return self._read_range(np.arange(first, first + count, dtype=np.int64))

    def _read_rows(self, ids: np.ndarray) -> np.ndarray:
        """Records of sorted unique `ids`, split over the thread pool when many are needed."""
        start = time.perf_counter()
        if len(ids) >= self.parallel_min_rows and self.io_threads > 1:
            with self._lock:  # gathers and warm-ups may arrive from different threads
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="engram-io")
            parts = [p for p in np.array_split(ids, self.io_threads) if len(p)]
            records = np.concatenate(list(self._pool.map(self._read_range, parts)))
        else:
            records = self._read_range(ids)
        with self._lock:
            self.stats.read_seconds += time.perf_counter() - start
            self.stats.bytes_read += records.nbytes
        return records

    def _records(self, unique_ids: np.ndarray, count: bool) -> tuple[np.ndarray, int]:
        """(records of sorted unique ids, number of rows newly put in the cache). `count`: a gather's lookup
        (counted as hits / misses) rather than a warm-up."""
        if self._fd is None:
            raise EngramTableError(f"{self.path}: the table is closed")
        records = np.empty((len(unique_ids), self.record_bytes), dtype=np.uint8)
        with self._lock:
            slots = self.cache.lookup(unique_ids)
            miss = slots < 0
            if not miss.all():
                records[~miss] = self.cache.read(slots[~miss])
        if miss.any():
            records[miss] = self._read_rows(unique_ids[miss])
        with self._lock:
            added = self.cache.insert(unique_ids[miss], records[miss])
            if count:
                self.stats.hits += int((~miss).sum())
                self.stats.misses += int(miss.sum())
            else:
                self.stats.rows_warmed += added
        return records, added

    def _unique_ids(self, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        flat = ids.reshape(-1).cpu()
        check_ids(flat, self.num_rows, f"{self.path}")
        return np.unique(flat.numpy().astype(np.int64, copy=False), return_inverse=True)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = self._unique_ids(ids)
        records, _ = self._records(unique, count=True)
        with self._lock:
            self.stats.gathers += 1
            self.stats.rows_requested += ids.numel()
            self.stats.unique_rows += len(unique)
        # Decode the unique records once, on the output device (264 B per row cross the bus, not 4*dim).
        rec = torch.from_numpy(records).to(self.device)
        rows = decode_rows(rec[:, :self.dim], rec[:, self.dim:])
        inverse = torch.from_numpy(inverse.reshape(-1)).to(self.device)
        return rows.index_select(0, inverse).reshape(*ids.shape, self.dim)

    def warm(self, ids: torch.Tensor) -> int:
        """Load rows into the row cache ahead of need (speculation); returns how many were newly cached."""
        if self.cache.capacity_rows == 0:
            return 0
        unique, _ = self._unique_ids(ids)
        return self._records(unique, count=False)[1]

    def clear_cache(self) -> None:
        with self._lock:
            self.cache.clear()

    def drop_page_cache(self) -> bool:
        """Ask the kernel to forget this file's cached pages (cold-cache benchmarks). Best effort: returns True
        when the advice call succeeded; the kernel may still keep pages that are in use."""
        try:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return True
        except (OSError, AttributeError, TypeError):
            return False

    def problem(self) -> str | None:
        fd = self._fd  # (read once: close() may clear it from another thread)
        if fd is None:
            return f"{self.path}: the table is closed"
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            return f"{self.path}: {exc.strerror or exc}"
        if size != self.header.file_bytes:
            return f"{self.path}: the file has {size} bytes, {self.header.file_bytes} expected (truncated or replaced)"
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DiskTable":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
