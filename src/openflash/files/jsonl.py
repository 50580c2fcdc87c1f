"""JSON Lines: each record with its place (file:line), so a bad one is refused by name.

Lines end at "\\n" alone (JSON Lines' rule): U+2028, U+2029 and U+0085 are ordinary characters inside a JSON
string, although Python's `str.splitlines` would cut there. The file is read a line at a time, and a line longer
than the limit is refused by its length before it is decoded or parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from openflash.errors import OpenflashError

MAX_LINE_BYTES = 16 << 20  # one record: a conversation of millions of tokens, far past any context


@dataclass(frozen=True)
class BadLine:
    """A line that is not a JSON record: where it is and why."""

    where: str
    problem: str

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


def jsonl_lines(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[str, Any | BadLine]]:
    """(where, record) of each non-blank line of a UTF-8 JSONL file, or (where, BadLine) for a line that is too
    long, not UTF-8 or not JSON, so a caller can name every bad line; OpenflashError for a file it cannot read."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise OpenflashError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    with f:
        for n, raw in enumerate(f, start=1):
            where = f"{path}:{n}"
            if len(raw) > max_line_bytes:
                yield where, BadLine(where, f"{len(raw):,} bytes, over the limit of {max_line_bytes:,} per line")
                continue
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadLine(where, f"not UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, BadLine(where, f"not JSON ({exc.msg} at column {exc.colno})")
            except RecursionError:
                yield where, BadLine(where, "JSON nested too deeply to read")


def jsonl_records(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[str, Any]]:
    """(where, record) of each non-blank line; OpenflashError naming the first line that is not a record."""
    for where, record in jsonl_lines(path, max_line_bytes):
        if isinstance(record, BadLine):
            raise OpenflashError(str(record))
        yield where, record
