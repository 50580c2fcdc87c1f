"""Ctrl-C during training: the first one asks the run to stop after the current step (it then saves a checkpoint),
a second one aborts at once. `request()` asks the same from code (tests interrupt a run this way)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from tqdm import tqdm


class StopRequest:
    """Use as a context manager around the training loop; `requested` turns True on Ctrl-C or `request()`."""

    def __init__(self, announce: bool = True) -> None:
        self.requested, self.announce = False, announce
        self._previous: Any = None

    def request(self) -> None:
        self.requested = True

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:  # a second Ctrl-C aborts at once
            raise KeyboardInterrupt
        self.requested = True
        if self.announce:
            tqdm.write("Ctrl-C: finishing this step and saving a checkpoint (Ctrl-C again to abort)")

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
