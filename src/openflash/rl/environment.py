"""Tool environments: an agent's episode (its tool calls, their results, the final answer) as one rollout.

A chat task with tools may name `"environment": "MODULE:FUNCTION"`. Every tool call a completion makes (DSML,
parsed as the server parses it) is passed to that function with the task's fields; what it returns goes back to the
model as a tool turn, rendered by the chat template, and the model writes its next turn:

    def lookup(call: dict, task: dict) -> str | Any:      # call: {"name": ..., "arguments": {...}}
        return PRICES[call["arguments"]["item"]]           # not a string: sent as JSON

A function that raises answers the call with the error (the model sees its call fail, as an agent would), and the
failure is logged and counted; training goes on. The update trains on the model's tokens only: the tool results
are in the rollout's context but masked out of the loss (Rollout.trained).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from openflash.chat.completion import CompletionParser
from openflash.chat.conversation import ChatOptions, Content, Reasoning, ToolCall, Turn
from openflash.errors import OpenflashError
from openflash.rl.user_code import call_limited


class ChatTemplate(Protocol):
    """What an episode needs of the chat format (chat/dsv41.py, chat/simple.py)."""

    name: str

    def render(self, turns: Sequence[Turn], options: ChatOptions) -> str: ...

    def reply_text(self, turn: Turn, options: ChatOptions) -> str: ...

    def parser(self, options: ChatOptions) -> CompletionParser: ...


MAX_RESULT_CHARS = 1 << 16  # a tool result past this is cut (a turn has TOOL_ROOM tokens of context anyway)


@dataclass(frozen=True)
class ToolEnvironment:
    spec: str  # MODULE:FUNCTION
    function: Callable[[dict[str, Any], dict[str, Any]], Any]
    timeout: float = 5.0  # seconds a call may take (--reward-timeout): one that hangs answers with an error

    def answer(self, call: ToolCall, fields: dict[str, Any]) -> tuple[str, str | None]:
        """The tool result of `call`, and what went wrong when the function failed (None when it did not)."""
        outcome = call_limited(self.function, ({"name": call.name, "arguments": call.argument_values()},
                                               dict(fields)), self.timeout, f"tool {self.spec}")
        if outcome.timed_out:
            return "error: the tool did not answer in time", f"{self.spec} took more than {self.timeout:g} s"
        if outcome.error is not None:  # a user's bug (or exit) is the call's result, not a crash
            exc = outcome.error
            return f"error: {type(exc).__name__}: {exc}", f"{self.spec} raised {type(exc).__name__}: {exc}"
        try:
            text = outcome.value if isinstance(outcome.value, str) else \
                json.dumps(outcome.value, ensure_ascii=False)
            text.encode("utf-8")  # (a lone surrogate would fail the tokenizer later)
        except (TypeError, ValueError) as exc:
            return f"error: {type(exc).__name__}: {exc}", f"{self.spec} returned what is not text or JSON: {exc}"
        if len(text) > MAX_RESULT_CHARS:
            return (text[:MAX_RESULT_CHARS] + f"... (result cut: {len(text):,} characters)",
                    f"{self.spec} returned {len(text):,} characters, cut at {MAX_RESULT_CHARS:,}")
        return text, None


def reply_turn(fmt: ChatTemplate, options: ChatOptions, text: str) -> Turn:
    """A completion's text as the assistant turn the template renders: its reasoning, answer and tool calls."""
    parser = fmt.parser(options)
    pieces = parser.feed(text) + parser.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    return Turn("assistant", ("".join(p.text for p in pieces if isinstance(p, Content)),),
                reasoning=reasoning if options.thinking else None,
                tool_calls=tuple(p for p in pieces if isinstance(p, ToolCall)))


def tool_turn_text(fmt: ChatTemplate, turns: Sequence[Turn], options: ChatOptions, reply: Turn,
                   results: Sequence[Turn]) -> str:
    """The text the template puts after a reply (its EOS included) for its tool results, up to and including the
    next assistant header: the conversation rendered with the results, less the one rendered without them. The
    model's own tokens stay as it wrote them; only this text is rendered."""
    before = fmt.render(turns, options) + fmt.reply_text(reply, options)
    after = fmt.render([*turns, reply, *results], options)
    if not after.startswith(before):
        raise OpenflashError(f"the {fmt.name} chat template does not render a conversation as its earlier turns "
                             f"plus the new ones; tool episodes need one that does")
    return after[len(before):]
