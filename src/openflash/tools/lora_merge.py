"""`openflash lora merge BASE ADAPTER OUT`: a LoRA adapter folded into its base, written as a full checkpoint in the
base's own layout (FP8 dense linears, FP4 experts, bf16 or fp32 elsewhere), loadable by anything that loads the base.

Each adapted weight becomes W' = W + (alpha / r) B A in fp32, then is quantized back to the weight's stored format
(FP8 blocks: formats.quantize_fp8_blocks; FP4: quantize_mxfp4). That rounding is new error the adapter-served model
does not have; the report states its size beside the size of the update itself.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from openflash import formats
from openflash.checkpoint import checkpoint_folder, load_checkpoint, save_checkpoint
from openflash.errors import OpenflashError
from openflash.files.manifest import MANIFEST_FILE, folder_fingerprint
from openflash.files.peft import adapter_folder, check_base, read_adapter, read_engram_rows
from openflash.files.run_dir import CHECKPOINTS_DIR, STATE_FILE
from openflash.files.shards import INDEX_FILE
from openflash.model.engram_table import DeviceTable
from openflash.model.layers import Linear
from openflash.model.lora import lora_delta


@dataclass
class MergeReport:
    folder: Path
    modules: int  # weights changed
    max_update: float  # largest |(alpha / r) B A| entry
    max_rounding: float  # largest |stored W' - exact W'| entry added by quantizing back
    mean_rounding: float  # mean of that over the changed weights
    engram_rows: int = 0  # trained Engram rows written into the tables

    def summary(self) -> str:
        return (f"{self.folder}: {self.modules} weights merged; the adapter's update is at most {self.max_update:.3g} "
                f"per entry, quantizing back to the stored formats adds at most {self.max_rounding:.3g} "
                f"(mean {self.mean_rounding:.3g})" + (f"; {self.engram_rows} trained Engram rows written into the tables "
                                                      f"(FP8 rows where stored so)" if self.engram_rows else ""))


@torch.no_grad()
def _store(linear: Linear, merged: torch.Tensor) -> None:
    """Write the fp32 weight `merged` into the linear in its own storage format."""
    if linear.storage == "fp8":
        q, s = formats.quantize_fp8_blocks(merged)
    elif linear.storage == "fp4":
        q, s = formats.quantize_mxfp4(merged)
    else:
        linear.weight.copy_(merged.to(linear.weight.dtype))
        return
    linear.weight.copy_(q.view(linear.weight.dtype))
    linear.scale.copy_(s.view(linear.scale.dtype))


@torch.no_grad()
def merge_adapter(base: str | Path, adapter: str | Path, out: str | Path,
                  device: torch.device | str = "cpu") -> MergeReport:
    """Fold the adapter (a PEFT folder or `train --lora` run) into the checkpoint `base`, written to the new folder
    `out` with the base's other files (tokenizer, token map). The model stays in host memory (every tensor is
    written back out); each adapted weight's product and requantization run on `device`, one weight at a time."""
    base, out = Path(base), Path(out)
    if out.exists() and not out.is_dir():
        raise OpenflashError(f"{out} is a file; the merged checkpoint goes to a new folder")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():  # checked before the merge's work, not at its end
        raise OpenflashError(f"{out}: {above} is a file, so no folder can be made under it")
    if out.exists() and any(out.iterdir()):
        raise OpenflashError(f"{out} already exists and is not empty; the merged checkpoint goes to a new folder")
    if out.resolve().parent.name == CHECKPOINTS_DIR:
        raise OpenflashError(f"{out} lies in a training run's {CHECKPOINTS_DIR}/ folder, where it would pass for "
                             f"that run's latest step; write the merged checkpoint elsewhere")
    folder = adapter_folder(adapter)
    lora = read_adapter(folder)
    base = checkpoint_folder(base)
    check_base(lora, folder, base, folder_fingerprint(base))
    model, _ = load_checkpoint(base, weights="stored")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    rounding_max, rounding_sum, count, update_max = 0.0, 0.0, 0, 0.0
    for name, (a, b) in lora.weights.items():
        linear = linears.get(name)
        if linear is None or (linear.out_features, linear.in_features) != (b.shape[0], a.shape[1]):
            raise OpenflashError(f"{folder}: {name} (A {list(a.shape)}, B {list(b.shape)}) is not a linear of {base}")
        delta = lora_delta(a.to(device), b.to(device), lora.scaling)
        merged = linear.dequantized_rows(0, linear.out_features).to(device) + delta
        _store(linear, merged)
        error = (linear.dequantized_rows(0, linear.out_features).to(device) - merged).abs()
        rounding_max, update_max = max(rounding_max, float(error.max())), max(update_max, float(delta.abs().max()))
        rounding_sum, count = rounding_sum + float(error.sum()), count + error.numel()
    rows = _merge_engram_rows(model, read_engram_rows(folder), folder)
    out.mkdir(parents=True, exist_ok=True)
    # A merge is a checkpoint, not a training run's step: the base's trainer state would make it one (a merge
    # written into a run's checkpoints/ would become what --resume continues).
    own = {"config.json", INDEX_FILE, MANIFEST_FILE, STATE_FILE}
    for extra in base.iterdir():  # tokenizer, token map, generation config: as the base has them
        if extra.is_file() and extra.name not in own and not extra.name.endswith(".safetensors"):
            shutil.copy(extra, out / extra.name)
    save_checkpoint(model, out, dtype="fp32" if model.cfg.weight_dtype == "fp32" else "bf16")
    return MergeReport(out, len(lora.weights), update_max, rounding_max, rounding_sum / max(count, 1), rows)


@torch.no_grad()
def _merge_engram_rows(model: nn.Module, tables: dict[str, dict[str, torch.Tensor]], folder: Path) -> int:
    """Write trained Engram rows (`train --train-engram`) into the model's tables, as FP8 rows where the table
    stores those (per-row UE8M0 per 32, engram.md §5); returns how many rows."""
    held = {name: m for name, m in model.named_modules() if isinstance(m, DeviceTable)}
    total = 0
    for name, state in tables.items():
        table = held.get(name)
        if table is None or table.released is not None or table.weight.shape[0] != table.num_rows:
            raise OpenflashError(f"{folder}: trained Engram rows of {name}, which the base does not hold in memory")
        rows, values = state["rows"].long(), state["values"].float()
        if table.storage == "fp8":
            q, scale = formats.encode_window_fp8(values)
            formats.as_uint8(table.weight)[rows] = formats.as_uint8(q)
            formats.as_uint8(table.scale)[rows] = formats.as_uint8(scale)
        else:
            table.weight[rows] = values
        total += rows.numel()
    return total


__all__ = ["MergeReport", "merge_adapter"]
