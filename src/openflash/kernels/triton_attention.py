"""The sparse attention's reads of the cache on the GPU (Triton): each query's picked compressed entries, straight
from the engine's block pool (E2M1 with an E4M3 scale per 16 in the packed storage, fp32 otherwise), and its
sliding-window ring (FP8 E4M3 with a UE8M0 scale per 32 packed, fp32 otherwise), decoded in registers and attended
with an online softmax. The PyTorch path instead writes an fp32 copy of both and reads it again: per decode row and
layer at the released widths, 1 MiB of picked entries (k = 512, head_dim = 512) and 256 KiB of ring, where these
kernels read 144 KiB and 66 KiB of packed bytes; for a prefill chunk the picked copy is k times its activations.

For query row r (of batch row rows[r]) and heads h, over the entries t it may see (a pick >= 0; a ring slot whose
position p has p <= qpos[r] and p > qpos[r] - window):

    z[h, t] = scale * q[r, h] . kv[t]         m[h] = max(-1e30, max_t z[h, t])
    total[h] = sum_t exp(z[h, t] - m[h])      acc[h] = sum_t exp(z[h, t] - m[h]) * kv[t]

the un-normalised partial softmax of architecture.md §5.10 (a "part"). model/sink_attention.py `sparse_attention`
joins the parts with what it attends itself (the chunk's own keys) and the sink: flash decoding's split-softmax
merge. One program per query row and 16 heads; the entries in tiles of BLOCK_K, both products by tl.dot in full fp32
("ieee": q is not quantized, and the exp-weights are fp32 in the PyTorch path too).

With TRITON_INTERPRET=1 (tests/conftest.py on machines without CUDA) they run in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import torch

from openflash.kernels.native import dispatch
from openflash.kernels.triton_products import (e2m1_values, e4m3_values, fp4_codes, register_op, tl, triton,
                                               ue8m0_values)

BLOCK_H = 16  # heads a program (tl.dot's smallest side; fewer heads are masked)

Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (acc [.., H, D], running max [.., H], total [.., H])


def _start(Q, H, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """A program's query row r64, its heads h (h_ok: below H), the columns d, q [BLOCK_H, D] (0 past H) and the empty
    running state (m, total, acc): m starts at the floor of model/sink_attention.py, so no entry gives 0, not NaN."""
    r64 = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    d = tl.arange(0, D)
    q = tl.load(Q + (r64 * H + h[:, None]) * D + d[None, :], mask=h_ok[:, None], other=0.0)
    m = tl.full((BLOCK_H,), -1e30, tl.float32)
    return r64, h, h_ok, d, q, m, tl.zeros((BLOCK_H,), dtype=tl.float32), tl.zeros((BLOCK_H, D), dtype=tl.float32)


def _online_update(q, kv, ok, m, total, acc, scale):
    """One tile of entries kv [BLOCK_K, D] (ok: which count) into the running (m, total, acc) of q [BLOCK_H, D]."""
    kv = tl.where(ok[:, None], kv, 0.0)
    z = tl.dot(q, tl.trans(kv), input_precision="ieee") * scale
    z = tl.where(ok[None, :], z, float("-inf"))
    new_m = tl.maximum(m, tl.max(z, axis=1))
    rescale = tl.exp(m - new_m)
    p = tl.exp(z - new_m[:, None])
    return new_m, total * rescale + tl.sum(p, axis=1), acc * rescale[:, None] + tl.dot(p, kv, input_precision="ieee")


def _store_part(ACC, MAX, TOTAL, r64, h, h_ok, d, m, total, acc, H, D: tl.constexpr):
    out = r64 * H + h
    tl.store(ACC + out[:, None] * D + d[None, :], acc, mask=h_ok[:, None])
    tl.store(MAX + out, m, mask=h_ok)
    tl.store(TOTAL + out, total, mask=h_ok)


def _picked_kernel(Q, PICKS, ROWS, TABLE, KV, KV_SCALE, ACC, MAX, TOTAL, scale, H, K, table_width, D: tl.constexpr,
                   BS: tl.constexpr, PACKED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    r64, h, h_ok, d, q, m, total, acc = _start(Q, H, BLOCK_H, D)
    row = tl.load(ROWS + r64)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        pick = tl.load(PICKS + r64 * K + kk, mask=kk < K, other=-1)
        ok = pick >= 0
        safe = tl.where(ok, pick, 0)
        # No pick reads block 0, the pool's zero block (and no table column where a row has none).
        block = tl.load(TABLE + row * table_width + safe // BS, mask=ok, other=0)
        entry = block * BS + safe % BS
        if PACKED:
            scale_bytes = tl.load(KV_SCALE + entry[:, None] * (D // 16) + (d // 16)[None, :])
            kv = e2m1_values(fp4_codes(KV, entry, d, D)) * e4m3_values(scale_bytes)
        else:
            kv = tl.load(KV + entry[:, None] * D + d[None, :])
        m, total, acc = _online_update(q, kv, ok, m, total, acc, scale)
    _store_part(ACC, MAX, TOTAL, r64, h, h_ok, d, m, total, acc, H, D)


def _ring_kernel(Q, ROWS, QPOS, KV, KV_SCALE, POS, ACC, MAX, TOTAL, scale, H, slots, window, D: tl.constexpr,
                 PACKED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    r64, h, h_ok, d, q, m, total, acc = _start(Q, H, BLOCK_H, D)
    row = tl.load(ROWS + r64)
    qpos = tl.load(QPOS + r64)
    for k0 in range(0, slots, BLOCK_K):
        slot = k0 + tl.arange(0, BLOCK_K)
        pos = tl.load(POS + row * slots + slot, mask=slot < slots, other=-1)
        ok = (pos >= 0) & (pos <= qpos) & (pos > qpos - window)
        entry = row * slots + tl.where(slot < slots, slot, 0)
        if PACKED:
            scale_bytes = tl.load(KV_SCALE + entry[:, None] * (D // 32) + (d // 32)[None, :])
            kv = e4m3_values(tl.load(KV + entry[:, None] * D + d[None, :])) * ue8m0_values(scale_bytes)
        else:
            kv = tl.load(KV + entry[:, None] * D + d[None, :])
        m, total, acc = _online_update(q, kv, ok, m, total, acc, scale)
    _store_part(ACC, MAX, TOTAL, r64, h, h_ok, d, m, total, acc, H, D)


if triton is not None:
    _start, _online_update, _store_part = triton.jit(_start), triton.jit(_online_update), triton.jit(_store_part)
_PICKED = triton.jit(_picked_kernel) if triton is not None else None
_RING = triton.jit(_ring_kernel) if triton is not None else None


def _empty_part(q: torch.Tensor) -> Part:
    R, H, D = q.shape
    return q.new_empty(R, H, D), q.new_empty(R, H), q.new_empty(R, H)


def _tiles(D: int) -> dict[str, int]:
    """A [BLOCK_K, D] fp32 tile of entries beside q and the accumulator, [16, D] each: at D = 512 that is 24K
    floats a program, spread over 8 warps (96 registers a thread) rather than spilled from 4."""
    return {"BLOCK_H": BLOCK_H, "BLOCK_K": 32 if D <= 128 else 16, "num_warps": 4 if D <= 128 else 8}


def picked_call(q: torch.Tensor, picks: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, kv: torch.Tensor,
                kv_scale: torch.Tensor, scale: float, packed: bool) -> Part:
    """q [R, H, D] fp32, picks [R, K] int64 (-1 = none), rows [R] (each query's row of table [B, nb]), the pool's
    main-KV planes (packed: E2M1 bytes [NB, BS, D/2] and E4M3 scales [NB, BS, D/16]; else fp32 [NB, BS, D], scales
    unread) -> the part (acc [R, H, D], running max [R, H], total [R, H]), fp32 (module doc)."""
    R, H, D = q.shape
    part = _empty_part(q)
    if R:
        _PICKED[(R, -(-H // BLOCK_H))](q.float().contiguous(), picks.contiguous(), rows.contiguous(),
                                       table.contiguous(), kv, kv_scale, *part, float(scale), H, picks.shape[1],
                                       table.shape[1], D=D, BS=kv.shape[1], PACKED=packed, **_tiles(D))
    return part


def ring_call(q: torch.Tensor, rows: torch.Tensor, qpos: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor,
              pos: torch.Tensor, window: int, scale: float, packed: bool) -> Part:
    """q [R, H, D] fp32, rows [R] and qpos [R] (each query's batch row and position), the ring's planes (packed: E4M3
    codes [B, W, D] and UE8M0 scales [B, W, D/32]; else fp32 [B, W, D], scales unread) and slot positions pos
    [B, W] (-1 = empty) -> the part over the slots within `window` behind each query (module doc)."""
    R, H, D = q.shape
    part = _empty_part(q)
    if R:
        _RING[(R, -(-H // BLOCK_H))](q.float().contiguous(), rows.contiguous(), qpos.contiguous(), kv, kv_scale,
                                     pos.contiguous(), *part, float(scale), H, pos.shape[1], window, D=D,
                                     PACKED=packed, **_tiles(D))
    return part


def _check(q: torch.Tensor, planes: str, kv: torch.Tensor, kv_scale: torch.Tensor, want: tuple[int, ...],
           want_scale: tuple[int, ...] | None) -> list[str]:
    """The problems with q [B, S, H, D] and a cache plane (and its scales, packed) of the shapes wanted."""
    D = q.shape[-1] if q.dim() == 4 else -1
    if q.dim() != 4 or D < 16 or D & (D - 1):
        return [f"q must be [B, S, H, D] with D a power of two >= 16, got {tuple(q.shape)}"]
    if tuple(kv.shape) != want or not kv.is_contiguous() or \
            (want_scale is not None and (tuple(kv_scale.shape) != want_scale or not kv_scale.is_contiguous())):
        return [f"{planes} {tuple(kv.shape)} / {tuple(kv_scale.shape)} do not hold {D}-wide entries: expected "
                f"{want} / {want_scale if want_scale is not None else 'unread'}, contiguous"]
    return []


def _rows(q: torch.Tensor) -> torch.Tensor:
    B, S = q.shape[:2]
    return torch.arange(B, device=q.device).repeat_interleave(S)


def _per_query(part: Part, q: torch.Tensor) -> Part:
    B, S, H, D = q.shape
    return part[0].view(B, S, H, D), part[1].view(B, S, H), part[2].view(B, S, H)


def picked_attention(q: torch.Tensor, picks: torch.Tensor, table: torch.Tensor, kv: torch.Tensor,
                     kv_scale: torch.Tensor, scale: float, packed: bool) -> Part:
    """The part of queries q [B, S, H, D] over their picks [B, S, K] (int64, -1 = none; each below what its row's
    blocks of table [B, nb] hold, as the indexer's are) from the pool's main-KV planes (`picked_call`): acc
    [B, S, H, D], max and total [B, S, H]. Checked (the kernel trusts its pointers); openflash::picked_attention
    inside a traced graph."""
    if triton is None:
        raise RuntimeError("picked_attention needs Triton (it ships with PyTorch's CUDA builds)")
    D = q.shape[-1]
    problems = _check(q, "main-KV planes", kv, kv_scale, (*kv.shape[:2], D // 2 if packed else D),
                      (*kv.shape[:2], D // 16) if packed else None)
    if picks.dim() != 3 or tuple(picks.shape[:2]) != tuple(q.shape[:2]) or picks.dtype != torch.long:
        problems.append(f"picks must be int64 [B, S, K] beside q {tuple(q.shape)}, got {picks.dtype} "
                        f"{tuple(picks.shape)}")
    if kv.dim() != 3 or table.dim() != 2 or table.shape[0] != q.shape[0] or table.dtype != torch.long:
        problems.append(f"the pool's planes must be [blocks, entries, width] and the block table int64 [B, blocks]; "
                        f"got {tuple(kv.shape)} and {table.dtype} {tuple(table.shape)}")
    if problems:
        raise ValueError("picked_attention: " + "; ".join(problems))
    B, S, H, _ = q.shape
    part = dispatch("picked_attention", picked_call, q.reshape(B * S, H, D), picks.reshape(B * S, -1), _rows(q),
                    table, kv, kv_scale, scale, packed)
    return _per_query(part, q)


def ring_attention(q: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor,
                   pos: torch.Tensor, window: int, scale: float, packed: bool) -> Part:
    """The part of queries q [B, S, H, D] at positions [B, S] over the window ring's slots within `window` behind
    each (`ring_call`): acc [B, S, H, D], max and total [B, S, H]. Checked; openflash::ring_attention inside a
    traced graph."""
    if triton is None:
        raise RuntimeError("ring_attention needs Triton (it ships with PyTorch's CUDA builds)")
    D = q.shape[-1]
    ring = tuple(pos.shape)
    problems = _check(q, "ring planes", kv, kv_scale, (*ring, D), (*ring, D // 32) if packed else None)
    if pos.dim() != 2 or pos.shape[0] != q.shape[0] or tuple(positions.shape) != tuple(q.shape[:2]) or \
            pos.dtype != torch.long or positions.dtype != torch.long:
        problems.append(f"slot positions must be int64 [B, W] and query positions int64 [B, S] beside q "
                        f"{tuple(q.shape)}; got {pos.dtype} {tuple(pos.shape)} and {positions.dtype} "
                        f"{tuple(positions.shape)}")
    if problems:
        raise ValueError("ring_attention: " + "; ".join(problems))
    B, S, H, _ = q.shape
    part = dispatch("ring_attention", ring_call, q.reshape(B * S, H, D), _rows(q), positions.reshape(-1), kv,
                    kv_scale, pos, window, scale, packed)
    return _per_query(part, q)


_OPS = (register_op("picked_attention(Tensor q, Tensor picks, Tensor rows, Tensor table, Tensor kv, "
                    "Tensor kv_scale, float scale, bool packed) -> (Tensor, Tensor, Tensor)", picked_call,
                    lambda q, *args: _empty_part(q)),
        register_op("ring_attention(Tensor q, Tensor rows, Tensor qpos, Tensor kv, Tensor kv_scale, Tensor pos, "
                    "int window, float scale, bool packed) -> (Tensor, Tensor, Tensor)", ring_call,
                    lambda q, *args: _empty_part(q)))

__all__ = ["picked_attention", "ring_attention", "picked_call", "ring_call", "Part", "BLOCK_H"]
