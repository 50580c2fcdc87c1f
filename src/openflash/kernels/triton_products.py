"""Products on FP8 and MXFP4 weights as stored, on the GPU (Triton): the codes decoded in registers, never a
dequantized copy in memory.

    y[m, n] = sum over K blocks b of 32:  (x[m, b] . codes[n, b]) * xs[m, b] * ws[n, b]

the reference GEMM's own order (quant_and_cache.md §3; model/layers.py `_block_scaled_gemm`): an fp32 partial product
per block of 32, scaled by the activation's and the weight's UE8M0 scales, accumulated in fp32. With the activation
QDQ (`act_qdq`), x holds E4M3 values and xs their scales (formats.act_quant, computed before the call), so every
product of the block's dot is exact in TF32 (3 mantissa bits each side): the tensor cores run in TF32, not bf16
(Triton's interpreter, which the CPU suite tests with, has no bf16 arithmetic to check a bf16 dot against). Without
it (the LoRA forward through a frozen base), x is any fp32 and the dot runs in full fp32 ("ieee").

Weights: FP8 E4M3 [N, K] bytes with a UE8M0 scale per 32 x 32 block [ceil(N/32), K/32]; MXFP4 [N, K/2] (two E2M1
codes a byte, element 2j in the low nibble) with a scale per 1 x 32 [N, K/32]. Any number of rows: decode (1-64,
one 16-row tile), prefill (tiles of 64). With TRITON_INTERPRET=1 set before Triton is imported (tests/conftest.py
does on machines without CUDA), the kernel runs in Triton's interpreter on CPU tensors.

Where Triton is missing (a CPU-only torch without the test extra) `available()` is False and model/layers.py keeps
the dequantize-a-tile path, which is also what the tests compare against.
"""

from __future__ import annotations

from typing import Callable

import torch

from openflash import formats
from openflash.kernels.native import BLOCK, dispatch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch without the test extra
    triton = tl = None


def available() -> bool:
    """Whether Triton is importable here."""
    return triton is not None


