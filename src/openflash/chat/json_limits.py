"""Bounds on the JSON a request carries: how deep it may nest, and a walk of it that costs no recursion.

Python's parser, json.dumps and any recursive walk fail with RecursionError near 1,000 levels; a request is refused
well before that, with the field named (serve/protocol.py for the body, conversation.py for arguments sent as text).
"""

from __future__ import annotations

from typing import Any, Iterator

MAX_JSON_DEPTH = 64  # deepest nesting a request body may have (tool schemas and arguments included)


def walk_json(value: Any, path: str = "") -> Iterator[tuple[str, int, Any]]:
    """Every value of a decoded JSON document in document order: (field path, depth, value). Iterative, so a
    hostile document's depth costs no recursion."""
    stack: list[tuple[str, int, Any]] = [(path, 0, value)]
    while stack:
        where, depth, item = stack.pop()
        yield where, depth, item
        if isinstance(item, dict):
            children = list(item.items())
        elif isinstance(item, (list, tuple)):
            children = list(enumerate(item))
        else:
            continue
        for key, child in reversed(children):
            stack.append((f"{where}.{key}" if where else str(key), depth + 1, child))


def short_path(path: str, parts: int = 8) -> str:
    """A field path cut after `parts` components (a deeply nested one would fill the error message)."""
    pieces = path.split(".")
    return path if len(pieces) <= parts else ".".join(pieces[:parts]) + f"...({len(pieces) - parts} more levels)"
