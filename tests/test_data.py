"""Dataset preparation (train/prepare.py: shards, manifest, resume) and batch loading (train/dataset.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from openflash.cli import main as cli_main
from openflash.errors import OpenflashError
from openflash.tokenizer import load_tokenizer, tokenizer_sha256
from openflash.train.dataset import BatchLoader, TokenDataset, eval_batches
from openflash.train.prepare import PreparationStopped, is_validation, prepare_dataset
from openflash.train.tokenizer import train_bpe_tokenizer

VOCAB = 320
SHARD = 300  # tokens per shard: small, so documents straddle shard boundaries
VAL = 0.25


def _text(i: int) -> str:
    body = "".join(f"    value_{i}_{j} = compute({j}, 'ünïcode {j}')\n\tif value_{i}_{j}:\n        pass\n"
                   for j in range(i % 7 + 1))
    return f"# module {i}\nimport sys\n\n\ndef function_{i}(x):\n{body}    return x\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(24):
        path = root / ("pkg" if i % 3 else "lib") / f"mod_{i:02d}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(_text(i), encoding="utf-8")
    (root / "latin.txt").write_bytes("# caf\xe9 cr\xe8me br\xfbl\xe9e\nna\xefve = True\n".encode("latin-1"))
    (root / "bom.md").write_bytes(b"\xef\xbb\xbf# title with BOM\n\ntext <|eos|> literal\n")
    (root / "blob.py").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)))
    (root / "empty.py").write_bytes(b"")
    (root / "image.png").write_bytes(b"\x89PNG not matched by the patterns")
    return root


@pytest.fixture(scope="module")
def tok_file(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(sorted(corpus.rglob("*.py")), VOCAB, out)
    return out


def _prepare(corpus: Path, tok: Path | str, out: Path, **kw) -> object:
    kw.setdefault("val_fraction", VAL)
    kw.setdefault("shard_tokens", SHARD)
    return prepare_dataset([corpus], tok, out, progress=False, **kw)


@pytest.fixture(scope="module")
def prepared(corpus: Path, tok_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "ds"
    _prepare(corpus, tok_file, out)
    return out


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _text_docs(corpus: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every document, in corpus order, read independently of the code under test."""
    docs = []
    for path in sorted(p for p in corpus.rglob("*") if p.suffix in (".py", ".txt", ".md")):
        rel = path.relative_to(corpus).as_posix()
        data = path.read_bytes()
        if not data or b"\x7fELF" in data:
            continue
        text = data.decode("latin-1") if rel == "latin.txt" else data.decode("utf-8-sig")
        docs.append((rel, text))
    return docs


