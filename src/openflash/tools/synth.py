"""`openflash checkpoint synth CONFIG OUT`: a random-weights checkpoint in the official layout, at any width.

What a user of the released model can test against without its 476 GiB: config.json in the HF layout, tensors under
the official names and stored dtypes (FP8 E4M3 dense linears with 32x32 UE8M0 block scales, MXFP4 routed experts as
I8 bytes with a UE8M0 scale per 32, FP8 Engram rows with a scale per 32, bf16 elsewhere, F32 for mHC / sinks /
router biases), shards of at most `shard_bytes` with `model.safetensors.index.json`, written one shard at a time so
memory stays at about one shard.

Cuts for machines smaller than the release: `layers` keeps the widths and takes the first N layers (a prefix keeps
a valid CSA2 topology: every owner precedes the layers that read it; sources, the candidate layer and Engram layers
beyond N are dropped, and so is the DSpark head, whose target layers are the last ones); `experts` keeps N routed
experts per layer (top-k capped at N). Engram tables larger than `dense_table_bytes` are written as sparse files of
zero rows (a zero FP8 row adds nothing): they take no disk space and read back as zeros, at the released row counts;
the same tables are also written as sparse disk-tier table files in `engram_tables/` (what `openflash engram
export` would write), so `--engram-placement disk` serves them without an export of ~100 GiB of zeros.

Weights: dense and Engram projections N(0, 1/fan_in); those stored as FP8 with block scales get E4M3 codes drawn
from a table of that distribution's quantiles under one power-of-two scale (what quantizing gaussians tile by tile
gives, less the tile-to-tile scale variation, without encoding every value); routed experts as uniformly random
E2M1 codes with a per-tensor scale exponent that gives the same standard deviation (drawing gaussians for all 384
experts would take minutes per layer and changes nothing a benchmark measures); norms 1 + 0.1 N(0, 1), embeddings
N(0, 1), mHC scales U(0.5, 1.5), biases and sinks small gaussians.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors.torch import save_file

from openflash import formats
from openflash.checkpoint import build_model, official_tensors, stored_as_fp4, stored_as_fp8_blocks
from openflash.config import FlashConfig, load_config
from openflash.errors import OpenflashError
from openflash.files.atomic import write_text_atomic
from openflash.files.manifest import write_manifest
from openflash.files.shards import INDEX_FILE
from openflash.memory.checkpoint_tables import read_engram_spec
from openflash.memory.table_file import TableHeader, table_file_name
from openflash.tokenizer import needs_cut, preset_tokenizer

E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of uniformly random codes
QUANTILES = 1 << 15  # levels of the table FP8 weight codes are drawn from


@dataclass(frozen=True)
class SynthReport:
    folder: Path
    tensors: int
    shards: int
    bytes_written: int  # on disk (sparse tables excluded)
    logical_bytes: int  # what the tensors would take written out
    sparse_tables: list[str]


def cut_config(cfg: FlashConfig, layers: int | None = None, experts: int | None = None,
               vision: bool = True) -> FlashConfig:
    """The config with the first `layers` layers and `experts` routed experts per layer (module doc)."""
    changes: dict = {}
    if layers is not None:
        n = cfg.num_hidden_layers
        if not 1 <= layers <= n:
            raise OpenflashError(f"--layers must be in 1..{n}, got {layers}")
        keep = [i for i, layer in enumerate(cfg.engram_layer_ids) if layer < layers]
        extra = dict(cfg.extra_text)
        if cfg.num_nextn_predict_layers:
            extra.update(dspark_block_size=0, dspark_target_layer_ids=[], dspark_n_routed_experts=0,
                         dspark_num_experts_per_tok=0)
        changes.update(
            num_hidden_layers=layers, compress_ratios=cfg.compress_ratios[:layers], num_nextn_predict_layers=0,
            kv_source_layer_ids=[i for i in cfg.kv_source_layer_ids if i < layers],
            index_source_layer_ids=[i for i in cfg.index_source_layer_ids if i < layers],
            candidate_source_layer_id=cfg.candidate_source_layer_id if cfg.candidate_source_layer_id < layers else -1,
            engram_layer_ids=[cfg.engram_layer_ids[i] for i in keep],
            engram_num_embeddings=[cfg.engram_num_embeddings[i] for i in keep], extra_text=extra)
    if experts is not None:
        if not 1 <= experts <= cfg.n_routed_experts:
            raise OpenflashError(f"--experts must be in 1..{cfg.n_routed_experts}, got {experts}")
        changes.update(n_routed_experts=experts, num_experts_per_tok=min(cfg.num_experts_per_tok, experts))
    if not vision and cfg.has_vision:
        root = dict(cfg.extra_root)
        root["vision_config"] = {**root["vision_config"], "num_hidden_layers": 0}
        changes["extra_root"] = root
    return cfg.replace(**changes).replace(weight_dtype="fp8", expert_dtype="fp4") if changes else \
        cfg.replace(weight_dtype="fp8", expert_dtype="fp4")


def _gaussian(shape: tuple[int, ...], mean: float, std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).normal_(mean, std, generator=gen)


def _random_float(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) or leaf in ("q_weight", "k_weight"):
        return _gaussian(shape, 1.0, 0.1, gen)
    if name.endswith("hc_attn_scale") or name.endswith("hc_ffn_scale"):
        return 0.5 + torch.rand(shape, generator=gen)
    if leaf in ("attn_sink", "bias", "bias_vl") or "hc_" in leaf or name.startswith("image_"):
        return _gaussian(shape, 0.0, 0.1, gen)
    if name == "embed.weight" or name.endswith(".embed.weight"):
        return _gaussian(shape, 0.0, 1.0, gen)
    return _gaussian(shape, 0.0, _fan_in(shape) ** -0.5, gen)


def _fan_in(shape: tuple[int, ...]) -> int:
    return shape[-1] if len(shape) > 1 else 1


def _random_fp8(shape: tuple[int, int], std: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes, UE8M0 block scales) of N(0, std): each code drawn from a table of QUANTILES quantiles of the
    distribution, encoded under one power-of-two scale that keeps the most extreme at most 448."""
    levels = torch.special.ndtri((torch.arange(QUANTILES, dtype=torch.float64) + 0.5) / QUANTILES) * std
    exponent = math.ceil(math.log2(float(levels.abs().max()) / formats.E4M3_MAX))
    table = formats.e4m3_encode((levels * 2.0 ** -exponent).float())
    picks = torch.randint(0, QUANTILES, (math.prod(shape),), generator=gen, dtype=torch.int32)
    codes = table.index_select(0, picks).view(shape)
    b = formats.FP8_BLOCK
    scale = torch.full((-(-shape[0] // b), -(-shape[1] // b)), 127 + exponent, dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)


def _random_fp4(shape: tuple[int, ...], rng: np.random.Generator) -> dict[str, torch.Tensor]:
    out_features, half = shape
    codes = torch.from_numpy(rng.integers(-128, 128, size=(out_features, half), dtype=np.int8))
    exponent = round(math.log2(((2 * half) ** -0.5) / E2M1_RMS))  # per-tensor: std 1/sqrt(fan_in)
    jitter = torch.from_numpy(rng.integers(-1, 2, size=(out_features, 2 * half // 32), dtype=np.int16))
    scale = (127 + exponent + jitter).clamp(1, 254).to(torch.uint8).view(torch.float8_e8m0fnu)
    return {"weight": codes, "scale": scale}


def _tensors_of(name: str, meta: torch.Tensor, gen: torch.Generator,
                rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """The stored tensor(s) of one state_dict entry, in the official dtypes (checkpoint.official_tensors, but for
    the routed experts: random codes, not quantized gaussians)."""
    if name.endswith(".scale"):
        return {}  # written with its weight
    if stored_as_fp4(name):
        t = _random_fp4(tuple(meta.shape), rng)
        return {name: t["weight"], name[: -len("weight")] + "scale": t["scale"]}
    if name.endswith("engram.embed.weight"):
        return official_tensors(name, _gaussian(tuple(meta.shape), 0.0, 0.5, gen), "fp8")
    if meta.dim() == 2 and stored_as_fp8_blocks(name):
        codes, scale = _random_fp8(tuple(meta.shape), _fan_in(tuple(meta.shape)) ** -0.5, gen)
        return {name: codes, name[: -len("weight")] + "scale": scale}
    return official_tensors(name, _random_float(name, tuple(meta.shape), gen), "fp8")


def _write_sparse_table(path: Path, name: str, rows: int, dim: int) -> int:
    """A safetensors file holding one Engram table of zero rows (FP8 weight + UE8M0 scale) without writing them."""
    weight_bytes, scale_bytes = rows * dim, rows * (dim // 32)
    header = {name: {"dtype": "F8_E4M3", "shape": [rows, dim], "data_offsets": [0, weight_bytes]},
              name[: -len("weight")] + "scale": {"dtype": "F8_E8M0", "shape": [rows, dim // 32],
                                                 "data_offsets": [weight_bytes, weight_bytes + scale_bytes]},
              "__metadata__": {"format": "pt", "openflash": "sparse zero rows (checkpoint synth)"}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + weight_bytes + scale_bytes)  # a hole: reads as zeros, takes no space
    os.replace(tmp, path)
    return 8 + len(text)


def synthesize(config: str | FlashConfig, out: str | Path, *, layers: int | None = None, experts: int | None = None,
               seed: int = 0, vision: bool = True, shard_bytes: int = 4 << 30,
               dense_table_bytes: int = 1 << 30) -> SynthReport:
    """Write the checkpoint (module doc) and return what was written."""
    cfg = cut_config(config if isinstance(config, FlashConfig) else load_config(config), layers, experts, vision)
    folder = Path(out)
    if folder.exists() and any(folder.iterdir()):
        raise OpenflashError(f"{folder}: not empty; checkpoint synth writes a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg, device="meta")
    entries = list(model.state_dict().items())
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    tables = {n: t for n, t in entries if n.endswith("engram.embed.weight") and t.numel() * 1.03 > dense_table_bytes}
    n_shards_guess = 1 + sum(t.numel() * t.element_size() for _, t in entries) // shard_bytes + len(tables)
    weight_map: dict[str, str] = {}
    written = logical = count = 0
    shard_names: list[str] = []

    def shard_name(i: int) -> str:
        return f"model-{i:05d}-of-{n_shards_guess:05d}.safetensors"

    def flush(shard: dict[str, torch.Tensor]) -> None:
        nonlocal written
        name = shard_name(len(shard_names) + 1)
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        written += (folder / name).stat().st_size
        shard_names.append(name)
        weight_map.update({k: name for k in shard})

    shard: dict[str, torch.Tensor] = {}
    size = 0
    for tensors in _generate(entries, tables, gen, rng):
        for key, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shard and size + nbytes > shard_bytes:
                flush(shard)
                shard, size = {}, 0
            shard[key] = t
            size += nbytes
            logical += nbytes
            count += 1
    if shard:
        flush(shard)
    for name, meta in tables.items():
        file = shard_name(len(shard_names) + 1)
        written += _write_sparse_table(folder / file, name, meta.shape[0], meta.shape[1])
        logical += meta.numel() * (1 + 1 / 32)
        shard_names.append(file)
        weight_map[name] = weight_map[name[: -len("weight")] + "scale"] = file
        count += 2
    # The file names promised a shard count; rename to the real one if the guess was off.
    final = {old: f"model-{i:05d}-of-{len(shard_names):05d}.safetensors" for i, old in enumerate(shard_names, 1)}
    for old, new in final.items():
        if old != new:
            os.replace(folder / old, folder / new)
    weight_map = {k: final[v] for k, v in weight_map.items()}
    write_text_atomic(folder / INDEX_FILE, json.dumps({"metadata": {"total_size": int(logical)},
                                                       "weight_map": weight_map}, indent=1))
    write_text_atomic(folder / "config.json", json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    if tables:
        spec = read_engram_spec(folder)
        for name in tables:
            layer = int(name.split(".")[1])
            slot = cfg.engram_layer_ids.index(layer)
            header = TableHeader(rows=spec.num_rows[slot], dim=spec.dim, layout_fingerprint=spec.layout_fingerprint())
            path = folder / "engram_tables" / table_file_name(layer)
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as f:
                f.write(header.encode())
                f.truncate(header.file_bytes)
    if needs_cut(cfg.vocab_size):  # a vocabulary smaller than DeepSeek's (presets): the matching cut
        preset_tokenizer(cfg).save(str(folder / "tokenizer.json"))
    if not tables:  # hashing sparse tables would read ~100 GiB of holes; `openflash verify --write` can
        write_manifest(folder)
    return SynthReport(folder, count, len(shard_names), written, int(logical), sorted(tables))


def _generate(entries: list[tuple[str, torch.Tensor]], tables: dict[str, torch.Tensor], gen: torch.Generator,
              rng: np.random.Generator) -> Iterator[dict[str, torch.Tensor]]:
    for name, meta in entries:
        if name in tables or name[: -len("scale")] + "weight" in tables:
            continue
        yield _tensors_of(name, meta, gen, rng)


__all__ = ["synthesize", "cut_config", "SynthReport"]
