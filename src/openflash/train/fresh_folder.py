"""What the whole-folder preparations share (chats, train/chats.py; dataset rows, train/prepare_rows.py): a new
output folder written aside and renamed when complete, the tokenizer checked, and every bad input named at once."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from openflash.errors import OpenflashError
from openflash.tokenizer import load_tokenizer, resolve_tokenizer_path
from openflash.train.dataset import token_dtype
from openflash.train.prepare import check_eos

MAX_NAMED = 20  # bad inputs listed in the error (the count says how many more)


@dataclass(frozen=True)
class FreshFolder:
    out_dir: Path
    tokenizer_path: Path
    tokenizer: Tokenizer
    vocab_size: int
    dtype: np.dtype
    work: Path  # the folder written aside: renamed to out_dir when complete

    @classmethod
    def start(cls, out_dir: str | Path, tokenizer_spec: str | Path, val_fraction: float, what: str) -> "FreshFolder":
        """Check the arguments, load the tokenizer, make the work folder beside out_dir (which must not exist)."""
        if not 0.0 <= val_fraction < 1.0:
            raise OpenflashError(f"val_fraction={val_fraction} must be in [0, 1)")
        out_dir = Path(out_dir)
        if out_dir.exists():
            raise OpenflashError(f"{out_dir} already exists; {what} is written to a new folder")
        tok_path = resolve_tokenizer_path(tokenizer_spec)
        tokenizer = load_tokenizer(tok_path)
        check_eos(tokenizer, tok_path)
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
        return cls(out_dir, tok_path, tokenizer, vocab, token_dtype(vocab), work)


def refuse_bad(bad: list[str], noun: str) -> None:
    """OpenflashError listing the bad inputs (the first MAX_NAMED, then how many more), if there are any."""
    if bad:
        shown = "\n  ".join(bad[:MAX_NAMED])
        more = f"\n  ... and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else ""
        raise OpenflashError(f"{len(bad)} bad {noun}(s); nothing was written:\n  {shown}{more}")


__all__ = ["FreshFolder", "refuse_bad", "MAX_NAMED"]
