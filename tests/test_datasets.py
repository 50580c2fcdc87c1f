"""`openflash data prepare --dataset`: Hugging Face datasets (a Parquet shard, JSON lines, a save_to_disk folder with
splits) to token shards, text and chats, offline; bad rows named; an absent dataset refused with the command that
fetches it."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openflash.cli import main
from openflash.tokenizer import load_tokenizer
from openflash.train.dataset import TokenDataset

TEXTS = [f"def f{i}(x):\n    return x + {i}\n" for i in range(30)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("deepseek")


def _docs(folder) -> list[list[int]]:
    out = []
    for split in ("train", "val"):
        data = TokenDataset(folder, split)
        for i in range(data.num_docs):
            start, end = int(data.doc_offsets[i]), int(data.doc_offsets[i + 1])
            out.append(data.read(start, end - start).tolist())
    return out


def test_parquet_and_json_lines_rows_become_documents(tmp_path, tok):
    pq.write_table(pa.table({"id": list(range(20)), "content": TEXTS[:20]}), tmp_path / "part-0.parquet")
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in TEXTS[20:]))
    out = tmp_path / "data"
    assert main(["data", "prepare", "--dataset", str(tmp_path / "part-0.parquet"), str(tmp_path / "more.jsonl"),
                 "--text-field", "content", "--tokenizer", "deepseek", "--out", str(out), "--val-fraction",
                 "0.2"]) == 0
    want = sorted(tok.encode(t, add_special_tokens=False).ids + [1] for t in TEXTS)
    assert sorted(_docs(out)) == want  # every row once, its tokens and eos, in train or val
    assert 0 < TokenDataset(out, "val").num_docs < 30


def test_a_saved_dataset_s_split(tmp_path, tok):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:5]}),
                          "test": datasets.Dataset.from_dict({"text": TEXTS[5:8]})}).save_to_disk(tmp_path / "saved")
    out = tmp_path / "data"
    assert main(["data", "prepare", "--dataset", str(tmp_path / "saved"), "--split", "test", "--tokenizer",
                 "deepseek", "--out", str(out), "--val-fraction", "0"]) == 0
    assert _docs(out) == [tok.encode(t, add_special_tokens=False).ids + [1] for t in TEXTS[5:8]]
    assert main(["data", "prepare", "--dataset", str(tmp_path / "saved"), "--split", "validation", "--tokenizer",
                 "deepseek", "--out", str(tmp_path / "other")]) == 2


def test_bad_rows_are_named_and_nothing_is_written(tmp_path, capsys):
    rows = [{"text": "ok"}, {"text": None}, {"text": "fine"}, {"body": "no text field"}, {"text": 7}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "prepare", "--dataset", str(tmp_path / "rows.jsonl"), "--tokenizer", "deepseek", "--out",
                 str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "3 bad row(s)" in err and "row 1: field 'text' is null or absent" in err
    assert "row 3: field 'text' is null or absent" in err and "row 4: field 'text' is int, not text" in err
    assert not (tmp_path / "data").exists() and not list(tmp_path.glob(".data-*"))


def test_an_absent_dataset_says_how_to_fetch_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    assert main(["data", "prepare", "--dataset", "someone/no-such-dataset", "--tokenizer", "deepseek", "--out",
                 str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "someone/no-such-dataset" in err and "load_dataset('someone/no-such-dataset'" in err
    assert main(["data", "prepare", str(tmp_path), "--text-field", "body", "--tokenizer", "deepseek", "--out",
                 str(tmp_path / "d")]) == 2
    assert "--text-field reads Hugging Face datasets: add --dataset" in capsys.readouterr().err


def test_chats_from_a_dataset_train_on_the_replies(tmp_path):
    chats = [[{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}"}] for i in range(6)]
    pq.write_table(pa.table({"conversation": chats}), tmp_path / "chats.parquet")
    out = tmp_path / "data"
    assert main(["data", "prepare", "--dataset", "--chats", str(tmp_path / "chats.parquet"), "--messages-field",
                 "conversation", "--tokenizer", "deepseek", "--out", str(out), "--val-fraction", "0"]) == 0
    data = TokenDataset(out, "train")
    assert data.num_docs == 6 and data.loss_mask
    mask = data.read(0, int(data.doc_offsets[1]), masks=True)
    assert 0 < int(mask.sum()) < len(mask)  # the reply's tokens only
