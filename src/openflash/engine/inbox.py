"""The hand-off between the threads that submit requests (a server's handlers) and the engine thread: arrivals and
cancellations wait here until the next step takes them, under one lock, with the flags of a shutdown (no more
arrivals; cancel what still runs; stop the loop)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from openflash.engine.request import EngineStoppedError, QueueFullError, Sequence


class Inbox:
    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting  # arrivals here plus those the scheduler holds
        self._lock = threading.Condition()
        self._arrivals: list[Sequence] = []
        self._aborts: list[str] = []
        self.accepting = True  # False once shutdown began
        self.abort_all = False  # shutdown: cancel everything still running
        self.stopped = False  # the loop ends

    def put(self, seq: Sequence, waiting: int) -> None:
        """Queue an arrival (`waiting`: the sequences the scheduler holds); EngineStoppedError after shutdown,
        QueueFullError past max_waiting."""
        with self._lock:
            if not self.accepting:
                raise EngineStoppedError("the server is shutting down and takes no new requests")
            if len(self._arrivals) + waiting >= self.max_waiting:
                raise QueueFullError(f"the request queue is full ({self.max_waiting} waiting); retry later")
            self._arrivals.append(seq)
            self._lock.notify()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    def take(self) -> tuple[list[Sequence], list[str]]:
        """What arrived and what was cancelled since the last call (engine thread)."""
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
            aborts, self._aborts = self._aborts, []
        return arrivals, aborts

    def pending(self) -> bool:
        with self._lock:
            return bool(self._arrivals or self._aborts)

    def __len__(self) -> int:
        """Arrivals not yet taken."""
        return len(self._arrivals)

    def wait(self, busy: Callable[[], bool], keepalive: float | None) -> bool:
        """Block until there is something to do (an arrival, an abort, `busy()`), the loop is stopped, or
        `keepalive` seconds passed (an empty step keeps followers' waits alive); False when stopped."""
        since = time.monotonic()
        with self._lock:
            while not (self.stopped or self._arrivals or self._aborts or busy()):
                self._lock.wait(timeout=1.0)
                if keepalive is not None and time.monotonic() - since > keepalive:
                    break
            return not self.stopped

    def close(self) -> None:
        """Take no more arrivals (those queued stay, for the steps that drain them)."""
        with self._lock:
            self.accepting = False

    def cancel_all(self) -> None:
        with self._lock:
            self.abort_all = True
            self._lock.notify_all()

    def stop(self, stopped: bool = True) -> None:
        """End the loop (or, with False, let a new one run)."""
        with self._lock:
            self.stopped = stopped
            self._lock.notify_all()


__all__ = ["Inbox"]
