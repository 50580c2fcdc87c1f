"""HostTable: FP8 rows in CPU RAM (pinned when CUDA exists); looked-up rows are copied to the device."""

from __future__ import annotations

import torch

from openflash.errors import EngramTableError
from openflash.formats import as_uint8
from openflash.memory.rows import CountedTable, TableStats, output_device
from openflash.model.engram_table import SCALE_BLOCK, DeviceTable, check_ids, check_row_format, decode_rows


class HostTable(CountedTable):
    """FP8 rows and scales in CPU RAM; each gather copies only the looked-up rows (264 B each) to `device`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, device: torch.device | str | None = None,
                 pin_memory: bool | None = None) -> None:
        w8, s8 = as_uint8(weight).cpu().contiguous(), as_uint8(scale).cpu().contiguous()
        self.num_rows, self.dim = check_row_format(w8, s8, "Engram HostTable")
        self.device = output_device(device)
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        if self.pinned:
            w8, s8 = w8.pin_memory(), s8.pin_memory()
        self.weight, self.scale = w8, s8
        self.stats = TableStats()

    @classmethod
    def from_device_table(cls, table: DeviceTable, device: torch.device | str | None = None) -> "HostTable":
        if table.storage != "fp8":
            raise EngramTableError("a HostTable holds FP8 rows; call DeviceTable.to_fp8() on an fp32 table first")
        return cls(table.weight.detach(), table.scale.detach(), device=device)

    @property
    def row_bytes(self) -> int:
        return self.dim + self.dim // SCALE_BLOCK

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        check_ids(flat, self.num_rows, "Engram HostTable")
        n = flat.numel()
        # Gather straight into pinned staging memory so the copy to the accelerator can overlap (non_blocking).
        w = torch.empty((n, self.dim), dtype=torch.uint8, pin_memory=self.pinned)
        s = torch.empty((n, self.dim // SCALE_BLOCK), dtype=torch.uint8, pin_memory=self.pinned)
        torch.index_select(self.weight, 0, flat, out=w)
        torch.index_select(self.scale, 0, flat, out=s)
        w = w.to(self.device, non_blocking=self.pinned)
        s = s.to(self.device, non_blocking=self.pinned)
        self.stats.gathers += 1
        self.stats.rows_requested += n
        return decode_rows(w, s).reshape(*ids.shape, self.dim)
