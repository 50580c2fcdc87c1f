"""Prepared token datasets: the folder layout and its manifest, and reading it back as batches.

Layout of a prepared folder (`openflash data prepare`):

    manifest.json         format version, arguments, counts, shard list (written last: its presence means "done")
    tokenizer.json        a copy of the tokenizer used, so later steps need no separate path
    train_00000.bin ...   flat little-endian token ids (uint16, or uint32 when the vocabulary exceeds 65535)
    train_docs.bin        little-endian int64 document start offsets into the split's token stream, plus the total
    val_00000.bin, val_docs.bin
    progress.json, prepare.lock, *.partial   only while a run is unfinished

Preparation (tokenizing a corpus into this layout, one document per file, resumably) is train/prepare.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from openflash.errors import OpenflashError

FORMAT_VERSION = 1
SPLITS = ("train", "val")
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
# The arguments a prepared folder is tied to; a re-run with any of them different is refused.
RUN_ARG_FIELDS = ("format_version", "tokenizer_sha256", "sources", "patterns", "val_fraction", "seed",
                  "shard_tokens", "corpus_sha256")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


def docs_name(split: str) -> str:
    return f"{split}_docs.bin"


def mask_name(split: str, index: int) -> str:
    """The loss-mask shard beside token shard `index` (one byte a token: 1 = trained on)."""
    return shard_name(f"{split}_mask", index)


# ---------------------------------------------------------------------------------------------------------------
# Manifest


@dataclass
class ShardInfo:
    file: str
    num_tokens: int


@dataclass
class SplitInfo:
    num_tokens: int
    num_docs: int
    docs_file: str  # int64 offsets, num_docs + 1 entries
    shards: list[ShardInfo]


@dataclass
class Manifest:
    format_version: int
    tokenizer_sha256: str
    tokenizer_file: str
    vocab_size: int
    eos_id: int
    dtype: str  # numpy name: "uint16" or "uint32" (little-endian on disk)
    shard_tokens: int
    sources: list[str]
    patterns: list[str]
    val_fraction: float
    seed: int
    corpus_sha256: str  # of (source index, relative path, size) of every file: a changed corpus is noticed
    num_files: int
    encodings: dict[str, int]  # documents per text encoding
    skipped: dict[str, Any]  # {"count": n, "by_reason": {reason: n}, "files": [{"path", "reason"}]}
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    loss_mask: bool = False  # chat data (train/chats.py): {split}_mask_NNNNN.bin beside each token shard
    chat_template: str = ""  # the chat format its conversations were rendered with

    def run_args(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RUN_ARG_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def load(cls, data_dir: str | Path) -> "Manifest":
        path = Path(data_dir) / MANIFEST_FILE
        if not path.is_file():
            raise OpenflashError(f"no prepared dataset in {data_dir}: {path} not found (run `openflash data prepare`)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise OpenflashError(f"{path}: not readable JSON ({exc})") from exc
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: Any, path: Path) -> "Manifest":
        def get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
            if not isinstance(obj, dict) or key not in obj:
                raise OpenflashError(f"{path}: field '{where}{key}' is missing")
            value = obj[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise OpenflashError(f"{path}: field '{where}{key}' has the wrong type ({type(value).__name__})")
            return value

        version = get(raw, "format_version", int, "")
        if version != FORMAT_VERSION:
            raise OpenflashError(f"{path}: format_version {version} is not supported (expected {FORMAT_VERSION})")
        dtype = get(raw, "dtype", str, "")
        if dtype not in ("uint16", "uint32"):
            raise OpenflashError(f"{path}: field 'dtype' must be uint16 or uint32, got {dtype!r}")
        splits: dict[str, SplitInfo] = {}
        raw_splits = get(raw, "splits", dict, "")
        for split in SPLITS:
            s = get(raw_splits, split, dict, "splits.")
            where = f"splits.{split}."
            shards = []
            for i, sh in enumerate(get(s, "shards", list, where)):
                shards.append(ShardInfo(get(sh, "file", str, f"{where}shards[{i}]."),
                                        get(sh, "num_tokens", int, f"{where}shards[{i}].")))
            info = SplitInfo(get(s, "num_tokens", int, where), get(s, "num_docs", int, where),
                             get(s, "docs_file", str, where), shards)
            if sum(sh.num_tokens for sh in shards) != info.num_tokens:
                raise OpenflashError(f"{path}: field '{where}num_tokens' ({info.num_tokens}) is not the sum of its "
                                     f"shards' num_tokens ({sum(sh.num_tokens for sh in shards)})")
            splits[split] = info
        return cls(
            format_version=version,
            tokenizer_sha256=get(raw, "tokenizer_sha256", str, ""),
            tokenizer_file=get(raw, "tokenizer_file", str, ""),
            vocab_size=get(raw, "vocab_size", int, ""),
            eos_id=get(raw, "eos_id", int, ""),
            dtype=dtype,
            shard_tokens=get(raw, "shard_tokens", int, ""),
            sources=get(raw, "sources", list, ""),
            patterns=get(raw, "patterns", list, ""),
            val_fraction=get(raw, "val_fraction", (int, float), ""),
            seed=get(raw, "seed", int, ""),
            corpus_sha256=get(raw, "corpus_sha256", str, ""),
            num_files=get(raw, "num_files", int, ""),
            encodings=get(raw, "encodings", dict, ""),
            skipped=get(raw, "skipped", dict, ""),
            splits=splits,
            loss_mask=get(raw, "loss_mask", bool, "") if "loss_mask" in raw else False,
            chat_template=get(raw, "chat_template", str, "") if "chat_template" in raw else "",
        )


def check_same_args(recorded: dict[str, Any], wanted: dict[str, Any], where: Path) -> None:
    diffs = [f"{k} (was {recorded.get(k)!r}, now {wanted[k]!r})" for k in RUN_ARG_FIELDS if recorded.get(k) != wanted[k]]
    if diffs:
        raise OpenflashError(f"{where} was prepared with different arguments: {'; '.join(diffs)}. "
                             f"Use a new --out folder, or delete this one to start over")



# ---------------------------------------------------------------------------------------------------------------
# Reading a prepared dataset


class TokenDataset:
    """One split of a prepared folder as a single token stream over memory-mapped shards."""

    def __init__(self, data_dir: str | Path, split: str):
        if split not in SPLITS:
            raise OpenflashError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.data_dir = Path(data_dir)
        self.split = split
        self.manifest = Manifest.load(self.data_dir)
        info = self.manifest.splits[split]
        self.dtype = np.dtype(self.manifest.dtype).newbyteorder("<")
        self._shards: list[np.memmap] = []
        for shard in info.shards:
            path = self.data_dir / shard.file
            want = shard.num_tokens * self.dtype.itemsize
            if not path.is_file():
                raise OpenflashError(f"shard {path} listed in {MANIFEST_FILE} is missing")
            if path.stat().st_size != want or shard.num_tokens == 0:
                raise OpenflashError(f"shard {path} is {path.stat().st_size} bytes; {MANIFEST_FILE} says "
                                     f"{shard.num_tokens} tokens ({want} bytes)")
            self._shards.append(np.memmap(path, dtype=self.dtype, mode="r"))
        self._masks: list[np.memmap] = []
        for i, shard in enumerate(info.shards if self.manifest.loss_mask else ()):
            path = self.data_dir / mask_name(split, i)
            if not path.is_file() or path.stat().st_size != shard.num_tokens:
                raise OpenflashError(f"loss mask {path} is missing or not {shard.num_tokens} bytes (one per token of "
                                     f"{shard.file})")
            self._masks.append(np.memmap(path, dtype=np.uint8, mode="r"))
        # starts[i] is the stream position of shard i's first token; starts[-1] is the total.
        self._starts = np.concatenate([[0], np.cumsum([s.num_tokens for s in info.shards], dtype=np.int64)])
        self.num_tokens = int(info.num_tokens)
        self.num_docs = int(info.num_docs)
        docs_path = self.data_dir / info.docs_file
        if not docs_path.is_file() or docs_path.stat().st_size != (self.num_docs + 1) * 8:
            raise OpenflashError(f"document offsets {docs_path} are missing or not {(self.num_docs + 1) * 8} bytes "
                                 f"({self.num_docs} docs in {MANIFEST_FILE})")
        self.doc_offsets = np.memmap(docs_path, dtype="<i8", mode="r")  # doc i is tokens [o[i], o[i+1])

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def tokenizer_sha256(self) -> str:
        return self.manifest.tokenizer_sha256

    @property
    def tokenizer_path(self) -> Path:
        return self.data_dir / self.manifest.tokenizer_file

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def loss_mask(self) -> bool:
        """Whether only some tokens are trained on (chat data: the replies)."""
        return bool(self._masks)

    def read(self, start: int, length: int, masks: bool = False) -> np.ndarray:
        """Tokens [start, start+length) of the stream as int64, across shard boundaries (masks: their loss-mask
        bytes instead)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) is outside the {self.num_tokens} tokens of "
                             f"{self.data_dir} ({self.split})")
        source = self._masks if masks else self._shards
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        while filled < length:
            offset = start + filled - int(self._starts[shard])
            take = min(length - filled, len(source[shard]) - offset)
            out[filled:filled + take] = source[shard][offset:offset + take]
            filled += take
            shard += 1
        return out


