"""The simple chat format: for models trained here with their own tokenizer (or a preset's cut of DeepSeek's).

    {bos}{system}\\n\\n## Tools\\n{schema per line}<｜User｜>{user}<｜Assistant｜>{answer}{eos}
    <｜User｜>[tool result call_1]\\n{result}<｜Assistant｜>

The DeepSeek-V3-style role markers; for a small tokenizer they are ordinary text, BOS / EOS are the tokenizer's own
(a tokenizer trained here calls them <|bos|> / <|eos|>). System messages are joined after BOS. Tools, earlier tool
calls and tool results are rendered as plain text, so a conversation that used tools elsewhere still fits. No
model trained here learnt to call tools or to think: its completions are answer text, never parsed for calls, and
requests that need either (tool_choice required / named, thinking, reasoning_effort) are refused.
"""

from __future__ import annotations

import json
from typing import Sequence

from tokenizers import Tokenizer

from openflash.chat.completion import CompletionParser
from openflash.chat.conversation import ChatOptions, Forcing, Turn
from openflash.errors import RequestError

USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"


class SimpleFormat:
    name = "simple"

    def __init__(self, tokenizer: Tokenizer, bos_token_id: int | None, eos_token_id: int | None) -> None:
        bos = tokenizer.id_to_token(bos_token_id) if bos_token_id is not None else None
        eos = tokenizer.id_to_token(eos_token_id) if eos_token_id is not None else None
        self.bos, self.eos = bos or "", eos or ""

    def check(self, options: ChatOptions) -> None:
        if options.thinking or options.reasoning_effort is not None:
            param = "reasoning_effort" if options.reasoning_effort is not None else "chat_template_kwargs.thinking"
            raise RequestError("this model's chat template (simple) has no thinking mode; thinking and "
                               "reasoning_effort need a model with the released DeepSeek-V4.1 vocabulary", param=param)
        if options.tools_on and options.tool_choice in ("required", "named"):
            raise RequestError(f"tool_choice {options.tool_choice!r} needs a chat template with a tool-call syntax; "
                               f"this model's (simple) renders tools as text only", param="tool_choice")

    def render(self, turns: Sequence[Turn], options: ChatOptions) -> str:
        system = [t.text for t in turns if t.role == "system"]
        if options.tools_on:
            system.append("## Tools\n" + "\n".join(json.dumps(t.schema(), ensure_ascii=False)
                                                   for t in options.tools))
        out = [self.bos, "\n\n".join(system)]
        for turn in turns:
            if turn.role == "user":
                out.append(USER + turn.text)
            elif turn.role == "tool":
                out.append(f"{USER}[tool result {turn.tool_call_id or ''}]\n{turn.text}")
            elif turn.role == "assistant":
                out.append(ASSISTANT + self.reply_text(turn, options))
        return "".join(out) + ASSISTANT

    def reply_text(self, turn: Turn, options: ChatOptions) -> str:
        """What the model writes for `turn` after the prompt `render` gives for the turns before it, EOS included
        (supervised fine-tuning trains on exactly this)."""
        calls = "".join(f"\n[tool call {c.id}] {c.name} {c.arguments}" for c in turn.tool_calls)
        return turn.text + calls + self.eos

    def parser(self, options: ChatOptions) -> CompletionParser:
        return CompletionParser(thinking=False)

    def answer_after(self, options: ChatOptions) -> int | None:
        return None  # (no thinking mode: check() refuses it)

    def forcing(self, options: ChatOptions) -> Forcing | None:
        return None  # `check` refused tool_choice required / named
