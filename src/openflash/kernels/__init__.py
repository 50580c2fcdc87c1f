"""Kernels for the stored weight formats. On the CPU: native.py builds, loads and registers them; the C code is gemv.c
(entry points, the experts' call), activations.c (QDQ, layouts), avx2.c and avx512.c (the products). On CUDA:
triton_products.py (FP8 and MXFP4 products in Triton), triton_experts.py (a layer's routed FP4 experts) and
triton_index.py (the indexer's scores from the engine's block pool), triton_attention.py (the sparse attention's
picked entries, from the same pool, and its window rings).

Whether a kernel serves a product is answered here and only here (`product_kernel`, `serves`, `experts_kernel`,
`cache_kernel`): the layers, the MoE, the engine's cache, the decode graph and `--weights auto` all ask these."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from openflash.kernels import native, triton_attention, triton_experts, triton_index, triton_products

NATIVE_FORMATS = ("fp8", "fp4", "bf16")  # what the CPU kernels read as stored
TRITON_FORMATS = ("fp8", "fp4")


@lru_cache(maxsize=None)
def triton_on() -> bool:
    """Whether the Triton kernels serve CUDA tensors: Triton importable, and OPENFLASH_KERNELS not 0 (which turns
    every kernel off, native and Triton: the PyTorch path everywhere, e.g. to rule a kernel out). Read once a
    process; a test that sets the variable clears this cache, as native.status's."""
    return triton_products.available() and os.environ.get("OPENFLASH_KERNELS", "1") != "0"


def native_rows(stored: str, training: bool = False) -> int | None:
    """The most activation rows the native kernels multiply a weight stored as `stored` by (None: any, MAX_ROWS a
    call), where past it the PyTorch path is faster: a bf16 weight goes to the BLAS as it is, and on AVX2 an FP4
    weight dequantized once beats reading it once per 16 rows (measured at the released shapes on the 2-core Xeon,
    AVX2 forced: 256 rows 53 ms against 43; 64 rows 13.5 against 23; benchmarks/released_prefill.py). training: a
    training-mode forward keeps more rows than one call on the PyTorch path, as its backward and its other passes
    have them (an RL update's old log-probs, a batch split over ranks), so their sums agree and no FP8 activation
    rounding flips between them."""
    if stored == "bf16" or training:
        return native.MAX_ROWS
    if stored == "fp4" and not native.status().isa & native.ISA_AVX512_BF16:
        return 128
    return None


def product_kernel(device: torch.device, stored: str | None, rows: int, training: bool = False) -> str | None:
    """Which kernel multiplies `rows` activation rows on `device` by a weight kept as stored in format `stored`
    (fp8, fp4, bf16; None: an fp32 weight, no kernel): "native" (the CPU, the kernels built here, up to
    `native_rows`), "triton" (CUDA, FP8 or FP4, any rows, Triton importable), or None (the PyTorch path)."""
    if device.type == "cpu" and stored in NATIVE_FORMATS and native.available() and \
            1 <= rows <= (native_rows(stored, training) or rows):
        return "native"
    if device.type == "cuda" and stored in TRITON_FORMATS and triton_on():
        return "triton"
    return None


def serves(x: torch.Tensor, weight: torch.Tensor, stored: str | None, training: bool = False) -> bool:
    """Whether a kernel multiplies x [..., K] by this stored weight: `product_kernel` names one for x's device and
    rows, the weight lies on that device, contiguous, and K is whole 32-blocks."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (product_kernel(x.device, stored, rows, training) is not None and weight.device == x.device
            and weight.is_contiguous() and x.shape[-1] % native.BLOCK == 0)


def experts_kernel(device: torch.device, stored: str | None) -> str | None:
    """Which kernel computes a MoE layer's routed experts from their stored bytes in one call: "native" for FP4
    experts on the CPU (kernels/native.py `fp4_experts`), "triton" for FP4 experts on CUDA (triton_experts.py),
    else None (each expert's products go through `product_kernel`)."""
    if stored != "fp4":
        return None
    if device.type == "cpu" and native.available():
        return "native"
    if device.type == "cuda" and triton_on():
        return "triton"
    return None


def cache_kernel(device: torch.device) -> str | None:
    """Which kernels read a cache's stored planes in place, on `device`: "triton" on CUDA (triton_index.py scores
    the index keys in the engine's pool, triton_attention.py attends the picked entries there and the window
    rings), else None (keys, entries and rings are read out, then scored and attended by the numerics' own ops)."""
    return "triton" if device.type == "cuda" and triton_on() else None


__all__ = ["triton_on", "native_rows", "product_kernel", "serves", "experts_kernel", "cache_kernel", "native",
           "triton_attention", "triton_experts", "triton_index", "triton_products"]