def _windows(dataset: TokenDataset, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of windows of seq_len + 1 tokens; with a loss mask, targets not trained on are -100 (the
    cross-entropy's ignore index)."""
    rows = np.stack([dataset.read(int(s), seq_len + 1) for s in starts]) if len(starts) else \
        np.empty((0, seq_len + 1), dtype=np.int64)
    tokens = torch.from_numpy(rows)
    targets = tokens[:, 1:].clone()
    if dataset.loss_mask and len(starts):
        mask = np.stack([dataset.read(int(s) + 1, seq_len, masks=True) for s in starts])
        targets[torch.from_numpy(mask) == 0] = -100
    return tokens[:, :-1].contiguous(), targets


class BatchLoader:
    """Random contiguous windows of seq_len + 1 tokens; batch t depends only on (seed, t), so it resumes exactly.

    Data parallel: the global batch at step t is the same for every world_size; rank r takes rows
    [r * b / ws, (r + 1) * b / ws), so 1-process and N-process training see the same sequences.
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, seq_len: int, seed: int, rank: int = 0,
                 world_size: int = 1):
        if batch_size <= 0 or seq_len <= 0:
            raise OpenflashError(f"batch_size={batch_size} and seq_len={seq_len} must be positive")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise OpenflashError(f"rank={rank} must be in [0, world_size={world_size})")
        if batch_size % world_size:
            raise OpenflashError(f"batch_size={batch_size} is not divisible by world_size={world_size}")
        if seed < 0:
            raise OpenflashError(f"seed={seed} must be non-negative")
        if dataset.num_tokens < seq_len + 1:
            raise OpenflashError(f"{dataset.data_dir} ({dataset.split}) has {dataset.num_tokens} tokens, fewer than "
                                 f"one window of seq_len + 1 = {seq_len + 1}")
        self.dataset, self.batch_size, self.seq_len = dataset, batch_size, seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.step = 0

    def global_starts(self, step: int) -> np.ndarray:
        """Window start positions of the whole global batch at `step`."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, step])))
        return rng.integers(0, self.dataset.num_tokens - self.seq_len, size=self.batch_size, dtype=np.int64)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each LongTensor [batch_size / world_size, seq_len], of this rank at `step`."""
        per_rank = self.batch_size // self.world_size
        starts = self.global_starts(step)[self.rank * per_rank:(self.rank + 1) * per_rank]
        return _windows(self.dataset, starts, self.seq_len)

    def __iter__(self) -> "BatchLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "step": self.step, "num_tokens": self.dataset.num_tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "step"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise OpenflashError(f"data loader state: '{key}' is missing or not a non-negative int ({state!r})")
        if "num_tokens" in state and state["num_tokens"] != self.dataset.num_tokens:
            raise OpenflashError(f"data loader state was saved for a dataset of {state['num_tokens']} tokens, but "
                                 f"{self.dataset.data_dir} ({self.dataset.split}) has {self.dataset.num_tokens}")
        self.seed, self.step = state["seed"], state["step"]


def eval_batches(dataset: TokenDataset, batch_size: int, seq_len: int,
                 max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed evaluation set: consecutive non-overlapping windows from the start of the stream (window i predicts
    tokens i*seq_len+1 .. (i+1)*seq_len), up to max_batches batches; the last batch may be smaller."""
    if batch_size <= 0 or seq_len <= 0 or max_batches <= 0:
        raise OpenflashError(f"batch_size={batch_size}, seq_len={seq_len} and max_batches={max_batches} must be "
                             f"positive")
    available = (dataset.num_tokens - 1) // seq_len
    if available == 0:
        raise OpenflashError(f"{dataset.data_dir} ({dataset.split}) has {dataset.num_tokens} tokens, fewer than "
                             f"one evaluation window of seq_len + 1 = {seq_len + 1}")
    count = min(available, batch_size * max_batches)
    starts = np.arange(count, dtype=np.int64) * seq_len
    return [_windows(dataset, starts[i:i + batch_size], seq_len) for i in range(0, count, batch_size)]
