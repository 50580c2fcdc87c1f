"""The softmax of CSA2 attention over [sink | window keys | selected compressed entries] (architecture.md §5.10), in
each form a kernel set of model/attention.py runs: `sparse_attention` (inference: the entries gathered, or some
attended in place by a cache kernel and merged), `dense_sparse_attention` (training on whole sequences, with its
own backward) and the reference kernel's exact numerics (`reference_sparse_attention`, over the KV list
`reference_window_layout` lays out). K = V throughout: one latent is each entry's key and value."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from openflash.kernels.triton_attention import Part  # a kernel's partial softmax: (acc, running max, total)

# Finite floor of the running max: an all-absent row gives 0 instead of NaN (quant_and_cache.md §4).
MAX_FLOOR = -1e30


def sparse_attention(q: torch.Tensor, window_kv: torch.Tensor, window_mask: torch.Tensor,
                     selected_kv: torch.Tensor, selected_mask: torch.Tensor, sink: torch.Tensor,
                     scale: float, round_fn, parts: tuple[Part, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B,S,H,D] over window keys [B,L,D] (mask [B,S,L]) and selected compressed entries
    [B,S,K,D] (mask [B,S,K]), K = V, with a per-head sink logit only in the denominator (§5.10); and over the
    entries of `parts`, which a kernel attended where they are stored (kernels/triton_attention.py): each the
    partial softmax (acc [B,S,H,D], running max m_i [B,S,H], total [B,S,H]) relative to its own max, joined here
    at the common max m by the factor exp(m_i - m) (flash decoding's split-softmax merge; fp32 numerics only: a
    part's probabilities are not rounded to bf16).

    Returns (output [B,S,H,D], probabilities of the selected entries [B,S,H,K]).
    """
    zw = torch.einsum("bshd,bld->bshl", q, window_kv) * scale
    zc = torch.einsum("bshd,bskd->bshk", q, selected_kv) * scale
    zw = zw.masked_fill(~window_mask.unsqueeze(2), float("-inf"))
    zc = zc.masked_fill(~selected_mask.unsqueeze(2), float("-inf"))
    m = torch.maximum(zw.amax(-1), zc.amax(-1)) if zc.shape[-1] else zw.amax(-1)  # (L >= 1: the query's own key)
    for _, part_max, _ in parts:
        m = torch.maximum(m, part_max)
    m = torch.maximum(m, torch.full((), MAX_FLOOR, device=q.device)).detach()  # a fill, no host-to-device copy
    pw, pc = torch.exp(zw - m.unsqueeze(-1)), torch.exp(zc - m.unsqueeze(-1))
    denom = pw.sum(-1) + pc.sum(-1) + torch.exp(sink.view(1, 1, -1) - m)
    # The reference kernel casts probabilities to bf16 before the P.V product (quant_and_cache.md §4).
    acc = torch.einsum("bshl,bld->bshd", round_fn(pw), window_kv) + \
        torch.einsum("bshk,bskd->bshd", round_fn(pc), selected_kv)
    for part_acc, part_max, part_total in parts:
        rescale = torch.exp(part_max - m)
        denom = denom + part_total * rescale
        acc = acc + part_acc * rescale.unsqueeze(-1)
    return round_fn(acc / denom.unsqueeze(-1)), pc / denom.unsqueeze(-1)