def e2m1_values(codes):
    """E2M1 codes (int32, any shape) as fp32: e = bits 1-2, m = bit 0; e == 0: m / 2, else (1 + m / 2) * 2^(e - 1)."""
    e = (codes >> 1) & 3
    mant = (codes & 1).to(tl.float32)
    mag = tl.where(e == 0, mant * 0.5, (1.0 + mant * 0.5) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where((codes & 8) != 0, -mag, mag)


def fp4_codes(W, rows, k, width):
    """The E2M1 codes [R, 32] of columns k (one 32-block) of rows `rows` of MXFP4 bytes W [*, width / 2] (element
    2j in byte j's low nibble). Every row is read: point the ones past the end at a real row."""
    byte = tl.load(W + rows[:, None] * (width // 2) + (k // 2)[None, :])
    return (byte.to(tl.int32) >> ((k % 2) * 4)[None, :]) & 0xF


def ue8m0_values(scale_bytes):
    """UE8M0 bytes as fp32 2^(byte - 127), built from the float's bits (exact, where exp2 is approximate on the
    GPU); byte 0 is the subnormal 2^-127 (bits 0x00400000), 255 is NaN."""
    bits = scale_bytes.to(tl.int32)
    bits = tl.where(bits == 0, 0x00400000, tl.where(bits == 255, 0x7FC00000, bits << 23))
    return bits.to(tl.float32, bitcast=True)


def e4m3_values(byte):
    """E4M3 (e4m3fn) bytes, any shape, as fp32: the byte into fp16's bits (sign to bit 15, the rest shifted 7), times
    2^8 for the exponent bias (15 - 7): exact for normals and subnormals alike; 0x7F / 0xFF (NaN) by hand."""
    bits = byte.to(tl.int32)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), half.to(tl.float32) * 256.0)


def block_dot(x, w, IEEE: tl.constexpr):
    """x [M, 32] . w [N, 32]^T in fp32 ("ieee") or on TF32 tensor cores (exact for QDQ'd activations)."""
    if IEEE:
        return tl.dot(x, tl.trans(w), input_precision="ieee")
    return tl.dot(x, tl.trans(w), input_precision="tf32")


def rows_product(X, XS, rows, m_ok, W, WS, n64, n_ok, K, FP4: tl.constexpr, HAS_XS: tl.constexpr,
                 IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] tile x[rows] W[n]^T of the module doc's formula: activation rows `rows` (int64; m_ok
    which are real) of X [*, K] fp32 (XS their scales per 32, with HAS_XS), weight rows n64 (n_ok) of W / WS (FP4
    or FP8 bytes and UE8M0 scales). Shared by this module's products and triton_experts.py's expert tiles."""
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, K // 32):
        k = b * 32 + j
        x = tl.load(X + rows[:, None] * K + k[None, :], mask=m_ok[:, None], other=0.0)
        if FP4:
            w = e2m1_values(fp4_codes(W, tl.where(n_ok, n64, 0), k, K))
            ws_byte = tl.load(WS + n64 * (K // 32) + b, mask=n_ok, other=127)
        else:
            w = e4m3_values(tl.load(W + n64[:, None] * K + k[None, :], mask=n_ok[:, None], other=0))
            ws_byte = tl.load(WS + (n64 // 32) * (K // 32) + b, mask=n_ok, other=127)
        ws = ue8m0_values(ws_byte)
        part = block_dot(x, w, IEEE)
        if HAS_XS:
            part = part * tl.load(XS + rows * (K // 32) + b, mask=m_ok, other=1.0)[:, None]
        acc += part * ws[None, :]
    return acc


def _stored_product_kernel(X, XS, W, WS, Y, M, N, K, FP4: tl.constexpr, HAS_XS: tl.constexpr, IEEE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    m64, n64 = m.to(tl.int64), n.to(tl.int64)  # released widths: offsets past 2^31 bytes
    acc = rows_product(X, XS, m64, m_ok, W, WS, n64, n_ok, K, FP4, HAS_XS, IEEE, BLOCK_M, BLOCK_N)
    tl.store(Y + m64[:, None] * N + n64[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


if triton is not None:
    e2m1_values, fp4_codes = triton.jit(e2m1_values), triton.jit(fp4_codes)
    ue8m0_values, block_dot = triton.jit(ue8m0_values), triton.jit(block_dot)
    e4m3_values, rows_product = triton.jit(e4m3_values), triton.jit(rows_product)
_KERNEL = triton.jit(_stored_product_kernel) if triton is not None else None


def stored_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, storage: str,
                   act_qdq: bool) -> torch.Tensor:
    """x [R, K] fp32 times the stored weight (module doc for the layouts); act_qdq: FP8-QDQ x per 32 channels first
    (as the reference's GEMMs do). Returns [R, N] fp32. Shapes are checked here (the kernel trusts its pointers)."""
    if triton is None:
        raise RuntimeError("stored_product needs Triton (it ships with PyTorch's CUDA builds; pip install triton)")
    R, K = x.shape if x.dim() == 2 else (0, -1)
    weight, scale = formats.as_uint8(weight), formats.as_uint8(scale)
    fp4 = storage == "fp4"
    N = weight.shape[0] if weight.dim() == 2 else -1
    want_w = (N, K // 2 if fp4 else K)
    want_s = (N if fp4 else -(-N // BLOCK), K // BLOCK)
    problems = []
    if storage not in ("fp8", "fp4"):
        problems.append(f"storage {storage!r} is neither fp8 nor fp4")
    if x.dim() != 2 or x.dtype != torch.float32 or K % BLOCK:
        problems.append(f"x must be fp32 [R, K] with K a multiple of {BLOCK}, got {x.dtype} {tuple(x.shape)}")
    elif tuple(weight.shape) != want_w or tuple(scale.shape) != want_s:
        problems.append(f"{storage} weight {tuple(weight.shape)} / scale {tuple(scale.shape)} do not hold K = {K}: "
                        f"expected {want_w} / {want_s}")
    elif x.device != weight.device or x.device != scale.device:
        problems.append(f"x on {x.device}, weight on {weight.device}, scale on {scale.device}")
    if problems:
        raise ValueError("stored_product: " + "; ".join(problems))
    if act_qdq:
        x, xs = formats.act_quant(x)
        xs = xs.contiguous()
    else:
        xs = x  # unread (HAS_XS is off)
    x, weight, scale = x.contiguous(), weight.contiguous(), scale.contiguous()
    y = x.new_empty(R, N)
    if R == 0 or N == 0:
        return y
    block_m = 16 if R <= 16 else 64
    block_n = 64
    grid = (-(-N // block_n), -(-R // block_m))
    _KERNEL[grid](x, xs, weight, scale, y, R, N, K, FP4=fp4, HAS_XS=act_qdq, IEEE=not act_qdq, BLOCK_M=block_m,
                  BLOCK_N=block_n)
    return y


def register_op(schema: str, kernel: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor],
                devices: tuple[str, ...] = ("CUDA", "CPU")) -> torch.library.Library:
    """openflash::`schema`'s op run by `kernel` on tensors of `devices` (CPU ones only in Triton's interpreter: the
    tests' traced graphs), with the fake that gives a traced graph its output's shape (a compiled graph and a
    CUDA-graph capture take it as one node). The returned Library keeps the registration alive."""
    library = torch.library.Library("openflash", "FRAGMENT")
    library.define(schema)
    name = schema.split("(")[0]
    for device in devices:
        library.impl(name, kernel, device)
    torch.library.register_fake(f"openflash::{name}", fake, lib=library)
    return library


_OP = register_op("stored_product(Tensor x, Tensor weight, Tensor scale, str storage, bool act_qdq) -> Tensor",
                  stored_product, lambda x, weight, scale, storage, act_qdq: x.new_empty(x.shape[0], weight.shape[0]),
                  devices=("CUDA",))


def product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, storage: str, act_qdq: bool) -> torch.Tensor:
    """`stored_product` as openflash::stored_product inside a traced graph, called directly in eager mode."""
    return dispatch("stored_product", stored_product, x, weight, scale, storage, act_qdq)
