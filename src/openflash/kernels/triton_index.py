"""The lightning indexer's scores on the GPU (Triton), straight from the engine's block pool: the index keys are
decoded in registers from their stored planes (MXFP4 in the packed storage, fp32 otherwise), never written out
as an fp32 copy of every key, which is what a long context's decode step would otherwise read and write per owner
layer (1M tokens at ratio 4: 17 MB of packed keys instead of 128 MB of fp32 ones, written and read again).

    score[r, t] = sum over heads h of w[r, h] * ReLU(q[r, h] . key[t])        (indexer.py, architecture.md §5.8)

for query rows r (each of a batch row b: its block table row) and entries t < n; one program per 64 entries and
query row, the heads summed in order. The caller masks what its queries may not see and takes the top-k.

With TRITON_INTERPRET=1 (tests/conftest.py on machines without CUDA) it runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import torch

from openflash.kernels.native import dispatch
from openflash.kernels.triton_products import e2m1_values, fp4_codes, register_op, tl, triton, ue8m0_values


def _index_scores_kernel(Q, W, ROWS, TABLE, KEYS, SCALES, OUT, n, table_width, H, D: tl.constexpr,
                         BS: tl.constexpr, PACKED: tl.constexpr, BLOCK_T: tl.constexpr):
    r = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n
    row = tl.load(ROWS + r)
    block = tl.load(TABLE + row * table_width + t // BS, mask=t_ok, other=0)
    entry = block * BS + t % BS  # [BLOCK_T] int64: the entry's place in the pool's planes
    d = tl.arange(0, D)
    if PACKED:
        codes = fp4_codes(KEYS, entry, d, D)  # (masked entries read block 0, the zero block)
        scale_bytes = tl.load(SCALES + entry[:, None] * (D // 32) + (d // 32)[None, :], mask=t_ok[:, None], other=127)
        keys = e2m1_values(codes) * ue8m0_values(scale_bytes)
    else:
        keys = tl.load(KEYS + entry[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0)
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    r64 = r.to(tl.int64)
    for h in range(0, H):
        q = tl.load(Q + (r64 * H + h) * D + d)
        logit = tl.sum(keys * q[None, :], axis=1)
        acc += tl.maximum(logit, 0.0) * tl.load(W + r64 * H + h)
    tl.store(OUT + r64 * n + t, acc, mask=t_ok)


_KERNEL = triton.jit(_index_scores_kernel) if triton is not None else None


def scores_call(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, keys: torch.Tensor,
                scales: torch.Tensor, n: int, packed: bool) -> torch.Tensor:
    """q [R, H, D] fp32, w [R, H] fp32, rows [R] (each query's row of table [B, nb]), the pool's index-key planes
    (packed: E2M1 bytes [NB, BS, D/2] and UE8M0 scales [NB, BS, D/32]; else fp32 keys [NB, BS, D], scales unread)
    -> scores [R, n] fp32."""
    R, H, D = q.shape
    out = torch.empty(R, n, dtype=torch.float32, device=q.device)
    if R == 0 or n == 0:
        return out
    block_t = 64
    _KERNEL[(-(-n // block_t), R)](q.float().contiguous(), w.float().contiguous(), rows.contiguous(),
                                   table.contiguous(), keys, scales, out, n, table.shape[1], H, D=D,
                                   BS=keys.shape[1], PACKED=packed, BLOCK_T=block_t)
    return out


def paged_index_scores(q: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
                       keys: torch.Tensor, scales: torch.Tensor, n: int, packed: bool) -> torch.Tensor:
    """`scores_call`, checked (the kernel trusts its pointers), as openflash::paged_index_scores inside a traced
    graph."""
    if triton is None:
        raise RuntimeError("paged_index_scores needs Triton (it ships with PyTorch's CUDA builds)")
    R, H, D = q.shape if q.dim() == 3 else (-1, -1, -1)
    width = D // 2 if packed else D
    problems = []
    if q.dim() != 3 or D & (D - 1) or D % 32 or tuple(w.shape) != (R, H) or tuple(rows.shape) != (R,):
        problems.append(f"q must be [R, H, D] with D a power of two and a multiple of 32, w [R, H], rows [R]; got q "
                        f"{tuple(q.shape)}, w {tuple(w.shape)}, rows {tuple(rows.shape)}")
    elif keys.dim() != 3 or keys.shape[2] != width or not keys.is_contiguous() or \
            (packed and (tuple(scales.shape) != (*keys.shape[:2], D // 32) or not scales.is_contiguous())):
        problems.append(f"index-key planes {tuple(keys.shape)} / {tuple(scales.shape)} do not hold {D}-wide keys "
                        f"({'packed' if packed else 'fp32'})")
    elif table.dim() != 2 or n > table.shape[1] * keys.shape[1]:
        problems.append(f"the block table {tuple(table.shape)} does not reach {n} entries of {keys.shape[1]} a block")
    if problems:
        raise ValueError("paged_index_scores: " + "; ".join(problems))
    return dispatch("paged_index_scores", scores_call, q, w, rows, table, keys, scales, n, packed)


_OP = register_op("paged_index_scores(Tensor q, Tensor w, Tensor rows, Tensor table, Tensor keys, Tensor scales, "
                  "int n, bool packed) -> Tensor", scores_call,
                  lambda q, w, rows, table, keys, scales, n, packed: q.new_empty(q.shape[0], n, dtype=torch.float32))

__all__ = ["paged_index_scores", "scores_call"]
