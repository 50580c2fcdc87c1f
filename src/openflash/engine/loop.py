"""What runs an engine's steps besides a caller's own loop: the background thread a server starts, a follower
rank's loop under expert parallelism (engine/lockstep.py), and the drain at shutdown. The engine itself
(engine/engine.py) only knows how to take one step."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Protocol

from openflash.engine.inbox import Inbox
from openflash.engine.lockstep import LockstepError
from openflash.engine.request import RequestOutput

log = logging.getLogger("openflash.engine")


class SteppedEngine(Protocol):
    """What the loop drives (engine.LLMEngine)."""

    inbox: Inbox  # arrivals and aborts from other threads, with the shutdown flags

    def step(self) -> list[RequestOutput]:
        """One step; raises LockstepError when an expert-parallel group broke."""

    def has_work(self) -> bool:
        """Something is queued, prefilling or decoding."""

    def busy(self) -> bool:
        """The scheduler holds sequences (arrivals aside)."""

    def fail_in_flight(self, exc: BaseException, during: str) -> None:
        """Fail every sequence the scheduler holds with `exc`."""

    def abandon(self) -> None:
        """The group is gone: take nothing new, fail what arrived and what is in flight."""


class EngineLoop:
    def __init__(self, engine: SteppedEngine, keepalive: float | None) -> None:
        """keepalive: seconds after which an idle loop steps anyway (followers wait on each of the leader's
        steps); None: wait until there is work."""
        self.engine, self.keepalive = engine, keepalive
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """The background thread runs the steps (a caller must not step too)."""
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self.engine.inbox.stop(False)
        self._thread = threading.Thread(target=self._run, name="openflash-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.engine.inbox.wait(self.engine.busy, self.keepalive):
            try:
                self.step_or_fail()
            except LockstepError:
                log.exception("engine loop stopped")
                self.engine.abandon()
                return

    def step_or_fail(self) -> None:
        """One step; if it fails, fail what was in flight and keep serving (a broken group raises on)."""
        try:
            self.engine.step()
        except LockstepError:
            raise
        except Exception as exc:
            self.engine.fail_in_flight(exc, "engine step")

    def follow(self) -> None:
        """A follower rank: step with the leader until it stops the group. SIGINT is ignored meanwhile (torchrun
        passes Ctrl-C to every rank): the leader drains and then stops the group, and a follower interrupted
        mid-step would leave its replica out of step or the leader waiting on it."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            while not self.engine.inbox.stopped:
                self.step_or_fail()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)

    def drain(self, timeout: float) -> None:
        """Take no new requests, let running ones finish for up to `timeout` seconds, cancel the rest, and stop
        the background thread (or step on the calling thread where there is none)."""
        inbox = self.engine.inbox
        inbox.close()
        deadline = time.monotonic() + timeout
        while self.engine.has_work() and time.monotonic() < deadline:
            if self._thread is None:
                self.engine.step()
            else:
                time.sleep(0.02)
        inbox.cancel_all()
        if self._thread is None:
            while self.engine.has_work():
                self.engine.step()
            return
        while self.engine.has_work() and self._thread.is_alive():
            time.sleep(0.01)
        inbox.stop()
        self._thread.join(timeout=30)
        self._thread = None


__all__ = ["EngineLoop", "SteppedEngine"]
