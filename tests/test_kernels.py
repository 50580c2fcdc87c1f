"""The native products on stored weights (kernels/) against their oracle, the PyTorch path: dequantize, then an
fp32 matmul (after the FP8 activation QDQ where the call asks for it). Never bitwise: the kernels sum in another
order (lanes, then a horizontal sum). The products run twice: with the best instruction set this CPU has
(AVX-512 BF16 where present) and kept to AVX2, the baseline a machine without AVX-512 runs."""

from __future__ import annotations

import pytest
import torch

from openflash import formats, kernels
from openflash.kernels import native
from openflash.model.layers import Linear
from openflash.model.numerics import FP32, PLAIN

pytestmark = pytest.mark.skipif(not native.status().available, reason=f"no native kernels: {native.status().reason}")

E4M3_CODES = [c for c in range(256) if c & 0x7F != 0x7F]  # every code but the two NaNs (never a weight)
EXTREME_SCALES = [0, 1, 2, 100, 126, 127, 128, 160, 200]  # UE8M0 bytes: 2^-127 (subnormal) .. 2^73


@pytest.fixture(params=["best", "avx2", "avx2-float"])
def isa(request, monkeypatch):
    """The instruction set the products use (OPENFLASH_KERNELS; status() is read again under it). avx2-float keeps
    AVX2's FP4 products with QDQ'd activations in floats, where avx2 takes one row in integers."""
    monkeypatch.setenv("OPENFLASH_KERNELS", "1" if request.param == "best" else request.param)
    native.status.cache_clear()
    yield request.param
    native.status.cache_clear()  # monkeypatch restores the variable after this: the next status() reads it afresh


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to fp32 summation order: relative to each output row's magnitude."""
    scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    assert torch.isfinite(got).all() and ((got - want).abs() / scale).max() < 1e-5, ((got - want).abs() / scale).max()


