"""LoRA adapters in the PEFT layout, so other tools read what `train --lora` writes (and openflash reads theirs):

    ADAPTER/adapter_config.json        {"peft_type": "LORA", "r", "lora_alpha", "target_modules": [names], ...}
    ADAPTER/adapter_model.safetensors  base_model.model.<module>.lora_A.weight [r, in], ...lora_B.weight [out, r]

Module names are the official checkpoint's (`layers.3.attn.wq_a`), which are also openflash's module names. Only
what openflash applies is accepted: plain LoRA (no DoRA, rsLoRA, bias, per-module rank or alpha patterns), with
finite floating-point weights and a finite alpha whose update cannot overflow fp32.

Beside them openflash writes `base_model.json` ({"path", "fingerprint"}: the checkpoint the adapter was trained on,
`files/manifest.folder_fingerprint`), outside PEFT's config so other tools read the folder as before; loading an
adapter onto another base is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import math
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
    key: str = ""  # a digest of everything that changes the product: weights, scaling, target modules
    base: dict[str, Any] | None = None  # base_model.json: the checkpoint it was trained on (None: not recorded)


CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Engram rows trained beside the adapter (`train --train-engram`), not part of PEFT: table module name -> its rows
# (`<table>.rows` int64), fp32 values and lazy Adam state (model/engram_rows.py TrainedRows.state_dict).
ENGRAM_ROWS_FILE = "engram_rows.safetensors"
BASE_FILE = "base_model.json"  # {"path": the base checkpoint folder, "fingerprint": folder_fingerprint of it}
PREFIX = "base_model.model."
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def write_adapter(folder: str | Path, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], rank: int,
                  alpha: float, base_model: str | None, base: Mapping[str, Any] | None = None) -> Path:
    """Write module name -> (A, B) as a PEFT adapter folder (fp32 tensors), with `base` (path and fingerprint of
    the checkpoint it adapts) as base_model.json; returns the folder."""
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
    if base is not None:
        write_json_atomic(out / BASE_FILE, dict(base))
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
    if not str(path).strip():
        raise OpenflashError("LoRA adapter path is empty; give the adapter folder or `train --lora` run")
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


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise OpenflashError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise OpenflashError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:
        raise OpenflashError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if not isinstance(config, dict):
        raise OpenflashError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_adapter(folder: str | Path) -> Adapter:
    """A PEFT LoRA adapter folder as module name -> (A, B) and its scaling; every problem names the file, the key
    or the tensor. Non-finite weights or alpha, non-float tensors and an update that would overflow fp32 are
    refused here, before any request can reach them."""
    root = Path(folder)
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise OpenflashError(f"{root}: not a LoRA adapter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = _read_config(config_path)
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
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise OpenflashError(f"{config_path}: r must be a positive integer, got {rank!r}")
    if not (_is_number(alpha) and math.isfinite(alpha)):
        raise OpenflashError(f"{config_path}: lora_alpha must be a finite number, got {alpha!r}")
    scaling = float(alpha) / rank
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
        if tensor.dtype not in _FLOAT_DTYPES:
            raise OpenflashError(f"{weights_path}: tensor {key} has dtype {tensor.dtype}; LoRA weights are floating "
                                 f"point (fp32, fp16, bf16)")
        if not bool(torch.isfinite(tensor.float()).all()):
            bad = int((~torch.isfinite(tensor.float())).sum())
            raise OpenflashError(f"{weights_path}: tensor {key} holds {bad} non-finite values (NaN or inf)")
    weights = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise OpenflashError(f"{weights_path}: {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise OpenflashError(f"{weights_path}: {module} has A {list(a.shape)} and B {list(b.shape)}; r = {rank} "
                                 f"needs A [r, in] and B [out, r]")
        a, b = a.float(), b.float()
        # |scaling * (B A)_ij| <= |scaling| * r * max|A| * max|B|: where that bound leaves fp32, the update can too.
        bound = abs(scaling) * rank * float(a.abs().max()) * float(b.abs().max())
        if not bound < torch.finfo(torch.float32).max:
            raise OpenflashError(f"{config_path}: lora_alpha = {alpha!r} with {module}'s weights (max |A| "
                                 f"{float(a.abs().max()):.3g}, max |B| {float(b.abs().max()):.3g}) can overflow "
                                 f"fp32 in the update")
        weights[module] = (a, b)
    if not weights:
        raise OpenflashError(f"{weights_path}: no adapter weights")
    digest = hashlib.sha256(json.dumps({"scaling": scaling, "modules": sorted(weights)}).encode())
    for module, (a, b) in weights.items():  # the tensors as read (sorted by module): no second read of the file
        digest.update(a.numpy().tobytes() + b.numpy().tobytes())
    return Adapter(weights, scaling, digest.hexdigest(), _read_base(root))


def _read_base(root: Path) -> dict[str, Any] | None:
    path = root / BASE_FILE
    if not path.is_file():
        return None
    base = _read_config(path)
    if not isinstance(base.get("fingerprint"), str):
        raise OpenflashError(f"{path}: expected {{\"path\": ..., \"fingerprint\": \"...\"}}")
    return base


def check_base(adapter: Adapter, folder: Path, base_folder: Path | None, base_fingerprint: str | None) -> None:
    """Refuse an adapter recorded as trained on another checkpoint than `base_folder` (fingerprints differ)."""
    if adapter.base is None or base_fingerprint is None or adapter.base["fingerprint"] == base_fingerprint:
        return
    raise OpenflashError(f"{folder}: this adapter was trained on {adapter.base.get('path')} (fingerprint "
                         f"{adapter.base['fingerprint'][:12]}), not on {base_folder} (fingerprint "
                         f"{base_fingerprint[:12]}); its weights would not fit this base's. Use the base it was "
                         f"trained on, or delete {folder / BASE_FILE} to apply it anyway")


__all__ = ["Adapter", "BASE_FILE", "check_base", "ENGRAM_ROWS_FILE", "read_engram_rows", "write_engram_rows", "adapter_folder", "read_adapter", "write_adapter", "CONFIG_FILE", "WEIGHTS_FILE"]
