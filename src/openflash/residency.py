"""Weights residency: the form a loaded model keeps its weights in, what each form costs, and the default choice.

"stored" keeps FP8 / FP4 codes with their scales (bf16 matrices as bf16), the checkpoint's bytes; "dequantized"
keeps fp32 copies. checkpoint.load_checkpoint asks `choose_residency` when the caller says "auto".
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from openflash import kernels
from openflash.model.layers import Linear
from openflash.model.transformer import Transformer


def bf16_matrices(model: Transformer) -> set[str]:
    """State-dict names of the matrices whose consumers compute in fp32 from any float dtype (linears, embedding
    tables, the vision tower's linears): under "stored" residency these stay bf16 as stored."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, (Linear, nn.Linear, nn.Embedding)) and isinstance(module.weight, nn.Parameter):
            names.add(f"{prefix}.weight" if prefix else "weight")
    return names


def dequantized_bytes(model: Transformer) -> int:
    """What "dequantized" residency adds over the stored bytes: fp32 copies of FP8/FP4 linears, bf16 promoted."""
    extra = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.quantized:
            extra += 4 * module.in_features * module.out_features
    extra += sum(2 * p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and
                 not n.endswith("engram.embed.weight") and p.dtype in (torch.float32, torch.bfloat16))
    return extra


def resident_bytes(model: Transformer) -> int:
    """Bytes the model holds: its parameters and buffers (each storage once) plus fp32 caches of its linears."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta":
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total + sum(m.dequantized_bytes for m in model.modules() if isinstance(m, Linear))


# The narrowest hidden size at which the native kernels on stored weights decode faster than fp32 copies on both
# backends (docs/benchmarks.md, "weights as stored against dequantized": 1.5x eager and 1.7x compiled at 256; at 128
# each product's call costs more than its arithmetic and the compiled graph on fp32 copies wins).
KERNELS_WIDTH = 256


def choose_residency(model: Transformer, available: int | None = None, device: str | torch.device = "cpu") -> str:
    """"stored" when the fp32 copies would take more than a quarter of the memory available, or when the native
    kernels serve the model's FP8/FP4 weights here (CPU) at a hidden size of KERNELS_WIDTH or more, where they
    decode faster (prefill is 7-8% slower there: one dequantized tile per product); "dequantized" otherwise."""
    if available is not None:
        free = available
    elif torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        free = available_memory()
    if dequantized_bytes(model) > free // 4:
        return "stored"
    stored = {m.storage for m in model.modules() if isinstance(m, Linear) and m.quantized}
    # One decode row: the step stored weights are chosen for. Only the native kernels' speed has been measured
    # against the dequantized path; Triton's on CUDA has not (docs/benchmarks.md), so CUDA keeps fp32 copies.
    native = bool(stored) and all(kernels.product_kernel(torch.device(device), f, 1) == "native" for f in stored)
    return "stored" if native and model.cfg.hidden_size >= KERNELS_WIDTH else "dequantized"


def available_memory() -> int:
    """Bytes of memory available to this process (MemAvailable; the cgroup limit where lower)."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = min(free, room) if free is not None else room
    except (OSError, ValueError):
        pass
    return free if free is not None else 16 << 30