def _fp8_weight(n: int, k: int, g: torch.Generator, scales=EXTREME_SCALES) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.tensor(E4M3_CODES, dtype=torch.uint8)[torch.randint(len(E4M3_CODES), (n, k), generator=g)]
    pick = torch.tensor(scales, dtype=torch.uint8)
    return codes, pick[torch.randint(len(scales), (-(-n // 32), k // 32), generator=g)]


def _fp4_weight(n: int, k: int, g: torch.Generator, scales=EXTREME_SCALES) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)  # every E2M1 pair
    pick = torch.tensor(scales, dtype=torch.uint8)
    return packed, pick[torch.randint(len(scales), (n, k // 32), generator=g)]


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 37])  # 37: three calls of the C code
@pytest.mark.parametrize("n, k", [(37, 32), (70, 160), (256, 96)])
@pytest.mark.parametrize("act_qdq", [False, True])
def test_fp8_and_fp4_products_equal_the_dequantized_matmul(rows, n, k, act_qdq, isa):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, k)  # magnitudes across many FP8 activation scales
    xin = formats.act_quant_qdq(x) if act_qdq else x
    q, s = _fp8_weight(n, k, g)
    _close(native.fp8_gemv(x, q, s, act_qdq), xin @ formats.dequantize_fp8_blocks(q, s).t())
    packed, s4 = _fp4_weight(n, k, g)
    _close(native.fp4_gemv(x, packed, s4, act_qdq), xin @ formats.dequantize_mxfp4(packed, s4).t())


@pytest.mark.parametrize("act_qdq", [False, True])  # a one-hot row is its own QDQ; True takes the bf16 decoders
def test_every_code_decodes_as_the_format_says(act_qdq, isa):
    """A one-hot activation reads single weights back: every E4M3 code and every E2M1 nibble, at unit scale."""
    k = 32 * 16
    codes = torch.tensor(E4M3_CODES + [0] * (k - len(E4M3_CODES)), dtype=torch.uint8).view(1, k)
    unit = torch.full((1, k // 32), 127, dtype=torch.uint8)
    eye = torch.eye(k)[: len(E4M3_CODES)]
    got = torch.cat([native.fp8_gemv(eye[i:i + 16], codes, unit, act_qdq) for i in range(0, len(eye), 16)])
    assert torch.equal(got[:, 0], formats.e4m3_decode(codes[0, : len(E4M3_CODES)]))
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 256)  # every (low, high) nibble pair
    for rows in (16, 1):  # AVX2 with the QDQ: one row in integers (avx2.c), more in floats
        got = torch.cat([native.fp4_gemv(torch.eye(512)[i:i + rows], packed, unit, act_qdq)
                         for i in range(0, 512, rows)])
        assert torch.equal(got[:, 0], formats.dequantize_mxfp4(packed, unit)[0]), rows


@pytest.mark.parametrize("rows", [1, 5])
def test_every_e4m3_activation_meets_every_e2m1_weight(rows, isa):
    """The integer FP4 products (AVX2, QDQ'd activations) hold |E4M3 value| * 512 in three 6-bit planes: every
    E4M3 code as an activation (one 32-group each, the group's scale set by a 448 beside it) against every nibble."""
    codes = formats.e4m3_decode(torch.tensor(E4M3_CODES, dtype=torch.uint8))
    x = torch.zeros(len(codes), 32)
    x[:, 0], x[:, 1] = codes, 448.0  # a unit activation scale: the code is its own QDQ
    packed = torch.zeros(256, 16, dtype=torch.uint8)  # K = 32: output o's first byte is the nibble pair o
    packed[:, 0] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    unit = torch.full((256, 1), 127, dtype=torch.uint8)
    w = formats.dequantize_mxfp4(packed, unit)
    got = torch.cat([native.fp4_gemv(x[i:i + rows], packed, unit, True) for i in range(0, len(x), rows)])
    _close(got, x @ w.t())
    assert torch.equal(got - 448.0 * w[:, 1], codes[:, None] * w[None, :, 0])  # each product exactly


@pytest.mark.parametrize("rows", [1, 5])
def test_a_value_that_is_not_finite_makes_its_row_not_finite(rows, isa):
    """NaN and inf activations give non-finite products, never finite garbage (the integer path has no NaN)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(rows, 64, generator=g)
    x[0, 3] = float("nan")
    x[-1, 40] = float("inf") if rows > 1 else float("nan")
    packed, s4 = _fp4_weight(8, 64, g, scales=[127])
    q, s8 = _fp8_weight(8, 64, g, scales=[127])
    for y in (native.fp4_gemv(x, packed, s4, True), native.fp8_gemv(x, q, s8, True)):
        assert not torch.isfinite(y[0]).any() and not torch.isfinite(y[-1]).any()
        assert torch.isfinite(y[1:-1]).all()


def test_bf16_products_and_rows_not_divisible_by_the_vector_width():
    g = torch.Generator().manual_seed(0)
    for n, k in ((5, 7), (33, 100), (64, 4096)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        for rows in (1, 16, 37):  # 37: three calls of the C code, the last of 5 rows
            x = torch.randn(rows, k, generator=g)
            _close(native.bf16_gemv(x, w), x @ w.float().t())


@pytest.mark.parametrize("threads", [1, 2])
def test_one_and_two_threads_agree(threads, isa):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, generator=g)
    packed, s4 = _fp4_weight(300, 256, g, scales=[120, 127, 130])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.fp4_gemv(x, packed, s4, True)
    finally:
        torch.set_num_threads(before)
    _close(got, formats.act_quant_qdq(x) @ formats.dequantize_mxfp4(packed, s4).t())


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
def test_a_stored_linear_uses_them_and_equals_the_pytorch_path(storage, monkeypatch):
    """`Linear` in "stored" residency: any rows go through the kernels (16 a call: 37 rows are three calls), and
    equal the PyTorch path the kernels replace, for fp32 (activation QDQ) and plain numerics."""
    torch.manual_seed(0)
    lin = Linear(256, 96, storage)
    w = torch.randn(96, 256) * 256 ** -0.5
    if storage == "fp8":
        q, s = formats.quantize_fp8_blocks(w)
        lin.weight.copy_(q.view(torch.float8_e4m3fn))
    else:
        q, s = formats.quantize_mxfp4(w)
        lin.weight.copy_(q.view(torch.int8))
    lin.scale.copy_(s.view(torch.float8_e8m0fnu))
    lin.keep_dequantized = False
    lin.eval()  # (in training mode more than 16 rows stay on the PyTorch path: model/layers.py _kernel_serves)
    calls = []
    product = getattr(native, f"{storage}_gemv")
    monkeypatch.setattr(native, f"{storage}_gemv", lambda *a: calls.append(a[0].shape) or product(*a))
    for numerics in (FP32, PLAIN):
        lin.numerics = numerics
        for rows in (1, 16, 37):
            x = torch.randn(rows, 256)
            got = lin(x)
            with monkeypatch.context() as off:
                off.setattr(kernels, "serves", lambda *a: False)
                want = lin(x)
            _close(got, want)
    assert calls == [(1, 256), (16, 256), (37, 256)] * 2


def test_the_ops_trace_as_single_nodes():
    """torch.compile sees each product as one custom op (its fake implementation gives the shape): no graph
    break, so a compiled graph can call them."""
    g = torch.Generator().manual_seed(1)
    q, s = _fp8_weight(64, 64, g, scales=[127])
    packed, s4 = _fp4_weight(64, 64, g, scales=[127])
    wb = torch.randn(64, 64, generator=g).to(torch.bfloat16)

    def f(x):
        return native.fp8_gemv(x, q, s, True) + native.fp4_gemv(x, packed, s4, True) + native.bf16_gemv(x, wb)

    x = torch.randn(2, 64, generator=g)
    torch._dynamo.reset()
    _close(torch.compile(f, fullgraph=True, backend="eager")(x), f(x))


def test_the_status_names_its_library():
    s = native.status()
    assert s.available and str(native.library_path()) in s.reason and native.library_path().is_file()


@pytest.mark.parametrize("golden", ["A2", "D"])
def test_parity_with_stored_weights_runs_through_them(golden, monkeypatch):
    """`openflash parity --numerics fp32 --weights stored`: every comparison holds with the kernels computing the
    quantized products (the reference numerics keep the reference's own block-scaled GEMM)."""
    from pathlib import Path

    from openflash.tools.parity import run_golden

    calls = []
    for name in ("fp8_gemv", "fp4_gemv"):
        product = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, product=product: calls.append(1) or product(*a))
    results = run_golden(Path(__file__).parent / "goldens" / golden, "fp32", teacher_forced=True, weights="stored")
    assert calls and all(r.passed for r in results), [r.key for r in results if not r.passed][:5]


def test_bad_arguments_are_named_before_the_c_code_sees_them():
    g = torch.Generator().manual_seed(5)
    q, s = _fp8_weight(64, 64, g, scales=[127])
    with pytest.raises(ValueError, match=r"of_fp8_gemv: x must be fp32 \[rows >= 1, K\], got torch.float32 \(0, 64\)"):
        native.fp8_gemv(torch.randn(0, 64), q, s, False)
    with pytest.raises(ValueError, match=r"weight torch.uint8 \(64, 64\) does not hold K = 96"):
        native.fp8_gemv(torch.randn(2, 96), q, s, False)
    with pytest.raises(ValueError, match=r"scale \(2, 1\) is not the \[2, 2\] UE8M0 bytes"):
        native.fp8_gemv(torch.randn(2, 64), q, s[:, :1].contiguous(), False)
    with pytest.raises(ValueError, match="of_bf16_gemv: weight torch.float32"):
        native.bf16_gemv(torch.randn(2, 64), torch.randn(8, 64))


def test_the_experts_call_names_bad_arguments():
    """`fp4_experts` (one call for a layer's routed experts; equal to one call per expert: tests/test_routed.py)
    checks what the C code trusts."""
    g = torch.Generator().manual_seed(6)
    w1 = torch.randint(0, 255, (64, 32), dtype=torch.uint8, generator=g)  # I = 64, K = 64
    s1 = torch.full((64, 2), 127, dtype=torch.uint8)
    w2, s2 = torch.randint(0, 255, (64, 32), dtype=torch.uint8, generator=g), torch.full((64, 2), 127, dtype=torch.uint8)
    pair = dict(token=torch.tensor([0]), expert=torch.tensor([0]), weight=torch.tensor([1.0]), limit=7.0, act_qdq=True)
    y = native.fp4_experts(torch.randn(1, 64), [w1], [s1], [w1], [s1], [w2], [s2], **pair)
    assert y.shape == (1, 64) and torch.isfinite(y).all()
    with pytest.raises(ValueError, match=r"of_fp4_experts: a pair names a token outside 0..0 or an expert outside"):
        native.fp4_experts(torch.randn(1, 64), [w1], [s1], [w1], [s1], [w2], [s2],
                           **{**pair, "expert": torch.tensor([1])})
    with pytest.raises(ValueError, match=r"w2 holds a torch.uint8 \(64, 16\) tensor, not contiguous bytes \(64, 32\)"):
        native.fp4_experts(torch.randn(1, 64), [w1], [s1], [w1], [s1], [w2[:, :16]], [s2], **pair)


@pytest.mark.parametrize("act_qdq", [False, True])
def test_the_experts_call_equals_the_dequantized_experts(act_qdq, isa):
    """All routed experts of a layer in one call against the formula on dequantized weights: K = 96 (three
    32-groups, an odd count the AVX-512 decoder pairs up), I = 64, tokens routed to several experts each."""
    g = torch.Generator().manual_seed(7)
    K, I, E, limit = 96, 64, 3, 7.0
    w1, s1 = zip(*(_fp4_weight(I, K, g, scales=[120, 124, 127]) for _ in range(E)))
    w3, s3 = zip(*(_fp4_weight(I, K, g, scales=[120, 124, 127]) for _ in range(E)))
    w2, s2 = zip(*(_fp4_weight(K, I, g, scales=[120, 124, 127]) for _ in range(E)))
    x = torch.randn(2, K, generator=g) * 4
    token, expert = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 1, 2])
    weight = torch.rand(4, generator=g)
    got = native.fp4_experts(x, list(w1), list(s1), list(w3), list(s3), list(w2), list(s2), token, expert, weight,
                             limit, act_qdq)
    qdq = formats.act_quant_qdq if act_qdq else (lambda t: t)
    want = torch.zeros_like(x)
    for t, e, r in zip(token.tolist(), expert.tolist(), weight):
        xe = qdq(x[t:t + 1])
        gate = (xe @ formats.dequantize_mxfp4(w1[e], s1[e]).t()).clamp(max=limit)
        up = (xe @ formats.dequantize_mxfp4(w3[e], s3[e]).t()).clamp(-limit, limit)
        h = qdq(r * torch.nn.functional.silu(gate) * up)
        want[t] += (h @ formats.dequantize_mxfp4(w2[e], s2[e]).t())[0]
    _close(got, want)


def test_the_kernel_choice_is_named(monkeypatch):
    monkeypatch.setenv("OPENFLASH_KERNELS", "avx2")
    native.status.cache_clear()
    try:
        assert native.status().isa == native.ISA_AVX2 | native.ISA_INTEGER_FP4
        assert native.status().reason.startswith("AVX2 (FP4 after the activation QDQ in integers) kernels")
        monkeypatch.setenv("OPENFLASH_KERNELS", "fast")
        native.status.cache_clear()
        with pytest.raises(ValueError, match="OPENFLASH_KERNELS='fast': expected 0 \\(off\\), avx2, avx2-float or 1"):
            native.status()
    finally:
        monkeypatch.undo()
        native.status.cache_clear()


def test_one_place_says_which_kernel_serves_a_product(monkeypatch):
    """kernels.product_kernel, the one answer every caller (layers, MoE, decode graph, --weights auto) asks; and
    OPENFLASH_KERNELS=0 turns every kernel off, the Triton ones on CUDA too."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [kernels.product_kernel(cpu, f, 16) for f in ("fp8", "fp4", "bf16")] == ["native"] * 3
    assert kernels.product_kernel(cpu, "fp8", 1000) == "native"  # a prefill: MAX_ROWS rows a call
    assert kernels.product_kernel(cpu, "bf16", native.MAX_ROWS + 1) is None  # the BLAS takes bf16 as it is
    fp4_rows = kernels.native_rows("fp4")  # any with AVX-512 BF16, 128 on AVX2 (dequantized tiles past it)
    assert fp4_rows == (None if native.status().isa & native.ISA_AVX512_BF16 else 128)
    assert kernels.product_kernel(cpu, "fp4", 128) == "native"
    assert kernels.product_kernel(cpu, "fp4", 129) == ("native" if fp4_rows is None else None)
    assert kernels.product_kernel(cpu, "fp8", 0) is None  # nothing to multiply
    assert kernels.product_kernel(cpu, None, 1) is None  # an fp32 weight
    assert kernels.experts_kernel(cpu, "fp4") == "native" and kernels.experts_kernel(cpu, "fp8") is None
    triton = kernels.triton_products.available()
    assert kernels.product_kernel(cuda, "fp4", 4096) == ("triton" if triton else None)
    assert kernels.product_kernel(cuda, "bf16", 1) is None
    assert kernels.experts_kernel(cuda, "fp4") == ("triton" if triton else None)
    assert kernels.experts_kernel(cuda, "fp8") is None
    assert kernels.cache_kernel(cuda) == ("triton" if triton else None) and kernels.cache_kernel(cpu) is None
    x, w = torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.uint8)
    assert kernels.serves(x, w, "fp8") and not kernels.serves(x[:, :48], w[:, :48], "fp8")  # K not whole blocks
    assert not kernels.serves(x, w.t().contiguous().t(), "fp8")  # a strided weight
    monkeypatch.setenv("OPENFLASH_KERNELS", "0")
    native.status.cache_clear()
    kernels.triton_on.cache_clear()
    try:
        assert kernels.product_kernel(cpu, "fp8", 1) is None
        assert (kernels.product_kernel(cuda, "fp4", 1), kernels.experts_kernel(cuda, "fp4"),
                kernels.cache_kernel(cuda)) == (None, None, None)
    finally:
        monkeypatch.undo()
        native.status.cache_clear()
        kernels.triton_on.cache_clear()


def test_the_kernels_module_says_which_kernels_run_here(monkeypatch, capsys):
    """`python -m openflash.kernels`: the native kernels' state and the Triton ones', each turned off by
    OPENFLASH_KERNELS=0."""
    from openflash.kernels.__main__ import main

    assert main() == 0
    out = capsys.readouterr().out
    assert out.startswith("openflash kernels: ") and "Triton kernels: " in out
    monkeypatch.setenv("OPENFLASH_KERNELS", "0")
    native.status.cache_clear()
    kernels.triton_on.cache_clear()
    try:
        assert main() == 0
        out = capsys.readouterr().out
        assert "not available: turned off by OPENFLASH_KERNELS=0" in out
        if kernels.triton_products.available():
            assert "Triton kernels: turned off by OPENFLASH_KERNELS=0" in out
    finally:
        monkeypatch.undo()
        native.status.cache_clear()
        kernels.triton_on.cache_clear()
