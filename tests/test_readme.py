"""The README's "Use from Python" block runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_the_python_example_runs(capsys):
    section = README.read_text().split("## Use from Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) >= 2 and re.fullmatch(r"\d+ Engram steps; loss \d+\.\d\d", printed[-1])
    assert int(printed[-1].split()[0]) >= 10  # the generation's steps and the two steps after it
