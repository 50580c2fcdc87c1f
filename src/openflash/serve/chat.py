"""Chat requests and replies: a chat body's options for the chat format (its messages become turns in
chat/messages.py), and a choice's parsed completion back to an OpenAI message (whole) or to deltas (streamed).

Thinking is on when the request says so: `thinking: {"type": "enabled"}` (DeepSeek's API),
`chat_template_kwargs: {"thinking": true}` (or "enable_thinking", as vLLM and SGLang take them), or a
`reasoning_effort` (which only has a meaning in thinking mode); otherwise the server's default (`--thinking`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from openflash.chat.conversation import ChatOptions, Content, Forcing, Piece, Reasoning, ToolCall, Turn, check_tool
from openflash.errors import RequestError
from openflash.serve.protocol import ChatCompletionRequest, NamedToolChoice
from openflash.serve.responses import (AssistantMessage, DeltaMessage, FunctionCallDelta, FunctionCallOut,
                                       ToolCallDelta, ToolCallOut)


class CompletionParser(Protocol):
    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class ChatFormat(Protocol):
    """What the server needs of a chat template (chat/dsv41.py, chat/simple.py)."""

    name: str

    def check(self, options: ChatOptions) -> None: ...

    def render(self, turns: Sequence[Turn], options: ChatOptions) -> str: ...

    def parser(self, options: ChatOptions) -> CompletionParser: ...

    def forcing(self, options: ChatOptions) -> Forcing | None: ...

    def answer_after(self, options: ChatOptions) -> int | None:
        """The token that ends the reasoning before the answer (thinking mode), or None: the answer comes first."""


def _thinking(body: ChatCompletionRequest, default: bool) -> bool:
    kwargs = body.chat_template_kwargs or {}
    for key in ("thinking", "enable_thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise RequestError(f"chat_template_kwargs.{key} must be true or false, got {kwargs[key]!r}",
                                   param=f"chat_template_kwargs.{key}")
            return kwargs[key]
    if body.thinking is not None:
        return body.thinking.type == "enabled"
    if body.reasoning_effort is not None or "reasoning_effort" in kwargs:
        return True
    return default


def chat_options(body: ChatCompletionRequest, thinking_default: bool = False) -> ChatOptions:
    """The request's chat options; RequestError naming the field for malformed tools or choices."""
    kwargs = body.chat_template_kwargs or {}
    unknown = sorted(set(kwargs) - {"thinking", "enable_thinking", "reasoning_effort"})
    if unknown:
        raise RequestError(f"chat_template_kwargs: unknown keys {unknown} (known: thinking, enable_thinking, "
                           f"reasoning_effort)", param=f"chat_template_kwargs.{unknown[0]}")
    effort = body.reasoning_effort if body.reasoning_effort is not None else kwargs.get("reasoning_effort")
    tools = tuple(check_tool(t, f"tools.{i}") for i, t in enumerate(body.tools or ()))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise RequestError(f"tools: the function name {dup!r} is defined twice", param="tools")
    choice, forced = body.tool_choice or "auto", None
    if isinstance(choice, NamedToolChoice):
        forced, choice = choice.function.name, "named"
        if forced not in names:
            raise RequestError(f"tool_choice.function.name: {forced!r} is not among the request's tools "
                               f"({names})", param="tool_choice.function.name")
    elif choice == "required" and not tools:
        raise RequestError("tool_choice 'required' needs tools", param="tool_choice")
    return ChatOptions(thinking=_thinking(body, thinking_default), reasoning_effort=effort, tools=tools,
                       tool_choice=choice, forced_tool=forced)


# ---- a choice's reply -------------------------------------------------------------------------------------------


@dataclass
class ChatReply:
    """One choice's message so far: pieces go in as the parser makes them final."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, pieces: list[Piece]) -> DeltaMessage | None:
        """Record pieces; the stream delta that carries them (None if there are none)."""
        if not pieces:
            return None
        delta = DeltaMessage()
        deltas: list[ToolCallDelta] = []
        for piece in pieces:
            if isinstance(piece, Reasoning):
                self.reasoning += piece.text
                delta.reasoning_content = (delta.reasoning_content or "") + piece.text
            elif isinstance(piece, Content):
                self.content += piece.text
                delta.content = (delta.content or "") + piece.text
            else:
                deltas.append(ToolCallDelta(index=len(self.calls), id=piece.id, type="function",
                                            function=FunctionCallDelta(name=piece.name, arguments=piece.arguments)))
                self.calls.append(piece)
        delta.tool_calls = deltas or None
        return delta

    def message(self) -> AssistantMessage:
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in self.calls]
        # Empty fields are null, as in a stream that never sent them.
        return AssistantMessage(content=self.content or None, reasoning_content=self.reasoning or None,
                                tool_calls=calls or None)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason
