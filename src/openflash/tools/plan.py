"""`openflash plan`: parameters, bytes by location and KV-cache bytes of a config, from the model built on meta.

Counting conventions follow spec numbers.md: "logical parameters" count every stored value once (FP4 values
individually) and exclude quantization scales. Active parameters per token: attention (with its compressor /
indexer), router, shared expert, the top-k routed experts, mHC and norms of each layer run, the Engram projection and
gains plus the looked-up table values at Engram layers, and the embedding (plus the head for a generated token).
Under CED a prompt token runs only the encoder half; a generated token runs every layer.

The vision tower and aligner and the DSpark draft stages are counted apart from the backbone (the image delimiter
vectors belong to the backbone, as in spec numbers.md); vision weights are bf16 in the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from openflash import formats
from openflash.config import FlashConfig, load_config
from openflash.model.engram_table import DeviceTable
from openflash.model.layers import Linear
from openflash.model.transformer import Transformer


@dataclass
class Plan:
    config: str
    params_total: int
    params_backbone: int
    params_engram_tables: int
    params_dspark: int  # the DSpark draft stages (built)
    params_vision: int  # ViT + aligner
    active_prefill_token: int
    active_decode_token: int
    bytes_by_location: dict[str, int]
    kv_bytes_per_token: int
    window_bytes_per_sequence: int
    context: int
    kv_bytes_at_context: int
    layers: list[dict[str, Any]] = field(default_factory=list)


def _logical(module: nn.Module) -> int:
    """Logical parameter count of a module's own tensors (no children), scales excluded."""
    if isinstance(module, Linear):
        return module.in_features * module.out_features
    if isinstance(module, DeviceTable):
        return module.num_rows * module.dim
    total = sum(p.numel() for p in module.parameters(recurse=False))
    total += sum(b.numel() for name, b in _persistent_buffers(module) if name != "scale")
    return total


def _persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, b) for name, b in module.named_buffers(recurse=False)
            if b is not None and name not in module._non_persistent_buffers_set]


def _count(module: nn.Module, skip: tuple[type, ...] = ()) -> int:
    return sum(_logical(m) for m in module.modules() if not isinstance(m, skip))


def stored_bytes(module: nn.Module) -> int:
    """Bytes in the official checkpoint layout: FP8 dense linears and FP4 experts with their scales, F32 for the
    mHC / sink / router-bias tensors, bf16 for everything else."""
    total = 0
    for m in module.modules():
        if isinstance(m, Linear) and m.quantized:
            total += m.weight.numel() * m.weight.element_size() + m.scale.numel()
        elif isinstance(m, DeviceTable) and m.storage == "fp8":
            total += m.num_rows * (m.dim + m.dim // 32)
        elif isinstance(m, DeviceTable):
            total += m.num_rows * m.dim * 2
        else:
            for name, t in list(m.named_parameters(recurse=False)) + _persistent_buffers(m):
                f32 = name.startswith("hc_") or name in ("attn_sink", "bias", "bias_vl")
                total += t.numel() * (4 if f32 else 2)
    return total


def kv_bytes(cfg: FlashConfig) -> tuple[int, int]:
    """(global KV cache bytes per token, window ring bytes per sequence): a config's cache, no model needed."""
    sources = cfg.topology.kv_sources
    main = sum(formats.cache_entry_bytes("main_kv", cfg.head_dim) / cfg.compress_ratios[s] for s in sources)
    index = sum(formats.cache_entry_bytes("index_k", cfg.index_head_dim) / cfg.compress_ratios[s] for s in sources)
    window = len(cfg.compress_ratios) * cfg.sliding_window * formats.cache_entry_bytes("window", cfg.head_dim)
    return int(round(main + index)), window


def build_plan(name_or_path: str | FlashConfig, context: int = 1_048_576, engram_placement: str = "host") -> Plan:
    """The plan of a preset, config.json or checkpoint folder, or of a config built in code (FlashConfig)."""
    cfg = name_or_path if isinstance(name_or_path, FlashConfig) else load_config(name_or_path)
    with torch.device("meta"):
        model = Transformer(cfg)
    topo = cfg.topology
    tables = sum(_count(m) for m in model.modules() if isinstance(m, DeviceTable))
    dspark = _count(model.mtp)  # the draft stages (embed and head are the backbone's)
    vision = _count(model.vision) + _count(model.aligner) if model.vision is not None else 0
    backbone = _count(model) - tables - dspark - vision
    k, cols = cfg.num_experts_per_tok, cfg.n_hash_columns
    layers = []
    for t, block in zip(topo.layers, model.layers):
        full = _count(block, skip=(DeviceTable,))
        expert = _count(block.ffn.experts[0])
        active = full - (cfg.n_routed_experts - k) * expert
        if t.engram_before:
            active += cols * cfg.engram_head_dim  # the looked-up table values
        layers.append({"index": t.index, "mode": t.mode.value, "half": t.half, "params": full, "active": active})
    embed = cfg.vocab_size * cfg.hidden_size
    prefill = embed + sum(layer["active"] for layer in layers if layer["half"] == "encoder")
    decode = 2 * embed + sum(layer["active"] for layer in layers)

    table_bytes = sum(m.num_rows * (m.dim + m.dim // 32) for m in model.modules() if isinstance(m, DeviceTable))
    dense_bytes = stored_bytes(model) - table_bytes
    where = {"device": "accelerator", "host": "host", "disk": "disk", "sharded": "host (sharded across ranks)"}
    by_location = {"accelerator": dense_bytes}
    by_location[where[engram_placement]] = by_location.get(where[engram_placement], 0) + table_bytes

    kv_per_token, window = kv_bytes(cfg)
    return Plan(
        config="(in code)" if isinstance(name_or_path, FlashConfig) else str(name_or_path),
        params_total=backbone + tables + dspark + vision, params_backbone=backbone,
        params_engram_tables=tables, params_dspark=dspark, params_vision=vision, active_prefill_token=prefill,
        active_decode_token=decode, bytes_by_location=by_location, kv_bytes_per_token=kv_per_token,
        window_bytes_per_sequence=window, context=context, kv_bytes_at_context=kv_per_token * context + window,
        layers=layers)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.2f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return str(n)
