"""OpenAI-compatible request models (the subset openflash serves); the responses are serve/responses.py.

Requests are validated here (types and ranges, each error names its field); what depends on the model (context
length, vocabulary) is checked by the engine. Unsupported OpenAI options are refused with a message rather than
ignored. Extensions in the style of other open servers: top_k, stop_token_ids, ignore_eos; for chat, DeepSeek's
`thinking` and vLLM / SGLang's `chat_template_kwargs` and `reasoning_content`.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from openflash.chat.messages import ChatMessage, json_problem
from openflash.engine.sampling import MAX_TOP_LOGPROBS

StopType = Union[str, list[str], None]
NOT_SUPPORTED = "not_supported"  # an OpenAI field this server does not implement (NOT_SERVED)


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
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


# Request fields OpenAI defines that change nothing a server computes (bookkeeping): accepted, not acted on.
BOOKKEEPING = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "modalities")
# OpenAI fields this server does not implement, and why: a request naming one is refused with a 400 saying so.
NOT_SERVED = {
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "web_search_options": "web search is not supported",
    "functions": "the deprecated functions API is not supported: use tools",
    "function_call": "the deprecated functions API is not supported: use tool_choice",
    "verbosity": "verbosity is not supported", "suffix": "suffix (insertion) is not supported",
}


class _Request(_TextChecked):
    """Fields both endpoints take. Every field is honoured, accepted as bookkeeping (BOOKKEEPING), or the request
    is refused naming it: unknown fields are not dropped (OpenAI answers them with a 400 too)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0 = off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM
    n: int = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopType = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: StrictBool = False  # vLLM
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)  # vLLM
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias in [-100, 100]
    min_tokens: int = Field(default=0, ge=0)  # vLLM
    ignore_eos: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False  # vLLM: log-probs name tokens "token_id:N"
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    modalities: list[Literal["text"]] | None = None  # (anything else: NOT_SERVED)

    @model_validator(mode="before")
    @classmethod
    def _not_served(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in NOT_SERVED.items():
                if data.get(name) not in (None, ["text"]):  # (modalities ["text"] is what this server does)
                    raise PydanticCustomError(NOT_SUPPORTED, "{param}: {why}", {"param": name, "why": why})
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: StopType) -> StopType:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit() or len(key) > 12:
                raise ValueError(f"key {key[:40]!r} is not a token id")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {bias}")
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
    echo: StrictBool = False
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the prompt (and its log-probs) only
    max_completion_tokens: int | None = Field(default=None, ge=0)  # OpenAI's newer name, which some clients send
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # each token's, and this many likeliest
    best_of: int | None = None

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

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _nothing_to_generate(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("0 generates nothing; it is for scoring a prompt (echo: true, with logprobs)")
        given = info.data.get("max_tokens")
        if info.field_name == "max_completion_tokens" and v is not None and given not in (None, v):
            raise ValueError("max_tokens and max_completion_tokens disagree: give one")
        return v

    def requested_max_tokens(self) -> int:
        """The completion's length: either field, 16 when neither is given (OpenAI's default)."""
        given = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return 16 if given is None else given

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly with type 'json_schema'")
        return self


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None  # checked by the server (400s naming tools.N.field), see serve/chat.py
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: Union[StrictInt, str, None] = None  # 1..100 or low / high / xhigh / max
    thinking: ThinkingOption | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM / SGLang: {"thinking": bool, "reasoning_effort"}
    response_format: ResponseFormat | None = None
    continue_final_message: StrictBool = False  # vLLM

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("parallel_tool_calls")
    @classmethod
    def _parallel(cls, v: bool | None) -> bool | None:
        if v is False:
            raise ValueError("parallel_tool_calls false is not supported (the model may call several tools)")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, v: bool) -> bool:
        if v:
            raise ValueError("continue_final_message is not supported (a reply starts a new assistant turn)")
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
    add_special_tokens: StrictBool = True  # (a prompt's; vLLM's field, which lm-eval's remote tokenizer sends)

    @model_validator(mode="after")
    def _one(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_TextChecked):
    model: str | None = None
    tokens: list[int]
