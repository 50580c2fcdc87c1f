"""Number formats: FP8 E4M3, FP4 E2M1, UE8M0, the reference quantizers, and the packed KV-cache codecs.

Everything here is exact, elementwise-vectorised plain PyTorch, computed in fp32 (fp64 inputs stay fp64 where a
rounding step would otherwise round twice) and runs on whatever device the input lives on. Spec:
quant_and_cache.md (formats §1, quantizers §2, cache sizes §6), checkpoint.md §4 (weight dequantization).

Byte conventions (all codes are uint8 tensors):
  * E4M3 (OCP e4m3fn): s.eeee.mmm, bias 7, max ±448, no infinities, NaN = 0x7F / 0xFF.
  * E2M1: codes 0..15, bit 3 = sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
  * UE8M0: byte b means 2^(b-127); 255 is NaN.
  * Packed FP4: byte j holds element 2j in the LOW nibble and element 2j+1 in the HIGH nibble.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from openflash.errors import OpenflashError


class QuantFormatError(OpenflashError, ValueError):
    """A tensor handed to a codec has the wrong shape or dtype; the message names the shape."""


E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_NAN_CODE = 0x7F
UE8M0_NAN_BYTE = 255

# Smallest power-of-two exponent that keeps the e4m3 spacing of the 2^-6 binade (subnormals share it).
_E4M3_MIN_NORMAL_EXP = -6
# Magnitude midpoints between consecutive E2M1 codes (quant_and_cache.md §2.4). At a tie the even code wins,
# i.e. midpoint i (between codes i and i+1) rounds up on a tie exactly when i+1 is even.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Activation quantizer amax floors (quant_and_cache.md §2.1-2.3).
_FP8_AMAX_FLOOR = 1e-4
_MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126
_NVFP4_AMAX_FLOOR = 6.0 * 2.0**-9


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 15 and m == 7:
        return float("nan")
    if e == 0:
        return sign * (m / 8) * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


class DeviceConstant:
    """A read-only table computed once on the CPU, copied once to each device that reads it: copied per call, it
    would be a host-to-device transfer inside every step, which a CUDA graph cannot record (and which waits)."""

    def __init__(self, values: Tensor) -> None:
        self.cpu = values
        self._copies: dict[torch.device, Tensor] = {}

    def on(self, device: torch.device) -> Tensor:
        if device.type == "cpu":
            return self.cpu
        copy = self._copies.get(device)
        if copy is None:
            copy = self._copies[device] = self.cpu.to(device)
        return copy


# Read-only lookup tables (built once from the format definitions; exact in fp32).
_E4M3_TABLE = torch.tensor([_e4m3_value(c) for c in range(256)], dtype=torch.float32)
_E2M1_TABLE = torch.tensor(list(_E2M1_MAGNITUDES) + [-v for v in _E2M1_MAGNITUDES], dtype=torch.float32)
_E2M1_CODES = DeviceConstant(_E2M1_TABLE)
_E2M1_PAIRS = DeviceConstant(torch.stack((_E2M1_TABLE[torch.arange(256) & 0xF], _E2M1_TABLE[torch.arange(256) >> 4]),
                                         dim=-1))


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def as_uint8(t: Tensor) -> Tensor:
    """Reinterpret the bytes of a 1-byte tensor (uint8, int8, float8_e4m3fn, float8_e8m0fnu, float4_e2m1fn_x2...)
    as uint8. Safetensors stores checkpoint dtypes F8_E4M3, F8_E8M0 and I8 this way; no value conversion."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1 or t.dtype == torch.bool:
        raise QuantFormatError(f"expected a 1-byte tensor of codes, got dtype {t.dtype} with shape {tuple(t.shape)}")
    return t.view(torch.uint8)


def _work(x: Tensor) -> Tensor:
    """Upcast to the compute dtype: fp64 stays fp64 (no double rounding), everything else is exact in fp32."""
    if not x.is_floating_point():
        raise QuantFormatError(f"expected a floating-point tensor, got dtype {x.dtype} with shape {tuple(x.shape)}")
    return x if x.dtype == torch.float64 else x.float()


