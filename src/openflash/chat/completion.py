"""Reading a completion as it streams: reasoning, answer text and DSML tool calls, in order.

One parser serves both the streamed and the whole response (the whole response is every piece of one parse), so
streamed deltas always reassemble to the non-streamed message. `feed` returns the pieces that can no longer change;
text that could still be the start of a marker ("</think>", the calls block) is held until it cannot.

A malformed calls block is not an error: it is returned as answer text (from the first call that could not be
read) with a logged warning, and the rest of the completion stays text. Calls read before it stand.
"""

from __future__ import annotations

import enum
import logging
import uuid
from typing import Callable

from openflash.chat import dsml
from openflash.chat.conversation import Content, Piece, Reasoning

log = logging.getLogger("openflash.chat")

THINK_END = "</think>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _State(enum.Enum):
    REASONING = "reasoning"  # inside <think>...</think> (the prompt opened it)
    CONTENT = "content"  # answer text; a calls block may start
    CALLS = "calls"  # inside a calls block
    TEXT = "text"  # answer text, no more parsing (no tools, or after a malformed block)


def _separator(text: str) -> int:
    """Length of the trailing newlines of `text` that belong to the blank line before a calls block (at most 2)."""
    return min(len(dsml.BLOCK_SEPARATOR), len(text) - len(text.rstrip("\n")))


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CompletionParser:
    """Incremental parser of one completion. `thinking`: the prompt ended inside a reasoning block; `tools`: the
    names a call may use (empty: no calls block is looked for)."""

    def __init__(self, thinking: bool, tools: set[str] | frozenset[str] = frozenset(),
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.tools, self.new_id = set(tools), new_id
        self.state = _State.REASONING if thinking else (_State.CONTENT if tools else _State.TEXT)
        self.buf = ""
        self.block_raw = ""  # text of the current calls block not yet accounted for by a read call

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[Piece]:
        """The rest, at the end of the completion (a truncated block comes back as text)."""
        return self._drain(final=True)

    # ---- the state machine --------------------------------------------------------------------------------------
    def _drain(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            before = (self.state, len(self.buf))
            if self.state is _State.REASONING:
                self._reasoning(out, final)
            elif self.state is _State.CONTENT:
                self._content(out, final)
            elif self.state is _State.CALLS:
                self._calls(out, final)
            else:
                if self.buf:
                    out.append(Content(self.buf))
                self.buf = ""
            if (self.state, len(self.buf)) == before:
                return [p for p in out if not isinstance(p, (Reasoning, Content)) or p.text]

    def _reasoning(self, out: list[Piece], final: bool) -> None:
        end = self.buf.find(THINK_END)
        if end >= 0:
            out.append(Reasoning(self.buf[:end]))
            self.buf = self.buf[end + len(THINK_END):]
            self.state = _State.CONTENT if self.tools else _State.TEXT
            return
        keep = 0 if final else _held(self.buf, THINK_END)
        out.append(Reasoning(self.buf[:len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]

    def _content(self, out: list[Piece], final: bool) -> None:
        start = self.buf.find(dsml.CALLS_OPEN)
        if start >= 0:
            text = self.buf[:start]
            sep = _separator(text)
            out.append(Content(text[:len(text) - sep]))
            self.block_raw = text[len(text) - sep:] + dsml.CALLS_OPEN
            self.buf = self.buf[start + len(dsml.CALLS_OPEN):]
            self.state = _State.CALLS
            return
        if final:
            out.append(Content(self.buf))
            self.buf = ""
            return
        # Hold a possible marker start and the blank line that would precede it.
        keep = _held(self.buf, dsml.CALLS_OPEN)
        head = self.buf[:len(self.buf) - keep]
        keep += _separator(head)
        out.append(Content(self.buf[:len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]

    def _calls(self, out: list[Piece], final: bool) -> None:
        stripped = self.buf.lstrip()
        space = self.buf[:len(self.buf) - len(stripped)]
        if stripped.startswith(dsml.CALLS_CLOSE):
            self.buf = stripped[len(dsml.CALLS_CLOSE):]
            self.block_raw = ""
            self.state = _State.CONTENT
            return
        if stripped.startswith(dsml.INVOKE_OPEN):
            end = stripped.find(dsml.INVOKE_CLOSE)
            if end < 0:
                if final:
                    self._malformed(out, "the completion ended inside a call")
                return
            end += len(dsml.INVOKE_CLOSE)
            try:
                call = dsml.parse_invoke(stripped[:end], self.tools, self.new_id())
            except dsml.DsmlError as exc:
                self._malformed(out, str(exc))
                return
            out.append(call)
            self.block_raw = ""
            self.buf = stripped[end:]
            return
        if not stripped:
            if final:
                self._malformed(out, "the completion ended inside the calls block")
            else:
                self.block_raw += space
                self.buf = ""
            return
        if not final and (dsml.CALLS_CLOSE.startswith(stripped) or dsml.INVOKE_OPEN.startswith(stripped)):
            return  # a tag is still arriving
        self._malformed(out, f"unexpected text in the calls block: {stripped[:60]!r}")

    def _malformed(self, out: list[Piece], why: str) -> None:
        log.warning("malformed tool-call block (%s); returning it as text", why)
        out.append(Content(self.block_raw + self.buf))
        self.block_raw, self.buf = "", ""
        self.state = _State.TEXT


def parse_completion(text: str, thinking: bool, tools: set[str] | frozenset[str] = frozenset(),
                     new_id: Callable[[], str] = new_call_id) -> list[Piece]:
    """Every piece of a whole completion."""
    parser = CompletionParser(thinking, tools, new_id)
    return parser.feed(text) + parser.finish()
