"""RL tasks: one JSON object a line, a prompt and what its reward checks.

    {"prompt": "2 + 3 =", "answer": "5"}                                  text prompt, exact-match reward
    {"messages": [{"role": "user", "content": "..."}], "tools": [...],     chat prompt (the model's chat template,
     "tests": "assert add(2, 3) == 5"}                                      as the server renders it), unit tests
    {"messages": [...], "tools": [...], "environment": "env.py:lookup",   an agent's episode: each tool call answered
     "answer": "42"}                                                       by the function (rl/environment.py)

Any other fields travel with the task to a user's reward function. Bad lines are named (file:line and why) and
skipped; a file with no good line is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tokenizers import Tokenizer

from openflash.chat import chat_format
from openflash.chat.conversation import ChatOptions, Turn
from openflash.errors import OpenflashError
from openflash.files.jsonl import BadLine, jsonl_lines
from openflash.rl.environment import ToolEnvironment
from openflash.rl.user_code import import_function
from openflash.tokenizer import max_chars_per_token

log = logging.getLogger("openflash.rl")

MAX_NAMED = 20  # bad lines listed in the log (the count says how many more)


@dataclass(frozen=True)
class Task:
    where: str  # file:line
    prompt_ids: tuple[int, ...]  # what the model is given
    chat: bool  # rendered with the chat template: the reply's answer part is what `exact` compares
    fields: dict[str, Any] = field(default_factory=dict, hash=False)  # the line's object (answer, tests, ...)
    turns: tuple[Turn, ...] = ()  # a chat task's conversation, and its options (tools, thinking)
    options: ChatOptions = field(default_factory=ChatOptions, hash=False)
    environment: ToolEnvironment | None = field(default=None, hash=False)  # answers its tool calls

    @property
    def thinking(self) -> bool:
        """The chat prompt opened a reasoning part."""
        return self.options.thinking


def read_tasks(path: str | Path, tokenizer: Tokenizer, bos_token_id: int | None, eos_token_id: int | None,
               needs: str | None = None, max_prompt_tokens: int | None = None,
               tool_timeout: float = 5.0) -> list[Task]:
    """The good tasks of a JSONL file, each with its prompt tokenized; bad lines logged by place and skipped.
    needs: a field every task must have (the reward's: "answer" or "tests"); max_prompt_tokens: a longer prompt is
    a bad line; tool_timeout: seconds an environment's function may take a call. OpenflashError when none is good."""
    fmt = None
    tasks: list[Task] = []
    bad: list[str] = []
    environments: dict[str, ToolEnvironment] = {}  # each named function imported once
    # A text of n characters has at least n / bound tokens: an oversized prompt is refused before it is tokenized
    # (a 10 MB line would take minutes), where the tokenizer allows such a bound.
    bound = max_chars_per_token(tokenizer) if max_prompt_tokens is not None else None

    def encode(text: str) -> list[int]:
        try:
            text.encode("utf-8")  # (JSON allows escapes of lone surrogates; no tokenizer takes them)
        except UnicodeEncodeError as bad:
            raise OpenflashError(f"the prompt holds a lone UTF-16 surrogate (U+{ord(text[bad.start]):04X}) at "
                                 f"character {bad.start}, which is not text") from None
        if bound is not None and len(text) // bound > max_prompt_tokens:
            raise OpenflashError(f"the prompt is {len(text):,} characters, so at least {len(text) // bound:,} tokens, "
                                 f"past --max-prompt-tokens {max_prompt_tokens}")
        return tokenizer.encode(text, add_special_tokens=False).ids

    for where, record in jsonl_lines(path):
        try:
            if isinstance(record, BadLine):
                raise OpenflashError(record.problem)
            if not isinstance(record, dict):
                raise OpenflashError(f"expected a JSON object, got {type(record).__name__}")
            if needs is not None and needs not in record:
                raise OpenflashError(f"no {needs!r} field (the reward needs it)")
            turns, options = (), ChatOptions()
            if "prompt" in record:
                if not isinstance(record["prompt"], str) or not record["prompt"]:
                    raise OpenflashError("'prompt' must be a non-empty string")
                ids, chat = encode(record["prompt"]), False
            elif "messages" in record:
                if fmt is None:
                    fmt = chat_format(tokenizer, bos_token_id, eos_token_id)
                ids, turns, options = _chat_prompt(record, fmt, encode)
                chat = True
            else:
                raise OpenflashError("neither 'prompt' (text) nor 'messages' (chat)")
            if not ids:
                raise OpenflashError("the prompt is empty after tokenization")
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                raise OpenflashError(f"the prompt is {len(ids)} tokens, past --max-prompt-tokens {max_prompt_tokens}")
            environment = None
            if "environment" in record:
                if not (chat and options.tools) or fmt is None or fmt.name == "simple":
                    template = fmt.name if fmt is not None else "none: a text task"
                    raise OpenflashError("'environment' needs a chat task with 'tools' and a chat template with a "
                                         f"tool-call syntax (this model's is {template})")
                spec = record["environment"]
                if not isinstance(spec, str):
                    raise OpenflashError(f"'environment' must be a MODULE:FUNCTION string, got {spec!r}")
                if spec not in environments:
                    environments[spec] = ToolEnvironment(spec, import_function(spec, "'environment'"), tool_timeout)
                environment = environments[spec]
            tasks.append(Task(where, tuple(ids), chat, record, tuple(turns), options, environment))
        except OpenflashError as exc:
            bad.append(f"{where}: {exc}")
    if bad:
        more = f" (and {len(bad) - MAX_NAMED} more)" if len(bad) > MAX_NAMED else ""
        log.warning("%s: %d bad task line(s) skipped%s:\n  %s", path, len(bad), more, "\n  ".join(bad[:MAX_NAMED]))
    if not tasks:
        raise OpenflashError(f"{path}: no usable task" + (f" ({len(bad)} bad line(s), first: {bad[0]})" if bad else
                                                          " (the file is empty)"))
    return tasks


def _chat_prompt(record: dict[str, Any], fmt: Any, encode: Callable[[str], list[int]]
                 ) -> tuple[list[int], list[Turn], ChatOptions]:
    """A chat task's prompt: its messages (and tools) rendered as the server would for the next assistant turn,
    with the turns and options they were rendered from."""
    from openflash.train.chats import parse_conversation  # (the server's reading of messages, as chat data uses)

    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise OpenflashError("'messages' must be a non-empty list")
    # parse_conversation wants an assistant turn to train on; a task's conversation ends before the reply
    turns, options = parse_conversation({**record, "messages": messages + [{"role": "assistant", "content": "."}]},
                                        "the task")
    options = ChatOptions(thinking=bool(record.get("thinking", False)) and fmt.name != "simple", tools=options.tools)
    try:
        text = fmt.render(turns[:-1], options)
    except Exception as exc:  # RequestError: a conversation the template cannot render
        raise OpenflashError(f"messages: {exc}") from None
    return encode(text), turns[:-1], options
