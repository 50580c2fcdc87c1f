"""Engram tables of a safetensors checkpoint: the config's table spec, lazy row access, and the export to table
files (`openflash engram export`; spec: checkpoint.md §3.5, §4)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from openflash.errors import CheckpointError, ConfigError
from openflash.files.manifest import write_manifest
from openflash.files.shards import INDEX_FILE, SINGLE_FILE, read_weight_map
from openflash.formats import encode_window_fp8
from openflash.memory.table_file import row_reader, table_file_name, write_table_file
from openflash.model.engram_table import SCALE_BLOCK


@dataclass(frozen=True)
class EngramTableSpec:
    """What a checkpoint's config says about its Engram tables."""

    layer_ids: list[int]
    num_rows: list[int]
    dim: int
    max_ngram: int
    n_heads: int
    engram_vocab_size: int
    compressed_vocab_size: int

    def layout_fingerprint(self) -> str:
        """Fingerprint of the prime layout (rows of each hash column), from the hashing module.

        EngramHashLayout.create also takes the compressed vocab size and pad id, which seed the hash multipliers
        but not the layout; the fingerprint covers the layout only, so the pad id passed here (0) is irrelevant.
        """
        from openflash.memory.hashing import EngramHashLayout

        layout = EngramHashLayout.create(layer_ids=self.layer_ids, engram_vocab_size=self.engram_vocab_size,
                                         max_ngram=self.max_ngram, n_heads=self.n_heads,
                                         compressed_vocab_size=self.compressed_vocab_size, pad_compressed_id=0,
                                         expected_num_embeddings=self.num_rows)
        return layout.layout_fingerprint()


_SPEC_KEYS = {"engram_layer_ids": list, "engram_num_embeddings": list, "engram_head_dim": int,
              "engram_max_ngram_size": int, "engram_n_heads": int, "engram_vocab_size": int,
              "engram_compressed_vocab_size": int}


