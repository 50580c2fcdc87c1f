"""OpenAI-compatible response models (the shapes openflash answers in), plus the error body; their requests are
serve/protocol.py."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: per token its text, log-prob (null for a prompt's first token), the likeliest
    tokens' (the token's own included, as vLLM gives them) and where its text starts."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)
    end: int = Field(default=0, exclude=True)  # the offset after the last token (where a next run starts)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info, what lm-eval's remote tokenizer reads (no chat_template: the chat format is code)."""

    tokenizer_class: str = "PreTrainedTokenizerFast"
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    model_max_length: int
    vocab_size: int


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
