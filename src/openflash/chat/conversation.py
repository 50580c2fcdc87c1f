"""A conversation as the chat formats see it: turns, tool definitions and calls, the request's chat options, and
the pieces a completion parses into. Plain data, independent of HTTP (serve/ converts OpenAI bodies into these)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from openflash.chat.json_limits import MAX_JSON_DEPTH, walk_json
from openflash.errors import RequestError

Role = Literal["system", "user", "assistant", "tool"]
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names (plus "."), 1-64 characters


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call: OpenAI's `tools[i].function`."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    description: str | None = None

    def schema(self) -> dict[str, Any]:
        """The function object as prompts show it (name, description, parameters)."""
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        out["parameters"] = self.parameters
        return out


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (or made in an earlier turn): `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def argument_values(self) -> dict[str, Any]:
        return json.loads(self.arguments)


# Where an image's span goes in a rendered prompt: the server splits the text there and splices the span's ids in.
IMAGE_MARK = "\x00image\x00"


@dataclass(frozen=True)
class ImagePart:
    """An image content part: its URL (a data URL, or a local path where the server allows them) and the request
    field it came from, for error messages."""

    url: str
    where: str


@dataclass(frozen=True)
class Turn:
    """One message. `parts` are its content blocks in order: text, and images in user turns (the formats decide
    how to join them; `blocks` gives images as IMAGE_MARK)."""

    role: Role
    parts: tuple[str | ImagePart, ...] = ()
    reasoning: str | None = None  # an assistant turn's reasoning_content
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(p if isinstance(p, str) else IMAGE_MARK for p in self.parts)

    @property
    def text(self) -> str:
        return "".join(self.blocks)

    @property
    def images(self) -> tuple[ImagePart, ...]:
        return tuple(p for p in self.parts if isinstance(p, ImagePart))


ToolChoiceMode = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True)
class ChatOptions:
    """What a request asks of the chat format besides its turns."""

    thinking: bool = False
    reasoning_effort: Union[int, str, None] = None  # None: the format's default
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoiceMode = "auto"
    forced_tool: str | None = None  # tool_choice "named": the function's name

    @property
    def tools_on(self) -> bool:
        """Tools are shown to the model and its calls parsed (tool_choice "none" turns both off)."""
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True)
class Forcing:
    """Completion text the server writes for the model (tool_choice required / named): at once, or, in thinking
    mode, once the model has closed its reasoning with the token `after_token`; `grammar` (llguidance's Lark
    syntax): what the model writes after it, its calls' arguments following the tools' schemas."""

    text: str
    after_token: int | None = None
    grammar: str | None = None


# ---- what a completion parses into (in order; streaming hands them out as they become final) ----------------------


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


Piece = Union[Reasoning, Content, ToolCall]


# ---- checks shared by every format --------------------------------------------------------------------------------


def check_tool(raw: Any, where: str) -> ToolSpec:
    """An OpenAI tool definition ({"type": "function", "function": {...}}) as a ToolSpec; RequestError naming the
    field (`where` is its path, e.g. "tools.0") if it is malformed."""
    if not isinstance(raw, dict):
        raise RequestError(f"{where}: a tool must be an object", param=where)
    if raw.get("type", "function") != "function":
        raise RequestError(f"{where}.type: only 'function' tools are supported, got {raw.get('type')!r}",
                           param=f"{where}.type")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"{where}.function: required, an object with name and parameters",
                           param=f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise RequestError(f"{where}.function.name: must be 1-64 characters of a-z, A-Z, 0-9, '_', '.' and '-', "
                           f"got {name!r}", param=f"{where}.function.name")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{where}.function.description: must be a string", param=f"{where}.function.description")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise RequestError(f"{where}.function.parameters: must be a JSON Schema object",
                           param=f"{where}.function.parameters")
    if parameters.get("type", "object") != "object":
        raise RequestError(f"{where}.function.parameters.type: a function's parameters must be of type 'object', "
                           f"got {parameters.get('type')!r}", param=f"{where}.function.parameters.type")
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        raise RequestError(f"{where}.function.parameters.properties: must be an object",
                           param=f"{where}.function.parameters.properties")
    return ToolSpec(name, parameters, description)


def check_arguments(arguments: Any, where: str) -> str:
    """An assistant turn's tool-call arguments: JSON text (or an object) of a JSON object, as JSON text."""
    value = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError as exc:
            raise RequestError(f"{where}: not valid JSON ({exc})", param=where) from None
        except RecursionError:  # the parser's own bound, near 1,000 levels
            value = None
        if value is None or any(depth > MAX_JSON_DEPTH for _, depth, _ in walk_json(value)):
            raise RequestError(f"{where}: JSON nested more than {MAX_JSON_DEPTH} levels deep", param=where)
    if not isinstance(value, dict):
        raise RequestError(f"{where}: must be a JSON object, got {type(value).__name__}", param=where)
    return json.dumps(value, ensure_ascii=False)
