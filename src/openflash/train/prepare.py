"""`openflash data prepare`: tokenize a corpus into the token-shard layout of train/dataset.py, resumably.

One file is one document: its tokens followed by eos (id 1). Documents go to train or val by a hash of their path
relative to the source folder and the seed, so the split does not depend on file order or on other files.

Resuming: work proceeds in units of files. After each unit the open shard and the offsets file are flushed and
`progress.json` records their committed lengths (written atomically). A re-run truncates the files back to those
lengths and continues, so an interrupted run ends byte-identical to an uninterrupted one. Full shards are renamed
from `.partial` to their final name (tmp + rename), so a final-named shard is always complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from openflash.errors import OpenflashError
from openflash.files.atomic import write_json_atomic
from openflash.tokenizer import load_tokenizer, resolve_tokenizer_path, tokenizer_sha256
from openflash.train.dataset import (FORMAT_VERSION, MANIFEST_FILE, SPLITS, TOKENIZER_FILE, Manifest, ShardInfo,
                                     SplitInfo, check_same_args, docs_name, shard_name, token_dtype)
from openflash.train.tokenizer import DEFAULT_PATTERNS, EOS_ID, SourceFile, read_text_file, walk_sources

PROGRESS_FILE = "progress.json"
LOCK_FILE = "prepare.lock"
DEFAULT_SHARD_TOKENS = 16 * 1024 * 1024
FILES_PER_UNIT = 64  # a unit ends after this many files or UNIT_BYTES of text, whichever comes first
UNIT_BYTES = 16 * 1024 * 1024
ENCODINGS = ("latin-1", "utf-8", "utf-8-sig")


ENCODE_CHARS = 1 << 20  # text per tokenizer call: the call holds ~125x its text (encodings, offsets, strings)
_PIECE_CUT = re.compile(r"\n(?=\S)")


def text_pieces(text: str, size: int = ENCODE_CHARS) -> list[str]:
    """`text` cut into pieces of at least `size` characters (the last may be shorter), each cut just after a newline
    that a non-space character follows. No pre-tokenizer of the byte-level BPE family (GPT-2's, DeepSeek's) joins
    text across such a point, so the pieces' tokens, concatenated, are the whole text's tokens."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = _PIECE_CUT.search(text, start + size)
        if cut is None:
            break
        pieces.append(text[start:cut.end()])
        start = cut.end()
    pieces.append(text[start:])
    return pieces


def encode_texts(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype,
                 chars: int = ENCODE_CHARS) -> list[np.ndarray]:
    """Each text's token ids, encoded in batches of at most `chars` characters of pieces (`text_pieces`), so
    memory stays bounded by that, not by the largest document."""
    parts: list[list[np.ndarray]] = [[] for _ in texts]
    batch: list[tuple[int, str]] = []

    def flush() -> None:
        encoded = tokenizer.encode_batch_fast([piece for _, piece in batch], add_special_tokens=False)
        for (doc, _), enc in zip(batch, encoded):
            parts[doc].append(np.array(enc.ids, dtype=dtype))
        batch.clear()

    size = 0
    for doc, text in enumerate(texts):
        for piece in text_pieces(text, chars):
            if batch and size + len(piece) > chars:
                flush()
                size = 0
            batch.append((doc, piece))
            size += len(piece)
    if batch:
        flush()
    return [np.concatenate(p) if p else np.zeros(0, dtype=dtype) for p in parts]


class PreparationStopped(Exception):
    """Raised by the `stop_after_files` test hook: the run stopped after committing that many files."""


