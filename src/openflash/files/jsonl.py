"""JSON Lines: each record with its place (file:line), so a bad one is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from openflash.errors import OpenflashError


def jsonl_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, record) of each non-blank line of a UTF-8 JSONL file; OpenflashError naming the file, or the line
    that is not JSON."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise OpenflashError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise OpenflashError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        yield where, record