def read_engram_spec(checkpoint_dir: str | Path) -> EngramTableSpec:
    """Engram table settings from `config.json` (HF layout with `text_config`, or the flat reference layout)."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint config not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON: {exc}") from exc
    text = data.get("text_config", data)
    missing = [key for key in _SPEC_KEYS if key not in text]
    if missing:
        raise CheckpointError(f"{path}: missing Engram config keys {missing}")
    for key, kind in _SPEC_KEYS.items():
        if not isinstance(text[key], kind) or isinstance(text[key], bool):
            raise CheckpointError(f"{path}: {key} must be {kind.__name__}, got {text[key]!r}")
    layer_ids = [int(x) for x in text["engram_layer_ids"]]
    num_rows = [int(x) for x in text["engram_num_embeddings"]]
    if len(layer_ids) != len(num_rows):
        raise CheckpointError(f"{path}: engram_num_embeddings has {len(num_rows)} entries for "
                              f"{len(layer_ids)} engram_layer_ids")
    return EngramTableSpec(layer_ids=layer_ids, num_rows=num_rows, dim=int(text["engram_head_dim"]),
                           max_ngram=int(text["engram_max_ngram_size"]), n_heads=int(text["engram_n_heads"]),
                           engram_vocab_size=int(text["engram_vocab_size"]),
                           compressed_vocab_size=int(text["engram_compressed_vocab_size"]))


def engram_tensor_names(layer_id: int) -> tuple[str, str]:
    return f"layers.{layer_id}.engram.embed.weight", f"layers.{layer_id}.engram.embed.scale"


_FLOAT_TABLE_DTYPES = ("F32", "BF16", "F16")


class _QuantizedFloatRows:
    """A float Engram table (as `openflash train` saves it: fp32, no scale tensor) read as the checkpoint's FP8 row
    format, chunk by chunk: `codes` and `scales` are two row sources over one quantization of each chunk."""

    def __init__(self, source: Any, dim: int) -> None:
        self.source, self.rows, self.dim = source, int(source.get_shape()[0]), dim
        self._chunk: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None

    def _quantized(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._chunk is None or self._chunk[0] != (start, stop):
            # the rule DeviceTable.to_fp8 uses, so an exported table equals the quantized in-memory one
            codes, scales = encode_window_fp8(self.source[start:stop].float())
            self._chunk = ((start, stop), codes, scales)
        return self._chunk[1], self._chunk[2]

    class _Part:
        def __init__(self, owner: "_QuantizedFloatRows", which: int, width: int) -> None:
            self.owner, self.which, self.width = owner, which, width

        def get_shape(self) -> list[int]:
            return [self.owner.rows, self.width]

        def __getitem__(self, rows: slice) -> torch.Tensor:
            start, stop, _ = rows.indices(self.owner.rows)
            return self.owner._quantized(start, stop)[self.which]

    def parts(self) -> tuple[Any, Any]:
        return self._Part(self, 0, self.dim), self._Part(self, 1, self.dim // SCALE_BLOCK)


class CheckpointTables:
    """Lazy access to the Engram tables of a safetensors checkpoint (one file, or shards + index json).

    Tables are FP8 rows with UE8M0 scales (the official layout), or float without a scale (checkpoints that
    `openflash train` writes), which are quantized to FP8 rows as they are read."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        from safetensors import safe_open

        self.dir = Path(checkpoint_dir)
        self.spec = read_engram_spec(self.dir)
        index, single = self.dir / INDEX_FILE, self.dir / SINGLE_FILE
        if index.is_file():
            weight_map = read_weight_map(self.dir)
        elif single.is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        wanted = [name for lid in self.spec.layer_ids for name in engram_tensor_names(lid)]
        if weight_map is not None:
            present = [name for name in wanted if name in weight_map]
            files = {name: weight_map[name] for name in present}
        else:
            files = {name: single for name in wanted}
        self._handles: dict[Path, Any] = {}
        self._slices: dict[str, Any] = {}
        missing = []
        for name, file in files.items():
            if file not in self._handles:
                if not file.is_file():
                    raise CheckpointError(f"checkpoint shard not found: {file} (holds {name})")
                try:
                    self._handles[file] = safe_open(str(file), framework="pt")
                except Exception as exc:  # safetensors raises its own error types for bad headers
                    raise CheckpointError(f"{file}: cannot open safetensors file: {exc}") from exc
            if name in self._handles[file].keys():
                self._slices[name] = self._handles[file].get_slice(name)
        self._float: dict[int, _QuantizedFloatRows] = {}
        for lid in self.spec.layer_ids:
            weight_name, scale_name = engram_tensor_names(lid)
            weight = self._slices.get(weight_name)
            if weight is not None and scale_name not in self._slices and weight.get_dtype() in _FLOAT_TABLE_DTYPES:
                self._float[lid] = _QuantizedFloatRows(weight, self.spec.dim)
            else:
                missing += [name for name in (weight_name, scale_name) if name not in self._slices]
        if missing:
            raise CheckpointError(f"{self.dir}: missing Engram tensors {missing}")
        for position, lid in enumerate(self.spec.layer_ids):
            self._check(lid, self.spec.num_rows[position])

    def _check(self, layer_id: int, rows: int) -> None:
        dim = self.spec.dim
        for name, dtype, shape in zip(engram_tensor_names(layer_id), ("F8_E4M3", "F8_E8M0"),
                                      ([rows, dim], [rows, dim // SCALE_BLOCK])):
            if layer_id in self._float:
                if name.endswith(".scale"):
                    continue
                dtype = self._slices[name].get_dtype()  # any float dtype; quantized when read
            found_shape, found_dtype = list(self._slices[name].get_shape()), self._slices[name].get_dtype()
            if found_dtype == "U8" and dtype == "F8_E8M0":
                found_dtype = dtype  # the same bits, as some writers store UE8M0 scales
            if found_shape != shape or found_dtype != dtype:
                raise CheckpointError(f"{self.dir}: tensor {name} is {found_dtype} {found_shape}, expected "
                                      f"{dtype} {shape} (engram_num_embeddings / engram_head_dim in config.json)")

    def slices(self, layer_id: int) -> tuple[Any, Any]:
        """(weight, scale) row sources of one layer in the FP8 row format; index them with [start:stop]."""
        if layer_id in self._float:
            return self._float[layer_id].parts()
        w, s = engram_tensor_names(layer_id)
        return self._slices[w], self._slices[s]

    def load(self, layer_id: int, chunk_rows: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole table as uint8 CPU tensors, read in chunks (no second full-size copy)."""
        (rows, dim), read_w = row_reader(self.slices(layer_id)[0], "weight")
        _, read_s = row_reader(self.slices(layer_id)[1], "scale")
        w = torch.empty((rows, dim), dtype=torch.uint8)
        s = torch.empty((rows, dim // SCALE_BLOCK), dtype=torch.uint8)
        for start in range(0, rows, chunk_rows):
            stop = min(rows, start + chunk_rows)
            w[start:stop] = torch.from_numpy(read_w(start, stop))
            s[start:stop] = torch.from_numpy(read_s(start, stop))
        return w, s


@dataclass(frozen=True)
class ExportedTable:
    layer_id: int
    path: Path
    rows: int
    bytes: int
    seconds: float


def export_engram_tables(checkpoint_dir: str | Path, out_dir: str | Path, chunk_rows: int = 1 << 16,
                         on_table: Callable[[ExportedTable], None] | None = None,
                         on_rows: Callable[[int, int, int], None] | None = None) -> list[Path]:
    """Write `engram_layer{L}.oftable` for every Engram layer of a checkpoint, streaming rows in chunks.

    on_table(result) is called after each file; on_rows(layer_id, rows_done, rows_total) after each chunk."""
    checkpoint = CheckpointTables(checkpoint_dir)
    try:
        fingerprint = checkpoint.spec.layout_fingerprint()
    except ConfigError as exc:
        raise CheckpointError(f"{Path(checkpoint_dir) / 'config.json'}: {exc}") from exc
    out_dir = Path(out_dir)
    paths = []
    for layer_id, rows in zip(checkpoint.spec.layer_ids, checkpoint.spec.num_rows):
        start, done = time.perf_counter(), [0]

        def progress(n: int) -> None:  # called synchronously per chunk, so layer_id / rows are this layer's
            done[0] += n
            if on_rows is not None:
                on_rows(layer_id, done[0], rows)

        path = out_dir / table_file_name(layer_id)
        weight, scale = checkpoint.slices(layer_id)
        header = write_table_file(path, weight, scale, fingerprint, chunk_rows=chunk_rows, on_rows=progress)
        paths.append(path)
        if on_table is not None:
            on_table(ExportedTable(layer_id, path, header.rows, header.file_bytes, time.perf_counter() - start))
    write_manifest(out_dir)
    return paths