class _DenseSinkAttention(torch.autograd.Function):
    """Softmax attention of q [B,S,H,D] over keys kv [B,N,D] (K = V) under a mask [B,S,N], plus a per-head sink
    logit that only adds to the denominator; returns the output and the probabilities [B,S,H,N].

    The sink is a zero key/value row appended to kv whose logit is overwritten with the sink, so one softmax
    kernel handles it. Backward: dz = softmax_backward(do kv^T, p); dq = scale dz kv; dkv = scale dz^T q + p^T do;
    dsink = the sink column of dz summed over batch and queries.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float):
        B, S, H, D = q.shape
        N = kv.shape[1]
        kv_ext = torch.cat((kv, kv.new_zeros(B, 1, D)), dim=1)
        qs = (q * scale).reshape(B, S * H, D)
        z = torch.bmm(qs, kv_ext.transpose(1, 2)).view(B, S, H, N + 1)
        z[..., N] = sink.to(z.dtype)
        z[..., :N].masked_fill_(~mask.unsqueeze(2), float("-inf"))
        p = torch.softmax(z, dim=-1)
        o = torch.bmm(p.view(B, S * H, N + 1), kv_ext).view(B, S, H, D)
        ctx.save_for_backward(qs, kv_ext, p)
        ctx.scale = scale
        probs = p[..., :N]
        ctx.mark_non_differentiable(probs)
        return o, probs

    @staticmethod
    def backward(ctx, do: torch.Tensor, _unused: torch.Tensor):
        qs, kv_ext, p = ctx.saved_tensors
        B, S, H, n1 = p.shape
        D = kv_ext.shape[-1]
        do = do.reshape(B, S * H, D)
        p = p.view(B, S * H, n1)
        dp = torch.bmm(do, kv_ext.transpose(1, 2))
        dz = torch._softmax_backward_data(dp, p, -1, p.dtype)
        d_sink = dz[..., n1 - 1].reshape(B, S, H).sum(dim=(0, 1))
        dq = torch.bmm(dz, kv_ext).mul_(ctx.scale).view(B, S, H, D)
        # qs already carries the scale, so dz^T qs is the key part of dkv; p^T do is the value part.
        d_kv = torch.bmm(dz.transpose(1, 2), qs).add_(torch.bmm(p.transpose(1, 2), do))
        return dq, d_kv[:, : n1 - 1], None, d_sink, None


# Scores a dense training attention holds at once (fp32 elements of [blocks, window, heads, keys]): past this, query
# blocks go in chunks, each recomputed in the backward (activation checkpointing), so memory stays bounded while
# the scores grow with the square of the sequence (an RL prompt of 8K tokens on `tiny` asked for 24 GB at once).
CHUNK_SCORES = 1 << 24


def dense_sparse_attention(q: torch.Tensor, kv: torch.Tensor, window: int, compressed_kv: torch.Tensor,
                           picks: torch.Tensor | None, sink: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attention` for a training forward (positions 0..S-1; same math, fused), returning
    (output [B,S,H,D], probabilities of the picked entries [B,S,H,K], 0 where picks is -1).

    q [B,S,H,D]; kv [B,S,D] the window keys/values of the same positions; compressed_kv [B,T,D]; picks [B,S,K].
    Queries go in blocks of `window`: a block's window keys all lie in its own and the previous block, so each
    block scores 2*window window keys plus every compressed entry (masked to its picks) with large matmuls,
    instead of gathering each query's entries. Blocks go in chunks of at most CHUNK_SCORES scores; where there is
    more than one chunk and a gradient is wanted, each chunk's scores are recomputed in the backward.
    """
    B, S, H, D = q.shape
    W, T = window, compressed_kv.shape[1]
    nb = -(-S // W)
    pad = nb * W - S
    qb = F.pad(q, (0, 0, 0, 0, 0, pad)).reshape(B, nb, W, H, D)
    # Block b's keys are positions [bW - W, bW + W): W zero rows in front, then one unfold.
    keys = F.pad(kv, (0, 0, W, pad)).unfold(1, 2 * W, W).transpose(2, 3)  # [B, nb, 2W, D]
    slot = picked = None
    if picks is not None and T > 0:
        # Picked-entry mask: -1 picks land in a spare column T, dropped after the scatter.
        slot = torch.where(picks >= 0, picks, T)
        picked = torch.zeros(B, S, T + 1, dtype=torch.bool, device=q.device).scatter_(-1, slot, True)[..., :T]
        picked = F.pad(picked, (0, 0, 0, pad)).view(B, nb, W, T)
        slot = F.pad(slot.clamp(max=T - 1), (0, 0, 0, pad)).view(B, nb, W, -1)
    compressed = compressed_kv.to(kv.dtype)
    per_chunk = max(1, CHUNK_SCORES // max(1, B * W * H * (2 * W + (T if picked is not None else 0) + 1)))
    recompute = nb > per_chunk and torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    outs, probs = [], []
    for b0 in range(0, nb, per_chunk):
        b1 = min(nb, b0 + per_chunk)
        args = (qb[:, b0:b1], keys[:, b0:b1], compressed, None if picked is None else picked[:, b0:b1],
                None if slot is None else slot[:, b0:b1], sink, scale, b0 == 0)
        o, p = checkpoint(_blocks, *args, use_reentrant=False) if recompute else _blocks(*args)
        outs.append(o)
        probs.append(p)
    o = torch.cat(outs, dim=1).view(B, nb * W, H, D)[:, :S]
    if picks is None:
        return o, q.new_zeros(B, S, H, 0)
    if T == 0:
        return o, q.new_zeros(B, S, H, picks.shape[-1])
    p_picked = torch.cat(probs, dim=1).view(B, nb * W, H, -1)[:, :S]
    return o, p_picked.masked_fill(~(picks >= 0).unsqueeze(2), 0.0)


def _blocks(qb: torch.Tensor, keys: torch.Tensor, compressed: torch.Tensor, picked: torch.Tensor | None,
            slot: torch.Tensor | None, sink: torch.Tensor, scale: float,
            first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dense_sparse_attention for n query blocks: qb [B,n,W,H,D], keys [B,n,2W,D], picked [B,n,W,T] (None: no
    compressed entries), slot [B,n,W,K]; `first`: the chunk holds block 0. Returns (output [B,n,W,H,D], the
    picked entries' probabilities [B,n,W,H,K] (empty without picks))."""
    B, n, W, H, D = qb.shape
    i = torch.arange(W, device=qb.device).unsqueeze(1)
    j = torch.arange(2 * W, device=qb.device)
    band = (j > i) & (j <= i + W)  # key position bW - W + j within (p - W, p] of query p = bW + i
    mask = band.expand(B, n, W, 2 * W).clone()
    if first:
        mask[:, 0] &= j >= W  # block 0: nothing before position 0
    if picked is not None:
        T = picked.shape[-1]
        mask = torch.cat((mask, picked), dim=-1)
        keys = torch.cat((keys, compressed.unsqueeze(1).expand(B, n, T, D)), dim=2)
    o, probs = _DenseSinkAttention.apply(qb.reshape(B * n, W, H, D), keys.reshape(B * n, -1, D),
                                         mask.view(B * n, W, -1), sink, scale)
    o = o.view(B, n, W, H, D)
    if picked is None:
        return o, o.new_zeros(B, n, W, H, 0)
    probs = probs[..., 2 * W:].reshape(B, n, W, H, -1)
    return o, probs.gather(-1, slot.unsqueeze(3).expand(-1, -1, -1, H, -1))


def reference_sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                               scale: float, block: int = 64) -> torch.Tensor:
    """The reference kernel's exact numerics (quant_and_cache.md §4): indices processed in blocks of 64 with an
    online softmax from a running max of -1e30, fp32 probabilities in the denominator, bf16 probabilities in the
    P.V product, the sink added to the denominator last. q [B,S,H,D], kv [B,N,D], idx [B,S,T] (-1 = absent)."""
    B, S, H, D = q.shape
    rows = torch.arange(B, device=q.device).view(B, 1, 1)
    acc = torch.zeros(B, S, H, D, device=q.device)
    total = torch.zeros(B, S, H, device=q.device)
    running_max = torch.full((B, S, H), MAX_FLOOR, device=q.device)
    for t in range(0, idx.shape[-1], block):
        ids = idx[..., t: t + block]
        valid = ids >= 0
        kv_blk = kv[rows, ids.clamp(min=0)] * valid.unsqueeze(-1)
        z = torch.where(valid.unsqueeze(2), torch.einsum("bshd,bskd->bshk", q, kv_blk), float("-inf")) * scale
        new_max = torch.maximum(running_max, z.amax(dim=-1))
        rescale = torch.exp(running_max - new_max)
        p = torch.exp(z - new_max.unsqueeze(-1))
        total = total * rescale + p.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.einsum("bshk,bskd->bshd", p.to(torch.bfloat16).float(), kv_blk)
        running_max = new_max
    total = total + torch.exp(sink.view(1, 1, -1) - running_max)
    return (acc / total.unsqueeze(-1)).to(torch.bfloat16).float()


def reference_window_layout(kv: torch.Tensor, pos: torch.Tensor, ring_kv: torch.Tensor | None,
                            window: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reference's window part of the KV list and its per-query indices (architecture.md §5.3): the chunk's
    own kv in prefill, the ring after this token's write (oldest slot first) in decode. None for other shapes
    (chunked prefill), which the reference does not support."""
    B, S = pos.shape
    if bool((pos[:, 0] == 0).all()):
        i = torch.arange(S, device=kv.device).unsqueeze(1)
        ids = (i - window + 1).clamp(min=0) + torch.arange(min(S, window), device=kv.device)
        ids = torch.where(ids > i, -1, ids)
        return kv, ids.unsqueeze(0).expand(B, -1, -1)
    if S == 1 and ring_kv is not None:
        p = pos[:, 0]
        ring = ring_kv.clone()
        ring[torch.arange(B, device=kv.device), p % window] = kv[:, 0]
        oldest = (p % window + 1).unsqueeze(1)
        slots = (oldest + torch.arange(window, device=kv.device)) % window
        slots = torch.where(slots > p.unsqueeze(1), -1, slots)
        return ring, slots.unsqueeze(1)
    return None
