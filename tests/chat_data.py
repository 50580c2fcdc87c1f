"""Chat records for the fine-tuning tests: a few arithmetic conversations and one tool call, as JSONL lines."""

from __future__ import annotations

import json
from pathlib import Path

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Find a value.",
                                         "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}


def chats(n: int) -> list[dict]:
    out = []
    for i in range(n):
        out.append({"messages": [{"role": "system", "content": "You answer in one line."},
                                 {"role": "user", "content": f"What is {i} plus {i}?"},
                                 {"role": "assistant", "content": f"ANSWER: {2 * i}"},
                                 {"role": "user", "content": "And times two?"},
                                 {"role": "assistant", "content": f"ANSWER: {4 * i}"}]})
    out.append({"tools": [TOOL], "messages": [
        {"role": "user", "content": "Look up x."},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"key\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x = 1"},
        {"role": "assistant", "content": "x is 1."}]})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path
