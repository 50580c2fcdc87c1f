"""`openflash demo` end to end on the tiny preset: stages, caching, continuing with a larger budget, generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openflash.cli import main as cli_main
from openflash.files.run_dir import latest_checkpoint
from openflash.tools.demo import DemoConfig, run_demo, select_corpus
from openflash.train.prepare import is_validation


def make_corpus(folder: Path) -> Path:
    """Small Python files; names chosen so that a few land in the validation split (val_fraction 0.2, seed 0)."""
    folder.mkdir(parents=True)
    names, i = [], 0
    while len(names) < 12 or sum(is_validation(n, 0, 0.2) for n in names) < 2:
        names.append(f"mod_{i:03d}.py")
        i += 1
    for k, name in enumerate(names):
        body = "".join(f"def step_{k}_{j}(x, y={j}):\n    total = x + y * {j}\n    for i in range(total):\n"
                       f"        if i % {j + 2} == 0:\n            yield i\n    return total\n\n" for j in range(12))
        (folder / name).write_text(f"import os\nimport sys\n\n\nclass Thing{k}:\n    pass\n\n\n" + body)
    (folder / "notes.bin").write_bytes(b"\x00\x01binary")  # not matched by the patterns
    return folder


def _config(tmp_path: Path, corpus: Path, minutes: float) -> DemoConfig:
    return DemoConfig(preset="tiny", minutes=minutes, run_dir=tmp_path / "run", corpus=corpus, batch_size=4,
                      seq_len=32, prompts=("def fibonacci(n):", "class Stack:"), max_new_tokens=6)


def test_demo_stages_cache_and_continue(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    first = run_demo(_config(tmp_path, corpus, minutes=0.04))
    out = capsys.readouterr().out
    for stage in ("[1/5] corpus", "[2/5] tokenizer: byte-level BPE", "[3/5] dataset", "[4/5] training: 'tiny' preset",
                  "[5/5] generation", "validation loss:", "----- 'def fibonacci(n):'", "tokens/s decode"):
        assert stage in out, stage
    assert first["val_loss_after"] < first["val_loss_before"]
    assert first["steps"] >= 1 and len(first["samples"]) == 2
    assert all(s["tokens"] >= 1 and s["decode_tokens_per_s"] > 0 for s in first["samples"])
    assert "class Stack:" + first["samples"][1]["completion"] in out
    ckpt = latest_checkpoint(tmp_path / "run" / "train")
    assert ckpt is not None and (ckpt / "model.safetensors").is_file()

    # Same budget again: every stage comes from the cache, generation still runs (and is reproducible).
    second = run_demo(_config(tmp_path, corpus, minutes=0.04))
    out = capsys.readouterr().out
    assert "[2/5] tokenizer: cached" in out and "(cached)" in out and "[4/5] training: cached" in out
    assert latest_checkpoint(tmp_path / "run" / "train") == ckpt
    assert second["samples"] == first["samples"] or all(  # decode speed differs between runs
        a["completion"] == b["completion"] for a, b in zip(first["samples"], second["samples"]))

    # A larger budget continues the same run from its checkpoint.
    # (the budget is set from what the first run trained, so a slow first step cannot use it all up)
    from openflash.files.run_dir import read_trainer_state
    trained = float(read_trainer_state(ckpt)["trained_seconds"])
    third = run_demo(_config(tmp_path, corpus, minutes=(trained + 4.0) / 60))
    out = capsys.readouterr().out
    assert f"[4/5] training: continuing from {ckpt.name}" in out
    assert third["steps"] > first["steps"]
    assert latest_checkpoint(tmp_path / "run" / "train").name != ckpt.name
    lines = [json.loads(x) for x in (tmp_path / "run" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lines if "event" in r] == ["start", "resume"]


def test_select_corpus_is_deterministic_and_bounded(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    (corpus / "test").mkdir()
    (corpus / "test" / "test_x.py").write_text("assert True\n")
    chosen = select_corpus(corpus, max_bytes=3000, patterns=("*.py",))
    assert chosen == select_corpus(corpus, max_bytes=3000, patterns=("*.py",))
    assert 1 <= len(chosen) < 12 and all(p.suffix == ".py" and "test" not in p.parts[-2:-1] for p in chosen)
    assert sum(p.stat().st_size for p in chosen[:-1]) < 3000 or len(chosen) == 1


def test_cli_demo_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["demo", "--preset", "tiny", "--minutes", "0", "--run-dir", str(tmp_path / "r")]) == 2
    assert "--minutes must be positive" in capsys.readouterr().err
    assert cli_main(["demo", "--preset", "tiny", "--corpus", str(tmp_path / "missing"),
                     "--run-dir", str(tmp_path / "r")]) == 2
    assert "not a folder" in capsys.readouterr().err
