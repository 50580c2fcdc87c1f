"""Byte-level BPE training, tokenizer loading and corpus walking (openflash.train.tokenizer)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from openflash.cli import main as cli_main
from openflash.errors import OpenflashError
from openflash.tokenizer import load_tokenizer, tokenizer_sha256
from openflash.train.tokenizer import (decode_text_bytes, iter_text_files, stdlib_source_dir, train_bpe_tokenizer,
                                       walk_sources)

CODE = '''import os\n\n\nclass Greeter:\n    """Says hello in several languages."""\n\n    def __init__(self, name: str) -> None:\n\tself.name = name  # tab-indented on purpose\n\n    def greet(self) -> str:\n        return f"Hello, {self.name}! Grüße, こんにちは, привет 👋"\n\n\ndef main():\n    for i in range(10):\n        print(Greeter(str(i)).greet())\n'''

ROUND_TRIP = [
    CODE,
    "def f(x):\r\n\treturn x  \t \r\n",
    "    leading spaces\n\n\n\ttabs\t\tinside\n   ",
    "naïve café — “quotes” ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 e\u0301 \u200b zero-width",
    "emoji 🧪🔥 and CJK 漢字 and RTL עברית",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("corpus")
    files = []
    for i in range(6):
        path = root / f"m{i}.py"
        path.write_text(CODE.replace("Greeter", f"Greeter{i}") * 3, encoding="utf-8")
        files.append(path)
    (root / "notes.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 40, encoding="utf-8")
    files.append(root / "notes.txt")
    return files


@pytest.fixture(scope="module")
def tok_file(corpus: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(corpus, 320, out)
    return out


def test_special_token_ids_and_vocab_size(tok_file: Path) -> None:
    tok = load_tokenizer(tok_file)
    assert [tok.id_to_token(i) for i in range(3)] == ["<|bos|>", "<|eos|>", "<|pad|>"]
    assert tok.token_to_id("<|bos|>") == 0 and tok.token_to_id("<|eos|>") == 1 and tok.token_to_id("<|pad|>") == 2
    assert tok.get_vocab_size(with_added_tokens=True) == 320
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    assert specials == {0, 1, 2}


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_exact(tok_file: Path, text: str) -> None:
    tok = load_tokenizer(tok_file)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert all(i >= 3 for i in ids)  # ordinary text never produces special ids
    assert tok.decode(ids) == text


def test_merges_compress_code(tok_file: Path) -> None:
    tok = load_tokenizer(tok_file)
    data = CODE.encode("utf-8")
    assert len(tok.encode(CODE).ids) < 0.8 * len(data)  # merges were learned: fewer tokens than bytes


def test_training_is_deterministic(corpus: list[Path], tok_file: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.json"
    train_bpe_tokenizer(corpus, 320, again)
    assert again.read_bytes() == tok_file.read_bytes()
    assert tokenizer_sha256(again) == tokenizer_sha256(tok_file)


def test_max_bytes_limits_training_text(corpus: list[Path], tmp_path: Path) -> None:
    one_file = len(corpus[0].read_bytes())
    a = train_bpe_tokenizer(corpus[:1], 320, tmp_path / "a.json")
    b = train_bpe_tokenizer(corpus, 320, tmp_path / "b.json", max_bytes=one_file)
    assert a.to_str() == b.to_str()


def test_vocab_too_small_rejected(corpus: list[Path], tmp_path: Path) -> None:
    with pytest.raises(OpenflashError, match="vocab_size=100 is too small.*259"):
        train_bpe_tokenizer(corpus, 100, tmp_path / "t.json")


def test_sha256_same_for_file_and_object(tok_file: Path) -> None:
    digest = tokenizer_sha256(tok_file)
    assert digest == tokenizer_sha256(load_tokenizer(tok_file)) == tokenizer_sha256(str(tok_file))
    assert len(digest) == 64


def test_load_folder_holding_tokenizer_json(tok_file: Path) -> None:
    assert tokenizer_sha256(load_tokenizer(tok_file.parent)) == tokenizer_sha256(tok_file)


def test_load_missing_and_invalid(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(OpenflashError, match="tokenizer file not found: .*nope.json"):
        load_tokenizer(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": "1.0", "model": 5}')
    with pytest.raises(OpenflashError, match="cannot load tokenizer .*bad.json"):
        load_tokenizer(bad)


def test_load_deepseek() -> None:
    tok = load_tokenizer("deepseek")
    assert tok.get_vocab_size(with_added_tokens=True) > 65535
    assert tok.id_to_token(0) == "<｜begin▁of▁sentence｜>"
    assert tok.id_to_token(1) == "<｜end▁of▁sentence｜>"
    assert tok.id_to_token(2) == "<｜▁pad▁｜>"
    assert tok.decode(tok.encode(CODE, add_special_tokens=False).ids) == CODE


def test_walk_sorted_patterns_and_skips(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for rel in ["b.py", "a.py", "z/c.py", "z/d.txt", "m/e.py", "m/ignored.bin", "__pycache__/x.py",
                ".git/y.py", "site-packages/pkg/z.py", "A.py"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    single = tmp_path / "single.bin"  # taken as is although it matches no pattern
    single.write_text("text\n")
    found = list(walk_sources([root, single], ["*.py", "*.txt"]))
    assert [f.rel for f in found] == ["A.py", "a.py", "b.py", "m/e.py", "z/c.py", "z/d.txt", "single.bin"]
    assert found[-1].path == single
    assert list(iter_text_files([root], ["*.txt"])) == [root / "z" / "d.txt"]
    with pytest.raises(OpenflashError, match="source not found: .*missing"):
        list(iter_text_files([tmp_path / "missing"], ["*.py"]))


def test_decode_text_bytes() -> None:
    assert decode_text_bytes("héllo\n".encode("utf-8")) == ("héllo\n", "utf-8")
    assert decode_text_bytes(b"\xef\xbb\xbfbom\n") == ("bom\n", "utf-8-sig")
    assert decode_text_bytes("caf\xe9 cr\xe8me\n".encode("latin-1")) == ("café crème\n", "latin-1")
    assert decode_text_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR") == (None, "binary")
    assert decode_text_bytes(bytes(range(1, 32)) * 10 + b"\xff") == (None, "binary")  # no NUL, mostly controls
    assert decode_text_bytes(b"") == (None, "empty")


def test_stdlib_source_dir() -> None:
    path = stdlib_source_dir()
    assert (path / "os.py").is_file() and (path / "json" / "__init__.py").is_file()


def test_cli_train(corpus: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.json"
    assert cli_main(["tokenizer", "train", str(corpus[0].parent), "--vocab-size", "300", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "vocab size 300" in printed and " s " in printed
    assert load_tokenizer(out).get_vocab_size() == 300
    from openflash.commands.train import tokenizer_train as cli_train
    with pytest.raises(OpenflashError, match="no files matching"):
        cli_train(argparse.Namespace(sources=[str(tmp_path)], vocab_size=300, out=str(out), glob="*.nothing"))
