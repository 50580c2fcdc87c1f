"""LoRA adapters in the PEFT layout, so other tools read what `train --lora` writes (and openflash reads theirs):

    ADAPTER/adapter_config.json        {"peft_type": "LORA", "r", "lora_alpha", "target_modules": [names], ...}
    ADAPTER/adapter_model.safetensors  base_model.model.<module>.lora_A.weight [r, in], ...lora_B.weight [out, r]

Module names are the official checkpoint's (`layers.3.attn.wq_a`), which are also openflash's module names. Only
what openflash applies is accepted: plain LoRA (no DoRA, rsLoRA, bias, per-module rank or alpha patterns).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from openflash.errors import OpenflashError
from openflash.files.atomic import write_json_atomic
from openflash.files.manifest import write_manifest
from openflash.files.run_dir import latest_checkpoint

@dataclass
class Adapter:
    """One adapter as read: module name -> (A [r, in], B [out, r]) in fp32, and its alpha / rank."""

    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float


CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Engram rows trained beside the adapter (`train --train-engram`), not part of PEFT: table module name -> its rows
# (`<table>.rows` int64), fp32 values and lazy Adam state (model/engram_rows.py TrainedRows.state_dict).
ENGRAM_ROWS_FILE = "engram_rows.safetensors"
PREFIX = "base_model.model."


def write_adapter(folder: str | Path, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], rank: int,
                  alpha: float, base_model: str | None) -> Path:
    """Write module name -> (A, B) as a PEFT adapter folder (fp32 tensors); returns the folder."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"{PREFIX}{module}.lora_A.weight"] = a.detach().float().cpu().contiguous()
        tensors[f"{PREFIX}{module}.lora_B.weight"] = b.detach().float().cpu().contiguous()
    _save(tensors, out / WEIGHTS_FILE)
    write_json_atomic(out / CONFIG_FILE, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "inference_mode": True, "modules_to_save": None,
        "target_modules": sorted(weights)})
    write_manifest(out)
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise OpenflashError(f"{path}: unreadable safetensors file ({exc})") from None


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Written whole or not at all (a temporary file, renamed)."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)


def write_engram_rows(folder: Path, tables: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    _save({f"{table}.{key}": t.detach().cpu().contiguous() for table, state in tables.items()
           for key, t in state.items()}, folder / ENGRAM_ROWS_FILE)


def read_engram_rows(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The trained Engram rows saved beside an adapter, by table module name ({} when there are none)."""
    path = folder / ENGRAM_ROWS_FILE
    if not path.is_file():
        return {}
    tensors = _tensors(path)
    tables: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        table, _, field = key.rpartition(".")
        tables.setdefault(table, {})[field] = tensor
    for table, state in tables.items():
        if {"rows", "values"} - set(state):
            raise OpenflashError(f"{path}: {table} lacks its rows or values")
    return tables


def adapter_folder(path: str | Path) -> Path:
    """An adapter folder as given, or the latest checkpoint of a `train --lora` run folder."""
    root = Path(path)
    if (root / CONFIG_FILE).is_file():
        return root
    latest = latest_checkpoint(root)
    if latest is not None and (latest / CONFIG_FILE).is_file():
        return latest
    if not root.exists():
        raise OpenflashError(f"LoRA adapter {root} does not exist")
    raise OpenflashError(f"{root}: neither a LoRA adapter folder ({CONFIG_FILE}, {WEIGHTS_FILE}) nor a "
                         f"`train --lora` run with a checkpoint")


def read_adapter(folder: str | Path) -> Adapter:
    """A PEFT LoRA adapter folder as module name -> (A, B) and its scaling; every problem names the file."""
    root = Path(folder)
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise OpenflashError(f"{root}: not a LoRA adapter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise OpenflashError(f"{config_path}: not valid JSON ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise OpenflashError(f"{config_path}: peft_type {config.get('peft_type')!r}; only LORA adapters apply")
    for field, plain in (("use_dora", False), ("use_rslora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if config.get(field, plain) != plain:
            raise OpenflashError(f"{config_path}: {field} = {config[field]!r}; openflash applies plain LoRA "
                                 f"({field} = {plain!r})")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise OpenflashError(f"{config_path}: {field} is not supported (one rank and alpha for every module)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise OpenflashError(f"{config_path}: r must be a positive integer and lora_alpha a number (got r={rank!r}, "
                             f"lora_alpha={alpha!r})")
    tensors = _tensors(weights_path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if name.endswith(suffix):
                pairs.setdefault(name[:-len(suffix)], {})[part] = tensor
                break
        else:
            raise OpenflashError(f"{weights_path}: tensor {key} is not a lora_A or lora_B weight")
    weights = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise OpenflashError(f"{weights_path}: {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise OpenflashError(f"{weights_path}: {module} has A {list(a.shape)} and B {list(b.shape)}; r = {rank} "
                                 f"needs A [r, in] and B [out, r]")
        weights[module] = (a.float(), b.float())
    if not weights:
        raise OpenflashError(f"{weights_path}: no adapter weights")
    return Adapter(weights, float(alpha) / rank)


__all__ = ["Adapter", "ENGRAM_ROWS_FILE", "read_engram_rows", "write_engram_rows", "adapter_folder", "read_adapter", "write_adapter", "CONFIG_FILE", "WEIGHTS_FILE"]
