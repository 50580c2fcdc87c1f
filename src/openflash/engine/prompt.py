"""The one way a prompt comes in (the engine's `add_request`, `generate`, the server): text checked against the
context before it is tokenized where the tokenizer allows a bound, then tokenized; token ids checked against the
vocabulary and the context; the completion's budget; image spans against the ids. Every refusal is a `PromptError`
whose `code` says which check failed, so the server maps it to HTTP in one place (serve/errors.py `prompt_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tokenizers import Tokenizer

from openflash.config import FlashConfig
from openflash.errors import RequestError
from openflash.tokenizer import max_chars_per_token
from openflash.vision.prompt import PromptImage, check_spans

EMPTY, INVALID_TOKEN, TOO_LONG, MAX_TOKENS, INVALID_IMAGES = (
    "empty_prompt", "invalid_token", "context_length_exceeded", "max_tokens", "invalid_images")


class PromptError(RequestError):
    """A prompt that cannot run as given. `code`: which check refused it (EMPTY, INVALID_TOKEN, TOO_LONG, MAX_TOKENS,
    INVALID_IMAGES); `param`: the request field at fault (the server names the one its request used)."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message, param)
        self.code = code


@dataclass(frozen=True)
class PromptIntake:
    tokenizer: Tokenizer
    vocab_size: int
    max_context: int | None  # prompt + completion tokens (None: no bound, the plain `generate` loop)
    max_token_chars: int | None  # the most characters a token stands for (None: no bound before tokenizing)
    image_token_id: int | None
    takes_images: bool

    @classmethod
    def of(cls, cfg: FlashConfig, tokenizer: Tokenizer, max_context: int | None) -> "PromptIntake":
        # (the bound reads the whole vocabulary: only where there is a context to hold a text against)
        bound = max_chars_per_token(tokenizer) if max_context is not None else None
        return cls(tokenizer, cfg.vocab_size, max_context, bound, cfg.image_token_id, cfg.has_vision)

    def encode(self, prompt: str | Sequence[int], param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """A text's token ids (its length checked first), or a list of ids as given; then `check_ids`."""
        if isinstance(prompt, str):
            self.check_text(prompt, param)
            ids = self.tokenizer.encode_batch([prompt], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = [int(t) for t in prompt]
        self.check_ids(ids, param)
        return ids

    def check_text(self, text: str, param: str = "prompt") -> None:
        """Before tokenizing: a text of n characters has at least n / max_token_chars tokens, so a 30 MB prompt
        costs no tokenizer time or memory."""
        if self.max_context is None or self.max_token_chars is None:
            return
        least = len(text) // self.max_token_chars
        if least >= self.max_context:
            raise PromptError(f"the prompt has {len(text)} characters, so at least {least} tokens, but the context "
                              f"holds {self.max_context} (prompt plus at least one generated token)", TOO_LONG, param)

    def check_ids(self, ids: Sequence[int], param: str = "prompt") -> None:
        if not ids:
            raise PromptError(f"{param} is empty after tokenization", EMPTY, param)
        if self.max_context is not None and len(ids) >= self.max_context:
            raise PromptError(f"the prompt has {len(ids)} tokens but the context holds {self.max_context} (prompt "
                              f"plus at least one generated token)", TOO_LONG, param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            shown = str(bad) if len(str(bad)) <= 40 else str(bad)[:40] + "..."
            raise PromptError(f"prompt token id {shown} is outside the model's vocabulary (0..{self.vocab_size - 1}):"
                              f" wrong tokenizer for this model?", INVALID_TOKEN, param)

    def check_budget(self, ids: Sequence[int], max_tokens: int) -> None:
        """The prompt plus max_tokens within the context."""
        if self.max_context is not None and len(ids) + max_tokens > self.max_context:
            raise PromptError(f"max_tokens {max_tokens} plus the prompt's {len(ids)} tokens exceeds the context of "
                              f"{self.max_context} tokens", MAX_TOKENS, "max_tokens")

    def check_images(self, ids: Sequence[int], images: Sequence[PromptImage]) -> None:
        """Image spans placed on the ids (vision/prompt.py), for a model with a vision tower."""
        if not images:
            return
        if not self.takes_images:
            raise PromptError("this model has no vision tower (vision_config.num_hidden_layers = 0): it takes no "
                              "images", INVALID_IMAGES, "images")
        if not all(isinstance(p, PromptImage) for p in images):
            raise PromptError("with a token-id prompt, images must be PromptImage spans (vision/prompt.py)",
                              INVALID_IMAGES, "images")
        try:
            check_spans(ids, images, self.image_token_id)
        except ValueError as exc:
            raise PromptError(str(exc), INVALID_IMAGES, "images") from None


__all__ = ["PromptIntake", "PromptError", "EMPTY", "INVALID_TOKEN", "TOO_LONG", "MAX_TOKENS", "INVALID_IMAGES"]
