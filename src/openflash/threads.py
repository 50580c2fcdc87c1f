"""The torch thread count of repeated steps (training steps, decode steps), picked from their measured times.

On a machine shared with other processes, OpenMP workers that spin-wait for a core held by someone else can make a
step many times slower (docs/benchmarks.md "Sharing the cores": the `small` decode step 27 ms quiet, 309 ms with one
core busy at two threads, 30 ms at one); the fastest count is measured, not guessed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


@dataclass
class ThreadTuner:
    """Picks the torch thread count from measured step times.

    On a machine shared with other processes, OpenMP worker threads that spin-wait for a core held by someone
    else can make a step many times slower; one thread is then faster than all cores. Every `every` steps each
    other candidate gets one probe step and the fastest is used until the next round. A candidate that lost by
    more than 2x is probed half as often each time it loses again (such probes are expensive).
    """

    candidates: tuple[int, ...]
    every: int = 30
    current: int = 0
    times: dict[int, float] = field(default_factory=dict)
    backoff: dict[int, int] = field(default_factory=dict)
    _probing: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.current = self.current or self.candidates[0]

    def threads_for(self, step_in_run: int) -> int:
        if step_in_run % self.every == 1 and not self._probing:  # step 0 pays one-off warm-up costs
            round_index = step_in_run // self.every
            self._probing = [t for t in self.candidates if t != self.current
                             and round_index % self.backoff.get(t, 1) == 0] + [self.current]
        return self._probing[0] if self._probing else self.current

    def record(self, threads: int, seconds: float) -> None:
        if not self._probing or self._probing[0] != threads:
            return
        self.times[threads] = seconds
        self._probing.pop(0)
        if not self._probing:
            best = min(self.times, key=self.times.get)
            for t, v in self.times.items():
                self.backoff[t] = min(8, self.backoff.get(t, 1) * 2) if v > 2 * self.times[best] else 1
            self.current = best


@dataclass
class StepThreads:
    """The thread count of the decode steps on the CPU: one tuner per batch size and torch thread count (steps of
    one size cost alike), choosing between torch's count and one thread. Each step runs at its tuner's pick and
    reports its time; torch's count is put back after it. Where torch has one thread, steps run as they are."""

    tuners: dict[tuple[int, int], ThreadTuner] = field(default_factory=dict)
    steps: dict[tuple[int, int], int] = field(default_factory=dict)

    def run(self, batch: int, step: Callable[[], T]) -> T:
        threads = torch.get_num_threads()
        if threads < 2:
            return step()
        key = (batch, threads)
        tuner = self.tuners.setdefault(key, ThreadTuner((threads, 1)))
        count = self.steps[key] = self.steps.get(key, -1) + 1
        chosen = tuner.threads_for(count)
        torch.set_num_threads(chosen)
        try:
            start = time.perf_counter()
            out = step()
            tuner.record(chosen, time.perf_counter() - start)
            return out
        finally:
            torch.set_num_threads(threads)
