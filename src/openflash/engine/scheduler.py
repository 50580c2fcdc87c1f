"""Continuous batching: which prompt chunks to prefill and which sequences to decode in each engine step.

Three sets: `waiting` (FIFO queue, nothing computed), `prefilling` (admitted, prompt partly in the cache) and
`running` (in the decode batch). Each step decodes every running sequence (one token each) and spends what is left
of a per-step token budget on prompt chunks, oldest request first. Chunks end at multiples of `prefill_chunk`
(absolute prompt positions), so a prompt is cut at the same places whatever else is running, and those places are
where the prefix cache can take snapshots. At least one chunk is scheduled per step when any prompt is pending, so
prefill always progresses; at most `max_batch` sequences are admitted (prefilling + running).

A prompt is prefilled once however many requests share it (a completion's `n`, an RL group, the same request sent
twice at once): a waiting sequence whose prompt (ids, images, adapter) a prefilling one already computes is admitted
as its twin and computes nothing; when that prefill ends, each twin takes a copy of its state (the engine's fork) and
samples its own first token from the same logits.
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
    share_prompts: bool = True  # admit a waiting sequence as the twin of a prefilling one with its prompt

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
        self.twins: dict[str, list[Sequence]] = {}  # a prefilling sequence's id -> those waiting for its state

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

    def take_twins(self, seq: Sequence) -> list[Sequence]:
        """The twins of a sequence whose prefill just ended, now running (the engine forks its state into them)."""
        twins = self.twins.pop(seq.request_id, [])
        for twin in twins:
            twin.status = SequenceStatus.RUNNING
        self.running += twins
        return twins

    def remove(self, seq: Sequence) -> None:
        for group in (self.running, self.prefilling, *self.twins.values()):
            if seq in group:
                group.remove(seq)
                break
        else:
            if seq in self.waiting:
                self.waiting.remove(seq)
        orphans = self.twins.pop(seq.request_id, [])  # it stopped before its prefill ended: they prefill themselves
        for twin in reversed(orphans):
            twin.status = SequenceStatus.WAITING
            self.waiting.appendleft(twin)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.all_sequences():
            if seq.request_id == request_id:
                return seq
        return None

    def all_sequences(self) -> list[Sequence]:
        return [*self.running, *self.prefilling, *(t for twins in self.twins.values() for t in twins), *self.waiting]

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.prefilling) + sum(len(t) for t in self.twins.values())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---- planning -----------------------------------------------------------------------------------------------
    def _chunks(self, seq: Sequence, budget: int, force: bool) -> list[PrefillChunk]:
        """Aligned chunks of seq's remaining prompt within budget (at least one if force). A prompt scored for its
        log-probs runs in one chunk: in the released numerics a position's logits depend (at the 1e-3 level) on how
        the prompt is cut into calls, and one call is the teacher-forced forward a client compares with."""
        size = seq.prompt_len if seq.params.prompt_logprobs is not None else self.config.prefill_chunk
        pos, out = seq.num_prefilled, []
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
        while self.waiting and self.num_active < self.config.max_batch:
            seq = self.waiting[0]
            leader = next((p for p in self.prefilling if p.key_ids == seq.key_ids and p.adapter == seq.adapter
                           and p.params.prompt_logprobs == seq.params.prompt_logprobs),
                          None) if self.config.share_prompts else None
            if leader is None and plan.prefills and budget < min(self.config.prefill_chunk, seq.prompt_len):
                break  # (a twin costs no budget)
            self.waiting.popleft()
            if leader is not None:
                seq.status = SequenceStatus.PREFILLING
                self.twins.setdefault(leader.request_id, []).append(seq)
                continue
            if not self.admit(seq):  # (may restore a cached prefix)
                continue
            seq.status = SequenceStatus.PREFILLING
            self.prefilling.append(seq)
            chunks = self._chunks(seq, budget, force=not plan.prefills)
            plan.prefills += chunks
            budget -= sum(c.num_tokens for c in chunks)
        return plan
