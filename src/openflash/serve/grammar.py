"""Structured output: a chat request's `response_format` (json_object, json_schema), or the arguments of a tool call
it forces (tool_choice required / named: the chat format's grammar), as a grammar its completion follows, token by
token (engine/logits.py TokenConstraint).

The grammar library is llguidance (MIT, as openflash; no dependencies; a Rust core that computes a step's mask over a
129K vocabulary in well under a millisecond on one CPU core, by measurement: benchmarks/grammar_mask.py). xgrammar
(Apache-2.0) needs transformers and a CUDA-minded torch stack for its tokenizer and masks; outlines-core (Apache-2.0)
compiles a whole-schema automaton up front, slow for large schemas. vLLM and SGLang ship all three.

In thinking mode the grammar starts after the token that ends the reasoning (the chat format's `answer_after`): the
reasoning is free, the answer follows the schema.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from openflash.errors import RequestError


class Grammar:
    """One choice's grammar state (a TokenConstraint): an llguidance matcher, waiting for `after_token` first when
    one is given."""

    def __init__(self, matcher: Any, after_token: int | None) -> None:
        self.matcher, self.waiting_for = matcher, after_token

    def allowed(self, vocab_size: int) -> torch.Tensor:
        if self.waiting_for is not None:
            return torch.ones(vocab_size, dtype=torch.bool)
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        n = min(vocab_size, bits.size)
        allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        return allowed

    def advance(self, token: int) -> bool:
        if self.waiting_for is not None:
            if token == self.waiting_for:
                self.waiting_for = None
            return True
        return bool(self.matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        return self.waiting_for is None and bool(self.matcher.is_stopped())


class GrammarCompiler:
    """Compiles response formats against the served tokenizer. The tokenizer's index is built on first use (about a
    second for a 129K vocabulary) and shared by every request after."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._index: Any = None
        self._lock = threading.Lock()

    def _llg(self) -> Any:
        try:
            import llguidance
        except ImportError as exc:  # a dependency of the package; a broken install says so
            raise RequestError(f"response_format needs the llguidance package, which is not importable here "
                               f"({exc}); reinstall openflash", param="response_format") from None
        with self._lock:
            if self._index is None:
                self._index = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_id)
        return llguidance

    def grammar(self, response_format: Any) -> str | None:
        """The grammar of a ResponseFormat (serve/protocol.py), or None for free text; RequestError naming the
        field for a schema the library cannot compile."""
        if response_format is None or response_format.type == "text":
            return None
        llguidance = self._llg()
        if response_format.type == "json_object":
            schema, param = {"type": "object"}, "response_format"
        else:
            schema = response_format.json_schema.schema_ or {}
            param = "response_format.json_schema.schema"
        # Compact JSON (no free whitespace): a weak model cannot fill a completion with blanks.
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except (TypeError, ValueError) as exc:
            raise RequestError(f"{param}: {exc}"[:500], param=param) from None
        return self._checked(grammar, param, "the schema")

    def lark(self, grammar: str, param: str) -> str:
        """A grammar in llguidance's Lark syntax (a chat format's tool calls: chat/dsml.py call_grammar), compiled;
        RequestError naming `param` for one the library refuses (a tool's parameters schema, say)."""
        llguidance = self._llg()
        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        except (TypeError, ValueError) as exc:
            raise RequestError(f"{param}: {exc}"[:500], param=param) from None
        return self._checked(compiled, param, "the tools' parameters schemas")

    def _checked(self, grammar: str, param: str, what: str) -> str:
        failed, problems = self._llg().LLMatcher.validate_grammar_with_warnings(grammar, self._index)
        if failed:
            raise RequestError(f"{param}: {what} cannot be compiled into a grammar: {'; '.join(problems)[:500]}",
                               param=param)
        return grammar

    def start(self, grammar: str, after_token: int | None = None) -> Grammar:
        """A fresh state of a compiled grammar, for one choice."""
        llguidance = self._llg()
        matcher = llguidance.LLMatcher(self._index, grammar)
        if matcher.is_error():
            raise RequestError(f"response_format: {matcher.get_error()[:500]}", param="response_format")
        return Grammar(matcher, after_token)


__all__ = ["Grammar", "GrammarCompiler"]