def is_validation(rel_path: str, seed: int, val_fraction: float) -> bool:
    """Document-level split: a uniform number in [0, 1) from sha256(seed, relative path), below val_fraction."""
    digest = hashlib.sha256(f"{seed}\0{rel_path}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < val_fraction


# ---------------------------------------------------------------------------------------------------------------
# Writing one split's token stream


class SplitWriter:
    """Appends documents to one split's shards and offsets file; recovers them to a committed state on resume."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int, state: dict[str, int]):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.shard_index = state["shard_index"]
        self.shard_fill = state["shard_fill"]
        self.num_docs = state["num_docs"]
        self._recover()
        self._shard = open(self._partial(self.shard_index), "ab")
        self._docs = open(self._docs_partial(), "ab")

    @property
    def num_tokens(self) -> int:
        return self.shard_index * self.shard_tokens + self.shard_fill

    def state(self) -> dict[str, int]:
        return {"shard_index": self.shard_index, "shard_fill": self.shard_fill, "num_docs": self.num_docs}

    def _final(self, index: int) -> Path:
        return self.out_dir / shard_name(self.split, index)

    def _partial(self, index: int) -> Path:
        return self.out_dir / (shard_name(self.split, index) + ".partial")

    def _docs_partial(self) -> Path:
        return self.out_dir / (docs_name(self.split) + ".partial")

    def _recover(self) -> None:
        """Make the files on disk match the committed state, whatever an interruption left behind."""
        hint = "delete the folder and prepare again"
        full_bytes = self.shard_tokens * self.dtype.itemsize
        for i in range(self.shard_index):
            path = self._final(i)
            if not path.is_file() or path.stat().st_size != full_bytes:
                raise OpenflashError(f"cannot resume: shard {path} is missing or not {full_bytes} bytes; {hint}")
        _reclaim(self._partial(self.shard_index), self._final(self.shard_index),
                 self.shard_fill * self.dtype.itemsize, hint)
        _reclaim(self._docs_partial(), self.out_dir / docs_name(self.split), self.num_docs * 8, hint)
        for path in self.out_dir.glob(f"{self.split}_[0-9]*.bin*"):  # shards an interrupted unit started
            index = int(path.name[len(self.split) + 1:].split(".")[0])
            if index > self.shard_index:
                path.unlink()

    def add(self, tokens: np.ndarray) -> None:
        """Append one document (already ending with eos), splitting it across shards as needed."""
        self._docs.write(np.array([self.num_tokens], dtype="<i8").tobytes())
        self.num_docs += 1
        pos = 0
        while pos < len(tokens):
            take = min(len(tokens) - pos, self.shard_tokens - self.shard_fill)
            self._shard.write(tokens[pos:pos + take].tobytes())
            self.shard_fill += take
            pos += take
            if self.shard_fill == self.shard_tokens:
                self._fsync_close(self._shard)
                os.replace(self._partial(self.shard_index), self._final(self.shard_index))
                self.shard_index += 1
                self.shard_fill = 0
                self._shard = open(self._partial(self.shard_index), "wb")

    def sync(self) -> None:
        for f in (self._shard, self._docs):
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def _fsync_close(f: Any) -> None:
        f.flush()
        os.fsync(f.fileno())
        f.close()

    def close(self) -> None:
        self._shard.close()
        self._docs.close()

    def finish(self) -> SplitInfo:
        """Close the last shard (dropped if empty) and the offsets file (the total appended), giving final names."""
        self._docs.write(np.array([self.num_tokens], dtype="<i8").tobytes())
        self._fsync_close(self._docs)
        self._fsync_close(self._shard)
        count = self.shard_index
        if self.shard_fill > 0:
            os.replace(self._partial(self.shard_index), self._final(self.shard_index))
            count += 1
        else:
            self._partial(self.shard_index).unlink()
        os.replace(self._docs_partial(), self.out_dir / docs_name(self.split))
        shards = [ShardInfo(shard_name(self.split, i), self.shard_tokens) for i in range(count)]
        if self.shard_fill > 0:
            shards[-1].num_tokens = self.shard_fill
        return SplitInfo(self.num_tokens, self.num_docs, docs_name(self.split), shards)


def _reclaim(partial: Path, final: Path, length: int, hint: str) -> None:
    """Ensure `partial` exists holding exactly its committed `length` bytes (it may have been renamed to `final`
    by a unit or a finish that was interrupted before its progress was committed)."""
    if not partial.exists() and final.exists():
        os.replace(final, partial)
    elif final.exists():
        final.unlink()
    if not partial.exists():
        if length:
            raise OpenflashError(f"cannot resume: {partial} is missing; {hint}")
        partial.touch()
    if partial.stat().st_size < length:
        raise OpenflashError(f"cannot resume: {partial} holds {partial.stat().st_size} bytes, fewer than the "
                             f"{length} recorded in {PROGRESS_FILE}; {hint}")
    os.truncate(partial, length)


# ---------------------------------------------------------------------------------------------------------------
# Preparing a dataset


def _corpus_sha256(files: list[tuple[int, SourceFile]]) -> str:
    digest = hashlib.sha256()
    for index, f in files:
        digest.update(f"{index}\t{f.rel}\t{f.path.stat().st_size}\n".encode("utf-8"))
    return digest.hexdigest()


def check_eos(tokenizer: Tokenizer, path: Path) -> None:
    token = tokenizer.get_added_tokens_decoder().get(EOS_ID)
    if token is None or not token.special:
        raise OpenflashError(f"tokenizer {path}: id {EOS_ID} must be the end-of-sequence special token (ids follow the "
                             f"DeepSeek convention bos=0, eos=1, pad=2), found {tokenizer.id_to_token(EOS_ID)!r}")


def _check_fresh_dir(out_dir: Path) -> None:
    """Refuse to write into a folder that holds something other than our own (possibly interrupted) files."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise OpenflashError(f"output {out_dir} exists and is not a folder")
    ours = ("train_", "val_", PROGRESS_FILE, TOKENIZER_FILE, MANIFEST_FILE, LOCK_FILE)
    foreign = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith(ours))
    if foreign:
        raise OpenflashError(f"output folder {out_dir} is not empty and holds no dataset being prepared "
                             f"(found {', '.join(foreign[:3])}); choose an empty or new folder")


