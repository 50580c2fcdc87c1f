"""RowCache: an LRU of raw table records under a byte budget (the disk tier's hot rows)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class RowCache:
    """LRU cache of table records with a capacity in bytes. Not thread-safe: the owning table locks around it."""

    def __init__(self, capacity_bytes: int, record_bytes: int) -> None:
        self.capacity_rows = max(0, int(capacity_bytes) // record_bytes)
        # np.empty only reserves address space; pages are touched as rows are cached.
        self._store = np.empty((self.capacity_rows, record_bytes), dtype=np.uint8)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # row id -> slot, least recently used first

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, row: int) -> bool:
        return row in self._slot_of

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where absent; hits become most recently used."""
        slots = np.full(len(ids), -1, dtype=np.int64)
        if not self._slot_of:
            return slots
        for i, row in enumerate(ids.tolist()):
            slot = self._slot_of.get(row)
            if slot is not None:
                self._slot_of.move_to_end(row)
                slots[i] = slot
        return slots

    def read(self, slots: np.ndarray) -> np.ndarray:
        return self._store[slots]

    def insert(self, ids: np.ndarray, records: np.ndarray) -> int:
        """Add rows not yet cached, evicting the least recently used; returns how many were added."""
        if self.capacity_rows == 0:
            return 0
        added = 0
        # Only the last `capacity_rows` of a huge batch can survive anyway.
        for row, record in zip(ids[-self.capacity_rows:].tolist(), records[-self.capacity_rows:]):
            if row in self._slot_of:
                continue
            if len(self._slot_of) < self.capacity_rows:
                slot = len(self._slot_of)
            else:
                _, slot = self._slot_of.popitem(last=False)
            self._store[slot] = record
            self._slot_of[row] = slot
            added += 1
        return added

    def clear(self) -> None:
        self._slot_of.clear()
