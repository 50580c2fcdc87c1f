"""Tokenizers for training: a small byte-level BPE for the small presets, or the official DeepSeek one.

The special-token ids follow the DeepSeek convention (architecture.md, root `bos/eos/pad_token_id` = 0 / 1 / 2), so a
small model trained with our tokenizer uses the same ids as the real one; the Engram pad slot relies on id 2.

Text files are found and read here too (`iter_text_files`, `read_text_file`) because both tokenizer training and
`openflash data prepare` walk the same corpora the same way.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from openflash.errors import OpenflashError

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # the trainer assigns ids in this order: 0, 1, 2
NUM_BYTES = 256  # byte-level alphabet: every byte has a token, so any text encodes
DEFAULT_PATTERNS = ("*.py", "*.txt", "*.md")

# Directories never walked into: caches, VCS metadata and installed third-party packages (the interpreter's stdlib
# folder holds site-packages, which is not part of the demo corpus and can be far larger than the stdlib itself).
SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
BINARY_SNIFF_BYTES = 8192
MAX_CONTROL_FRACTION = 0.05  # more control bytes than this and a non-UTF-8 file is treated as binary


# ---------------------------------------------------------------------------------------------------------------
# Finding and reading text files


@dataclass(frozen=True)
class SourceFile:
    """A corpus file: where it is, and its path relative to the source it was found under (used for the split)."""

    path: Path
    rel: str  # posix path relative to the source folder; the file name for a file given directly


def walk_sources(sources: Sequence[str | Path], patterns: Sequence[str]) -> Iterator[SourceFile]:
    """Files given directly as is; folders walked recursively, matching patterns, in sorted order (deterministic)."""
    for source in sources:
        root = Path(source)
        if root.is_file():
            yield SourceFile(root, root.name)
        elif root.is_dir():
            found: list[str] = []
            for dirpath, dirnames, filenames in os.walk(root):  # does not follow symlinked folders: no cycles
                dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
                base = Path(dirpath).relative_to(root)
                for name in filenames:
                    if not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns):
                        found.append((base / name).as_posix())
            for rel in sorted(found):
                path = root / rel
                if path.is_file():  # skips dangling symlinks and other non-files
                    yield SourceFile(path, rel)
        else:
            raise OpenflashError(f"source not found: {root} (expected a text file or a folder)")


def iter_text_files(sources: Sequence[str | Path], patterns: Sequence[str]) -> Iterator[Path]:
    """Paths of the corpus files under `sources` (see `walk_sources`)."""
    for item in walk_sources(sources, patterns):
        yield item.path


def parse_patterns(glob: str) -> list[str]:
    """The CLI's comma-separated --glob value as a list of patterns."""
    return [p.strip() for p in glob.split(",") if p.strip()]


def decode_text_bytes(data: bytes) -> tuple[str | None, str]:
    """Decode file bytes as text. Returns (text, encoding) or (None, reason it is not text).

    Order: UTF-8 (a leading BOM is stripped, 'utf-8-sig'), then latin-1, but latin-1 only when the bytes look like
    text; latin-1 maps every byte to a character, so without that check binary files would pass as text.
    """
    if not data:
        return None, "empty"
    if b"\x00" in data[:BINARY_SNIFF_BYTES]:
        return None, "binary"
    if data.startswith(b"\xef\xbb\xbf"):
        try:
            return data.decode("utf-8-sig"), "utf-8-sig"
        except UnicodeDecodeError:
            pass
    else:
        try:
            return data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            pass
    sample = data[:BINARY_SNIFF_BYTES]
    controls = sum(1 for b in sample if (b < 0x20 and b not in b"\t\n\r\f\v") or b == 0x7F)
    if controls > MAX_CONTROL_FRACTION * len(sample):
        return None, "binary"
    return data.decode("latin-1"), "latin-1"


def read_text_file(path: Path) -> tuple[str | None, str]:
    """Read and decode one file. Returns (text, encoding) or (None, reason); reasons: empty, binary, unreadable."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    return decode_text_bytes(data)


def stdlib_source_dir() -> Path:
    """The running interpreter's standard-library source folder: a demo corpus that needs no download."""
    path = Path(sysconfig.get_paths()["stdlib"])
    if not (path / "os.py").is_file():
        raise OpenflashError(f"the Python standard library source is not at {path} (no os.py there); pass a corpus folder")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Training and loading


def train_bpe_tokenizer(files: list[Path], vocab_size: int, out: Path, max_bytes: int | None = None) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `files` and save it as tokenizer.json at `out`.

    Specials get ids bos=0, eos=1, pad=2; then the 256 byte tokens; then merges. No normalizer, and a byte-level
    decoder, so decode(encode(text)) == text exactly. Files are fed in the given order (training is deterministic).
    `max_bytes` stops reading after that many bytes of files (whole files; a subset of a large corpus).
    """
    min_size = len(SPECIAL_TOKENS) + NUM_BYTES
    if vocab_size < min_size:
        raise OpenflashError(f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs at least {min_size} "
                             f"({len(SPECIAL_TOKENS)} special tokens + {NUM_BYTES} bytes)")
    if not files:
        raise OpenflashError("no files to train the tokenizer on")

    def texts() -> Iterator[str]:
        total = 0
        for path in files:
            if max_bytes is not None and total >= max_bytes:
                return
            text, _ = read_text_file(Path(path))
            if text is not None:
                total += len(text.encode("utf-8"))
                yield text

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    for token, want in zip(SPECIAL_TOKENS, (BOS_ID, EOS_ID, PAD_ID)):
        got = tokenizer.token_to_id(token)
        if got != want:  # a change in the tokenizers library, not a user error
            raise RuntimeError(f"special token {token} got id {got}, expected {want}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tokenizer.save(str(tmp), pretty=True)
    os.replace(tmp, out)
    return tokenizer
