"""Chat formats: OpenAI-style conversations to prompts, completions back to reasoning, answer and tool calls.

    conversation.py  turns, tools, calls, the request's chat options, the pieces a completion parses into
    messages.py      chat messages as clients send them (server requests, chat data lines), checked, to turns
    dsv41.py         the DeepSeek-V4.1 template (models with the released vocabulary)
    simple.py        the template of models trained here with their own tokenizer
    dsml.py          V4.1's tool-call markup, both ways
    completion.py    the incremental completion parser (streamed and whole responses alike)

Which applies: `chat_format(..., "auto")` takes V4.1 when the tokenizer holds V4.1's special tokens (the released
tokenizer does), else simple.
"""

from __future__ import annotations

from typing import Union

from tokenizers import Tokenizer

from openflash.chat.dsv41 import DeepSeekV41Format
from openflash.chat.simple import SimpleFormat
from openflash.errors import ConfigError

CHAT_TEMPLATES = ("auto", DeepSeekV41Format.name, SimpleFormat.name)
AnyFormat = Union[DeepSeekV41Format, SimpleFormat]


def chat_format(tokenizer: Tokenizer, bos_token_id: int | None, eos_token_id: int | None,
                template: str = "auto") -> AnyFormat:
    """The chat format for a model's tokenizer: "auto", "deepseek-v4.1" or "simple"."""
    if template not in CHAT_TEMPLATES:
        raise ConfigError(f"chat template must be one of {list(CHAT_TEMPLATES)}, got {template!r}")
    if template == DeepSeekV41Format.name or (template == "auto" and not DeepSeekV41Format.missing_tokens(tokenizer)):
        return DeepSeekV41Format(tokenizer, eos_token_id)
    return SimpleFormat(tokenizer, bos_token_id, eos_token_id)
