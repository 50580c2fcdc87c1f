"""Checksum manifests: written beside checkpoints and exported tables, checked by `openflash verify` and --verify."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from openflash.checkpoint import load_checkpoint, save_checkpoint
from openflash.cli import main as cli_main
from openflash.config import load_config
from openflash.errors import OpenflashError
from openflash.files.manifest import MANIFEST_FILE, verify_manifest
from openflash.memory.checkpoint_tables import export_engram_tables
from openflash.memory.table_file import read_table_header, table_file_name
from openflash.model.transformer import Transformer


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("manifest") / "ckpt"
    save_checkpoint(Transformer(load_config("tiny")), folder, dtype="fp8", max_shard_bytes=1 << 20)
    return folder


def test_save_writes_a_sha256sum_compatible_manifest(checkpoint, capsys):
    names = {line.split("  ")[1] for line in (checkpoint / MANIFEST_FILE).read_text().splitlines()}
    assert names == {p.name for p in checkpoint.iterdir() if p.name != MANIFEST_FILE}
    assert "config.json" in names and "model.safetensors.index.json" in names
    check = subprocess.run(["sha256sum", "--quiet", "-c", MANIFEST_FILE], cwd=checkpoint, capture_output=True)
    assert check.returncode == 0, check.stdout
    assert cli_main(["verify", str(checkpoint)]) == 0
    assert "match checksums.sha256" in capsys.readouterr().out


def test_a_flipped_weight_byte_is_named(checkpoint, tmp_path, capsys):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    _flip_byte(shard, shard.stat().st_size - 10)
    load_checkpoint(folder)  # loading does not verify unless asked: the flip goes unnoticed
    with pytest.raises(OpenflashError, match=f"{shard}: sha256 differs"):
        load_checkpoint(folder, verify=True)
    assert cli_main(["verify", str(folder)]) == 2
    err = capsys.readouterr().err
    assert str(shard) in err and len(err.strip().splitlines()) == 1
    assert cli_main(["generate", "--model", str(folder), "--prompt", "x", "--max-tokens", "1", "--verify"]) == 2
    assert str(shard) in capsys.readouterr().err
    (folder / "config.json").unlink()
    with pytest.raises(OpenflashError, match="config.json: missing"):
        verify_manifest(folder)


def test_exported_tables_are_checked_too(checkpoint, tmp_path, capsys):
    paths = export_engram_tables(checkpoint, tmp_path / "tables")
    assert verify_manifest(tmp_path / "tables").files == len(paths)
    layer = load_config("tiny").engram_layer_ids[0]
    path = tmp_path / "tables" / table_file_name(layer)
    _flip_byte(path, read_table_header(path).data_offset + 1000)  # one row's byte
    assert cli_main(["verify", str(tmp_path / "tables")]) == 2
    assert f"{path}: sha256 differs" in capsys.readouterr().err


def test_verify_without_a_manifest_says_how_to_make_one(tmp_path, capsys):
    (tmp_path / "a.bin").write_bytes(b"abc")
    assert cli_main(["verify", str(tmp_path)]) == 2
    assert "verify --write" in capsys.readouterr().err
    assert cli_main(["verify", "--write", str(tmp_path)]) == 0
    assert cli_main(["verify", str(tmp_path)]) == 0


def test_verify_a_path_that_is_not_a_folder(tmp_path, capsys):
    (tmp_path / "file.bin").write_bytes(b"x")
    assert cli_main(["verify", str(tmp_path / "file.bin")]) == 2
    assert "not a folder" in capsys.readouterr().err
    (tmp_path / MANIFEST_FILE).write_text("not a checksum line\n")
    with pytest.raises(OpenflashError, match=rf"{MANIFEST_FILE}:1: not a '<sha256>  <file name>' line"):
        verify_manifest(tmp_path)
