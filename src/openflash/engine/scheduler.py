"""Continuous batching: which prompt chunks to prefill and which sequences to decode in each engine step.

Three sets: `waiting` (FIFO queue, nothing computed), `prefilling` (admitted, prompt partly in the cache) and
`running` (in the decode batch). Each step decodes every running sequence (one token each) and spends what is left
of a per-step token budget on prompt chunks, oldest request first. Chunks end at multiples of `prefill_chunk`
(absolute prompt positions), so a prompt is cut at the same places whatever else is running, and those places are
where the prefix cache can take snapshots. At least one chunk is scheduled per step when any prompt is pending, so
prefill always progresses; at most `max_batch` sequences are admitted (prefilling + running).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from openflash.engine.request import QueueFullError, Sequence, SequenceStatus
from openflash.errors import OpenflashError


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 32  # sequences admitted at once (prefilling + decoding)
    max_step_tokens: int = 512  # prompt + decode tokens per step
    prefill_chunk: int = 128  # prompt chunk length; chunks end at multiples of it
    max_waiting: int = 256  # queue length before requests are refused

    def validate(self) -> "SchedulerConfig":
        for name in ("max_batch", "max_step_tokens", "prefill_chunk", "max_waiting"):
            if getattr(self, name) < 1:
                raise OpenflashError(f"scheduler {name} must be >= 1, got {getattr(self, name)}")
        return self


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int

    @property
    def last(self) -> bool:
        return self.end == self.seq.prompt_len

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class StepPlan:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    def prefill_waves(self) -> list[list[PrefillChunk]]:
        """The prompt chunks grouped so that each sequence's run in order: wave k holds every sequence's k-th."""
        waves: list[list[PrefillChunk]] = []
        seen: dict[str, int] = {}
        for chunk in self.prefills:
            k = seen.get(chunk.seq.request_id, 0)
            seen[chunk.seq.request_id] = k + 1
            if k == len(waves):
                waves.append([])
            waves[k].append(chunk)
        return waves


class Scheduler:
    def __init__(self, config: SchedulerConfig, admit: Callable[[Sequence], bool]) -> None:
        """`admit(seq)` runs when a waiting sequence is admitted: it sets up its cache (and may restore a cached
        prefix, advancing seq.num_prefilled); it returns False if the sequence failed and was finished instead."""
        self.config = config.validate()
        self.admit = admit
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []

    # ---- membership -------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the request queue is full ({self.config.max_waiting} waiting); retry later")
        self.waiting.append(seq)

    def promote(self, seq: Sequence) -> None:
        """A sequence whose prompt is fully prefilled joins the decode set."""
        self.prefilling.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        for group in (self.running, self.prefilling):
            if seq in group:
                group.remove(seq)
                return
        if seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.prefilling, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def all_sequences(self) -> list[Sequence]:
        return [*self.running, *self.prefilling, *self.waiting]

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---- planning -----------------------------------------------------------------------------------------------
    def _chunks(self, seq: Sequence, budget: int, force: bool) -> list[PrefillChunk]:
        """Aligned chunks of seq's remaining prompt within budget (at least one if force)."""
        size, pos, out = self.config.prefill_chunk, seq.num_prefilled, []
        while pos < seq.prompt_len:
            end = min((pos // size + 1) * size, seq.prompt_len)
            if end - pos > budget and not (force and not out):
                break
            out.append(PrefillChunk(seq, pos, end))
            budget -= end - pos
            pos = end
        return out

    def schedule(self) -> StepPlan:
        plan = StepPlan(decodes=list(self.running))
        budget = self.config.max_step_tokens - len(plan.decodes)
        for seq in list(self.prefilling):
            if budget <= 0 and plan.prefills:
                return plan
            chunks = self._chunks(seq, budget, force=not plan.prefills)
            plan.prefills += chunks
            budget -= sum(c.num_tokens for c in chunks)
        while self.waiting and self.num_active < self.config.max_batch and (
                not plan.prefills or budget >= min(self.config.prefill_chunk, self.waiting[0].prompt_len)):
            seq = self.waiting.popleft()
            if not self.admit(seq):  # (may restore a cached prefix)
                continue
            seq.status = SequenceStatus.PREFILLING
            self.prefilling.append(seq)
            chunks = self._chunks(seq, budget, force=not plan.prefills)
            plan.prefills += chunks
            budget -= sum(c.num_tokens for c in chunks)
        return plan
