"""The engine's log-probabilities (engine/sampling.TokenLogprob) in OpenAI's two shapes: the completions API's
legacy lists (tokens, token_logprobs, top_logprobs, text_offset) and the chat API's `logprobs.content` entries.

A token is named by its text (TokenNames); a log-prob below the float range JSON can hold is written as -9999.0, as
vLLM does.
"""

from __future__ import annotations

import codecs

from tokenizers import Tokenizer

from openflash.engine.sampling import TokenLogprob
from openflash.serve.jobs import Choice
from openflash.serve.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's scheme, which the DeepSeek tokenizer and the
    ones trained here use): printable Latin-1 bytes stand for themselves, the others for chr(256 + k) in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


BYTE_ALPHABET = _byte_alphabet()  # (built once: every request names tokens through it)


class TokenNames:
    """What a token is called in a log-prob entry: its text, or, for a piece of a UTF-8 character (no text of its
    own), OpenAI's "bytes:\\xNN..." form, so that two such tokens never share a name; "token_id:N" with vLLM's
    return_tokens_as_token_ids."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids
        byte_level = "ByteLevel" in repr(tokenizer.decoder)  # (a Sequence of decoders names its parts too)
        self.alphabet = BYTE_ALPHABET if byte_level else {}

    def bytes(self, token: int) -> bytes:
        """The token's bytes: from its piece in a byte-level vocabulary, else its text's UTF-8."""
        piece = self.tokenizer.id_to_token(token) or ""
        if self.alphabet and piece and all(c in self.alphabet for c in piece):
            return bytes(self.alphabet[c] for c in piece)
        return self.tokenizer.decode([token], skip_special_tokens=False).encode("utf-8", "replace")

    def __call__(self, token: int) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" in text:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in self.bytes(token))
        return text


def completion_logprobs(records: list[TokenLogprob], name: TokenNames, first_offset: int,
                        unscored: int | None = None) -> CompletionLogprobs:
    """The legacy shape of a run of tokens, led by `unscored` (an echoed prompt's first token, which has no
    log-prob) when given. Offsets count from first_offset, the characters of the choice's text before them: each
    token's bytes go through one UTF-8 decoder, so a token that ends inside a character gives that character to the
    token that completes it, and both have the character's offset."""
    out = CompletionLogprobs()
    offset = first_offset
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    head = [] if unscored is None else [TokenLogprob(unscored, FLOOR)]
    for i, record in enumerate(head + records):
        text = name(record.token)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(decoder.decode(name.bytes(record.token)))
        if i < len(head):
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(record.logprob))
        top = {name(t): _value(lp) for t, lp in record.top}
        top.setdefault(text, _value(record.logprob))  # the token's own, as vLLM gives it
        out.top_logprobs.append(top)
    out.end = offset + len(decoder.decode(b"", final=True))
    return out


def chat_logprobs(records: list[TokenLogprob], name: TokenNames) -> ChatLogprobs:
    def entry(token: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=name(token), logprob=_value(logprob), bytes=list(name.bytes(token)))

    content = []
    for r in records:
        head = entry(r.token, r.logprob)
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=[entry(t, lp) for t, lp in r.top]))
    return ChatLogprobs(content=content)


def completion_choice_logprobs(choice: Choice, names: TokenNames, streamed: bool) -> CompletionLogprobs:
    """A completion choice's log-probs: all of them (streamed: those not sent yet, which are then marked sent, the
    offset after them kept on the choice), its echoed prompt's first. Offsets count in the prompt's text and then the
    completion's, as OpenAI counts them."""
    echoed = choice.prompt_logprobs is not None and not choice.prompt_logprobs_sent
    start = choice.logprobs_sent if streamed else 0
    new = choice.logprobs[start:]
    if echoed:
        prompt = completion_logprobs(choice.prompt_logprobs, names, 0, unscored=choice.prompt_ids[0])
        rest = completion_logprobs(new, names, prompt.end)
        out = CompletionLogprobs(tokens=prompt.tokens + rest.tokens,
                                 token_logprobs=prompt.token_logprobs + rest.token_logprobs,
                                 top_logprobs=prompt.top_logprobs + rest.top_logprobs,
                                 text_offset=prompt.text_offset + rest.text_offset, end=rest.end)
    else:
        offset = choice.logprobs_offset if streamed and start else \
            len(choice.prefix or names.tokenizer.decode(choice.prompt_ids))
        out = completion_logprobs(new, names, offset)
    if streamed:
        choice.logprobs_sent, choice.prompt_logprobs_sent, choice.logprobs_offset = len(choice.logprobs), True, out.end
    return out


def chat_choice_logprobs(choice: Choice, names: TokenNames, streamed: bool) -> ChatLogprobs:
    """A chat choice's log-probs: all of them, or (streamed) those not sent yet, which are then marked sent."""
    start = choice.logprobs_sent if streamed else 0
    if streamed:
        choice.logprobs_sent = len(choice.logprobs)
    return chat_logprobs(choice.logprobs[start:], names)


__all__ = ["TokenNames", "completion_logprobs", "chat_logprobs", "completion_choice_logprobs",
           "chat_choice_logprobs"]
