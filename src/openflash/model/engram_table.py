"""The Engram table held by the model: `DeviceTable` (`...engram.embed.weight` / `.scale` in the state_dict), fp32
while training, FP8 rows (checkpoint layout) otherwise, and the FP8 row format every tier shares (engram.md §3, §5).

A looked-up row dequantises to fp32(weight[r, d]) * 2^(scale[r, d//32] - 127), then rounds to bf16. Other tiers
(memory/tiers/) hold the same rows elsewhere and decode them with `decode_rows`, so every tier returns the same bits.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from openflash.errors import ConfigError, EngramTableError
from openflash.formats import as_uint8, dequantize_fp8_rows, encode_window_fp8
from openflash.model.engram_rows import TrainedRows

SCALE_BLOCK = 32  # one UE8M0 scale per 32 consecutive values of a row (engram.md §5)
UE8M0_ONE = 127  # scale byte of 2^0: the padding value of sharded scale blocks (checkpoint.md §6)


def decode_rows(weight_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """FP8 rows + UE8M0 row scales (uint8) -> fp32 holding the bf16-rounded values (engram.md §5)."""
    return dequantize_fp8_rows(weight_u8, scale_u8).to(torch.bfloat16).to(torch.float32)


def check_ids(ids: torch.Tensor, num_rows: int, where: str) -> None:
    """Out-of-range ids mean the hash layout and the table disagree; numpy would wrap negatives silently."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise EngramTableError(f"{where}: hash ids must be int64, got {ids.dtype}")
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise EngramTableError(
            f"{where}: hash id {bad} is outside the table's {num_rows} rows (hash layout and table do not match)"
        )


