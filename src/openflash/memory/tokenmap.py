"""Engram's compressed token map: token id -> compressed id (engram.md §1).

Tokens whose decoded text normalises to the same string share one compressed id, so the n-gram hash
(hashing.py) sees "Hello", " hello" and "HELLO" as one token. Ids are assigned in order of first occurrence
over ascending token ids, which makes the map a pure function of the tokenizer and `num_ids`.

Building the released map takes ~129k single-token decodes plus as many normalisations, so the result is cached
on disk, keyed by the sha256 of the tokenizer's JSON and `num_ids`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

from openflash.errors import ConfigError, OpenflashError
from openflash.files.cache import cache_dir

if TYPE_CHECKING:
    from openflash.config import FlashConfig

# A checkpoint may carry its own map beside config.json, for models whose tokenizer is not DeepSeek's: the file
# config.json names under one of TOKEN_MAP_CONFIG_KEYS, else the first of these files found (openflash's own, then
# what other V4.1 implementations write: colibri's dsv41_engram.json). The JSON form is a list of ints, or an object
# holding that list under one of TOKEN_MAP_JSON_KEYS.
TOKEN_MAP_FILES = ("engram_token_map.npy", "engram_token_map.json", "dsv41_engram.json")
TOKEN_MAP_CONFIG_KEYS = ("engram_token_map_file", "engram_token_map")
TOKEN_MAP_JSON_KEYS = ("token_map", "compressed_ids", "ids")

# Bump when the map procedure changes, so old cache entries are never read back.
_CACHE_FORMAT = "openflash-engram-token-map-v1"

# A token that is exactly one space must survive the Strip step: it is swapped for this private-use sentinel
# first and swapped back after (engram.md §1 steps 6-8).
_SPACE_SENTINEL = "\ue000"
_REPLACEMENT_CHAR = "\ufffd"


def engram_normalizer() -> normalizers.Normalizer:
    """The normaliser sequence of engram.md §1 step 4, in order."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def _compute_token_map(tokenizer: Tokenizer, num_ids: int) -> np.ndarray:
    """The uncached procedure of engram.md §1."""
    norm = engram_normalizer()
    # Raw backend decode of each id on its own; special tokens decode to their literal text.
    texts = tokenizer.decode_batch([[i] for i in range(num_ids)], skip_special_tokens=False)
    key_to_id: dict[str, int] = {}
    out = np.empty(num_ids, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if _REPLACEMENT_CHAR in text:
            # A partial UTF-8 byte token: its decode is lossy, so the raw token string is the key (not normalised).
            key = tokenizer.id_to_token(token_id)
            if key is None:
                raise OpenflashError(f"tokenizer has no token string for id {token_id}")
        else:
            key = norm.normalize_str(text) or text  # empty after normalising: keep the decoded text
        # First occurrence wins: the smallest token id with a key fixes that key's compressed id.
        out[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return out


def _cache_path(tokenizer: Tokenizer, num_ids: int) -> Path:
    digest = hashlib.sha256()
    digest.update(_CACHE_FORMAT.encode())
    digest.update(tokenizer.to_str().encode())
    digest.update(f"\nnum_ids={num_ids}".encode())
    return cache_dir() / "token_maps" / f"{digest.hexdigest()}.npy"


def _read_cached(path: Path, num_ids: int) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        warnings.warn(f"ignoring unreadable token-map cache {path} ({exc}); rebuilding it", stacklevel=3)
        return None
    if ids.dtype != np.int64 or ids.shape != (num_ids,):
        warnings.warn(f"ignoring token-map cache {path} with dtype {ids.dtype} shape {ids.shape}; rebuilding it",
                      stacklevel=3)
        return None
    return ids


def _write_cached(path: Path, ids: np.ndarray) -> None:
    """Write via a temporary file and rename, so a reader never sees a half-written map."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, ids, allow_pickle=False)
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache may be shared
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        # The cache is an optimisation; the map itself is correct either way.
        warnings.warn(f"could not write token-map cache {path}: {exc}", stacklevel=3)


def build_compressed_token_map(tokenizer: Tokenizer, num_ids: int | None = None, *, cache: bool = True) -> np.ndarray:
    """Compressed id of every token id in [0, num_ids) as int64 (engram.md §1).

    num_ids defaults to the tokenizer length with added tokens (HF `len(tokenizer)`); a smaller value restricts
    the map to the first num_ids ids, as the tiny goldens do. The number of compressed ids is `map.max() + 1`.
    """
    full = tokenizer.get_vocab_size(with_added_tokens=True)
    num_ids = full if num_ids is None else int(num_ids)
    if not 0 < num_ids <= full:
        raise ConfigError(f"token map size num_ids={num_ids} must be in [1, {full}] (the tokenizer's length)")
    path = _cache_path(tokenizer, num_ids) if cache else None
    if path is not None and (ids := _read_cached(path, num_ids)) is not None:
        return ids
    ids = _compute_token_map(tokenizer, num_ids)
    if path is not None:
        _write_cached(path, ids)
    return ids


@dataclass
class TokenMap:
    """The compressed token map plus the two numbers the hash needs from it."""

    ids: np.ndarray  # int64 [num_ids]: compressed id per token id
    compressed_vocab_size: int  # number of distinct compressed ids (seeds the hash multipliers)
    pad_id: int  # compressed id of engram_pad_token_id, used for every blocked n-gram slot
    _device_copies: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        tokenizer: Tokenizer,
        num_ids: int | None,
        pad_token_id: int,
        expected_compressed_vocab_size: int | None = None,
    ) -> "TokenMap":
        """Build (or load from cache) the map; optionally check the size the config declares."""
        ids = build_compressed_token_map(tokenizer, num_ids)
        size = int(ids.max()) + 1
        if expected_compressed_vocab_size is not None and size != expected_compressed_vocab_size:
            raise ConfigError(
                f"engram_compressed_vocab_size is {expected_compressed_vocab_size} in the config but the tokenizer's "
                f"compressed token map over {len(ids)} ids has {size} distinct ids: wrong tokenizer or vocab_size? "
                f"A checkpoint whose tokenizer is not DeepSeek's carries its own map beside config.json as "
                f"{' or '.join(TOKEN_MAP_FILES)} (the compressed id of each token id)"
            )
        if not 0 <= pad_token_id < len(ids):
            raise ConfigError(
                f"engram_pad_token_id {pad_token_id} is outside the token map (ids 0..{len(ids) - 1})"
            )
        return cls(ids=ids, compressed_vocab_size=size, pad_id=int(ids[pad_token_id]))

    @classmethod
    def for_config(cls, tokenizer: Tokenizer, config: "FlashConfig") -> "TokenMap":
        """The map a model with this config uses: over min(tokenizer length, vocab_size) ids, size-checked.

        A tokenizer longer than the model's vocabulary is restricted to the vocabulary (as the tiny goldens are).
        """
        num_ids = min(tokenizer.get_vocab_size(with_added_tokens=True), config.vocab_size)
        return cls.build(tokenizer, num_ids, config.engram_pad_token_id, config.engram_compressed_vocab_size)

    @classmethod
    def from_file(cls, path: str | Path, config: "FlashConfig") -> "TokenMap":
        """A map a checkpoint carries itself (one of TOKEN_MAP_FILES: int [num_ids], the compressed id of each token
        id, num_ids <= vocab_size), for models whose tokenizer is not DeepSeek's; checked against the config."""
        path = Path(path)
        ids = _read_json_map(path) if path.suffix == ".json" else _read_npy_map(path)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or not 0 < len(ids) <= config.vocab_size:
            raise ConfigError(f"{path}: a token map is a 1-D integer array of at most vocab_size={config.vocab_size} "
                              f"entries; found dtype {ids.dtype} shape {list(ids.shape)}")
        ids = ids.astype(np.int64)
        size = int(ids.max()) + 1
        if ids.min() < 0 or size != config.engram_compressed_vocab_size:
            raise ConfigError(f"{path}: compressed ids span {int(ids.min())}..{size - 1}, but the config's "
                              f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size}")
        if not 0 <= config.engram_pad_token_id < len(ids):
            raise ConfigError(f"{path}: engram_pad_token_id {config.engram_pad_token_id} is outside the map "
                              f"(ids 0..{len(ids) - 1})")
        return cls(ids=ids, compressed_vocab_size=size, pad_id=int(ids[config.engram_pad_token_id]))

    def __len__(self) -> int:
        return len(self.ids)

    def tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The map as an int64 torch tensor on `device`, copied there once."""
        device = torch.device(device if device is not None else "cpu")
        key = str(device)
        if key not in self._device_copies:
            self._device_copies[key] = torch.from_numpy(self.ids).to(device)
        return self._device_copies[key]


def find_token_map_file(folder: Path) -> Path | None:
    """The token map a checkpoint folder carries: the file its config.json names (TOKEN_MAP_CONFIG_KEYS, a file
    name inside the folder), else the first of TOKEN_MAP_FILES present, else None."""
    folder = Path(folder)
    named = _named_in_config(folder)
    if named is not None:
        return named
    return next((folder / name for name in TOKEN_MAP_FILES if (folder / name).is_file()), None)


def _named_in_config(folder: Path) -> Path | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # (config.json's own problems are reported where it is loaded)
    key = next((k for k in TOKEN_MAP_CONFIG_KEYS if isinstance(config, dict) and isinstance(config.get(k), str)),
               None)
    if key is None:
        return None
    path = folder / config[key]
    if Path(config[key]).name != config[key] or not path.is_file():
        raise ConfigError(f"{folder / 'config.json'}: {key} = {config[key]!r} names no token map file in {folder} "
                          f"(a file name there: .npy, or .json with a list or one of the keys "
                          f"{list(TOKEN_MAP_JSON_KEYS)})")
    return path


def _read_npy_map(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable .npy token map ({exc})") from None


def _read_json_map(path: Path) -> np.ndarray:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable JSON token map ({exc})") from None
    if isinstance(raw, dict):
        key = next((k for k in TOKEN_MAP_JSON_KEYS if k in raw), None)
        if key is None:
            raise ConfigError(f"{path}: a JSON token map is a list of ints or an object with one of the keys "
                              f"{list(TOKEN_MAP_JSON_KEYS)}; found keys {sorted(raw)[:10]}")
        raw = raw[key]
    if not isinstance(raw, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
        raise ConfigError(f"{path}: a JSON token map is a list of integers (the compressed id of each token id)")
    return np.asarray(raw, dtype=np.int64)
