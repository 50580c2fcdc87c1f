"""Engine measurements: latency histograms, token counters, throughput. Rendered by serve/metrics.py.

Written by the engine thread, read by the server (a lock guards each histogram). Histograms keep Prometheus-style
cumulative buckets plus a bounded window of recent raw samples, from which quantiles (p50 / p99) are computed.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from openflash.engine.request import Sequence
from openflash.engine.speculative import Acceptance

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                   2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS, keep: int = 20000) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0
        self.recent: deque[float] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
            self.counts[i] += 1
            self.sum += value
            self.count += 1
            self.recent.append(value)

    def snapshot(self) -> tuple[list[int], float, int]:
        """(cumulative counts per bucket incl. +Inf, sum, count)."""
        with self._lock:
            cumulative, total = [], 0
            for c in self.counts:
                total += c
                cumulative.append(total)
            return cumulative, self.sum, self.count

    def quantile(self, q: float) -> float | None:
        with self._lock:
            values = sorted(self.recent)
        if not values:
            return None
        return values[min(len(values) - 1, int(q * len(values)))]

    def reset(self) -> None:
        with self._lock:
            self.counts = [0] * (len(self.buckets) + 1)
            self.sum, self.count = 0.0, 0
            self.recent.clear()


@dataclass
class EngineMetrics:
    ttft: Histogram = field(default_factory=Histogram)  # arrival -> first token
    itl: Histogram = field(default_factory=Histogram)  # between consecutive tokens of a request
    e2e: Histogram = field(default_factory=Histogram)  # arrival -> finish
    queue_time: Histogram = field(default_factory=Histogram)  # arrival -> admitted
    step_time: Histogram = field(default_factory=Histogram)
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: Counter = field(default_factory=Counter)  # by finish reason
    steps: int = 0
    # speculative decoding: rounds, drafts verified and kept, and kept drafts by block position (1-based)
    spec_rounds: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_accepted_at: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.perf_counter)
    _token_times: deque = field(default_factory=lambda: deque(maxlen=100000))

    def record_token(self, seq: Sequence, now: float) -> None:
        self.generation_tokens += 1
        self._token_times.append(now)
        if len(seq.token_times) == 1:
            self.ttft.observe(now - seq.arrival_time)
        else:
            self.itl.observe(now - seq.token_times[-2])

    def record_rounds(self, rounds: list[Acceptance]) -> None:
        """Speculative rounds (engine/speculative.py Acceptance): one per sequence and step."""
        for r in rounds:
            self.spec_rounds += 1
            self.spec_drafted += r.drafted
            self.spec_accepted += r.accepted
            for position in range(1, r.accepted + 1):
                self.spec_accepted_at[position] += 1

    def acceptance_length(self) -> float | None:
        """Mean tokens committed per verification (kept drafts + the target's own token)."""
        return (self.spec_accepted + self.spec_rounds) / self.spec_rounds if self.spec_rounds else None

    def record_finish(self, seq: Sequence) -> None:
        self.requests_finished[seq.finish_reason] += 1
        if seq.finish_time is not None:
            self.e2e.observe(seq.finish_time - seq.arrival_time)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds (or since the metrics started, if later)."""
        now = time.perf_counter()
        recent = sum(1 for t in list(self._token_times) if t >= now - window)
        return recent / max(min(window, now - self.started), 1e-3)

    def reset(self) -> None:
        for h in (self.ttft, self.itl, self.e2e, self.queue_time, self.step_time):
            h.reset()
        self.prompt_tokens = self.cached_prompt_tokens = self.generation_tokens = self.steps = 0
        self.spec_rounds = self.spec_drafted = self.spec_accepted = 0
        self.spec_accepted_at.clear()
        self.requests_finished.clear()
        self._token_times.clear()
        self.started = time.perf_counter()