def _pow2(k: Tensor, dtype: torch.dtype) -> Tensor:
    """Exact 2^k for an integer tensor k in the normal range of dtype, built from the IEEE bits (no libm pow)."""
    if dtype == torch.float64:
        return ((k.long() + 1023) << 52).view(torch.float64)
    return ((k.int() + 127) << 23).view(torch.float32)


def _fp32_const(value: float, device: torch.device) -> Tensor:
    """A 0-d fp32 constant on device (e.g. fp32(1/448)), filled there rather than copied from the host."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _blocks(x: Tensor, block: int, what: str) -> Tensor:
    """View the last dim as [..., n_blocks, block]; the last dim must be a multiple of block."""
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise QuantFormatError(
            f"{what}: last dim of shape {tuple(x.shape)} is not divisible by the block size {block}"
        )
    return x.unflatten(-1, (x.shape[-1] // block, block))


# ----------------------------------------------------------------------------------------------------------------
# FP8 E4M3


def e4m3_round(x: Tensor) -> Tensor:
    """Round to the nearest E4M3 value (ties to even mantissa), saturating at ±448. Returns fp32 (fp64 for fp64
    input). NaN stays NaN, ±inf saturates, -0 keeps its sign."""
    xf = _work(x)
    a = xf.abs().clamp(max=E4M3_MAX)  # saturate before rounding (torch's own cast maps overflow to NaN)
    _, exp = torch.frexp(a)  # a = m * 2^exp with m in [0.5, 1), so floor(log2 a) = exp - 1
    binade = (exp - 1).clamp(min=_E4M3_MIN_NORMAL_EXP)
    step = _pow2(binade - 3, xf.dtype)  # 3 mantissa bits: spacing 2^(binade-3)
    r = torch.round(a / step) * step  # torch.round is round-half-to-even; scaling by 2^k is exact
    return torch.copysign(r, xf)


FP8_BLOCK = 32  # the dense linears' FP8 weights: one UE8M0 scale per FP8_BLOCK x FP8_BLOCK tile


def e4m3_encode(x: Tensor) -> Tensor:
    """Float tensor -> E4M3 codes (uint8): RNE, saturating at ±448, NaN -> 0x7F (with the input's sign bit)."""
    r = e4m3_round(x)
    a = r.abs()
    mant, exp = torch.frexp(a)  # a = mant * 2^exp, mant in [0.5, 1)
    # normal: biased exponent (exp - 1) + 7 in bits 3..6, mantissa (2*mant - 1) * 8 in bits 0..2
    normal = (exp + 6).to(a.dtype) * 8 + (mant * 16 - 8)
    subnormal = a * 512  # a = m * 2^-9; a == 2^-6 gives 8 either way
    mag = torch.where(a >= 2.0**_E4M3_MIN_NORMAL_EXP, normal, subnormal)
    mag = torch.where(torch.isnan(a), torch.full_like(a, E4M3_NAN_CODE), mag)
    code = mag.to(torch.int32) | (torch.signbit(r).to(torch.int32) << 7)
    return code.to(torch.uint8)


def e4m3_decode(codes: Tensor) -> Tensor:
    """E4M3 codes (uint8 / int8 / float8_e4m3fn) -> fp32 values (torch's conversion: the same values as the table
    of _e4m3_value, NaN at 0x7F / 0xFF; tests check all 256 codes)."""
    return as_uint8(codes).view(torch.float8_e4m3fn).float()


# ----------------------------------------------------------------------------------------------------------------
# UE8M0 and the power-of-two ceiling


def pow2_ceil_scale(amax_times_inv: Tensor) -> Tensor:
    """The kernel's fast_round_scale (quant_and_cache.md §2): read the fp32 bits of x and return
    2^(E - 127 + [mantissa != 0]), i.e. 2^ceil(log2 x) with exact powers of two unchanged. Uses |x|; NaN -> NaN."""
    x = amax_times_inv.float()
    bits = x.view(torch.int32)
    biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    out = (biased << 23).view(torch.float32)
    # biased == 0 only for x == 0: the formula gives 2^-127, an fp32 subnormal (bits 0x00400000).
    out = torch.where(biased == 0, torch.full_like(out, 2.0**-127), out)
    return torch.where(torch.isnan(x), x, out)


def _ue8m0_from_pow2(s: Tensor) -> Tensor:
    """Byte of an fp32 power of two in [2^-127, 2^127] (2^-127 is subnormal, its exponent field is 0); NaN -> 255."""
    bits = s.float().view(torch.int32)
    return ((bits >> 23) & 0xFF).to(torch.uint8)


def ue8m0_decode(scales: Tensor) -> Tensor:
    """UE8M0 bytes (uint8 / float8_e8m0fnu) -> fp32 2^(b-127); 255 -> NaN."""
    return as_uint8(scales).view(torch.float8_e8m0fnu).float()  # torch's conversion (tests check all 256 bytes)


def ue8m0_encode(scale: Tensor) -> Tensor:
    """Power-of-two scales in [2^-127, 2^127] (or NaN) -> UE8M0 bytes. Anything else raises."""
    if scale.dtype == torch.float8_e8m0fnu:
        return as_uint8(scale)
    s = _work(scale)
    b = _ue8m0_from_pow2(s)
    ok = (ue8m0_decode(b).to(s.dtype) == s) | torch.isnan(s)
    if not bool(ok.all()):
        bad = s[~ok].flatten()[0].item()
        raise QuantFormatError(
            f"ue8m0_encode: tensor of shape {tuple(scale.shape)} holds {bad!r}, not a power of two in [2^-127, 2^127]"
        )
    return b


# ----------------------------------------------------------------------------------------------------------------
# FP4 E2M1


def e2m1_encode(v: Tensor) -> Tensor:
    """Float tensor -> E2M1 codes 0..15 (uint8): RNE per the midpoint table, saturating at ±6, sign in bit 3 (-0 keeps
    it). NaN has no E2M1 code and becomes ±0; the quantizers carry NaN through the block scale instead."""
    vf = _work(v)
    a = vf.abs()
    mag = torch.zeros(vf.shape, dtype=torch.int32, device=vf.device)
    for i, mid in enumerate(_E2M1_MIDPOINTS):
        ties_up = (i + 1) % 2 == 0
        mag += (a >= mid).int() if ties_up else (a > mid).int()
    return (mag | (torch.signbit(vf).int() << 3)).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """E2M1 codes 0..15 -> fp32 values (code 8 is -0)."""
    c = as_uint8(codes)
    return _E2M1_CODES.on(c.device)[(c & 0xF).int()]


def pack_fp4(codes: Tensor) -> Tensor:
    """E2M1 codes [..., K] -> bytes [..., K/2]; element 2j goes to the low nibble, 2j+1 to the high nibble."""
    c = as_uint8(codes)
    if c.dim() == 0 or c.shape[-1] % 2 != 0:
        raise QuantFormatError(f"pack_fp4: last dim of shape {tuple(c.shape)} must be even")
    c = c & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Bytes [..., K/2] (uint8 / int8 / float4_e2m1fn_x2) -> E2M1 codes [..., K] (low nibble first)."""
    p = as_uint8(packed)
    if p.dim() == 0:
        raise QuantFormatError("unpack_fp4: expected at least one dimension, got a scalar")
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------------------------
# Block quantizers (quant_and_cache.md §2). Each returns fp32 pieces over [..., n_blocks, block].


def _fp8_ue8m0_blocks(x: Tensor, block: int, what: str) -> tuple[Tensor, Tensor]:
    """§2.1: q = e4m3(clamp(x/s, ±448)) with s = pow2ceil(max(amax, 1e-4) * fp32(1/448)). Returns (q, s)."""
    xb = _blocks(_work(x).float(), block, what)
    amax = xb.abs().amax(dim=-1).clamp(min=_FP8_AMAX_FLOOR)
    # The kernel multiplies by the fp32 reciprocal; it does not divide.
    s = pow2_ceil_scale(amax * _fp32_const(1 / E4M3_MAX, x.device))
    q = e4m3_round((xb / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX))
    return q, s


def _fp4_ue8m0_blocks(x: Tensor, block: int, what: str) -> tuple[Tensor, Tensor]:
    """§2.2 (MXFP4): codes = e2m1(clamp(x/s, ±6)), s = pow2ceil(max(amax, 6*2^-126) * fp32(1/6)).
    Returns (codes, s)."""
    xb = _blocks(_work(x).float(), block, what)
    amax = xb.abs().amax(dim=-1).clamp(min=_MXFP4_AMAX_FLOOR)
    s = pow2_ceil_scale(amax * _fp32_const(1 / E2M1_MAX, x.device))
    codes = e2m1_encode((xb / s.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return codes, s


def _fp4_e4m3_blocks(x: Tensor, block: int, what: str) -> tuple[Tensor, Tensor]:
    """§2.3: s = e4m3_RNE_sat(max(amax, 6*2^-9) / 6), codes = e2m1(clamp(x/s, ±6)).
    Returns (codes, s as E4M3 codes)."""
    xb = _blocks(_work(x).float(), block, what)
    amax = xb.abs().amax(dim=-1).clamp(min=_NVFP4_AMAX_FLOOR)
    # UNCERTAIN (quant_and_cache.md §2.3 / §7.1): [K] divides by 6 here; the kernel might multiply by fp32(1/6).
    # The two differ by at most 1 fp32 ulp before the E4M3 rounding, so the scale differs only where one of them
    # lands on an E4M3 tie (e.g. amax = 0.8906249403953552: divide -> 0x21, multiply -> 0x22).
    s_code = e4m3_encode(amax / E2M1_MAX)
    s = e4m3_decode(s_code)
    # s is rounded, so x/s can exceed 6 slightly: the clamp matters.
    codes = e2m1_encode((xb / s.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return codes, s_code


def act_quant(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """FP8 activation quantizer for GEMM emulation: (e4m3 values as fp32 [..., K], scales fp32 [..., K/block])."""
    q, s = _fp8_ue8m0_blocks(x, block, "act_quant")
    return q.flatten(-2), s


def act_quant_qdq(x: Tensor, block: int = 32) -> Tensor:
    """FP8 E4M3 / UE8M0-per-block quantize-dequantize (§2.1), returned in x's dtype (exact in bf16)."""
    q, s = _fp8_ue8m0_blocks(x, block, "act_quant_qdq")
    return (q * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp4_qdq_ue8m0(x: Tensor, block: int = 32) -> Tensor:
    """MXFP4 quantize-dequantize (§2.2: indexer query and index keys), returned in x's dtype."""
    codes, s = _fp4_ue8m0_blocks(x, block, "fp4_qdq_ue8m0")
    return (e2m1_decode(codes) * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def fp4_qdq_e4m3(x: Tensor, block: int = 16) -> Tensor:
    """FP4 with an E4M3 scale per 16 quantize-dequantize (§2.3: compressed main KV), returned in x's dtype."""
    codes, s_code = _fp4_e4m3_blocks(x, block, "fp4_qdq_e4m3")
    return (e2m1_decode(codes) * e4m3_decode(s_code).unsqueeze(-1)).flatten(-2).to(x.dtype)


def ste(x: Tensor, qdq_fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Straight-through estimator: the forward value is qdq_fn(x), the gradient is the identity."""
    return x + (qdq_fn(x) - x).detach()


# ----------------------------------------------------------------------------------------------------------------
# Packed KV-cache codecs (quant_and_cache.md §5-6). decode(encode(x)) equals the matching QDQ exactly.


def _check_pair(values: Tensor, scales: Tensor, elems_per_value: int, block: int, what: str) -> None:
    if values.dim() == 0 or values.shape[:-1] != scales.shape[:-1] or (
        values.shape[-1] * elems_per_value != scales.shape[-1] * block
    ):
        raise QuantFormatError(
            f"{what}: values of shape {tuple(values.shape)} do not match scales of shape {tuple(scales.shape)} "
            f"(expected scales [..., {values.shape[-1] * elems_per_value if values.dim() else '?'}/{block}])"
        )


def encode_kv_fp4(x: Tensor, block: int = 16) -> tuple[Tensor, Tensor]:
    """Compressed main KV: x [..., D] -> (packed E2M1 uint8 [..., D/2], E4M3 scale codes uint8 [..., D/16])."""
    codes, s_code = _fp4_e4m3_blocks(x, block, "encode_kv_fp4")
    return pack_fp4(codes.flatten(-2)), s_code


def decode_kv_fp4(packed: Tensor, scales: Tensor, block: int = 16, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of encode_kv_fp4: -> [..., D] in dtype."""
    _check_pair(packed, scales, 2, block, "decode_kv_fp4")
    v = _blocks(e2m1_decode(unpack_fp4(packed)), block, "decode_kv_fp4")
    return (v * e4m3_decode(scales).unsqueeze(-1)).flatten(-2).to(dtype)


def encode_index_mxfp4(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Index keys: x [..., Dk] -> (packed E2M1 uint8 [..., Dk/2], UE8M0 bytes [..., Dk/32])."""
    codes, s = _fp4_ue8m0_blocks(x, block, "encode_index_mxfp4")
    return pack_fp4(codes.flatten(-2)), _ue8m0_from_pow2(s)


def decode_index_mxfp4(packed: Tensor, scales: Tensor, block: int = 32, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of encode_index_mxfp4: -> [..., Dk] in dtype."""
    _check_pair(packed, scales, 2, block, "decode_index_mxfp4")
    v = _blocks(e2m1_decode(unpack_fp4(packed)), block, "decode_index_mxfp4")
    return (v * ue8m0_decode(scales).unsqueeze(-1)).flatten(-2).to(dtype)


def encode_window_fp8(x: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Sliding-window KV: x [..., D] -> (E4M3 codes uint8 [..., D], UE8M0 bytes [..., D/32])."""
    q, s = _fp8_ue8m0_blocks(x, block, "encode_window_fp8")
    return e4m3_encode(q.flatten(-2)), _ue8m0_from_pow2(s)


def decode_window_fp8(q: Tensor, scales: Tensor, block: int = 32, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of encode_window_fp8: -> [..., D] in dtype."""
    _check_pair(q, scales, 1, block, "decode_window_fp8")
    v = _blocks(e4m3_decode(q), block, "decode_window_fp8")
    return (v * ue8m0_decode(scales).unsqueeze(-1)).flatten(-2).to(dtype)


_CACHE_LAYOUTS = {
    # kind: (bytes per element of values, elements per scale byte)
    "main_kv": (0.5, 16),  # E2M1 + E4M3 per 16
    "index_k": (0.5, 32),  # E2M1 + UE8M0 per 32
    "window": (1.0, 32),  # E4M3 + UE8M0 per 32
}


def cache_entry_bytes(kind: str, dim: int) -> int:
    """Bytes of one cache entry (values then scales, quant_and_cache.md §6): main_kv 512 -> 288, index_k 128 -> 68,
    window 512 -> 528."""
    if kind not in _CACHE_LAYOUTS:
        raise QuantFormatError(
            f"cache_entry_bytes: unknown cache kind {kind!r}; expected one of {sorted(_CACHE_LAYOUTS)}"
        )
    per_elem, block = _CACHE_LAYOUTS[kind]
    if dim <= 0 or dim % block != 0:
        raise QuantFormatError(f"cache_entry_bytes: {kind} dim {dim} is not a positive multiple of {block}")
    return int(dim * per_elem) + dim // block


# ----------------------------------------------------------------------------------------------------------------
# Weight formats (checkpoint.md §4)


def quantize_fp8_blocks(w: Tensor, block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """Dense weight [N, K] -> (E4M3 codes uint8 [N, K], UE8M0 bytes [ceil(N/b), ceil(K/b)]) with the smallest
    power-of-two scale per b x b tile such that amax/scale <= 448 (ragged edge tiles cover only the real elements)."""
    if w.dim() != 2:
        raise QuantFormatError(f"quantize_fp8_blocks: expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    gn, gk = -(-n // block), -(-k // block)
    wf = torch.nn.functional.pad(_work(w).float(), (0, gk * block - k, 0, gn * block - n))
    tiles = wf.view(gn, block, gk, block)
    # Zero tiles get the smallest normal scale 2^-126 (any scale represents them exactly).
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=E4M3_MAX * 2.0**-126)
    s = pow2_ceil_scale(amax * _fp32_const(1 / E4M3_MAX, w.device))
    q = e4m3_encode((tiles / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX))
    return q.view(gn * block, gk * block)[:n, :k].contiguous(), _ue8m0_from_pow2(s)


def dequantize_fp8_blocks(q: Tensor, scale: Tensor, block: int = FP8_BLOCK) -> Tensor:
    """W[n, k] = e4m3(q[n, k]) * 2^(scale[n//b, k//b] - 127) in fp32. q [..., N, K], scale [..., ceil(N/b), ceil(K/b)]
    (uint8 or the safetensors dtypes F8_E4M3 / F8_E8M0)."""
    if q.dim() < 2:
        raise QuantFormatError(f"dequantize_fp8_blocks: expected a weight [N, K], got shape {tuple(q.shape)}")
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], -(-n // block), -(-k // block))
    if tuple(scale.shape) != want:
        raise QuantFormatError(
            f"dequantize_fp8_blocks: weight of shape {tuple(q.shape)} needs a scale of shape {want} "
            f"(block {block}), got {tuple(scale.shape)}"
        )
    if n % block == 0 and k % block == 0:  # one broadcast multiply, no expanded scale tensor
        blocks = e4m3_decode(q).view(*q.shape[:-2], n // block, block, k // block, block)
        return (blocks * ue8m0_decode(scale)[..., :, None, :, None]).view(q.shape)
    s = ue8m0_decode(scale).repeat_interleave(block, dim=-2)[..., :n, :]
    s = s.repeat_interleave(block, dim=-1)[..., :k]
    return e4m3_decode(q) * s


def quantize_mxfp4(w: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Expert weight [..., N, K] -> (packed E2M1 uint8 [..., N, K/2], UE8M0 bytes [..., N, K/32]) with the smallest
    power-of-two scale per 1 x 32 block such that amax/scale <= 6."""
    codes, s = _fp4_ue8m0_blocks(w, block, "quantize_mxfp4")
    return pack_fp4(codes.flatten(-2)), _ue8m0_from_pow2(s)


def dequantize_mxfp4(packed: Tensor, scale: Tensor, block: int = 32) -> Tensor:
    """W[n, k] = e2m1(code[n, k]) * 2^(scale[n, k//32] - 127) in fp32. packed [..., N, K/2] (uint8 / I8 /
    float4_e2m1fn_x2), scale [..., N, K/32]."""
    _check_pair(packed, scale, 2, block, "dequantize_mxfp4")
    p = as_uint8(packed)
    pairs = torch.nn.functional.embedding(p.int(), _E2M1_PAIRS.on(p.device))  # [..., K/2, 2]: low nibble first
    v = _blocks(pairs.flatten(-2), block, "dequantize_mxfp4")
    return (v * ue8m0_decode(scale).unsqueeze(-1)).flatten(-2)


def dequantize_fp8_rows(q: Tensor, scale: Tensor, block: int = 32) -> Tensor:
    """Engram rows: E[r, d] = e4m3(q[r, d]) * 2^(scale[r, d//32] - 127) in fp32. q [..., d], scale [..., d/32]."""
    _check_pair(q, scale, 1, block, "dequantize_fp8_rows")
    v = _blocks(e4m3_decode(q), block, "dequantize_fp8_rows")
    return (v * ue8m0_decode(scale).unsqueeze(-1)).flatten(-2)
