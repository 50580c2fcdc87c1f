"""`openflash data prepare --dataset SOURCE... --text-field text`: the text of a Hugging Face dataset's rows
(train/hf_datasets.py) into the token-shard layout of train/dataset.py.

One row is one document: its tokens followed by eos, held out by a hash of where it is (source, split, row) and the
seed, as files are by their path (train/prepare.py). Rows stream through in batches, so memory holds one batch;
the folder is written aside and renamed when complete (an interrupted run leaves nothing, and runs again whole).
Rows whose field is missing or not text are all named, and then nothing is written.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from openflash.errors import OpenflashError
from openflash.files.atomic import write_json_atomic
from openflash.tokenizer import tokenizer_sha256
from openflash.train.dataset import FORMAT_VERSION, MANIFEST_FILE, SPLITS, TOKENIZER_FILE, Manifest
from openflash.train.fresh_folder import FreshFolder, refuse_bad
from openflash.train.hf_datasets import dataset_rows, field_of
from openflash.train.prepare import ENCODE_CHARS, SplitWriter, encode_texts, is_validation
from openflash.train.tokenizer import EOS_ID


def prepare_rows(sources: Sequence[str], tokenizer_spec: str | Path, out_dir: str | Path, split: str = "train",
                 text_field: str = "text", val_fraction: float = 0.01, seed: int = 0, progress: bool = True,
                 shard_tokens: int = 1 << 24) -> Manifest:
    folder = FreshFolder.start(out_dir, tokenizer_spec, val_fraction, "dataset text")
    tokenizer, dtype, work = folder.tokenizer, folder.dtype, folder.work
    start = time.perf_counter()
    try:
        fresh = {"shard_index": 0, "shard_fill": 0, "num_docs": 0}
        writers = {s: SplitWriter(work, s, dtype, shard_tokens, dict(fresh)) for s in SPLITS}
        batch: list[tuple[str, str]] = []  # (where, text)
        size, rows, bad = 0, 0, []

        def flush() -> None:
            for (where, _), ids in zip(batch, encode_texts(tokenizer, [t for _, t in batch], dtype)):
                split_name = "val" if is_validation(where, seed, val_fraction) else "train"
                writers[split_name].add(np.append(ids, np.array([EOS_ID], dtype=dtype)))
            batch.clear()

        for source in sources:
            for where, row in dataset_rows(source, split, progress):
                rows += 1
                try:
                    text = field_of(row, text_field, where)
                    if text is None:  # (in a table a row's absent key reads as null)
                        raise OpenflashError(f"{where}: field {text_field!r} is null or absent")
                    if not isinstance(text, str):
                        raise OpenflashError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
                except OpenflashError as exc:
                    bad.append(str(exc))
                    continue
                if bad or not text:
                    continue
                batch.append((where, text))
                size += len(text)
                if size >= ENCODE_CHARS:
                    flush()
                    size = 0
        refuse_bad(bad, "row")
        flush()
        infos = {s: writers[s].finish() for s in SPLITS}
        if infos["train"].num_tokens == 0:
            raise OpenflashError(f"no training text in {', '.join(sources)} (field {text_field!r} of split {split!r}: "
                                 f"all empty, or all held out)")
        shutil.copy(folder.tokenizer_path, work / TOKENIZER_FILE)
        manifest = Manifest(FORMAT_VERSION, tokenizer_sha256(tokenizer), TOKENIZER_FILE, folder.vocab_size, EOS_ID,
                            dtype.name, shard_tokens, list(sources), [f"dataset split {split}, field {text_field}"],
                            float(val_fraction), int(seed), "", rows, {"dataset": rows},
                            {"count": 0, "by_reason": {}, "files": []}, infos)
        write_json_atomic(work / MANIFEST_FILE, manifest.to_dict())
        work.rename(folder.out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # gone already once renamed
    if progress:
        print(f"{folder.out_dir}: {rows:,} rows, {infos['train'].num_docs:,} training documents "
              f"({infos['train'].num_tokens:,} tokens), {infos['val'].num_docs:,} held out, in "
              f"{time.perf_counter() - start:.1f} s")
    return Manifest.load(folder.out_dir)


__all__ = ["prepare_rows"]
