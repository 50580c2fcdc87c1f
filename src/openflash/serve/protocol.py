"""OpenAI-compatible request and response models (the subset openflash serves), plus the error body.

Requests are validated here (types and ranges, each error names its field); what depends on the model (context
length, vocabulary) is checked by the engine. Unsupported OpenAI options are refused with a message rather than
ignored. Extensions in the style of other open servers: top_k, stop_token_ids, ignore_eos; for chat, DeepSeek's
`thinking` and vLLM / SGLang's `chat_template_kwargs` and `reasoning_content`.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from openflash.chat.conversation import ImagePart
from openflash.chat.json_limits import MAX_JSON_DEPTH, short_path, walk_json

StopType = Union[str, list[str], None]
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


class _TextChecked(BaseModel):
    """Refuses a body nested too deeply or holding a lone surrogate, naming the field (see json_problem); numbers
    and booleans are strict (`"2"` and `true` are no integers)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_json_text(cls, data: Any) -> Any:
        problem = json_problem(data)
        if problem is not None:
            kind, template, context = problem
            raise PydanticCustomError(kind, template, context)
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Request(_TextChecked):
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0 = off
    n: int = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopType = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: StrictBool = False
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: StopType) -> StopType:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v not in (None, 0, 0.0):
            raise ValueError(f"{info.field_name} is not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def max_tokens_field(self) -> str:
        """The field the completion's length came from, for errors about it."""
        return "max_tokens"


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: StrictBool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("logprobs", "suffix")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v not in (None, info.data.get("n", 1)):
            raise ValueError("best_of is not supported (only equal to n)")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v


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


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ThinkingOption(BaseModel):
    """DeepSeek's API: {"thinking": {"type": "enabled" | "disabled"}}."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled"]


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by the server (400s naming tools.N.field), see serve/chat.py
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: Union[StrictInt, str, None] = None  # 1..100 or low / high / xhigh / max
    thinking: ThinkingOption | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM / SGLang: {"thinking": bool, "reasoning_effort"}
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    @field_validator("parallel_tool_calls")
    @classmethod
    def _parallel(cls, v: bool | None) -> bool | None:
        if v is False:
            raise ValueError("parallel_tool_calls false is not supported (the model may call several tools)")
        return v

    @field_validator("response_format")
    @classmethod
    def _format(cls, v: dict | None) -> dict | None:
        if v not in (None, {"type": "text"}):
            raise ValueError("only {'type': 'text'} is supported")
        return v

    @field_validator("messages")
    @classmethod
    def _known_parts(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(v):
            try:
                m.parts()
            except ValueError as exc:
                raise ValueError(f"message {i}: {exc}") from None
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeRequest(_TextChecked):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_TextChecked):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # thinking mode: the reasoning, apart from the answer
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "openflash"
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int  # image spans included: each image counts its span's positions (spec §A.2)
    max_model_len: int
    image_tokens: int = 0  # of `count`, the positions of image spans


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