def _walk_indexed(sources: Sequence[str | Path], patterns: Sequence[str]) -> Iterator[tuple[int, SourceFile]]:
    for index, source in enumerate(sources):
        for f in walk_sources([source], patterns):
            yield index, f


def prepare_dataset(
    sources: Sequence[str | Path],
    tokenizer_spec: str | Path,
    out_dir: str | Path,
    val_fraction: float = 0.01,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    seed: int = 0,
    progress: bool = True,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    stop_after_files: int | None = None,
) -> Manifest:
    """Tokenize the text files under `sources` into `out_dir`; resumes an interrupted run; a finished one is a no-op.

    `stop_after_files` is a test hook: commit that many files, then raise PreparationStopped.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise OpenflashError(f"val_fraction={val_fraction} must be in [0, 1)")
    if shard_tokens <= 0:
        raise OpenflashError(f"shard_tokens={shard_tokens} must be positive")
    out_dir = Path(out_dir)
    tok_path = resolve_tokenizer_path(tokenizer_spec)
    tokenizer = load_tokenizer(tok_path)
    check_eos(tokenizer, tok_path)
    files = list(_walk_indexed(sources, patterns))
    if not files:
        raise OpenflashError(f"no files matching {','.join(patterns)} under {', '.join(map(str, sources))}")
    run_args = {
        "format_version": FORMAT_VERSION,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "sources": [str(Path(s).resolve()) for s in sources],
        "patterns": list(patterns),
        "val_fraction": float(val_fraction),
        "seed": int(seed),
        "shard_tokens": int(shard_tokens),
        "corpus_sha256": _corpus_sha256(files),
    }

    manifest_path = out_dir / MANIFEST_FILE
    if manifest_path.exists():
        manifest = Manifest.load(out_dir)
        check_same_args(manifest.run_args(), run_args, manifest_path)
        (out_dir / PROGRESS_FILE).unlink(missing_ok=True)  # left if a run died right after writing the manifest
        if progress:
            print(f"{out_dir}: already prepared ({manifest.splits['train'].num_tokens:,} train tokens); nothing to do")
        return manifest
    if not (out_dir / PROGRESS_FILE).exists():
        _check_fresh_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir):
        state = _start_or_resume(out_dir, run_args)
        start_time = time.perf_counter()
        infos, new_tokens = _tokenize(files, tokenizer, out_dir, state, progress, stop_after_files)
        seconds = time.perf_counter() - start_time
        manifest = _finish(out_dir, tok_path, tokenizer, files, state, infos)
        (out_dir / LOCK_FILE).unlink()
    if progress:
        _print_summary(manifest, out_dir, new_tokens, seconds)
    return manifest


@contextlib.contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the folder: two runs writing the same shards would corrupt each other."""
    with open(out_dir / LOCK_FILE, "a") as f:
        if fcntl is not None:  # POSIX; elsewhere the folder is not locked
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise OpenflashError(f"another `openflash data prepare` is writing to {out_dir} "
                                     f"(it holds the lock {out_dir / LOCK_FILE})") from exc
        yield


def _start_or_resume(out_dir: Path, run_args: dict[str, Any]) -> dict[str, Any]:
    """The progress record: read back (it must be for the same arguments) or started afresh."""
    path = out_dir / PROGRESS_FILE
    if path.exists():
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            check_same_args(state["args"], run_args, path)
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise OpenflashError(f"{path}: unreadable progress record ({exc}); delete the folder") from exc
        return state
    empty = {"shard_index": 0, "shard_fill": 0, "num_docs": 0}
    state = {"args": run_args, "files_done": 0, "encodings": {e: 0 for e in ENCODINGS}, "skipped": [],
             "splits": {s: dict(empty) for s in SPLITS}}
    write_json_atomic(path, state)
    return state


