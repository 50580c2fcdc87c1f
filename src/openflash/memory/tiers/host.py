"""HostTable: FP8 rows in CPU RAM; looked-up rows are copied to the device.

Next to a GPU, what is pinned is the staging memory each gather fills (a step's rows, kilobytes), which the copy
to the GPU reads asynchronously; the table itself stays in ordinary pages. Pinning the table would buy nothing for
this gather (the CPU reads it either way) and cost a second copy of it: PyTorch's pinned allocator also rounds each
block up to a power of two, so the 94.6 GiB of a released table would ask for 128 GiB of page-locked RAM.
"""

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
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory  # the staging memory
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
