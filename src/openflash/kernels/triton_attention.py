"""The sparse attention's picked part on the GPU (Triton), straight from the engine's block pool: each query row's
top-k compressed entries are decoded in registers from their stored planes (E2M1 with an E4M3 scale per 16 in the
packed storage, fp32 otherwise) and attended with an online softmax, never gathered into an fp32 copy. The copy is
what the PyTorch path writes and reads again: [rows, k, head_dim] fp32 per layer, 1 MiB a decode row at the
released widths (k = 512, head_dim = 512) and k times a prefill chunk's activations, where the kernel reads
k * 288 B of packed entries.

For query row r (of batch row rows[r], its block table row) and heads h, over the picks t >= 0 (-1 = none):

    z[h, t] = scale * q[r, h] . kv[t]         m[h] = max(-1e30, max_t z[h, t])
    total[h] = sum_t exp(z[h, t] - m[h])      acc[h] = sum_t exp(z[h, t] - m[h]) * kv[t]

(the un-normalised partial softmax of architecture.md §5.10). The caller merges it with the window's part and the
sink (model/sink_attention.py `merge_picked_part`): the split-softmax merge of flash decoding. One program per query row
and 16 heads; the picks in tiles of BLOCK_K, both products on the tensor cores' dot in full fp32 ("ieee": q is
not quantized, and the exp-weights are fp32 in the PyTorch path too).

With TRITON_INTERPRET=1 (tests/conftest.py on machines without CUDA) it runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import torch

from openflash.kernels.native import dispatch
from openflash.kernels.triton_products import e2m1_values, e4m3_values, fp4_codes, register_op, tl, triton

BLOCK_H = 16  # heads a program (tl.dot's smallest side; fewer heads are masked)


def _picked_attention_kernel(Q, PICKS, ROWS, TABLE, KV, KV_SCALE, ACC, MAX, TOTAL, scale, H, K, table_width,
                             D: tl.constexpr, BS: tl.constexpr, PACKED: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    d = tl.arange(0, D)
    q = tl.load(Q + (r64 * H + h[:, None]) * D + d[None, :], mask=h_ok[:, None], other=0.0)
    row = tl.load(ROWS + r)
    # The running max's floor, as in model/sink_attention.py: a row with no pick gives 0, not NaN.
    m = tl.full((BLOCK_H,), -1e30, tl.float32)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, D), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        pick = tl.load(PICKS + r64 * K + kk, mask=kk < K, other=-1)
        ok = pick >= 0
        safe = tl.where(ok, pick, 0)
        # No pick reads block 0, the pool's zero block (and no table column where a row has none).
        block = tl.load(TABLE + row * table_width + safe // BS, mask=ok, other=0)
        entry = block * BS + safe % BS
        if PACKED:
            codes = fp4_codes(KV, entry, d, D)
            scale_bytes = tl.load(KV_SCALE + entry[:, None] * (D // 16) + (d // 16)[None, :])
            kv = e2m1_values(codes) * e4m3_values(scale_bytes)
        else:
            kv = tl.load(KV + entry[:, None] * D + d[None, :])
        kv = tl.where(ok[:, None], kv, 0.0)
        z = tl.dot(q, tl.trans(kv), input_precision="ieee") * scale
        z = tl.where(ok[None, :], z, float("-inf"))
        new_m = tl.maximum(m, tl.max(z, axis=1))
        rescale = tl.exp(m - new_m)
        p = tl.exp(z - new_m[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p, kv, input_precision="ieee")
        m = new_m
    out = r64 * H + h
    tl.store(ACC + out[:, None] * D + d[None, :], acc, mask=h_ok[:, None])
    tl.store(MAX + out, m, mask=h_ok)
    tl.store(TOTAL + out, total, mask=h_ok)


_KERNEL = triton.jit(_picked_attention_kernel) if triton is not None else None


def picked_call(q: torch.Tensor, picks: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, kv: torch.Tensor,
                kv_scale: torch.Tensor, scale: float, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [R, H, D] fp32, picks [R, K] int64 (-1 = none), rows [R] (each query's row of table [B, nb]), the pool's
    main-KV planes (packed: E2M1 bytes [NB, BS, D/2] and E4M3 scales [NB, BS, D/16]; else fp32 [NB, BS, D], scales
    unread) -> (acc [R, H, D], running max [R, H], total [R, H]), fp32 (module doc)."""
    R, H, D = q.shape
    acc = torch.empty(R, H, D, dtype=torch.float32, device=q.device)
    row_max = torch.empty(R, H, dtype=torch.float32, device=q.device)
    total = torch.empty(R, H, dtype=torch.float32, device=q.device)
    if R == 0:
        return acc, row_max, total
    block_k = 32 if D <= 128 else 16  # a [BLOCK_K, D] fp32 tile of entries beside the [16, D] accumulator
    _KERNEL[(R, -(-H // BLOCK_H))](q.float().contiguous(), picks.contiguous(), rows.contiguous(), table.contiguous(),
                                   kv, kv_scale, acc, row_max, total, float(scale), H, picks.shape[1],
                                   table.shape[1], D=D, BS=kv.shape[1], PACKED=packed, BLOCK_H=BLOCK_H, BLOCK_K=block_k)
    return acc, row_max, total


def picked_attention(q: torch.Tensor, picks: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
                     kv: torch.Tensor, kv_scale: torch.Tensor, scale: float,
                     packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`picked_call`, checked (the kernel trusts its pointers), as openflash::picked_attention inside a traced
    graph. Every pick must lie below what its row's blocks hold (the indexer's picks do)."""
    if triton is None:
        raise RuntimeError("picked_attention needs Triton (it ships with PyTorch's CUDA builds)")
    R, H, D = q.shape if q.dim() == 3 else (-1, -1, -1)
    width = D // 2 if packed else D
    problems = []
    if q.dim() != 3 or D < 16 or D & (D - 1) or picks.dim() != 2 or picks.shape[0] != R or \
            picks.dtype != torch.long or tuple(rows.shape) != (R,):
        problems.append(f"q must be [R, H, D] with D a power of two >= 16, picks int64 [R, K], rows [R]; got q "
                        f"{tuple(q.shape)}, picks {picks.dtype} {tuple(picks.shape)}, rows {tuple(rows.shape)}")
    elif kv.dim() != 3 or kv.shape[2] != width or not kv.is_contiguous() or \
            (packed and (tuple(kv_scale.shape) != (*kv.shape[:2], D // 16) or not kv_scale.is_contiguous())):
        problems.append(f"main-KV planes {tuple(kv.shape)} / {tuple(kv_scale.shape)} do not hold {D}-wide entries "
                        f"({'packed' if packed else 'fp32'})")
    elif table.dim() != 2:
        problems.append(f"the block table must be [B, blocks], got {tuple(table.shape)}")
    if problems:
        raise ValueError("picked_attention: " + "; ".join(problems))
    return dispatch("picked_attention", picked_call, q, picks, rows, table, kv, kv_scale, scale, packed)


def _fake(q, picks, rows, table, kv, kv_scale, scale, packed):
    R, H, D = q.shape
    return q.new_empty(R, H, D), q.new_empty(R, H), q.new_empty(R, H)


_OP = register_op("picked_attention(Tensor q, Tensor picks, Tensor rows, Tensor table, Tensor kv, Tensor kv_scale, "
                  "float scale, bool packed) -> (Tensor, Tensor, Tensor)", picked_call, _fake)

__all__ = ["picked_attention", "picked_call", "BLOCK_H"]
