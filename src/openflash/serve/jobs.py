"""A request's choices in flight: each choice is one engine request (two when a tool call is forced after the
model's reasoning), its outputs arriving on an asyncio queue fed from the engine thread; `Job` applies them (text,
tokens, the parsed chat reply and its stream delta), continues a forced tool call, and sums the usage."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from openflash.chat.conversation import Forcing
from openflash.engine.engine import LLMEngine
from openflash.engine.logits import TokenConstraint
from openflash.engine.request import ERROR, STOP, RequestOutput
from openflash.engine.sampling import SamplingParams, TokenLogprob
from openflash.errors import OpenflashError
from openflash.serve.chat import ChatReply, CompletionParser
from openflash.serve.errors import APIError, engine_failure
from openflash.serve.responses import DeltaMessage, PromptTokensDetails, Usage
from openflash.vision.prompt import PromptImage

log = logging.getLogger("openflash.serve")


@dataclass
class Choice:
    """One choice of an HTTP request: its engine request, its text and tokens so far, its parsed chat reply."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    ignore_eos: bool
    prefix: str = ""  # echoed prompt text (completions)
    echo_pending: bool = False  # streaming: the prefix still has to go out
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    unavailable: bool = False  # the error is a storage tier's (503)
    done: bool = False
    # chat: the parsed reply, and what the latest output added to it (a stream delta)
    parser: CompletionParser | None = None
    reply: ChatReply | None = None
    delta: DeltaMessage | None = None
    continuation: Forcing | None = None  # forced text to write once the model emits continuation.after_token
    continuation_constraint: TokenConstraint | None = None  # the grammar the rest follows after that forced text
    images: list[PromptImage] = field(default_factory=list)  # the prompt's image spans
    token_ids: list[int] = field(default_factory=list)  # every completion token so far, forced ones included
    earlier_tokens: int = 0  # completion tokens of the engine requests before the current one
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the sampled tokens' (params.logprobs)
    logprobs_sent: int = 0  # streaming: of those, the ones already in a chunk
    logprobs_offset: int = 0  # streaming: the text offset after the last of them
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens after its first (params.prompt_logprobs)
    prompt_logprobs_sent: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class Job:
    """The engine requests of one HTTP request, and the queue their outputs arrive on."""

    def __init__(self, engine: LLMEngine, adapter: str | None = None) -> None:
        self.engine, self.adapter = engine, adapter  # adapter: the served LoRA adapter the request named
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.choices: list[Choice] = []

    def _deliverer(self, index: int) -> Any:
        def deliver(out: RequestOutput) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
        return deliver

    def submit(self, ids: list[int], params: SamplingParams, ignore_eos: bool, prefix: str = "",
               parser: CompletionParser | None = None, reply: ChatReply | None = None,
               continuation: Forcing | None = None, images: list[PromptImage] | None = None,
               constraint: TokenConstraint | None = None,
               continuation_constraint: TokenConstraint | None = None) -> None:
        index = len(self.choices)
        first = params
        if continuation is not None:  # stop at its token, then force the text (_continue)
            first = replace(params, stop_token_ids=params.stop_token_ids + (continuation.after_token,))
        seq = self.engine.add_request(ids, first, on_output=self._deliverer(index), ignore_eos=ignore_eos,
                                      images=images or (), adapter=self.adapter, constraint=constraint)
        self.choices.append(Choice(index, seq.request_id, list(ids), params, ignore_eos, prefix, bool(prefix),
                                    text=prefix, parser=parser, reply=reply, continuation=continuation,
                                    continuation_constraint=continuation_constraint, images=list(images or ())))

    def apply(self, index: int, out: RequestOutput) -> Choice:
        c = self.choices[index]
        c.text += out.text
        c.token_ids += out.token_ids
        c.logprobs += out.logprobs or ()
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        c.completion_tokens = c.earlier_tokens + out.completion_tokens
        if not c.earlier_tokens:
            c.cached_tokens = out.cached_tokens
        pieces = c.parser.feed(out.text) if c.parser is not None else []
        if out.finished:
            forced = self._continue(c, out) if c.continuation is not None else None
            if forced is not None:
                pieces += c.parser.feed(forced) if c.parser is not None else []
            else:
                c.done, c.finish_reason, c.error, c.unavailable = True, out.finish_reason, out.error, out.unavailable
                pieces += c.parser.finish() if c.parser is not None else []
        if c.reply is not None:
            c.delta = c.reply.add(pieces)
            if c.done:
                c.finish_reason = c.reply.finish_reason(c.finish_reason)
        return c

    def _continue(self, c: Choice, out: RequestOutput) -> str | None:
        """The model closed its reasoning where the server forces a tool call: submit the rest (prompt, reasoning,
        forced text) as the choice's next engine request. Returns the completion text that adds, or None when the
        choice ends here (another stop, no room left, or the engine refused)."""
        forcing, c.continuation = c.continuation, None
        if out.finish_reason != STOP or not c.token_ids or c.token_ids[-1] != forcing.after_token:
            return None
        tokenizer = self.engine.tokenizer
        forced_ids = tokenizer.encode(forcing.text, add_special_tokens=False).ids
        used = c.earlier_tokens + out.completion_tokens + len(forced_ids)
        if c.params.max_tokens - used < 1:
            return None
        try:
            seq = self.engine.add_request(c.prompt_ids + c.token_ids + forced_ids,
                                          replace(c.params, max_tokens=c.params.max_tokens - used),
                                          on_output=self._deliverer(c.index), ignore_eos=c.ignore_eos,
                                          images=c.images, adapter=self.adapter, constraint=c.continuation_constraint)
        except OpenflashError as exc:
            log.warning("forcing the tool call of choice %d failed: %s", c.index, exc)
            return None
        c.request_id, c.earlier_tokens = seq.request_id, used
        c.token_ids += forced_ids
        c.completion_tokens = used
        return tokenizer.decode([forcing.after_token], skip_special_tokens=False) + forcing.text

    @property
    def pending(self) -> int:
        return sum(not c.done for c in self.choices)

    def abort_unfinished(self) -> None:
        for c in self.choices:
            if not c.done:
                self.engine.abort(c.request_id)

    def usage(self, n: int) -> Usage:
        prompt = sum(c.prompt_tokens for c in self.choices[::n])  # each prompt once, whatever n
        completion = sum(c.completion_tokens for c in self.choices)
        cached = sum(c.cached_tokens for c in self.choices[::n])
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def failure(self) -> APIError | None:
        for c in self.choices:
            if c.finish_reason == ERROR:
                return engine_failure(c.error, c.unavailable)
        return None


__all__ = ["Job", "Choice"]
