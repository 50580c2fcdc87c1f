"""The torch thread count of a training run, picked from measured step times (a machine shared with others)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
