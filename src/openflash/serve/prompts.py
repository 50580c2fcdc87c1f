"""A request's prompt as token ids, for the server (serve/app.py): completion prompts (text or ids), chat messages
rendered by the served chat format with their images decoded and placed, and the checks that come before the
engine sees them (the engine's PromptIntake: a text bounded before it is tokenized, ids against the vocabulary and
the context). Each refusal is an APIError (400): a prompt that cannot fit (context_length_exceeded), one the model
or the chat template cannot take."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from openflash.chat.conversation import IMAGE_MARK, ChatOptions, Forcing
from openflash.config import FlashConfig
from openflash.engine.prompt import PromptError, PromptIntake
from openflash.errors import RequestError
from openflash.chat.messages import conversation
from openflash.serve.chat import ChatFormat, chat_options
from openflash.serve.errors import APIError, prompt_error
from openflash.serve.images import ImagePolicy, image_bytes
from openflash.serve.protocol import ChatCompletionRequest, CompletionRequest
from openflash.vision.preprocess import PreparedImage, prepare_image
from openflash.vision.prompt import PromptImage, assemble

log = logging.getLogger("openflash.serve")


@dataclass
class ChatPrompt:
    """A rendered chat request: token ids (image spans included), the forced text already at their end ("" if
    none; the reply's parser reads it first), a forcing that waits for the model's reasoning to end, the spans."""

    ids: list[int]
    forced: str = ""
    deferred: Forcing | None = None
    images: list[PromptImage] = field(default_factory=list)
    call_grammar: str | None = None  # what follows the forced text (Forcing.grammar), at once or deferred


class ServerPrompts:
    def __init__(self, tokenizer: Tokenizer, intake: PromptIntake, chat_format: ChatFormat, thinking_default: bool,
                 images: ImagePolicy, model: FlashConfig) -> None:
        """intake: the engine's (its checks, before the engine sees the request); model: the served model's config
        (its vision tower and image token)."""
        self.tokenizer, self.intake, self.chat_format = tokenizer, intake, chat_format
        self.thinking_default, self.images, self.model = thinking_default, images, model
        if intake.max_token_chars is None:
            log.warning("this tokenizer's normalizer or pre-tokenizer drops characters: prompts are tokenized in "
                        "full before their length is checked")

    def check_ids(self, ids: list[int], param: str) -> None:
        try:
            self.intake.check_ids(ids, param)
        except PromptError as exc:
            raise prompt_error(exc) from None

    def check_length(self, text: str, param: str) -> None:
        """A 400 for a text too long for the context, before it is tokenized (PromptIntake.check_text)."""
        try:
            self.intake.check_text(text, param)
        except PromptError as exc:
            raise prompt_error(exc) from None

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of `text` (a 400 first if it cannot fit the context). Called in a worker thread (app.py
        `off_loop`); encode_batch releases the GIL while the Rust tokenizer runs, so the event loop keeps serving
        other requests during a long prompt."""
        self.check_length(text, param)
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def completion(self, body: CompletionRequest) -> list[list[int]]:
        p = body.prompt
        if isinstance(p, str):
            return [self.encode(p)]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return [self.encode(x) if isinstance(x, str) else list(x) for x in p]

    def chat(self, messages: list[Any], options: ChatOptions) -> ChatPrompt:
        """The rendered conversation as token ids, with its images decoded and placed (see ChatPrompt)."""
        fmt = self.chat_format
        try:
            fmt.check(options)
            turns = conversation(messages)
            text = fmt.render(turns, options)
            self.check_length(text, "messages")  # before any image is decoded
            images = self.prepare_images([image for turn in turns for image in turn.images])
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.param or "messages", code="invalid_value") from None
        forcing = fmt.forcing(options)
        forced = "" if forcing is None or forcing.after_token is not None else forcing.text
        pieces = (text + forced).split(IMAGE_MARK)
        if len(pieces) != len(images) + 1:  # the format dropped or repeated an image: a bug, not the request's
            raise RuntimeError(f"the {fmt.name} chat format rendered {len(pieces) - 1} image marks for "
                               f"{len(images)} images")
        segments: list[list[int] | PreparedImage] = []
        encoded = self.tokenizer.encode_batch(pieces, add_special_tokens=False)  # one call for every text piece
        for k, piece in enumerate(encoded):
            segments.append(piece.ids)
            if k < len(images):
                segments.append(images[k])
        ids, placed = assemble(segments, self.model.image_token_id)
        return ChatPrompt(ids, forced, forcing if not forced else None, placed,
                          None if forcing is None else forcing.grammar)

    def prepare_images(self, parts: list[Any]) -> list[PreparedImage]:
        """Decode and preprocess a request's image parts (RequestError naming the part for a bad one)."""
        if not parts:
            return []
        vision = self.model.vision
        if vision is None:
            raise RequestError(f"{parts[0].where}: this model has no vision tower; it takes text only",
                               param=parts[0].where)
        policy = self.images
        if len(parts) > policy.max_images:
            raise RequestError(f"messages: {len(parts)} images, over the limit of {policy.max_images} per request",
                               param=parts[policy.max_images].where)
        return [prepare_image(image_bytes(p.url, p.where, policy), vision, policy.limits, p.where) for p in parts]

    def chat_options(self, body: ChatCompletionRequest) -> ChatOptions:
        try:
            return chat_options(body, self.thinking_default)
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None


__all__ = ["ChatPrompt", "ServerPrompts"]
