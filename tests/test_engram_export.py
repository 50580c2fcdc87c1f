"""Engram tables exported from a checkpoint into table files (spec: engram.md §5; checkpoint.md §6): single-file and
sharded checkpoints, every placement reading the same rows, the errors naming what is missing, and a trained
checkpoint's fp32 tables quantized on the way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import random_ids, same_bits
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from openflash.errors import CheckpointError, ConfigError, EngramTableError
from openflash.memory.checkpoint_tables import export_engram_tables
from openflash.memory.hashing import EngramHashLayout
from openflash.memory.table_file import table_file_name
from openflash.memory.tables import open_tables
from openflash.memory.tiers.disk import DiskTable
from openflash.model.engram_table import DeviceTable

GOLDEN_A = Path(__file__).parent / "goldens" / "A"
# Golden A's Engram setup (from its config.json): layers 0 and 3, tables of 304 and 462 rows of 32 values.
GOLDEN_LAYERS, GOLDEN_ROWS, GOLDEN_DIM = [0, 3], [304, 462], 32


def golden_fingerprint() -> str:
    layout = EngramHashLayout.create(layer_ids=GOLDEN_LAYERS, engram_vocab_size=40, max_ngram=4, n_heads=2,
                                     compressed_vocab_size=850, pad_compressed_id=0,
                                     expected_num_embeddings=GOLDEN_ROWS)
    return layout.layout_fingerprint()


def golden_tables() -> dict[int, DeviceTable]:
    with safe_open(str(GOLDEN_A / "model.safetensors"), framework="pt") as f:
        return {lid: DeviceTable.from_fp8(f.get_tensor(f"layers.{lid}.engram.embed.weight"),
                                          f.get_tensor(f"layers.{lid}.engram.embed.scale"))
                for lid in GOLDEN_LAYERS}


def test_export_single_file_checkpoint(tmp_path):
    out = tmp_path / "tables"
    reported, chunks = [], []
    paths = export_engram_tables(GOLDEN_A, out, chunk_rows=100, on_table=reported.append,
                                 on_rows=lambda *a: chunks.append(a))
    assert chunks == [(0, 100, 304), (0, 200, 304), (0, 300, 304), (0, 304, 304),
                      (3, 100, 462), (3, 200, 462), (3, 300, 462), (3, 400, 462), (3, 462, 462)]
    assert paths == [out / table_file_name(lid) for lid in GOLDEN_LAYERS]
    assert [(t.layer_id, t.rows, t.bytes) for t in reported] == [
        (lid, rows, 4096 + rows * (GOLDEN_DIM + 1)) for lid, rows in zip(GOLDEN_LAYERS, GOLDEN_ROWS)]
    fingerprint = golden_fingerprint()
    for (lid, device), rows, path in zip(golden_tables().items(), GOLDEN_ROWS, paths):
        with DiskTable.open(path, rows, GOLDEN_DIM, fingerprint) as disk:
            every = torch.arange(rows)
            assert same_bits(disk.gather(every), device.gather(every))


def test_export_sharded_checkpoint_matches_single_file(tmp_path):
    tensors = load_file(str(GOLDEN_A / "model.safetensors"))
    names = sorted(tensors)
    first = [n for n in names if n.startswith("layers.0.")]
    second = [n for n in names if n not in first]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((GOLDEN_A / "config.json").read_text())
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    for file, group in shards.items():
        save_file({n: tensors[n] for n in group}, str(ckpt / file))
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, group in shards.items() for n in group}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))

    single = export_engram_tables(GOLDEN_A, tmp_path / "single")
    sharded = export_engram_tables(ckpt, tmp_path / "sharded", chunk_rows=64)
    for a, b in zip(single, sharded):
        assert a.read_bytes() == b.read_bytes()

    # The index naming a shard that is not there is an error naming the shard.
    os.remove(ckpt / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        export_engram_tables(ckpt, tmp_path / "again")


def _golden_copy(tmp_path: Path, drop: str | None = None, config_edit=None) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = json.loads((GOLDEN_A / "config.json").read_text())
    if config_edit is not None:
        config_edit(config["text_config"])
    (ckpt / "config.json").write_text(json.dumps(config))
    tensors = {n: t for n, t in load_file(str(GOLDEN_A / "model.safetensors")).items()
               if "engram" in n and n != drop}
    save_file(tensors, str(ckpt / "model.safetensors"))
    return ckpt


def test_export_missing_tensor(tmp_path):
    ckpt = _golden_copy(tmp_path, drop="layers.3.engram.embed.scale")
    with pytest.raises(CheckpointError, match=r"missing Engram tensors \['layers.3.engram.embed.scale"):
        export_engram_tables(ckpt, tmp_path / "out")


def test_export_missing_config_key(tmp_path):
    ckpt = _golden_copy(tmp_path, config_edit=lambda c: (c.pop("engram_head_dim"), c.pop("engram_n_heads")))
    with pytest.raises(CheckpointError, match=r"config.json: missing Engram config keys .*engram_head_dim"):
        export_engram_tables(ckpt, tmp_path / "out")


def test_export_rows_disagree_with_config(tmp_path):
    ckpt = _golden_copy(tmp_path, config_edit=lambda c: c.update(engram_num_embeddings=[304, 463]))
    with pytest.raises(CheckpointError, match=r"layers.3.engram.embed.weight is F8_E4M3 \[462, 32\], expected "
                                              r"F8_E4M3 \[463, 32\]"):
        export_engram_tables(ckpt, tmp_path / "out")


def test_cli_export_prints_each_file(tmp_path, capsys):
    from openflash.cli import main

    assert main(["engram", "export", str(GOLDEN_A), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    for lid, rows in zip(GOLDEN_LAYERS, GOLDEN_ROWS):
        assert f"engram_layer{lid}.oftable  layer {lid}  rows {rows}" in out
    assert main(["engram", "export", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "checkpoint config not found" in capsys.readouterr().err


def test_open_tables_placements_agree(tmp_path):
    table_dir = tmp_path / "tables"
    export_engram_tables(GOLDEN_A, table_dir)
    device = golden_tables()
    common = dict(layer_ids=GOLDEN_LAYERS, num_rows=GOLDEN_ROWS, dim=GOLDEN_DIM)
    placements = {
        "device": open_tables("device", checkpoint_dir=GOLDEN_A, **common),
        "host": open_tables("host", device_tables={j: device[lid] for j, lid in enumerate(GOLDEN_LAYERS)},
                            **common),
        "host-ckpt": open_tables("host", checkpoint_dir=GOLDEN_A, **common),
        "disk": open_tables("disk", table_dir=table_dir, layout_fingerprint=golden_fingerprint(),
                            cache_bytes=1 << 16, **common),
    }
    ids = random_ids((2, 9, 6), min(GOLDEN_ROWS))
    for name, tables in placements.items():
        assert sorted(tables) == [0, 1], name
        for j, lid in enumerate(GOLDEN_LAYERS):
            assert tables[j].num_rows == GOLDEN_ROWS[j] and tables[j].dim == GOLDEN_DIM
            assert same_bits(tables[j].gather(ids), device[lid].gather(ids)), name
    with pytest.raises(ConfigError, match="unknown Engram placement 'ssd'"):
        open_tables("ssd", **common)
    with pytest.raises(ConfigError, match="placement 'disk' needs a table folder"):
        open_tables("disk", **common)
    with pytest.raises(EngramTableError, match="fingerprint mismatch"):
        open_tables("disk", table_dir=table_dir, layout_fingerprint="x", **common)


def test_export_float_tables_of_a_trained_checkpoint(tmp_path):
    """`openflash train` saves fp32 tables without scales; export quantizes them to the FP8 row format, the same
    rows the in-memory quantization (DeviceTable.to_fp8) gives, so the disk tier serves a model trained here."""
    from openflash.checkpoint import save_checkpoint
    from openflash.config import load_config
    from openflash.memory.frontend import EngramFrontend
    from openflash.model.transformer import Transformer
    from openflash.tokenizer import preset_tokenizer

    cfg = load_config("tiny")
    torch.manual_seed(0)
    model = Transformer(cfg)
    save_checkpoint(model, tmp_path / "ckpt", dtype="fp32")
    assert "layers.1.engram.embed.scale" not in load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    paths = export_engram_tables(tmp_path / "ckpt", tmp_path / "tables", chunk_rows=1000)
    fingerprint = EngramFrontend.for_config(cfg, preset_tokenizer(cfg)).layout.layout_fingerprint()
    for lid, rows, path in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings, paths):
        want = model.layers[lid].engram.embed.to_fp8()
        with DiskTable.open(path, rows, cfg.engram_head_dim, fingerprint) as disk:
            every = torch.arange(rows)
            assert same_bits(disk.gather(every), want.gather(every))