def test_manifest_contents(prepared: Path, tok_file: Path, corpus: Path) -> None:
    m = json.loads((prepared / "manifest.json").read_text())
    docs = _text_docs(corpus)
    assert m["format_version"] == 1
    assert m["vocab_size"] == VOCAB and m["dtype"] == "uint16" and m["eos_id"] == 1
    assert m["tokenizer_sha256"] == tokenizer_sha256(tok_file)
    assert m["num_files"] == len(docs) + 2
    assert m["encodings"] == {"latin-1": 1, "utf-8": len(docs) - 2, "utf-8-sig": 1}
    assert m["skipped"]["count"] == 2
    assert m["skipped"]["by_reason"] == {"binary": 1, "empty": 1}
    assert sorted(Path(f["path"]).name for f in m["skipped"]["files"]) == ["blob.py", "empty.py"]
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert train["num_docs"] + val["num_docs"] == len(docs)
    assert val["num_docs"] == sum(is_validation(rel, 0, VAL) for rel, _ in docs) > 0
    tok = load_tokenizer(tok_file)
    tok.encode_special_tokens = True
    expected = sum(len(tok.encode(text, add_special_tokens=False).ids) + 1 for _, text in docs)
    assert train["num_tokens"] + val["num_tokens"] == expected
    for split in (train, val):
        assert sum(s["num_tokens"] for s in split["shards"]) == split["num_tokens"]
        assert all(s["num_tokens"] == SHARD for s in split["shards"][:-1]) and split["shards"][-1]["num_tokens"] > 0
        for s in split["shards"]:
            assert (prepared / s["file"]).stat().st_size == 2 * s["num_tokens"]
    assert len(train["shards"]) > 2
    assert not (prepared / "progress.json").exists()
    assert (prepared / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    assert not [p for p in prepared.iterdir() if p.name.endswith((".tmp", ".partial"))]


def test_documents_round_trip_through_shards(prepared: Path, tok_file: Path, corpus: Path) -> None:
    tok = load_tokenizer(tok_file)
    docs = _text_docs(corpus)
    for split in ("train", "val"):
        ds = TokenDataset(prepared, split)
        assert all(isinstance(s, np.memmap) for s in ds._shards)
        assert ds.vocab_size == VOCAB and ds.tokenizer_sha256 == tokenizer_sha256(tok_file)
        assert ds.tokenizer_path.read_bytes() == tok_file.read_bytes()
        want = [text for rel, text in docs if is_validation(rel, 0, VAL) == (split == "val")]
        offsets = np.asarray(ds.doc_offsets)
        assert ds.num_docs == len(want) and offsets[0] == 0 and offsets[-1] == ds.num_tokens == len(ds)
        for i, text in enumerate(want):
            ids = ds.read(int(offsets[i]), int(offsets[i + 1] - offsets[i]))
            assert ids[-1] == 1 and 1 not in ids[:-1]  # one eos, at the end (a literal "<|eos|>" is plain text)
            assert tok.decode(ids[:-1].tolist()) == text
    with pytest.raises(IndexError):
        TokenDataset(prepared, "val").read(0, 10**9)


def test_split_is_deterministic_and_seeded(corpus: Path, tok_file: Path, prepared: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    _prepare(corpus, tok_file, again)
    assert _folder_bytes(again) == _folder_bytes(prepared)
    other = tmp_path / "seed1"
    _prepare(corpus, tok_file, other, seed=1)
    m0 = json.loads((prepared / "manifest.json").read_text())["splits"]["val"]
    m1 = json.loads((other / "manifest.json").read_text())["splits"]["val"]
    assert (m0["num_docs"], m0["num_tokens"]) != (m1["num_docs"], m1["num_tokens"])
    # The hash split is uniform: about val_fraction of many paths land in val.
    share = np.mean([is_validation(f"dir/file_{i}.py", 0, 0.1) for i in range(4000)])
    assert 0.085 < share < 0.115


@pytest.mark.parametrize("stops", [[1], [5, 13], [26]])
def test_resume_is_byte_identical(corpus: Path, tok_file: Path, prepared: Path, tmp_path: Path,
                                  stops: list[int]) -> None:
    out = tmp_path / "ds"
    for k in stops:
        with pytest.raises(PreparationStopped):
            _prepare(corpus, tok_file, out, stop_after_files=k)
        assert (out / "progress.json").exists() and not (out / "manifest.json").exists()
    _prepare(corpus, tok_file, out)
    assert _folder_bytes(out) == _folder_bytes(prepared)


def test_resume_after_a_crash_mid_unit(corpus: Path, tok_file: Path, prepared: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    with pytest.raises(PreparationStopped):
        _prepare(corpus, tok_file, out, stop_after_files=9)
    # What an interruption between writing and committing can leave: uncommitted bytes appended, a shard that was
    # completed and renamed, a new shard started.
    partials = sorted(out.glob("train_0*.bin.partial"))
    assert len(partials) == 1
    with open(partials[0], "ab") as f:
        f.write(b"\x05\x00" * 7)
    with open(out / "train_docs.bin.partial", "ab") as f:
        f.write(b"\x00" * 16)
    os.replace(partials[0], out / partials[0].name.removesuffix(".partial"))
    index = int(partials[0].name[6:11])
    (out / f"train_{index + 1:05d}.bin.partial").write_bytes(b"\x01\x00" * 3)
    (out / "train_00099.bin").write_bytes(b"\x01\x00" * SHARD)
    _prepare(corpus, tok_file, out)
    assert _folder_bytes(out) == _folder_bytes(prepared)


def test_resume_after_a_crash_while_finishing(corpus: Path, tok_file: Path, prepared: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import openflash.train.prepare as prepare

    real_write = prepare.write_json_atomic

    def crash_on_manifest(path: Path, obj: object) -> None:
        if path.name == "manifest.json":
            raise RuntimeError("power cut")
        real_write(path, obj)

    out = tmp_path / "ds"
    monkeypatch.setattr(prepare, "write_json_atomic", crash_on_manifest)
    with pytest.raises(RuntimeError, match="power cut"):
        _prepare(corpus, tok_file, out)
    monkeypatch.setattr(prepare, "write_json_atomic", real_write)
    assert (out / "train_docs.bin").exists() and (out / "progress.json").exists()  # finished shards, no manifest
    _prepare(corpus, tok_file, out)
    assert _folder_bytes(out) == _folder_bytes(prepared)


def test_rerun_of_finished_dataset_is_a_noop(corpus: Path, tok_file: Path, prepared: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()}
    m = _prepare(corpus, tok_file, prepared)
    assert m.splits["train"].num_tokens == TokenDataset(prepared, "train").num_tokens
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()} == before


def test_mismatched_rerun_is_refused(corpus: Path, tok_file: Path, prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(OpenflashError, match=r"manifest.json was prepared with different arguments: seed \(was 0, now 3\)"):
        _prepare(corpus, tok_file, prepared, seed=3)
    other_tok = tmp_path / "other.json"
    train_bpe_tokenizer(sorted(corpus.rglob("*.py"))[:3], VOCAB, other_tok)
    with pytest.raises(OpenflashError, match="different arguments: tokenizer_sha256"):
        _prepare(corpus, other_tok, prepared)
    # An interrupted run is tied to its arguments too.
    out = tmp_path / "partial"
    with pytest.raises(PreparationStopped):
        _prepare(corpus, tok_file, out, stop_after_files=4)
    with pytest.raises(OpenflashError, match=r"progress.json was prepared with different arguments: sources"):
        _prepare(corpus / "pkg", tok_file, out)
    with pytest.raises(OpenflashError, match="val_fraction"):
        _prepare(corpus, tok_file, out, val_fraction=0.5)


def test_concurrent_run_refused(corpus: Path, tok_file: Path, tmp_path: Path) -> None:
    import fcntl

    out = tmp_path / "ds"
    out.mkdir()
    with open(out / "prepare.lock", "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # as another running prepare would
        with pytest.raises(OpenflashError, match="another `openflash data prepare` is writing to .*ds"):
            _prepare(corpus, tok_file, out)
    _prepare(corpus, tok_file, out)  # lock released: runs (the stale lock file is no obstacle) and removes it
    assert not (out / "prepare.lock").exists()


def test_foreign_folder_refused(corpus: Path, tok_file: Path, tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "thesis.tex").write_text("precious")
    with pytest.raises(OpenflashError, match="is not empty.*thesis.tex"):
        _prepare(corpus, tok_file, tmp_path / "ds")


def test_large_vocab_uses_uint32(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    m = prepare_dataset([corpus / "lib"], "deepseek", out, val_fraction=0.0, progress=False)
    assert m.dtype == "uint32" and m.vocab_size > 65535
    ds = TokenDataset(out, "train")
    assert ds._shards[0].dtype == np.dtype("<u4")
    tok = load_tokenizer("deepseek")
    first = sorted((corpus / "lib").glob("*.py"))[0].read_text()
    ids = ds.read(0, int(ds.doc_offsets[1]))
    assert ids[-1] == 1 and tok.decode(ids[:-1].tolist()) == first
    assert TokenDataset(out, "val").num_tokens == 0


def test_dataset_errors(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(OpenflashError, match=r"manifest.json not found"):
        TokenDataset(tmp_path, "train")
    with pytest.raises(OpenflashError, match="split must be one of"):
        TokenDataset(prepared, "test")
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in prepared.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    manifest = json.loads((broken / "manifest.json").read_text())
    with open(broken / "train_00001.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(OpenflashError, match=r"shard .*train_00001.bin is 10 bytes"):
        TokenDataset(broken, "train")
    del manifest["vocab_size"]
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(OpenflashError, match=r"manifest.json: field 'vocab_size' is missing"):
        TokenDataset(broken, "val")
    manifest["vocab_size"] = VOCAB
    manifest["splits"]["val"]["num_tokens"] += 1
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(OpenflashError, match=r"field 'splits.val.num_tokens'"):
        TokenDataset(broken, "val")


def test_batches_are_windows_of_the_stream(prepared: Path) -> None:
    ds = TokenDataset(prepared, "train")
    loader = BatchLoader(ds, batch_size=6, seq_len=32, seed=7)
    x, y = next(loader)
    assert x.shape == y.shape == (6, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, start in zip(x, loader.global_starts(0)):
        assert torch.equal(row, torch.from_numpy(ds.read(int(start), 32)))
    starts = np.concatenate([loader.global_starts(t) for t in range(50)])
    assert starts.min() >= 0 and starts.max() <= ds.num_tokens - 33
    assert len(np.unique(starts)) > 200  # spread over the stream, not stuck


def test_loader_deterministic_and_resumable(prepared: Path) -> None:
    ds = TokenDataset(prepared, "train")
    a = BatchLoader(ds, 4, 16, seed=1)
    run = [next(a) for _ in range(5)]
    b = BatchLoader(ds, 4, 16, seed=1)
    for (xa, ya), (xb, yb) in zip(run, (next(b) for _ in range(5))):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(next(BatchLoader(ds, 4, 16, seed=2))[0], run[0][0])
    # Save after 3 steps, restore into a fresh loader: the next batches match the uninterrupted run.
    c = BatchLoader(ds, 4, 16, seed=1)
    for _ in range(3):
        next(c)
    state = json.loads(json.dumps(c.state_dict()))  # survives a checkpoint round trip
    assert state == {"seed": 1, "step": 3, "num_tokens": ds.num_tokens}
    d = BatchLoader(ds, 4, 16, seed=99)
    d.load_state_dict(state)
    for want in run[3:]:
        got = next(d)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(OpenflashError, match="'step' is missing"):
        d.load_state_dict({"seed": 1})
    with pytest.raises(OpenflashError, match="saved for a dataset of 5 tokens"):
        d.load_state_dict({"seed": 1, "step": 0, "num_tokens": 5})


def test_data_parallel_ranks_split_the_global_batch(prepared: Path) -> None:
    ds = TokenDataset(prepared, "train")
    single = BatchLoader(ds, 8, 16, seed=3)
    ranks = [BatchLoader(ds, 8, 16, seed=3, rank=r, world_size=2) for r in range(2)]
    quads = [BatchLoader(ds, 8, 16, seed=3, rank=r, world_size=4) for r in range(4)]
    for _ in range(4):
        x, y = next(single)
        parts = [next(r) for r in ranks]
        assert parts[0][0].shape == (4, 16)
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        assert torch.equal(torch.cat([next(q)[0] for q in quads]), x)
    with pytest.raises(OpenflashError, match="batch_size=6 is not divisible by world_size=4"):
        BatchLoader(ds, 6, 16, seed=0, rank=0, world_size=4)
    with pytest.raises(OpenflashError, match="rank=2"):
        BatchLoader(ds, 4, 16, seed=0, rank=2, world_size=2)
    with pytest.raises(OpenflashError, match="fewer than one window"):
        BatchLoader(ds, 4, ds.num_tokens, seed=0)


def test_eval_batches_fixed_and_non_overlapping(prepared: Path) -> None:
    ds = TokenDataset(prepared, "val")
    batches = eval_batches(ds, batch_size=3, seq_len=20, max_batches=2)
    assert len(batches) == 2 and all(x.shape == (3, 20) for x, _ in batches)
    rows = torch.cat([x for x, _ in batches])
    targets = torch.cat([y for _, y in batches])
    for i in range(6):
        assert torch.equal(rows[i], torch.from_numpy(ds.read(20 * i, 20)))
        assert torch.equal(targets[i], torch.from_numpy(ds.read(20 * i + 1, 20)))
    again = eval_batches(ds, batch_size=3, seq_len=20, max_batches=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    everything = eval_batches(ds, batch_size=4, seq_len=20, max_batches=10**6)
    windows = (ds.num_tokens - 1) // 20
    assert sum(len(x) for x, _ in everything) == windows and len(everything) == -(-windows // 4)
    with pytest.raises(OpenflashError, match="fewer than one evaluation window"):
        eval_batches(ds, 1, ds.num_tokens, 1)


def test_cli_prepare(corpus: Path, tok_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    code = cli_main(["data", "prepare", str(corpus), "--tokenizer", str(tok_file), "--out", str(out),
                     "--val-fraction", "0.25", "--glob", "*.py,*.txt"])
    assert code == 0
    printed = capsys.readouterr()
    assert "tokens/s" in printed.out and "skipped 2 file(s): binary 1, empty 1" in printed.out
    assert "1 file(s) were not UTF-8 and were read as latin-1" in printed.out
    m = json.loads((out / "manifest.json").read_text())
    assert m["patterns"] == ["*.py", "*.txt"] and m["encodings"]["utf-8-sig"] == 0
    assert cli_main(["data", "prepare", str(corpus), "--tokenizer", str(tok_file), "--out", str(out),
                     "--seed", "5"]) == 2
    assert "different arguments" in capsys.readouterr().err
