"""Chat messages as OpenAI clients send them (the server's requests and `train --data` chat lines alike), checked
and turned into the turns a chat format renders.

`json_problem` names what no decoded JSON body may hold (nesting past the limit, lone surrogates); `ChatMessage`
is one message; `conversation` the turns of a list of them, with a RequestError naming the field for what is
malformed.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence, Union

from pydantic import BaseModel, ConfigDict

from openflash.chat.conversation import IMAGE_MARK, ImagePart, ToolCall, Turn, check_arguments
from openflash.chat.json_limits import MAX_JSON_DEPTH, short_path, walk_json
from openflash.errors import RequestError

LONE_SURROGATE = "invalid_text"  # the error type the server turns into a 400 naming the field
TOO_DEEP = "too_deep"  # the error type the server turns into a 400 naming the field


def json_problem(value: Any, limit: int = MAX_JSON_DEPTH) -> tuple[str, str, dict[str, Any]] | None:
    """The first thing in a decoded JSON document no request may carry: (error type, message template, context).

    Nesting deeper than `limit` (the parser, the renderer and every walk of it would recurse that deep), and lone
    UTF-16 surrogates: JSON allows escapes such as "\\ud800" that decode to a str no UTF-8 text can hold; the
    tokenizer (and any UTF-8 encoder) fails on them."""
    for where, depth, item in walk_json(value):
        if depth > limit:
            return TOO_DEEP, "{param}: JSON nested more than {limit} levels deep", \
                {"param": short_path(where), "limit": limit}
        if isinstance(item, str):
            try:
                item.encode("utf-8")  # in C: fast even for a prompt of megabytes
            except UnicodeEncodeError as bad:
                return LONE_SURROGATE, ("{param}: character {index} is a lone UTF-16 surrogate (U+{code}), which is "
                                        "not valid text"), \
                    {"param": where, "index": bad.start, "code": f"{ord(item[bad.start]):04X}"}
    return None


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: str | None = None  # accepted and ignored: the spec's preprocessing decides the resolution


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"  # JSON text of an object (OpenAI); an object is taken too


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning, sent back by the client
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call answered

    def parts(self) -> list[str | ImagePart]:
        """The content blocks: text, and images (user messages; ValueError for other part types)."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [self.content]
        parts: list[str | ImagePart] = []
        for j, part in enumerate(self.content):
            if part.type == "image_url":
                if part.image_url is None:
                    raise ValueError(f"content part {j}: type 'image_url' needs an image_url object with a url")
                if self.role != "user":
                    raise ValueError(f"content part {j}: only user messages carry images, not {self.role!r}")
                parts.append(ImagePart(part.image_url.url, f"content.{j}.image_url.url"))
            elif part.type == "text" and part.text is not None:
                parts.append(part.text)
            else:
                raise ValueError(f"content part {j}: type {part.type!r} is not supported (text, image_url)")
        return parts


def conversation(messages: Sequence[ChatMessage]) -> list[Turn]:
    """A request's messages as turns; RequestError naming the field for malformed tool calls."""
    turns = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        role = "system" if m.role == "developer" else m.role
        calls: list[ToolCall] = []
        for j, call in enumerate(m.tool_calls or ()):
            if role != "assistant":
                raise RequestError(f"{where}.tool_calls: only assistant messages carry tool calls",
                                   param=f"{where}.tool_calls")
            arguments = check_arguments(call.function.arguments, f"{where}.tool_calls.{j}.function.arguments")
            calls.append(ToolCall(call.id or f"call_{i}_{j}", call.function.name, arguments))
        if role == "tool" and not m.tool_call_id:
            raise RequestError(f"{where}.tool_call_id: a tool message must say which call it answers",
                               param=f"{where}.tool_call_id")
        reasoning = m.reasoning_content if role == "assistant" else None
        parts = []
        try:
            content = m.parts()
        except ValueError as exc:
            raise RequestError(f"{where}.{exc}", param=f"{where}.content") from None
        for part in content:
            if isinstance(part, ImagePart):
                part = ImagePart(part.url, f"{where}.{part.where}")
            elif IMAGE_MARK in part:
                raise RequestError(f"{where}.content: the text holds a NUL-delimited image marker, which this "
                                   f"server reserves", param=f"{where}.content")
            parts.append(part)
        turns.append(Turn(role, tuple(parts), reasoning, tuple(calls), m.tool_call_id))
    return turns
