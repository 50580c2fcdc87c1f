"""Tests for openflash.formats: exact FP8 / FP4 / UE8M0 codecs, the reference quantizers and the cache codecs.

Spec constants (quant_and_cache.md, numbers.md §5/§7, checkpoint.md §4) are copied in as data.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openflash.errors import OpenflashError
from openflash.formats import (act_quant, act_quant_qdq, as_uint8, cache_entry_bytes, decode_index_mxfp4,
                               decode_kv_fp4, decode_window_fp8, dequantize_fp8_blocks, dequantize_fp8_rows,
                               dequantize_mxfp4, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, e4m3_round,
                               encode_index_mxfp4, encode_kv_fp4, encode_window_fp8, fp4_qdq_e4m3, fp4_qdq_ue8m0,
                               pack_fp4, pow2_ceil_scale, quantize_fp8_blocks, quantize_mxfp4, ste, ue8m0_decode,
                               ue8m0_encode, unpack_fp4)

GOLDEN_A = Path(__file__).parent / "goldens" / "A"
HYP = settings(derandomize=True, deadline=None, max_examples=100)
NAN_CODES = {0x7F, 0xFF}
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def spec_e4m3(code: int) -> float:
    """quant_and_cache.md §1, written independently of the module: normal (1 + m/8) 2^(e-7), subnormal m/8 2^-6."""
    s = -1.0 if code >> 7 else 1.0
    e, m = (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return math.nan
    return s * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def u8(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values (NaN == NaN, and -0 distinguished from +0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.nan_to_num(nan=1234.5), b.nan_to_num(nan=1234.5)  # NaN sign bits are not compared
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def finite_blocks(n_blocks: int, block: int, max_exp: int = 20, min_exp: int = -30):
    """Blocks of fp32 values whose magnitudes span many binades (a common 2^k factor times per-element mantissas)."""
    return st.tuples(
        st.lists(st.floats(-8.0, 8.0, width=32), min_size=n_blocks * block, max_size=n_blocks * block),
        st.integers(min_exp, max_exp),
    ).map(lambda t: torch.tensor(t[0], dtype=torch.float32).reshape(n_blocks, block) * 2.0 ** t[1])


# ------------------------------------------------------------------------------------------------- E4M3


def test_e4m3_decode_all_codes_match_spec_and_torch():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e4m3_decode(codes)
    want = torch.tensor([spec_e4m3(c) for c in range(256)], dtype=torch.float32)
    assert got.dtype == torch.float32
    assert same(got, want)
    assert same(got, codes.view(torch.float8_e4m3fn).float())


def test_e4m3_every_code_round_trips():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    back = e4m3_encode(e4m3_decode(codes))
    for c in range(256):
        if c not in NAN_CODES:
            assert back[c].item() == c, hex(c)
    assert (back[[0x7F, 0xFF]] & 0x7F).tolist() == [0x7F, 0x7F]


def test_e4m3_known_bit_patterns():
    cases = {0x38: 1.0, 0x40: 2.0, 0x7E: 448.0, 0xFE: -448.0, 0xB8: -1.0, 0x01: 2.0**-9, 0x07: 7 * 2.0**-9,
             0x08: 2.0**-6, 0x00: 0.0, 0x3C: 1.5, 0x30: 0.5}
    codes = u8(list(cases))
    assert e4m3_decode(codes).tolist() == list(cases.values())
    assert e4m3_encode(torch.tensor(list(cases.values()))).tolist() == list(cases)
    assert math.isnan(e4m3_decode(u8([0x7F])).item())
    assert e4m3_encode(torch.tensor([-0.0])).item() == 0x80


def test_e4m3_ties_round_to_even_mantissa():
    values = e4m3_decode(torch.arange(0x7F, dtype=torch.int32).to(torch.uint8)).double()  # 0 .. 448, ascending
    lo, hi = values[:-1], values[1:]
    mid = (lo + hi) / 2  # exact in fp32: one more mantissa bit
    codes = torch.arange(0x7E)
    even = torch.where(codes % 2 == 0, codes, codes + 1)
    for sign, sign_bit in ((1.0, 0), (-1.0, 0x80)):
        assert (e4m3_encode((sign * mid).float()).long() == even + sign_bit).all()
        up = torch.nextafter(mid.float(), torch.tensor(math.inf))
        down = torch.nextafter(mid.float(), torch.tensor(0.0))
        assert (e4m3_encode(sign * up).long() == codes + 1 + sign_bit).all()
        assert (e4m3_encode(sign * down).long() == codes + sign_bit).all()


def test_e4m3_saturates_and_keeps_nan():
    x = torch.tensor([448.0, 449.0, 464.0, 1e30, math.inf, -500.0, -math.inf, math.nan])
    assert e4m3_encode(x).tolist()[:7] == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
    assert e4m3_encode(x)[7].item() & 0x7F == 0x7F
    assert e4m3_round(torch.tensor([1e9, -1e9])).tolist() == [448.0, -448.0]


def test_e4m3_tiny_values_round_in_subnormal_range():
    x = torch.tensor([2.0**-10, 2.0**-10 + 2.0**-20, 3 * 2.0**-10, 2.0**-30, 2.0**-140])
    assert e4m3_encode(x).tolist() == [0x00, 0x01, 0x02, 0x00, 0x00]


def test_e4m3_fp64_and_bf16_inputs():
    # 1.0625 is the tie between 0x38 (1.0) and 0x39 (1.125); a hair above it must round up. Going through fp32
    # first would make it an exact tie and round to even (0x38): fp64 must not be rounded twice.
    assert e4m3_encode(torch.tensor([1.0625 + 2.0**-40], dtype=torch.float64)).item() == 0x39
    assert e4m3_encode(torch.tensor([1.0625], dtype=torch.float64)).item() == 0x38
    xb = torch.tensor([1.0625, 3.0, -0.3], dtype=torch.bfloat16)
    assert torch.equal(e4m3_encode(xb), e4m3_encode(xb.float()))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        e4m3_encode(torch.tensor([1, 2, 3]))


@HYP
@given(st.lists(st.floats(-448.0, 448.0, width=32), min_size=1, max_size=64))
def test_e4m3_encode_matches_torch_cast(xs):
    x = torch.tensor(xs, dtype=torch.float32)
    assert torch.equal(e4m3_encode(x), x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert same(e4m3_round(x), e4m3_decode(e4m3_encode(x)))


# ------------------------------------------------------------------------------------------------- UE8M0


def test_ue8m0_decode_and_encode():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    d = ue8m0_decode(b)
    want = torch.tensor([2.0 ** (i - 127) for i in range(255)] + [math.nan], dtype=torch.float32)
    assert same(d, want)
    assert same(d, b.view(torch.float8_e8m0fnu).float())
    assert ue8m0_decode(u8([127])).item() == 1.0
    assert torch.equal(ue8m0_encode(d[:255]), b[:255])
    assert ue8m0_encode(torch.tensor([math.nan])).item() == 255
    assert torch.equal(ue8m0_encode(b.view(torch.float8_e8m0fnu)), b)
    assert same(ue8m0_decode(b.view(torch.float8_e8m0fnu)), d)


@pytest.mark.parametrize("bad", [3.0, 0.0, -1.0, 2.0**-130, math.inf])
def test_ue8m0_encode_rejects_non_powers_of_two(bad):
    with pytest.raises(OpenflashError, match=r"shape \(2,\)"):
        ue8m0_encode(torch.tensor([1.0, bad]))


def test_pow2_ceil_scale_bit_trick():
    x = torch.tensor([1.0, 0.75, 3.0, 4.0, 2.0**-126, 1.5 * 2.0**-130, 0.0, 2.0**127, math.nan])
    got = pow2_ceil_scale(x)
    want = torch.tensor([1.0, 1.0, 4.0, 4.0, 2.0**-126, 2.0**-126, 2.0**-127, 2.0**127, math.nan])
    assert same(got, want)


@HYP
@given(st.floats(min_value=2.0**-126, max_value=2.0**126, width=32))
def test_pow2_ceil_scale_is_the_smallest_power_of_two_above(x):
    s = pow2_ceil_scale(torch.tensor([x])).item()
    assert math.frexp(s)[0] == 0.5  # a power of two
    assert s >= x and s / 2 < x


# ------------------------------------------------------------------------------------------------- E2M1


def test_e2m1_rne_table():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 100.0, math.inf,
                      0.2500001, 0.7499999, 2.5000002, 4.9999995, 0.1])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, 0.5, 0.5, 3.0, 4.0, 0.0]
    assert e2m1_decode(e2m1_encode(v)).tolist() == want
    assert e2m1_decode(e2m1_encode(-v)).tolist() == [-w for w in want]


def test_e2m1_codes_signs_and_zero():
    codes = torch.arange(16, dtype=torch.int32).to(torch.uint8)
    vals = e2m1_decode(codes)
    assert vals.tolist() == E2M1_VALUES + [-v for v in E2M1_VALUES]
    assert torch.signbit(vals[8]).item()  # code 8 is -0
    assert torch.equal(e2m1_encode(vals), codes)
    assert e2m1_encode(torch.tensor([-0.0, 0.0, -0.1, -7.0])).tolist() == [8, 0, 8, 15]
    assert e2m1_encode(torch.tensor([2.0**-149, 6.0 - 2.0**-21])).tolist() == [0, 7]


def test_pack_fp4_nibble_order():
    codes = u8([0x0, 0xA, 0x3, 0xF, 0x7, 0x1])
    packed = pack_fp4(codes)
    assert packed.tolist() == [0xA0, 0xF3, 0x17]
    assert torch.equal(unpack_fp4(packed), codes)
    assert unpack_fp4(u8([0xA0])).tolist() == [0x0, 0xA]
    assert unpack_fp4(torch.tensor([0xA0 - 256], dtype=torch.int8)).tolist() == [0x0, 0xA]
    many = torch.randint(0, 16, (3, 5, 64), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    assert pack_fp4(many).shape == (3, 5, 32)
    assert torch.equal(unpack_fp4(pack_fp4(many)), many)


def test_pack_fp4_rejects_odd_width():
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        pack_fp4(torch.zeros(2, 7, dtype=torch.uint8))


def test_as_uint8_reinterprets_bytes_only():
    b = u8([0x38, 0xD8, 0x00, 0xFF])
    for t in (b.view(torch.int8), b.view(torch.float8_e4m3fn), b.view(torch.float8_e8m0fnu), b):
        assert torch.equal(as_uint8(t), b)
    with pytest.raises(OpenflashError, match=r"float32.*\(4,\)"):
        as_uint8(b.float())


# ------------------------------------------------------------------------------------------------- checkpoint bytes


def test_checkpoint_real_bytes_fp8_wkv():
    # checkpoint.md §4: layers.0.attn.wkv, scale byte 0x73 (2^-12), weight bytes d8 71 f2 79.
    q = u8([0xD8, 0x71, 0xF2, 0x79])
    want = [-0.00390625, 0.03515625, -0.0390625, 0.0703125]
    assert ue8m0_decode(u8([0x73])).item() == 2.0**-12
    w = dequantize_fp8_blocks(q.view(1, 4), u8([[0x73]]))
    assert w.flatten().tolist() == want
    # the same bytes as safetensors hands them over (F8_E4M3 / F8_E8M0)
    w2 = dequantize_fp8_blocks(q.view(torch.float8_e4m3fn).view(1, 4), u8([[0x73]]).view(torch.float8_e8m0fnu))
    assert w2.flatten().tolist() == want


def test_checkpoint_real_bytes_fp4_expert():
    # checkpoint.md §4: layers.0.ffn.experts.0.w1, scale byte 0x78 (2^-7), bytes a0 a8 ec 4a + padding to K = 32.
    packed = torch.cat([u8([0xA0, 0xA8, 0xEC, 0x4A]), torch.zeros(12, dtype=torch.uint8)]).view(1, 16)
    want = [0, -0.0078125, 0, -0.0078125, -0.015625, -0.03125, -0.0078125, 0.015625]
    w = dequantize_mxfp4(packed.view(torch.int8), u8([[0x78]]).view(torch.float8_e8m0fnu))
    assert w.shape == (1, 32)
    assert w[0, :8].tolist() == want


def test_dequantize_fp8_rows_engram_layout():
    q = e4m3_encode(torch.tensor([[1.0] * 32 + [-2.0] * 32, [0.5] * 64]))
    s = u8([[127, 128], [126, 120]])
    e = dequantize_fp8_rows(q, s)
    assert e[0, 0].item() == 1.0 and e[0, 32].item() == -4.0
    assert e[1, 0].item() == 0.25 and e[1, 63].item() == 0.5 * 2.0**-7
    with pytest.raises(ValueError, match=r"\(2, 64\).*\(2, 3\)"):
        dequantize_fp8_rows(q, u8([[127] * 3] * 2))


# ------------------------------------------------------------------------------------------------- quantizer scales


def block_with_amax(amax: float, block: int = 32) -> torch.Tensor:
    x = torch.linspace(-amax / 3, amax / 5, block)
    x[7] = -amax
    return x


@pytest.mark.parametrize("amax,log2_scale", [(1.0, -8), (3.0, -7), (448.0, 0), (449.0, 1), (0.0, -22)])
def test_act_quant_scale_spot_checks(amax, log2_scale):
    x = block_with_amax(amax)
    q, s = act_quant(x)
    assert s.tolist() == [2.0**log2_scale]
    assert e4m3_encode(x.unsqueeze(0))[0].shape == (32,)
    _, s_bytes = encode_window_fp8(x)
    assert s_bytes.tolist() == [127 + log2_scale]
    assert torch.equal(q * s, act_quant_qdq(x))


@pytest.mark.parametrize("amax,log2_scale", [(6.0, 0), (6.000001, 1), (7.0, 1), (1.0, -2), (0.0, -126)])
def test_mxfp4_scale_spot_checks(amax, log2_scale):
    _, s_bytes = encode_index_mxfp4(block_with_amax(amax))
    assert s_bytes.tolist() == [127 + log2_scale]


# 0.8906249403953552 is the fp32 just below 6 * 0.1484375, the E4M3 tie between 0x21 and 0x22: amax / 6 rounds to
# just below the tie (0x21) while amax * fp32(1/6) lands on it and goes to even (0x22). It pins [K]'s division
# (quant_and_cache.md §2.3, UNCERTAIN).
@pytest.mark.parametrize("amax,scale_code", [(6.0, 0x38), (0.0, 0x01), (3.0, 0x30), (2688.0, 0x7E), (1e6, 0x7E),
                                             (6.0 * 1.0625, 0x38), (6.0 * 1.0625 * 1.0001, 0x39),
                                             (0.8906249403953552, 0x21)])
def test_nvfp4_e4m3_scale_is_rounded_amax_over_6(amax, scale_code):
    x = block_with_amax(amax, 16)
    packed, s = encode_kv_fp4(x)
    assert packed.shape == (8,) and s.tolist() == [scale_code]
    y = fp4_qdq_e4m3(x)
    assert y.abs().max().item() <= 6 * e4m3_decode(s).item()


def test_qdq_keep_dtype_and_reference_bf16_mode():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g) * 5
    xb = x.bfloat16()
    for fn in (act_quant_qdq, fp4_qdq_ue8m0, fp4_qdq_e4m3):
        assert fn(x).dtype == torch.float32
        yb = fn(xb)
        assert yb.dtype == torch.bfloat16
        assert torch.equal(yb.float(), fn(xb.float()))  # QDQ values are exact in bf16


def test_quantizers_reject_ragged_last_dim():
    x = torch.zeros(4, 48)
    for fn in (act_quant_qdq, fp4_qdq_ue8m0, encode_index_mxfp4, encode_window_fp8):
        with pytest.raises(ValueError, match=r"\(4, 48\)"):
            fn(x)
    with pytest.raises(OpenflashError, match=r"\(4, 40\)"):
        encode_kv_fp4(torch.zeros(4, 40))


# ------------------------------------------------------------------------------------------------- error bounds


@HYP
@given(finite_blocks(2, 32))
def test_fp8_qdq_error_bound(x):
    q, s = act_quant(x)
    y = act_quant_qdq(x)
    blk = s.repeat_interleave(32, dim=-1)
    assert (q.abs() <= 448).all()
    assert same(e4m3_round(q), q)  # q holds E4M3 values
    # RNE in the e4m3 binade of x/s: at most half a step, i.e. 2^-4 relative, or 2^-10 in the subnormal range
    assert ((x - y).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * blk).all()
    amax = x.abs().amax(-1, keepdim=True)
    assert ((amax / s <= 448) | (amax < 1e-4)).all()
    assert torch.equal(act_quant_qdq(y), y)  # idempotent


@HYP
@given(finite_blocks(2, 32))
def test_mxfp4_qdq_error_bound(x):
    y = fp4_qdq_ue8m0(x)
    _, s_bytes = encode_index_mxfp4(x)
    s = ue8m0_decode(s_bytes).repeat_interleave(32, dim=-1)
    assert ((x - y).abs() <= torch.maximum(0.25 * s, x.abs() / 4)).all()
    assert (y.abs() <= 6 * s).all()
    assert torch.equal(fp4_qdq_ue8m0(y), y)


@HYP
@given(finite_blocks(4, 16, max_exp=10, min_exp=-12))
def test_nvfp4_qdq_error_bound(x):
    y = fp4_qdq_e4m3(x)
    _, s_codes = encode_kv_fp4(x)
    s = e4m3_decode(s_codes).repeat_interleave(16, dim=-1)
    clamp_err = (x.abs() - 6 * s).clamp(min=0)
    rne_err = torch.maximum(0.25 * s, torch.minimum(x.abs(), 6 * s) / 4)
    assert ((x - y).abs() <= clamp_err + rne_err).all()


# ------------------------------------------------------------------------------------------------- cache codecs


@HYP
@given(finite_blocks(4, 32), st.booleans())
def test_cache_codecs_decode_to_the_qdq_values(x, bf16):
    x = x.reshape(2, 64)
    if bf16:
        x = x.bfloat16()
    packed, s = encode_kv_fp4(x)
    assert packed.shape == (2, 32) and s.shape == (2, 4) and packed.dtype == s.dtype == torch.uint8
    assert same(decode_kv_fp4(packed, s, dtype=x.dtype), fp4_qdq_e4m3(x))
    packed, s = encode_index_mxfp4(x)
    assert packed.shape == (2, 32) and s.shape == (2, 2)
    assert same(decode_index_mxfp4(packed, s, dtype=x.dtype), fp4_qdq_ue8m0(x))
    q, s = encode_window_fp8(x)
    assert q.shape == (2, 64) and s.shape == (2, 2)
    assert same(decode_window_fp8(q, s, dtype=x.dtype), act_quant_qdq(x))


def test_cache_decoders_check_shapes():
    with pytest.raises(ValueError, match=r"\(2, 32\).*\(2, 3\)"):
        decode_kv_fp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(2, 64\).*\(3, 2\)"):
        decode_window_fp8(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.uint8))


def test_cache_entry_bytes():
    # numbers.md §5
    assert cache_entry_bytes("main_kv", 512) == 288
    assert cache_entry_bytes("index_k", 128) == 68
    assert cache_entry_bytes("window", 512) == 528
    per_token = 3 * cache_entry_bytes("main_kv", 512) // 2 + cache_entry_bytes("main_kv", 512) + (
        3 * cache_entry_bytes("index_k", 128) // 2 + cache_entry_bytes("index_k", 128)
    )
    assert per_token == 890
    # the codecs really produce that many bytes
    x = torch.randn(512)
    assert sum(t.numel() for t in encode_kv_fp4(x)) == 288
    assert sum(t.numel() for t in encode_index_mxfp4(x[:128])) == 68
    assert sum(t.numel() for t in encode_window_fp8(x)) == 528
    with pytest.raises(ValueError, match="'kv'"):
        cache_entry_bytes("kv", 512)
    with pytest.raises(ValueError, match="100"):
        cache_entry_bytes("window", 100)


def test_ste_forward_is_qdq_and_gradient_is_identity():
    x = (torch.randn(2, 32, generator=torch.Generator().manual_seed(3)) * 3).requires_grad_()
    y = ste(x, act_quant_qdq)
    assert torch.equal(y.detach(), act_quant_qdq(x.detach()))
    (y * torch.arange(64.0).view(2, 32)).sum().backward()
    assert torch.equal(x.grad, torch.arange(64.0).view(2, 32))


# ------------------------------------------------------------------------------------------------- weight formats


@pytest.mark.parametrize("shape", [(64, 96), (45, 70), (1, 33)])
def test_fp8_block_weights_round_trip(shape):
    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=g) * torch.logspace(-6, 2, shape[1])  # tiles of very different size
    q, s = quantize_fp8_blocks(w)
    assert q.shape == shape and q.dtype == torch.uint8
    assert s.shape == (-(-shape[0] // 32), -(-shape[1] // 32)) and s.dtype == torch.uint8
    d = dequantize_fp8_blocks(q, s)
    sc = ue8m0_decode(s).repeat_interleave(32, 0)[: shape[0]].repeat_interleave(32, 1)[:, : shape[1]]
    assert ((w - d).abs() <= 2.0**-4 * w.abs() + 2.0**-10 * sc).all()
    # smallest power-of-two scale per tile with amax / s <= 448
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = w[32 * i: 32 * i + 32, 32 * j: 32 * j + 32].abs().max().item()
            scale = ue8m0_decode(s[i, j]).item()
            assert amax / scale <= 448 < amax / (scale / 2)
    q2, s2 = quantize_fp8_blocks(d)  # dequantized weights re-quantize to the same values
    assert torch.equal(dequantize_fp8_blocks(q2, s2), d)


def test_fp8_block_weights_zero_tile_and_shape_errors():
    q, s = quantize_fp8_blocks(torch.zeros(32, 32))
    assert (q == 0).all() and (dequantize_fp8_blocks(q, s) == 0).all()
    with pytest.raises(ValueError, match=r"\(45, 70\).*\(2, 2\)"):
        dequantize_fp8_blocks(torch.zeros(45, 70, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(3, 4, 5\)"):
        quantize_fp8_blocks(torch.zeros(3, 4, 5))


def test_mxfp4_weights_round_trip():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 128, generator=g) * torch.logspace(-3, 1, 128)
    packed, s = quantize_mxfp4(w)
    assert packed.shape == (8, 64) and s.shape == (8, 4)
    d = dequantize_mxfp4(packed, s)
    sc = ue8m0_decode(s).repeat_interleave(32, -1)
    assert ((w - d).abs() <= torch.maximum(0.25 * sc, w.abs() / 4)).all()
    amax = w.view(8, 4, 32).abs().amax(-1)
    assert ((amax / ue8m0_decode(s) <= 6) & (amax / (ue8m0_decode(s) / 2) > 6)).all()
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(d)), d)
    with pytest.raises(ValueError, match=r"\(8, 64\).*\(8, 3\)"):
        dequantize_mxfp4(packed, s[:, :3])
    with pytest.raises(ValueError, match=r"\(8, 48\)"):
        quantize_mxfp4(torch.zeros(8, 48))


def test_golden_checkpoint_tensors_dequantize():
    from safetensors import safe_open

    with safe_open(str(GOLDEN_A / "model.safetensors"), "pt") as f:
        wkv, wkv_s = f.get_tensor("layers.0.attn.wkv.weight"), f.get_tensor("layers.0.attn.wkv.scale")
        w1, w1_s = f.get_tensor("layers.0.ffn.experts.0.w1.weight"), f.get_tensor("layers.0.ffn.experts.0.w1.scale")
        emb, emb_s = f.get_tensor("layers.0.engram.embed.weight"), f.get_tensor("layers.0.engram.embed.scale")
    assert (wkv.dtype, wkv_s.dtype, w1.dtype, w1_s.dtype) == (
        torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.float8_e8m0fnu)

    dense = dequantize_fp8_blocks(wkv, wkv_s)
    assert dense.shape == wkv.shape
    expert = dequantize_mxfp4(w1, w1_s)
    assert expert.shape == (w1.shape[0], 2 * w1.shape[1])
    rows = dequantize_fp8_rows(emb, emb_s)
    assert rows.shape == emb.shape
    for t in (dense, expert, rows):
        assert torch.isfinite(t).all()
        assert 1e-3 < t.std().item() < 10 and 1e-2 < t.abs().max().item() < 100
    # our decoders agree with torch's own float8 conversion of the stored dtypes
    assert torch.equal(dense, wkv.float() * wkv_s.float().repeat_interleave(32, 0).repeat_interleave(32, 1))
    # stored weights are fixed points of quantize -> dequantize
    assert torch.equal(dequantize_fp8_blocks(*quantize_fp8_blocks(dense)), dense)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(expert)), expert)
