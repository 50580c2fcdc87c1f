"""Rows of a Hugging Face dataset for `openflash data prepare --dataset` (text and chats): what `datasets.load_dataset`
reads, offline.

A source is a data file (Parquet, Arrow, JSON lines, CSV), a folder of them or one written by `save_to_disk`, or a
dataset repo id already in the local Hugging Face cache (nothing is downloaded at run time: an absent one is refused
with the command that downloads it). Files and folders are streamed (bounded memory on large shards); a cached repo
is read from its memory-mapped Arrow files. Each row comes with where it is ("SOURCE[split] row N"), so that bad
rows are named as bad JSONL lines are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

from openflash.errors import OpenflashError

BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _offline() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:
        raise OpenflashError(f"--dataset needs the `datasets` package, which is not importable here ({exc}); "
                             f"reinstall openflash") from None
    datasets.disable_progress_bars()
    return datasets


def _open(source: str, split: str) -> tuple[Any, int | None]:
    """The split's rows (an iterable dataset) and their count where known."""
    datasets = _offline()
    path = Path(source)
    try:
        if path.is_file():
            builder = BUILDERS.get("".join(path.suffixes[-1:]).lower())
            if builder is None:
                raise OpenflashError(f"{source}: not a data file datasets reads ({', '.join(BUILDERS)})")
            if split != "train":
                raise OpenflashError(f"{source}: a single data file is one split, 'train'; got --split {split}")
            return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True), None
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
            loaded = datasets.load_from_disk(str(path))  # save_to_disk's layout: memory-mapped Arrow
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise OpenflashError(f"{source}: no split {split!r} (it has {sorted(loaded)})")
                loaded = loaded[split]
            return loaded, len(loaded)
        if path.is_dir():
            return datasets.load_dataset(str(path), split=split, streaming=True), None
        loaded = datasets.load_dataset(source, split=split)  # a repo id: from the local cache only
        return loaded, len(loaded)
    except OpenflashError:
        raise
    except (FileNotFoundError, ConnectionError) as exc:
        if path.exists():
            raise OpenflashError(f"{source}: datasets cannot read it: {exc}") from None
        raise OpenflashError(f"{source}: no such file or folder, and no dataset of that name in the local Hugging "
                             f"Face cache (nothing is downloaded at run time); where there is a network, fetch it "
                             f"once with: python -c \"import datasets; datasets.load_dataset('{source}', "
                             f"split='{split}')\"") from None
    except ValueError as exc:  # an unknown split, files datasets cannot parse
        raise OpenflashError(f"{source}: {exc}") from None


def dataset_rows(source: str, split: str, progress: bool = True) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) of every row of `source`'s split, streamed; OpenflashError naming the source for one that
    cannot be read."""
    rows, total = _open(source, split)
    bar = tqdm(total=total, unit="row", desc=Path(source).name or source, disable=not progress, dynamic_ncols=True)
    try:
        for n, row in enumerate(rows):
            bar.update(1)
            yield f"{source}[{split}] row {n}", row
    except OpenflashError:
        raise
    except Exception as exc:  # a shard that breaks off mid-stream (pyarrow's and datasets' own errors)
        raise OpenflashError(f"{source}[{split}]: reading stopped: {type(exc).__name__}: {exc}") from None
    finally:
        bar.close()


def field_of(row: dict[str, Any], name: str, where: str) -> Any:
    """A row's field, or OpenflashError naming the row and the fields it has."""
    if name not in row:
        raise OpenflashError(f"{where}: no field {name!r} (fields: {sorted(row)[:20]})")
    return row[name]


__all__ = ["dataset_rows", "field_of", "BUILDERS"]
