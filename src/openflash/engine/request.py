"""A request's life in the engine: its sequence state, status, outputs and timestamps.

A `Sequence` is created by `LLMEngine.add_request`, waits in the scheduler's queue, has its prompt prefilled in
chunks (its own one-row cache), then joins the decode batch (its rows live in the runner's batched cache) until
it finishes. Every new token produces a `RequestOutput` holding the token ids and the text that became final with
it (text that could still turn into a stop string is held back until it cannot).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from openflash.engine.logits import TokenConstraint
from openflash.engine.sampling import SamplerState, SamplingParams, TokenLogprob, find_stop
from openflash.errors import OpenflashError
from openflash.model.cache import ModelCache
from openflash.model.lora import BASE
from openflash.vision.prompt import PromptImage, key_ids


class QueueFullError(OpenflashError):
    """Too many requests are waiting."""


class EngineStoppedError(OpenflashError):
    """The engine is shutting down and takes no new requests."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, nothing computed
    PREFILLING = "prefilling"  # some prompt chunks done (own cache)
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


# Finish reasons (the OpenAI names where one exists).
STOP = "stop"  # a stop string, stop token id or the end-of-sequence token
LENGTH = "length"  # max_tokens reached
ABORT = "abort"  # cancelled by the client or by shutdown
ERROR = "error"  # the engine failed on this request


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]  # new token ids
    text: str  # newly final text
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served by the prefix cache
    error: str | None = None
    unavailable: bool = False  # the error is a storage tier's, not the request's: a server answers 503
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs: the new tokens'
    prompt_logprobs: list[TokenLogprob] | None = None  # with params.prompt_logprobs, once: prompt tokens 1.. (not 0)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: SamplerState
    eos_token_id: int | None = None  # stops the sequence unless ignore_eos
    on_output: Callable[[RequestOutput], None] | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # with params.logprobs: each output id's
    pending_logprob: TokenLogprob | None = None  # the token being sampled (logits.choose_tokens to _append)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with params.prompt_logprobs: tokens 1..
    prompt_logprobs_sent: bool = False
    constraint: TokenConstraint | None = None  # a grammar the completion follows (engine/logits.py)
    num_prefilled: int = 0  # prompt tokens whose state is in the cache
    num_cached: int = 0  # of those, tokens restored from the prefix cache
    cache: ModelCache | None = None  # own cache while prefilling (then owned by the runner's batch)
    draft_hidden: torch.Tensor | None = None  # speculative decoding: main_hidden [1, 1, n*dim] of the last run token
    images: list[PromptImage] = field(default_factory=list)  # image spans of the prompt (their rows: the runner)
    key_ids: list[int] = field(default_factory=list)  # what the prefix cache hashes: prompt ids + image digests
    adapter: int = BASE  # the LoRA adapter slot its rows run with (runtime.adapter_slot)
    adapter_key: int = 0  # a digest of what that adapter computes, mixed into key_ids: its prefixes are its own
    finish_reason: str | None = None
    error: str | None = None
    unavailable: bool = False  # the error is a storage tier's (RequestOutput.unavailable)
    # Text bookkeeping: `text` is the decoded output so far, cut at a stop string; `sent` chars have been emitted.
    text: str = ""
    sent: int = 0
    # Timestamps (time.perf_counter): arrival, each generated token, the end.
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.key_ids = key_ids(self.prompt_ids, self.images)
        if self.adapter_key and self.key_ids:  # the first id salts every block key of the chain
            self.key_ids[0] ^= self.adapter_key

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    def finish(self, reason: str, error: str | None = None, unavailable: bool = False) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.error, self.unavailable = reason, error, unavailable
        self.finish_time = time.perf_counter()

    def append_token(self, token: int, decode: Callable[[list[int]], str], now: float) -> RequestOutput:
        """Record a sampled token, apply the stop conditions, and return what became final."""
        self.output_ids.append(token)
        self.token_times.append(now)
        p = self.params
        if token in p.stop_token_ids or (self.eos_token_id is not None and token == self.eos_token_id):
            self.text = decode(self.output_ids[:-1])
            self.finish(STOP)
        else:
            self.text = decode(self.output_ids)
            cut = find_stop(self.text, p.stop)
            if cut is not None:
                if p.include_stop_str_in_output:
                    cut += max(len(s) for s in p.stop if self.text.startswith(s, cut))
                self.text = self.text[:cut]
                self.finish(STOP)
            elif self.constraint is not None and self.constraint.finished:
                self.finish(STOP)
            elif len(self.output_ids) >= p.max_tokens:
                self.finish(LENGTH)
        return self.emit([token])

    def emit(self, token_ids: list[int]) -> RequestOutput:
        """The output for this step: text that can no longer change."""
        if self.finished:
            final = len(self.text)
        else:
            # Hold back a tail that could still begin a stop string, and an incomplete UTF-8 character.
            hold = max((len(s) for s in self.params.stop), default=1) - 1
            final = len(self.text) - hold
            while final > self.sent and self.text[final - 1] == "\ufffd":
                final -= 1
        new = self.text[self.sent:final] if final > self.sent else ""
        self.sent = max(self.sent, final)
        logprobs = self.output_logprobs[len(self.output_ids) - len(token_ids):] if self.params.logprobs else None
        prompt = None
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent and \
                len(self.prompt_logprobs) == self.prompt_len - 1:
            prompt, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return RequestOutput(self.request_id, token_ids, new, self.finished, self.finish_reason, self.prompt_len,
                             len(self.output_ids), self.num_cached, self.error, self.unavailable, logprobs, prompt)