def check_row_format(weight_u8: torch.Tensor, scale_u8: torch.Tensor, where: str) -> tuple[int, int]:
    if weight_u8.dim() != 2 or scale_u8.dim() != 2:
        raise EngramTableError(f"{where}: weight and scale must be 2-D, got {list(weight_u8.shape)} and "
                               f"{list(scale_u8.shape)}")
    rows, dim = weight_u8.shape
    if dim % SCALE_BLOCK != 0:
        raise EngramTableError(f"{where}: row width {dim} is not a multiple of {SCALE_BLOCK}")
    if tuple(scale_u8.shape) != (rows, dim // SCALE_BLOCK):
        raise EngramTableError(f"{where}: scale has shape {list(scale_u8.shape)}, expected "
                               f"[{rows}, {dim // SCALE_BLOCK}] for weight [{rows}, {dim}]")
    return rows, dim


class DeviceTable(nn.Module):
    """The table as model weights: `weight` (and `scale`) are part of the model's state_dict.

    storage="fp8": `weight` float8_e4m3fn [rows, dim] and `scale` float8_e8m0fnu [rows, dim/32], exactly as the
    checkpoint stores them (frozen parameters). storage="fp32": a trainable fp32 `weight` for training from scratch;
    its gather is a plain differentiable embedding lookup without bf16 rounding. When another tier takes over the
    rows (EngramMemory.attach), `release` frees them here.
    """

    def __init__(self, num_rows: int, dim: int, storage: str = "fp8", device: torch.device | str | None = None,
                 init_std: float = 1.0) -> None:
        super().__init__()
        if storage not in ("fp8", "fp32"):
            raise ConfigError(f"Engram table storage must be 'fp8' or 'fp32', got {storage!r}")
        if dim % SCALE_BLOCK != 0:
            raise ConfigError(f"engram_head_dim {dim} is not a multiple of {SCALE_BLOCK} (one scale per 32 values)")
        self.num_rows, self.dim, self.storage, self.init_std = int(num_rows), int(dim), storage, init_std
        self.released: str | None = None  # the tier that took over the rows (see `release`)
        self.trained: TrainedRows | None = None  # rows a LoRA run trains (`train --train-engram`), fp32 masters
        if storage == "fp8":
            self.weight = nn.Parameter(torch.zeros(num_rows, dim, dtype=torch.float8_e4m3fn, device=device),
                                       requires_grad=False)
            # Byte 127 = 2^0, so a fresh table decodes to zeros rather than to whatever empty memory held.
            scale = torch.full((num_rows, dim // SCALE_BLOCK), UE8M0_ONE, dtype=torch.uint8, device=device)
            self.scale = nn.Parameter(scale.view(torch.float8_e8m0fnu), requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(num_rows, dim, dtype=torch.float32, device=device))
            self.scale = None
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random init of a trainable table (a training choice, not part of the spec: engram.md §9.3)."""
        if self.storage == "fp32" and self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=self.init_std)

    @property
    def row_bytes(self) -> int:
        """Bytes one row occupies in this storage (264 for the released fp8 rows of 256 values)."""
        return self.dim + self.dim // SCALE_BLOCK if self.storage == "fp8" else 4 * self.dim

    # The EngramTable protocol (memory/rows.py) of the model's own tables: looked up in place, no counters.
    collective = False
    host_ids = False

    def warm(self, ids: torch.Tensor) -> int:
        return 0

    def counters(self) -> dict[str, Any] | None:
        return None

    def reset_counters(self) -> None:
        pass

    def problem(self) -> str | None:
        return None if self.released is None else f"its rows were moved to the {self.released!r} tier"

    def close(self) -> None:
        pass

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        if self.released is not None:
            raise EngramTableError(f"this Engram table's rows were moved to the {self.released!r} tier; look them "
                                   f"up through the EngramMemory that holds them (its prepare() hands the rows down)")
        if self.storage == "fp32" and self.trained is None:
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1).to(self.weight.device)
        if flat.device.type == "cpu":  # on an accelerator index_select asserts on bad ids; a CPU check is free
            check_ids(flat, self.num_rows, "Engram DeviceTable")
        if self.storage == "fp32":
            rows = self.weight.index_select(0, flat)
        else:
            rows = decode_rows(as_uint8(self.weight).index_select(0, flat), as_uint8(self.scale).index_select(0, flat))
        if self.trained is not None:
            rows = self.trained.overlay(flat, rows)
        return rows.reshape(*ids.shape, self.dim)

    forward = gather

    @torch.no_grad()
    def to_fp8(self) -> "DeviceTable":
        """This table in checkpoint row format (per-row 1x32 UE8M0 blocks), e.g. to save in the official layout."""
        if self.storage == "fp8":
            return self
        return DeviceTable.from_fp32(self.weight.detach())

    @classmethod
    @torch.no_grad()
    def from_fp32(cls, weight: torch.Tensor) -> "DeviceTable":
        """Quantize an fp32 [rows, dim] table to FP8 rows with one UE8M0 scale per 32 values of a row.

        Uses the act_quant rule (quant_and_cache.md §2.1: power-of-two ceiling of amax/448, RNE, saturating),
        which formats exposes for any per-32 FP8 row format as `encode_window_fp8`."""
        q, scale = encode_window_fp8(weight.detach().float())
        return cls.from_fp8(q, scale)

    @classmethod
    @torch.no_grad()
    def from_fp8(cls, weight: torch.Tensor, scale: torch.Tensor) -> "DeviceTable":
        """Wrap checkpoint tensors (float8, or their uint8 bytes) as a frozen fp8 table, sharing their memory."""
        w8, s8 = as_uint8(weight), as_uint8(scale)
        rows, dim = check_row_format(w8, s8, "Engram DeviceTable")
        table = cls(rows, dim, storage="fp8", device="meta")  # meta: allocate nothing, then adopt the tensors
        table.weight = nn.Parameter(w8.view(torch.float8_e4m3fn), requires_grad=False)
        table.scale = nn.Parameter(s8.view(torch.float8_e8m0fnu), requires_grad=False)
        return table

    @torch.no_grad()
    def release(self, placement: str) -> None:
        """Free the rows: another tier (host / disk / sharded) serves them from now on.

        The weight (and scale) become empty [0, dim] tensors of the same dtype and device, so the memory is really
        returned while `.to(device)` keeps working. A released table cannot be gathered from or saved: the
        model's state_dict() (and so save_checkpoint) raises EngramTableError. Save before attaching a tier.
        """
        if self.released is not None:
            return
        self.released = placement
        self.weight = nn.Parameter(self.weight.new_empty((0, self.dim)), requires_grad=False)
        if self.scale is not None:
            self.scale = nn.Parameter(self.scale.new_empty((0, self.dim // SCALE_BLOCK)), requires_grad=False)
        self.register_state_dict_pre_hook(_refuse_released_state_dict)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "DeviceTable":
        # Module.to(dtype) / .float() / .bfloat16() cast every floating-point tensor, float8 included, which would
        # silently decode the stored FP8 rows into a 2-4x larger table. FP8 storage follows device moves only.
        if self.storage == "fp8":
            probe = fn(torch.empty(0, dtype=torch.float8_e4m3fn, device=self.weight.device))
            if isinstance(probe, torch.Tensor) and probe.dtype != torch.float8_e4m3fn:
                return super()._apply(lambda t: t.to(probe.device), recurse)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"rows={self.num_rows}, dim={self.dim}, storage={self.storage}"


def _refuse_released_state_dict(module: DeviceTable, prefix: str, keep_vars: bool) -> None:
    raise EngramTableError(f"{prefix}weight: this Engram table was released to the {module.released!r} tier "
                           f"(EngramMemory.attach), so the model cannot be saved with its tables; save the "
                           f"checkpoint before attaching a tier, or use the exported table files")
