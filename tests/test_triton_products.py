"""The Triton kernels, run by Triton's interpreter on the CPU (tests/conftest.py turns it on where there is no GPU):
the products on stored FP8 / MXFP4 weights (kernels/triton_products.py) against dequantize-then-matmul in fp64
(every E4M3 and E2M1 code, extreme UE8M0 exponents, odd shapes, one and many rows, with and without the activation
QDQ), a layer's routed experts in one call, and the pool kernels (the indexer's scores, the picked entries'
attention) against the keys and entries read out. On a machine with CUDA the same checks run on the GPU too."""

from __future__ import annotations

import pytest
import torch

from openflash import formats
from openflash.kernels import triton_products

from error_bounds import assert_within, partial_softmax_bound

pytestmark = pytest.mark.skipif(not triton_products.available(), reason="Triton is not installed")

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # CPU tensors need the interpreter


def stored(storage: str, n: int, k: int, gen: torch.Generator, scale_bytes: tuple[int, int] = (115, 135),
           nan_codes: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random bytes covering every code (E4M3's NaN codes only when asked), scales in scale_bytes; and the fp64
    dequantized weight [n, k]."""
    lo, hi = scale_bytes
    if storage == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32)
        codes.view(-1)[:256] = torch.arange(256, dtype=torch.int32)[: min(256, n * k)]  # every code, once at least
        if not nan_codes:
            codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
        weight = codes.to(torch.uint8)
        scale = torch.randint(lo, hi + 1, (-(-n // 32), k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        values = formats.e4m3_decode(weight).double()
        scales = formats.ue8m0_decode(scale).double().repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)
    else:
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        codes.view(-1)[:16] = torch.arange(16, dtype=torch.int32)
        weight = formats.pack_fp4(codes.to(torch.uint8))
        scale = torch.randint(lo, hi + 1, (n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        values = formats.e2m1_decode(codes.to(torch.uint8)).double()
        scales = formats.ue8m0_decode(scale).double().repeat_interleave(32, 1)
    return weight, scale, values * scales


def oracle(x: torch.Tensor, w: torch.Tensor, act_qdq: bool) -> torch.Tensor:
    x = formats.act_quant_qdq(x) if act_qdq else x
    return x.double() @ w.t()


def check(y: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 accumulation against fp64: relative to each row's magnitude (the sum's rounding scales with it)."""
    y = y.cpu().double()
    assert y.shape == want.shape
    bound = 1e-5 * (want.abs().amax(dim=-1, keepdim=True) + 1e-300)
    assert bool(((y - want).abs() <= bound).all()), f"max error {(y - want).abs().max():.3g}, bound {bound.min():.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["fp8", "fp4"])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 70])
@pytest.mark.parametrize("act_qdq", [True, False])
def test_matches_dequantized(device: str, storage: str, rows: int, act_qdq: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + (storage == "fp4"))
    n, k = 72, 96  # N not a multiple of 32 or of the kernel's tile; K three scale blocks
    weight, scale, w = stored(storage, n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    y = triton_products.stored_product(x.to(device), weight.to(device), scale.to(device), storage, act_qdq)
    check(y, oracle(x, w, act_qdq))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("storage", ["fp8", "fp4"])
@pytest.mark.parametrize("scale_bytes, x_scale", [((0, 8), 2.0**100), ((240, 254), 2.0**-100)])
def test_extreme_scales(device: str, storage: str, scale_bytes: tuple[int, int], x_scale: float) -> None:
    """UE8M0 bytes at both ends (byte 0 is the subnormal 2^-127), with activations that keep the result finite."""
    gen = torch.Generator().manual_seed(scale_bytes[0])
    weight, scale, w = stored(storage, 40, 64, gen, scale_bytes)
    x = torch.randn(3, 64, generator=gen) * x_scale
    y = triton_products.stored_product(x.to(device), weight.to(device), scale.to(device), storage, False)
    check(y, oracle(x, w, False))


@pytest.mark.parametrize("device", DEVICES)
def test_nan_codes_and_scales_propagate(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    weight, scale, _ = stored("fp8", 64, 32, gen)
    weight[5, 3] = 0x7F  # E4M3's NaN
    scale[1, 0] = 255  # UE8M0's NaN: rows 32..63
    y = triton_products.stored_product(torch.randn(2, 32, generator=gen).to(device), weight.to(device),
                                       scale.to(device), "fp8", True).cpu()
    nan_rows = torch.isnan(y).all(dim=0)
    assert nan_rows[5] and nan_rows[32:].all() and not torch.isnan(y[:, :5]).any()


def test_bad_shapes_are_named() -> None:
    gen = torch.Generator().manual_seed(4)
    weight, scale, _ = stored("fp4", 32, 64, gen)
    with pytest.raises(ValueError, match=r"fp4 weight \(32, 32\) / scale \(32, 2\) do not hold K = 96"):
        triton_products.stored_product(torch.randn(1, 96), weight, scale, "fp4", True)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        triton_products.stored_product(torch.randn(1, 40), weight, scale, "fp4", True)
    with pytest.raises(ValueError, match="neither fp8 nor fp4"):
        triton_products.stored_product(torch.randn(1, 64), weight, scale, "bf16", True)


def test_empty_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    weight, scale, _ = stored("fp8", 32, 32, gen)
    assert triton_products.stored_product(torch.randn(0, 32), weight, scale, "fp8", True).shape == (0, 32)


# ---- a layer's routed experts in one call (kernels/triton_experts.py) ----------------------------------------------

def _experts(E: int, K: int, I: int, gen: torch.Generator):
    """E experts' MXFP4 w1, w3 [I, K/2], w2 [K, I/2] with their scales, and their fp64 dequantized weights."""
    parts, values = [], []
    for n, k in ((I, K), (I, K), (K, I)):
        made = [stored("fp4", n, k, gen, (118, 128)) for _ in range(E)]
        parts += [[m[0] for m in made], [m[1] for m in made]]
        values.append([m[2] for m in made])
    return parts, values


def _experts_oracle(x, values, token, expert, weight, limit, act_qdq):
    """The formula (kernels/native.py fp4_experts) on dequantized weights, each pair added to its token in order."""
    qdq = formats.act_quant_qdq if act_qdq else (lambda t: t)
    w1, w3, w2 = values
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t, e, r in zip(token.tolist(), expert.tolist(), weight.tolist()):
        xe = qdq(x[t:t + 1]).double()
        gate = (xe @ w1[e].t()).clamp(max=limit)
        up = (xe @ w3[e].t()).clamp(-limit, limit)
        h = qdq((r * torch.nn.functional.silu(gate) * up).float()).double()
        y[t] += (h @ w2[e].t())[0]
    return y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act_qdq", [True, False])
def test_the_experts_call_matches_the_dequantized_experts(device: str, act_qdq: bool) -> None:
    """K = 96 (three 32-blocks), I = 64 + 32 (a partial 64-wide tile), three experts, tokens with several pairs in
    no particular order, one token with none (its row stays zero), every E2M1 code; the same as the native call."""
    from openflash.kernels import triton_experts

    gen = torch.Generator().manual_seed(11)
    K, I, E, limit = 96, 96, 3, 7.0
    parts, values = _experts(E, K, I, gen)
    x = torch.randn(4, K, generator=gen) * 4
    token, expert = torch.tensor([2, 0, 0, 2, 1, 0]), torch.tensor([1, 0, 2, 0, 2, 1])  # token 3 gets none
    weight = torch.rand(6, generator=gen)
    got = triton_experts.fp4_experts(x.to(device), *[[t.to(device) for t in p] for p in parts], token.to(device),
                                     expert.to(device), weight.to(device), limit, act_qdq)
    want = _experts_oracle(x, values, token, expert, weight, limit, act_qdq)
    check(got, want)
    assert bool((got[3] == 0).all())


def test_the_experts_call_names_bad_arguments() -> None:
    from openflash.kernels import triton_experts

    gen = torch.Generator().manual_seed(12)
    parts, _ = _experts(2, 64, 32, gen)
    pair = dict(token=torch.tensor([0]), expert=torch.tensor([0]), weight=torch.tensor([1.0]), limit=7.0,
                act_qdq=True)
    with pytest.raises(ValueError, match=r"a pair names a token outside 0..0 or an expert outside 0..1"):
        triton_experts.fp4_experts(torch.randn(1, 64), *parts, **{**pair, "expert": torch.tensor([2])})
    bad = [list(p) for p in parts]
    bad[4][1] = bad[4][1][:, :8].contiguous()
    with pytest.raises(ValueError, match=r"w2\[1\] is a torch.uint8 \(64, 8\) tensor on cpu, not contiguous bytes "
                                         r"\(64, 16\)"):
        triton_experts.fp4_experts(torch.randn(1, 64), *bad, **pair)
    with pytest.raises(ValueError, match="token, expert \\(int64\\) and weight \\(fp32\\) must be one value per pair"):
        triton_experts.fp4_experts(torch.randn(1, 64), *parts, **{**pair, "weight": torch.tensor([1.0, 2.0])})
    empty = triton_experts.fp4_experts(torch.randn(2, 64), *parts, torch.zeros(0, dtype=torch.long),
                                       torch.zeros(0, dtype=torch.long), torch.zeros(0), 7.0, True)
    assert empty.shape == (2, 64) and bool((empty == 0).all())


# ---- the indexer's scores from the engine's block pool (kernels/triton_index.py) --------------------------------

@pytest.mark.parametrize("storage", ["packed", "fp32"])
def test_index_scores_from_the_pool_match_the_scores_of_the_keys_read_out(storage: str) -> None:
    """Two rows of different lengths (the shorter one's blocks past its end are the zero block), three queries a
    row, blocks of 8 entries, 37 entries (a partial block and a partial 64-entry tile): the same scores as the
    keys read out and scored by the fp32 numerics' ops."""
    from openflash.engine.block_pool import BlockPool, EntryLayout
    from openflash.engine.cache import PagedCompressedCache
    from openflash.kernels.triton_index import paged_index_scores
    from openflash.model.indexer import index_scores

    gen = torch.Generator().manual_seed(13)
    D, H, n = 64, 4, 37
    pool = BlockPool(EntryLayout(128, D, storage), block_size=8)
    store = PagedCompressedCache.empty(pool, 2, 4, 128)
    for row, length in enumerate((21, n)):
        store.write(torch.full((length,), row), torch.arange(length),
                    formats.fp4_qdq_e4m3(torch.randn(length, 128, generator=gen)),
                    formats.fp4_qdq_ue8m0(torch.randn(length, D, generator=gen) * 3))
    q = formats.fp4_qdq_ue8m0(torch.randn(2, 3, H, D, generator=gen))
    w = torch.randn(2, 3, H, generator=gen)
    keys = pool.planes["index_k"]
    got = paged_index_scores(q.reshape(6, H, D), w.reshape(6, H), torch.arange(2).repeat_interleave(3),
                             store.device_table, keys, pool.planes.get("index_scale", keys), n, storage == "packed")
    torch.testing.assert_close(got.view(2, 3, n), index_scores(q, store.read_index(n), w), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="does not reach 100 entries"):
        paged_index_scores(q.reshape(6, H, D), w.reshape(6, H), torch.arange(2).repeat_interleave(3),
                           store.device_table, keys, pool.planes.get("index_scale", keys), 100, storage == "packed")


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_sized_experts_call_is_tiled_and_matches(device: str) -> None:
    """Past PER_PAIR_CALLS pairs the call goes to tiles of one expert's pairs (TILE_ROWS a tile, an expert with
    more than one tile here, one with none): the formula's result, each token's pairs summed by ascending expert."""
    from openflash.kernels import triton_experts

    gen = torch.Generator().manual_seed(14)
    K, I, E, T, limit = 64, 32, 4, 40, 7.0
    parts, values = _experts(E, K, I, gen)
    x = torch.randn(T, K, generator=gen) * 4
    token = torch.arange(T).repeat_interleave(2)
    expert = torch.stack([torch.tensor([0, 1 + int(torch.randint(2, (1,), generator=gen))]) for _ in range(T)])
    expert = expert.flatten()  # expert 0 in every token (two tiles), expert 3 in none
    weight = torch.rand(2 * T, generator=gen)
    assert token.numel() > triton_experts.PER_PAIR_CALLS and int((expert == 0).sum()) > triton_experts.TILE_ROWS
    got = triton_experts.fp4_experts(x.to(device), *[[t.to(device) for t in p] for p in parts], token.to(device),
                                     expert.to(device), weight.to(device), limit, True)
    check(got, _experts_oracle(x, values, token, expert, weight, limit, True))


# ---- the sparse attention's parts from the cache's planes (kernels/triton_attention.py) --------------------------

def _part(q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, scale: float):
    """The partial softmax of q [R, H, D] over keys [R, N, D] where seen [R, N], in fp64."""
    z = torch.einsum("rhd,rkd->rhk", q.double(), keys.double()) * scale
    z = z.masked_fill(~seen.unsqueeze(1), float("-inf"))
    row_max = z.amax(-1).clamp(min=-1e30)
    p = torch.exp(z - row_max.unsqueeze(-1))
    return torch.einsum("rhk,rkd->rhd", p, keys.double()), row_max, p.sum(-1)


def _assert_part(got, q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, scale: float, tile: int) -> None:
    """The kernel's fp32 part against the fp64 one, each element within the a-priori bound of an fp32 online softmax
    in tiles of `tile` entries (tests/error_bounds.py): whatever order the reductions took on this machine."""
    bounds = partial_softmax_bound(q, keys, seen, scale, tile)
    for name, g, w, b in zip(("acc", "max", "total"), got, _part(q, keys, seen, scale), bounds):
        assert_within(name, g.cpu(), w, b)


def test_the_attention_bound_holds_for_every_summation_order_and_catches_a_wrong_part() -> None:
    """The partial softmax at the released width (D = 512, scores in the tens, entries over five decades) computed in
    fp32 in orders that differ in their last bits (one matmul, keys reversed, columns reversed, online in tiles of
    1 and 16): each within the bound against fp64. A tolerance read off one machine (the 6e-5 the kernel tests had)
    can be broken by one of these orders; the bound is not, and a wrong part (an entry dropped, the scale 1% off)
    still fails it."""
    gen = torch.Generator().manual_seed(3)
    R, H, N, D, scale = 3, 20, 37, 512, 512 ** -0.5
    q = torch.randn(R, H, D, generator=gen)
    keys = formats.fp4_qdq_e4m3(torch.randn(R, N, D, generator=gen) * torch.logspace(-4, 1, N).unsqueeze(1))
    seen = torch.rand(R, N, generator=gen) > 0.2
    want = _part(q, keys, seen, scale)

    def fp32_part(q, keys, seen, scale, tile: int | None, flip_keys=False, flip_columns=False):
        if flip_keys:
            keys, seen = keys.flip(1), seen.flip(1)
        if flip_columns:
            q, keys = q.flip(-1), keys.flip(-1)
        if tile is None:
            z = (q @ keys.transpose(1, 2) * scale).masked_fill(~seen.unsqueeze(1), float("-inf"))
            m = z.amax(-1).clamp(min=-1e30)
            p = torch.exp(z - m.unsqueeze(-1))
            acc, total = p @ keys, p.sum(-1)
        else:
            m, total, acc = torch.full((R, H), -1e30), torch.zeros(R, H), torch.zeros(R, H, D)
            for k0 in range(0, N, tile):
                kv, ok = keys[:, k0:k0 + tile], seen[:, k0:k0 + tile].unsqueeze(1)
                z = (q @ kv.transpose(1, 2) * scale).masked_fill(~ok, float("-inf"))
                new_m = torch.maximum(m, z.amax(-1))
                rescale, p = torch.exp(m - new_m), torch.exp(z - new_m.unsqueeze(-1))
                m, total, acc = new_m, total * rescale + p.sum(-1), acc * rescale.unsqueeze(-1) + p @ kv
        return acc.flip(-1) if flip_columns else acc, m, total

    orders = {"one matmul": (None, False, False), "keys reversed": (None, True, False),
              "columns reversed": (None, False, True), "tiles of 1": (1, False, False), "tiles of 16": (16, True, True)}
    parts = {name: fp32_part(q, keys, seen, scale, *how) for name, how in orders.items()}
    assert len({parts[name][0].numpy().tobytes() for name in orders}) > 1, "the orders did not differ"
    for name, part in parts.items():
        _assert_part(part, q, keys, seen, scale, tile=1)
    dropped = seen.clone()
    dropped[0, int(seen[0].nonzero()[-1])] = False  # the last entry row 0 sees, its weight among the largest
    with pytest.raises(AssertionError, match="past their bound"):
        _assert_part(fp32_part(q, keys, dropped, scale, None), q, keys, seen, scale, tile=1)
    with pytest.raises(AssertionError, match="past their bound"):
        _assert_part(fp32_part(q, keys, seen, scale * 1.01, None), q, keys, seen, scale, tile=1)


@pytest.mark.parametrize("storage", ["packed", "fp32"])
@pytest.mark.parametrize("heads, D", [(4, 64), (20, 512)])
@pytest.mark.parametrize("device", DEVICES)
def test_picked_attention_from_the_pool_matches_the_entries_read_out(storage: str, heads: int, D: int,
                                                                     device: str) -> None:
    """Two rows of different lengths, blocks of 8 entries, three queries a row picking 37 entries (a partial
    BLOCK_K tile) with some -1, one query with none, 4 and 20 heads (a partial and a second head block), the
    released width 512 (its own tiles), E4M3 scales down to the subnormal ones: the partial softmax (acc, max,
    total) of the entries read out, in fp64."""
    from openflash.engine.block_pool import BlockPool, EntryLayout
    from openflash.engine.cache import PagedCompressedCache
    from openflash.kernels.triton_attention import picked_attention

    gen = torch.Generator().manual_seed(15)
    K, scale = 37, D ** -0.5
    pool = BlockPool(EntryLayout(D, 32, storage), block_size=8, device=device)
    store = PagedCompressedCache.empty(pool, 2, 4, D, device=device)
    lengths = (21, 50)
    for row, length in enumerate(lengths):
        magnitude = torch.logspace(-4, 1, length).unsqueeze(1)  # subnormal E4M3 scales at the small end
        kv = formats.fp4_qdq_e4m3(torch.randn(length, D, generator=gen) * magnitude)
        store.write(torch.full((length,), row, device=device), torch.arange(length, device=device), kv.to(device),
                    formats.fp4_qdq_ue8m0(torch.randn(length, 32, generator=gen)).to(device))
    picks = torch.stack([torch.randint(0, lengths[r // 3], (K,), generator=gen) for r in range(6)])
    picks[1, ::3] = -1
    picks[4] = -1
    q = torch.randn(2, 3, heads, D, generator=gen)
    planes = pool.planes
    got = picked_attention(q.to(device), picks.view(2, 3, K).to(device), store.device_table, planes["kv"],
                           planes.get("kv_scale", planes["kv"]), scale, storage == "packed")
    assert got[0].shape == (2, 3, heads, D) and got[1].shape == got[2].shape == (2, 3, heads)
    rows = torch.arange(2).repeat_interleave(3)
    entries = store.read(50)[0].cpu()[rows.unsqueeze(1), picks.clamp(min=0)]  # [6, K, D]
    _assert_part(got, q.view(6, heads, D), entries, picks >= 0, scale, tile=16)
    assert bool((got[2].cpu().view(6, heads)[4] == 0).all()) and bool((got[0].cpu().view(6, heads, D)[4] == 0).all())
    with pytest.raises(ValueError, match="picks must be int64"):
        picked_attention(q.to(device), picks.view(2, 3, K).int().to(device), store.device_table, planes["kv"],
                         planes.get("kv_scale", planes["kv"]), scale, storage == "packed")


@pytest.mark.parametrize("storage", ["packed", "fp32"])
@pytest.mark.parametrize("D", [64, 512])
@pytest.mark.parametrize("device", DEVICES)
def test_ring_attention_matches_the_ring_read_out(storage: str, D: int, device: str) -> None:
    """A ring of 20 slots (a window of 16 plus spare ones) for two rows, one full and wrapped (slots hold positions
    past the window too), one with empty slots, two queries a row at different positions, 20 heads, widths 64 and
    512: the partial softmax of the visible slots of the ring read out (decoded), in fp64."""
    from openflash.engine.cache import PackedWindowCache
    from openflash.kernels.triton_attention import ring_attention
    from openflash.model.stores import WindowCache

    gen = torch.Generator().manual_seed(16)
    B, W, H, window, scale = 2, 20, 20, 16, D ** -0.5
    values = formats.act_quant_qdq(torch.randn(B, W, D, generator=gen) * torch.logspace(-3, 1, W).unsqueeze(1))
    written = torch.tensor([[40 + (s - 40) % W for s in range(W)], list(range(W))])  # each slot's position % W
    valid = torch.stack([torch.ones(W, dtype=torch.bool), torch.arange(W) < 7])
    pos = torch.where(valid, written, -1)
    if storage == "packed":
        ring = PackedWindowCache.empty(B, W, D, device=device)
        ring.write(values.to(device), written.to(device), valid.to(device))
        assert torch.equal(ring.pos.cpu(), pos)
        kv, scales = ring.codes, ring.scales
    else:
        ring = WindowCache(values.to(device), pos.to(device))
        kv = scales = ring.kv
    positions = torch.tensor([[52, 59], [6, 9]])
    q = torch.randn(B, 2, H, D, generator=gen)
    got = ring_attention(q.to(device), positions.to(device), kv, scales, ring.pos, window, scale, storage == "packed")
    kp, qp = pos.unsqueeze(1), positions.unsqueeze(2)
    seen = ((kp >= 0) & (kp <= qp) & (kp > qp - window)).view(B * 2, W)
    assert not bool(seen.all()) and bool(seen.any(-1).all())
    read_out = ring.kv.cpu().repeat_interleave(2, 0)  # [B * 2, W, D]
    _assert_part(got, q.view(B * 2, H, D), read_out, seen, scale, tile=16)
    with pytest.raises(ValueError, match="ring planes"):
        ring_attention(q.to(device), positions.to(device), kv[:, :, :32], scales, ring.pos, window, scale,
                       storage == "packed")
    with pytest.raises(ValueError, match="slot positions must be int64"):
        ring_attention(q.to(device), positions.to(device), kv, scales, ring.pos.int(), window, scale,
                       storage == "packed")
