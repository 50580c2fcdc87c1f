"""A MoE layer's routed experts in one call on the GPU (Triton), from their MXFP4 bytes as stored: what the native
kernels' `fp4_experts` does on the CPU (kernels/native.py), with the same arguments and the same sums.

For each routed pair p (token[p], expert[p], routing weight[p]):

    h[p] = weight[p] * silu(min(x[token] W1^T, L)) * clamp(x[token] W3^T, -L, L)     (gate_up: one program per pair
    y[t] = sum over the pairs p of token t, in pair order, of h[p] W2^T              and I-block; down: per token
                                                                                      and K-block)
every product in the reference's block order (triton_products.py: an fp32 partial per 32, times the activation's
and the weight's UE8M0 scales), x and h FP8-QDQ'd per 32 first with `act_qdq` (the experts' input rounding, as
their Linears do). Each program reads its expert's rows by a table of the experts' addresses (`ExpertTables`: the
experts stay where they are, no stacked copy); the pairs of a token are found through a stable sort by token, so
nothing here reads the routing on the host: a decode step with it records as one CUDA graph. Decode-sized calls
(a program per pair is a one-row product): the MoE sends a step here where the CPU would take its native call.

With TRITON_INTERPRET=1 (tests/conftest.py on machines without CUDA) it runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openflash import formats
from openflash.kernels.native import BLOCK, dispatch
from openflash.kernels.triton_products import (e2m1_values, fp4_codes, register_op, rows_product, tl, triton,
                                              ue8m0_values)

PARTS = ("w1", "s1", "w3", "s3", "w2", "s2")  # the rows of an address table
# Past this many routed pairs a call goes to the tiled kernels (one program per pair reads its expert's rows once
# per pair: right for a decode step's few tokens, not for a prefill chunk, where an expert has many).
PER_PAIR_CALLS = 16
TILE_ROWS = 32  # pairs of one expert a tile multiplies at once


def _block_product(X, XS, row, b, W, WS, n64, n_ok, width, HAS_XS: tl.constexpr):
    """sum over one 32-block b of x[row] * w[n] (fp32), times x's scale and each row n's weight scale: [BLOCK_N]."""
    j = tl.arange(0, 32)
    k = b * 32 + j
    x = tl.load(X + row * width + k)
    w = e2m1_values(fp4_codes(W, tl.where(n_ok, n64, 0), k, width))
    ws = ue8m0_values(tl.load(WS + n64 * (width // 32) + b, mask=n_ok, other=127))
    part = tl.sum(x[None, :] * w, axis=1)
    if HAS_XS:
        part = part * tl.load(XS + row * (width // 32) + b)
    return part * ws


def _gate_up_kernel(X, XS, TABLES, TOKEN, EXPERT, WEIGHT, H, K, I, E, limit, HAS_XS: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    p = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    n64 = n.to(tl.int64)
    row = tl.load(TOKEN + p)
    e = tl.load(EXPERT + p)
    w1 = tl.load(TABLES + 0 * E + e).to(tl.pointer_type(tl.uint8))
    s1 = tl.load(TABLES + 1 * E + e).to(tl.pointer_type(tl.uint8))
    w3 = tl.load(TABLES + 2 * E + e).to(tl.pointer_type(tl.uint8))
    s3 = tl.load(TABLES + 3 * E + e).to(tl.pointer_type(tl.uint8))
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for b in range(0, K // 32):
        gate += _block_product(X, XS, row, b, w1, s1, n64, n_ok, K, HAS_XS)
        up += _block_product(X, XS, row, b, w3, s3, n64, n_ok, K, HAS_XS)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    z = tl.exp(-tl.abs(gate))  # silu without overflow: sigmoid from exp of a non-positive number
    h = tl.load(WEIGHT + p) * gate * tl.where(gate >= 0, 1.0 / (1.0 + z), z / (1.0 + z)) * up
    tl.store(H + p.to(tl.int64) * I + n64, h, mask=n_ok)


def _down_kernel(H, HS, TABLES, ORDER, STARTS, EXPERT, Y, K, I, E, HAS_XS: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < K
    n64 = n.to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for q in range(tl.load(STARTS + t), tl.load(STARTS + t + 1)):  # the token's pairs, in pair order
        p = tl.load(ORDER + q)
        e = tl.load(EXPERT + p)
        w2 = tl.load(TABLES + 4 * E + e).to(tl.pointer_type(tl.uint8))
        s2 = tl.load(TABLES + 5 * E + e).to(tl.pointer_type(tl.uint8))
        pair = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for b in range(0, I // 32):
            pair += _block_product(H, HS, p, b, w2, s2, n64, n_ok, I, HAS_XS)
        acc += pair
    tl.store(Y + t.to(tl.int64) * K + n64, acc, mask=n_ok)


def _tile_kernel(X, XS, ROWS, TABLES, PART, TILE_EXPERT, TILE_START, TILE_END, Y, K, N, E, HAS_XS: tl.constexpr,
                 IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y[m] = x[ROWS[m]] W_e^T for the pairs m of one tile (pairs sorted by expert; a tile holds one expert's): the
    products as triton_products.py forms them, tensor cores on BLOCK_M x BLOCK_N tiles (prefill-sized calls)."""
    tile = tl.program_id(1)
    e = tl.load(TILE_EXPERT + tile)
    m = tl.load(TILE_START + tile) + tl.arange(0, BLOCK_M)
    m_ok = m < tl.load(TILE_END + tile)
    row = tl.load(ROWS + m, mask=m_ok, other=0)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n64 = n.to(tl.int64)
    W = tl.load(TABLES + (2 * PART) * E + e).to(tl.pointer_type(tl.uint8))
    WS = tl.load(TABLES + (2 * PART + 1) * E + e).to(tl.pointer_type(tl.uint8))
    acc = rows_product(X, XS, row, m_ok, W, WS, n64, n_ok, K, True, HAS_XS, IEEE, BLOCK_M, BLOCK_N)
    tl.store(Y + m.to(tl.int64)[:, None] * N + n64[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def _sum_kernel(O, ORDER, STARTS, Y, K, BLOCK_N: tl.constexpr):
    """Y[t] = the sum of the rows O[ORDER[q]] for q in [STARTS[t], STARTS[t + 1]), in that order."""
    t = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < K
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for q in range(tl.load(STARTS + t), tl.load(STARTS + t + 1)):
        acc += tl.load(O + tl.load(ORDER + q) * K + n, mask=n_ok, other=0.0)
    tl.store(Y + t.to(tl.int64) * K + n, acc, mask=n_ok)


if triton is not None:
    _block_product = triton.jit(_block_product)
    _GATE_UP, _DOWN = triton.jit(_gate_up_kernel), triton.jit(_down_kernel)
    _TILE, _SUM = triton.jit(_tile_kernel), triton.jit(_sum_kernel)


@dataclass(frozen=True)
class ExpertTables:
    """The addresses of a layer's experts' stored tensors on their device: int64 [6, E] (rows in PARTS order), the
    experts' inner width I, and the tensors themselves (kept alive while the table is). Built once per layer by its
    owner (the MoE), which rebuilds it when the weights move."""

    addresses: torch.Tensor
    inner: int
    held: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, w1: list[torch.Tensor], s1: list[torch.Tensor], w3: list[torch.Tensor], s3: list[torch.Tensor],
           w2: list[torch.Tensor], s2: list[torch.Tensor], K: int) -> "ExpertTables":
        """The table of these experts' MXFP4 bytes and scales (w1, w3 [I, K/2]; s1, s3 [I, K/32]; w2 [K, I/2];
        s2 [K, I/32]), each checked: the kernels trust the addresses."""
        E = len(w1)
        I = w1[0].shape[0] if E else 0
        shapes = {"w1": (I, K // 2), "s1": (I, K // BLOCK), "w3": (I, K // 2), "s3": (I, K // BLOCK),
                  "w2": (K, I // 2), "s2": (K, I // BLOCK)}
        parts = dict(zip(PARTS, (w1, s1, w3, s3, w2, s2)))
        if not E or I % BLOCK or K % BLOCK or any(len(t) != E for t in parts.values()):
            raise ValueError(f"triton fp4_experts: one tensor per expert in each of {', '.join(PARTS)}, K and I "
                             f"multiples of {BLOCK}; got K {K}, I {I}, {[len(t) for t in parts.values()]} tensors")
        device = w1[0].device
        for name, tensors in parts.items():
            for e, t in enumerate(tensors):
                if tuple(t.shape) != shapes[name] or t.element_size() != 1 or not t.is_contiguous() \
                        or t.device != device:
                    raise ValueError(f"triton fp4_experts: {name}[{e}] is a {t.dtype} {tuple(t.shape)} tensor on "
                                     f"{t.device}, not contiguous bytes {shapes[name]} on {device}")
        addresses = torch.tensor([[t.data_ptr() for t in parts[name]] for name in PARTS], dtype=torch.int64)
        return cls(addresses.to(device), I, tuple(t for name in PARTS for t in parts[name]))


def experts_call(x: torch.Tensor, addresses: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                 weight: torch.Tensor, inner: int, limit: float, act_qdq: bool) -> torch.Tensor:
    """The two kernels on a table's addresses (module doc): y [T, K] fp32. Pairs name experts of the table."""
    T, K = x.shape
    P, E = token.numel(), addresses.shape[1]
    if act_qdq:
        x, xs = formats.act_quant(x.float())
    else:
        x, xs = x.float(), x
    x, xs = x.contiguous(), xs.contiguous()
    y = torch.zeros(T, K, dtype=torch.float32, device=x.device)
    if P == 0 or T == 0:
        return y
    token, expert, weight = token.contiguous(), expert.contiguous(), weight.float().contiguous()
    h = torch.empty(P, inner, dtype=torch.float32, device=x.device)
    block = 64
    _GATE_UP[(-(-inner // block), P)](x, xs, addresses, token, expert, weight, h, K, inner, E, float(limit),
                                      HAS_XS=act_qdq, BLOCK_N=block)
    if act_qdq:
        h, hs = formats.act_quant(h)
    else:
        hs = h
    order = torch.argsort(token, stable=True)
    starts = torch.searchsorted(token[order], torch.arange(T + 1, device=token.device))
    _DOWN[(-(-K // block), T)](h.contiguous(), hs.contiguous(), addresses, order, starts, expert, y, K, inner, E,
                               HAS_XS=act_qdq, BLOCK_N=block)
    return y


def tiled_call(x: torch.Tensor, addresses: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
               weight: torch.Tensor, inner: int, limit: float, act_qdq: bool) -> torch.Tensor:
    """`experts_call`'s result for prefill-sized calls: the pairs sorted by expert into tiles of TILE_ROWS, each
    tile's products on tensor cores (w1, w3, then w2 on the SwiGLU between), each token's pairs summed in the sorted
    order (ascending expert, as the MoE's `grouped` path sums them). Reads the routing's counts on the host."""
    T, K = x.shape
    P, E = token.numel(), addresses.shape[1]
    y = torch.zeros(T, K, dtype=torch.float32, device=x.device)
    if P == 0 or T == 0:
        return y
    x = x.float()
    x, xs = formats.act_quant(x) if act_qdq else (x, x)  # (xs unread without the QDQ)
    order = torch.argsort(expert, stable=True)
    token, weight = token[order].contiguous(), weight.float()[order]
    starts, experts_of, ends, at = [], [], [], 0
    for e, count in enumerate(torch.bincount(expert, minlength=E).tolist()):
        for first in range(at, at + count, TILE_ROWS):
            starts.append(first)
            ends.append(min(first + TILE_ROWS, at + count))
            experts_of.append(e)
        at += count
    tiles = [torch.tensor(v, dtype=torch.long, device=x.device) for v in (experts_of, starts, ends)]
    block = 64

    def products(a: torch.Tensor, a_scales: torch.Tensor, rows: torch.Tensor, part: int, width: int,
                 out: int) -> torch.Tensor:
        result = torch.empty(P, out, dtype=torch.float32, device=x.device)
        _TILE[(-(-out // block), len(starts))](a.contiguous(), a_scales.contiguous(), rows, addresses, part, *tiles,
                                               result, width, out, E, HAS_XS=act_qdq, IEEE=not act_qdq,
                                               BLOCK_M=TILE_ROWS, BLOCK_N=block)
        return result

    gate = products(x, xs, token, 0, K, inner).clamp(max=limit)
    up = products(x, xs, token, 1, K, inner).clamp(-limit, limit)
    h = weight.unsqueeze(1) * torch.nn.functional.silu(gate) * up
    h, hs = formats.act_quant(h) if act_qdq else (h, h)
    out = products(h, hs, torch.arange(P, device=x.device), 2, inner, K)
    by_token = torch.argsort(token, stable=True)  # each token's pairs, still by ascending expert
    bounds = torch.searchsorted(token[by_token], torch.arange(T + 1, device=x.device))
    _SUM[(-(-K // block), T)](out, by_token, bounds, y, K, BLOCK_N=block)
    return y


def fp4_experts(x: torch.Tensor, w1: list[torch.Tensor], s1: list[torch.Tensor], w3: list[torch.Tensor],
                s3: list[torch.Tensor], w2: list[torch.Tensor], s2: list[torch.Tensor], token: torch.Tensor,
                expert: torch.Tensor, weight: torch.Tensor, limit: float, act_qdq: bool) -> torch.Tensor:
    """native.fp4_experts's call (the same arguments and result) through the Triton kernels; the table of the
    experts' addresses is built for this call (the MoE keeps its own: `ExpertTables`)."""
    if triton is None:
        raise RuntimeError("fp4_experts on the GPU needs Triton (it ships with PyTorch's CUDA builds)")
    problems = []
    if x.dim() != 2 or x.dtype != torch.float32:
        problems.append(f"x must be fp32 [T, K], got {x.dtype} {tuple(x.shape)}")
    P = token.numel()
    if token.dtype != torch.int64 or expert.dtype != torch.int64 or weight.dtype != torch.float32 or \
            not token.shape == expert.shape == weight.shape == (P,):
        problems.append("token, expert (int64) and weight (fp32) must be one value per pair")
    elif P and (int(token.min()) < 0 or int(token.max()) >= x.shape[0] or int(expert.min()) < 0
                or int(expert.max()) >= len(w1)):
        problems.append(f"a pair names a token outside 0..{x.shape[0] - 1} or an expert outside 0..{len(w1) - 1}")
    if problems:
        raise ValueError("triton fp4_experts: " + "; ".join(problems))
    tables = ExpertTables.of(w1, s1, w3, s3, w2, s2, x.shape[1])
    return experts(x, tables, token, expert, weight, limit, act_qdq)


def experts(x: torch.Tensor, tables: ExpertTables, token: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor,
            limit: float, act_qdq: bool) -> torch.Tensor:
    """`experts_call` on a kept table, as openflash::triton_fp4_experts inside a traced graph (a decode step); past
    PER_PAIR_CALLS pairs in eager code (a prefill chunk), `tiled_call`."""
    if not torch.compiler.is_compiling() and token.numel() > PER_PAIR_CALLS:  # (no guard on a traced size)
        return tiled_call(x, tables.addresses, token, expert, weight, tables.inner, limit, act_qdq)
    return dispatch("triton_fp4_experts", experts_call, x, tables.addresses, token, expert, weight, tables.inner,
                    limit, act_qdq)


_OP = register_op("triton_fp4_experts(Tensor x, Tensor addresses, Tensor token, Tensor expert, Tensor weight, "
                  "int inner, float limit, bool act_qdq) -> Tensor", experts_call,
                  lambda x, addresses, token, expert, weight, inner, limit, act_qdq:
                  x.new_empty(x.shape, dtype=torch.float32))

__all__ = ["ExpertTables", "experts", "experts_call", "tiled_call", "fp4_experts", "PARTS", "PER_PAIR_CALLS",
           "TILE_ROWS"]