def _tokenize(files: list[tuple[int, SourceFile]], tokenizer: Tokenizer, out_dir: Path, state: dict[str, Any],
              progress: bool, stop_after_files: int | None) -> tuple[dict[str, SplitInfo], int]:
    """Tokenize the files not yet done, unit by unit, committing after each; returns the splits and new tokens."""
    args = state["args"]
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    # Special-token text inside the corpus (e.g. a literal "<|eos|>") is tokenized as ordinary text, so documents
    # never contain a stray eos.
    tokenizer.encode_special_tokens = True
    writers = {s: SplitWriter(out_dir, s, dtype, args["shard_tokens"], state["splits"][s]) for s in SPLITS}
    tokens_before = sum(w.num_tokens for w in writers.values())
    bar = tqdm(total=len(files), initial=state["files_done"], unit="file", desc="tokenizing", disable=not progress)
    try:
        done = state["files_done"]
        limit = len(files) if stop_after_files is None else min(len(files), stop_after_files)
        while done < len(files):
            if done >= limit:
                raise PreparationStopped(f"stopped after {done} files (stop_after_files)")
            # Read one unit of files.
            unit: list[tuple[SourceFile, str | None, str]] = []
            unit_bytes = 0
            while done + len(unit) < limit and len(unit) < FILES_PER_UNIT and unit_bytes < UNIT_BYTES:
                f = files[done + len(unit)][1]
                text, how = read_text_file(f.path)
                unit.append((f, text, how))
                unit_bytes += len(text) if text is not None else 0
            encodings = iter(encode_texts(tokenizer, [text for _, text, _ in unit if text is not None], dtype))
            for f, text, how in unit:
                if text is None:  # recorded by absolute path, so the record does not depend on the cwd
                    state["skipped"].append({"path": str(f.path.resolve()), "reason": how})
                    continue
                state["encodings"][how] += 1
                ids = np.append(next(encodings), np.array([EOS_ID], dtype=dtype))
                split = "val" if is_validation(f.rel, args["seed"], args["val_fraction"]) else "train"
                writers[split].add(ids)
            # Commit: data first, then the record of it.
            for w in writers.values():
                w.sync()
            done += len(unit)
            state["files_done"] = done
            state["splits"] = {s: w.state() for s, w in writers.items()}
            write_json_atomic(out_dir / PROGRESS_FILE, state)
            bar.update(len(unit))
            bar.set_postfix(tokens=f"{sum(w.num_tokens for w in writers.values()):,}", refresh=False)
        infos = {s: w.finish() for s, w in writers.items()}
    finally:
        bar.close()
        for w in writers.values():
            w.close()
    return infos, sum(info.num_tokens for info in infos.values()) - tokens_before


def _finish(out_dir: Path, tok_path: Path, tokenizer: Tokenizer, files: list[tuple[int, SourceFile]],
            state: dict[str, Any], infos: dict[str, SplitInfo]) -> Manifest:
    """Copy the tokenizer, write the manifest (the mark of a finished folder), drop the progress record."""
    shutil.copyfile(tok_path, out_dir / (TOKENIZER_FILE + ".tmp"))
    os.replace(out_dir / (TOKENIZER_FILE + ".tmp"), out_dir / TOKENIZER_FILE)
    by_reason: dict[str, int] = {}
    for item in state["skipped"]:
        key = item["reason"].split(" ")[0]
        by_reason[key] = by_reason.get(key, 0) + 1
    args = state["args"]
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        tokenizer_sha256=args["tokenizer_sha256"],
        tokenizer_file=TOKENIZER_FILE,
        vocab_size=vocab_size,
        eos_id=EOS_ID,
        dtype=token_dtype(vocab_size).name,
        shard_tokens=args["shard_tokens"],
        sources=args["sources"],
        patterns=args["patterns"],
        val_fraction=args["val_fraction"],
        seed=args["seed"],
        corpus_sha256=args["corpus_sha256"],
        num_files=len(files),
        encodings=state["encodings"],
        skipped={"count": len(state["skipped"]), "by_reason": dict(sorted(by_reason.items())),
                 "files": state["skipped"]},
        splits=infos,
    )
    write_json_atomic(out_dir / MANIFEST_FILE, manifest.to_dict())
    (out_dir / PROGRESS_FILE).unlink()
    (out_dir / (PROGRESS_FILE + ".tmp")).unlink(missing_ok=True)  # a write cut short by an earlier interruption
    return manifest


def _print_summary(m: Manifest, out_dir: Path, new_tokens: int, seconds: float) -> None:
    train, val = m.splits["train"], m.splits["val"]
    print(f"prepared {out_dir}: train {train.num_tokens:,} tokens / {train.num_docs:,} docs in {len(train.shards)} "
          f"shard(s), val {val.num_tokens:,} tokens / {val.num_docs:,} docs ({m.dtype}, vocab {m.vocab_size:,})")
    print(f"tokenized {new_tokens:,} tokens in {seconds:.1f} s ({new_tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    latin = m.encodings.get("latin-1", 0)
    if latin:
        print(f"{latin} file(s) were not UTF-8 and were read as latin-1")
    if m.skipped["count"]:
        reasons = ", ".join(f"{k} {v}" for k, v in m.skipped["by_reason"].items())
        print(f"skipped {m.skipped['count']} file(s): {reasons}")
        for item in m.skipped["files"][:10]:
            if item["reason"] != "empty":
                print(f"  {item['path']}: {item['reason']}")
    if val.num_tokens == 0 and m.val_fraction > 0:
        print("warning: no document fell into the validation split; use more files or a larger --val-fraction")
