"""The lightning indexer: which compressed entries each query attends to (spec: architecture.md §5.6, §5.8, §5.9).

score[b, s, t] = sum_h ReLU(q_idx[b, s, h] . K[b, t]) * w[b, s, h], over the entries t visible to query s
(entry t covers tokens [t*ratio, (t+1)*ratio) and is visible once its whole group lies at or before the query).
The top `index_topk` entries are kept, re-sorted by ascending entry id; picks beyond the visible prefix become -1.
Ties prefer the smaller entry id (the spec's documented `small_position` default; the reference's unsorted top-k
leaves ties implementation-defined, UNCERTAIN §9.1).

The candidate source (layer 20 released) also keeps, per query, the best `candidate_topk_blocks` blocks of
`candidate_block_size` entries (block score = max entry score; the block holding the newest visible entry is
pinned), and later REINDEX layers score only inside that pool.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from openflash.config import FlashConfig
from openflash.model.compiled import compiled
from openflash.model.context import CompressedView, StepContext
from openflash.model.layers import Linear, NumericsMixin, RMSNorm
from openflash.model.numerics import Numerics
from openflash.model.rope import Rotary
from openflash.topology import LayerMode, LayerTopology


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Entries visible to a query at position p: floor((p + 1) / ratio) (§5.8 step 5)."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def top_entries(scores: torch.Tensor, k: int, n_visible: torch.Tensor) -> torch.Tensor:
    """Top-k entry ids [B, S, k] ascending, ties to the smaller id, ids >= n_visible replaced by -1 (§5.8 step 7):
    the rule as two sorts, the tests' oracle for `top_entries_select`, which every policy runs."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    picks = torch.sort(order, dim=-1).values
    return torch.where(picks < n_visible.unsqueeze(-1), picks, torch.full_like(picks, -1))


def top_entries_select(scores: torch.Tensor, k: int, n_visible: torch.Tensor) -> torch.Tensor:
    """`top_entries` without sorting whole rows (the same picks, ties included): one top-k over a key per entry that
    orders by score, then by smaller id, so the k it selects are the rule's. The key is the score's bits made
    order-preserving as an int32 (negative floats have their magnitude bits flipped; -0.0 becomes +0.0 first, as
    the sorts find them equal) above the id's complement. A long context's decode step picks from every
    compressed entry at each indexer: over 262K entries on the CPU 1.25x faster than the earlier threshold-and-ties
    selection and 9x faster than the sorts (docs/benchmarks.md, benchmarks/long_context_reads.py); on a GPU one
    top-k and a sort of k ids instead of two top-ks, a cumulative sum and five other passes over every score."""
    T = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    key = (ordered << 32) | (T - 1 - torch.arange(T, device=scores.device))
    top = torch.topk(key, k, dim=-1).values
    picks = torch.sort(T - 1 - (top & 0xFFFFFFFF), dim=-1).values  # the k ids, ascending
    return torch.where(picks < n_visible.unsqueeze(-1), picks, torch.full_like(picks, -1))


def candidate_pool(scores: torch.Tensor, n_visible: torch.Tensor, n_blocks: int, block_size: int) -> torch.Tensor:
    """Entry mask [B, S, T] of the best blocks per query (§5.9)."""
    B, S, T = scores.shape
    pad = (-T) % block_size
    padded = F.pad(scores, (0, pad), value=float("-inf"))
    block_score = padded.view(B, S, -1, block_size).amax(dim=-1)
    total_blocks = block_score.shape[-1]
    # Pin the block of the newest visible entry: it may be partly filled and lose to an older full block.
    newest = torch.div(n_visible - 1, block_size, rounding_mode="floor").clamp(min=0)
    pin = (n_visible > 0).unsqueeze(-1) & (torch.arange(total_blocks, device=scores.device) == newest.unsqueeze(-1))
    block_score = block_score.masked_fill(pin, float("inf"))
    keep_n = min(n_blocks, total_blocks)
    kept = torch.sort(block_score, dim=-1, descending=True, stable=True).indices[..., :keep_n]
    kept_score = block_score.gather(-1, kept)
    block_mask = torch.zeros_like(block_score, dtype=torch.bool)
    block_mask.scatter_(-1, kept, kept_score > float("-inf"))  # kept but unreachable blocks are dropped
    return block_mask.repeat_interleave(block_size, dim=-1)[..., :T]


# A long sequence's indexer works on query rows in blocks, so what grows with queries x entries is held once, as the
# [B, S, T] scores: the per-head logits [B, rows, H, T] and the selection's 64-bit keys [B, rows, T] stay within this
# many elements a block (a 4K-token training sequence's whole logits would be 537 MB, its keys 268 MB). A row's
# values do not depend on the block it is computed in; shapes this small run as one block.
ROW_BLOCK_ELEMENTS = 1 << 22


def _row_blocks(S: int, per_row: int) -> list[slice]:
    if S == 1 or S * per_row <= ROW_BLOCK_ELEMENTS:  # (S first: a decode graph's entry count grows, its S is 1)
        return [slice(None)]
    rows = max(1, ROW_BLOCK_ELEMENTS // max(1, per_row))
    return [slice(a, min(S, a + rows)) for a in range(0, S, rows)]


def _by_row_blocks(S: int, per_row: int, block: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """block(rows) for each block of S query rows, concatenated along the rows (one call when one block)."""
    blocks = _row_blocks(S, per_row)
    return block(blocks[0]) if len(blocks) == 1 else torch.cat([block(r) for r in blocks], dim=1)


# ---- the score kernels of each numerics policy (chosen once: index_kernels) ------------------------------------

class IndexKernels:
    """fp32 / plain: the lightning indexer's score ReLU(q . k) weighted and summed over heads (§5.8 step 4), and
    the top-k by selection (`top_entries_select`)."""

    def scores(self, q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """q [B, S, H, D], index keys [B, T, D], head weights [B, S, H] -> scores [B, S, T]."""
        return index_scores(q, index_k, w)

    def view_scores(self, q: torch.Tensor, view: CompressedView, w: torch.Tensor) -> torch.Tensor:
        """`scores` against a view's keys: by its store's kernel where there is one (the engine's pool on CUDA:
        the keys scored where they are stored), else on the keys read out, query rows in blocks."""
        stored = view.stored_scores(q, w)
        return stored if stored is not None else self.row_scores(q, view.index_k, w)

    def row_scores(self, q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        B, S, H, _ = q.shape
        return _by_row_blocks(S, B * H * index_k.shape[1], lambda r: self.scores(q[:, r], index_k, w[:, r]))

    def top_entries(self, scores: torch.Tensor, k: int, n_visible: torch.Tensor,
                    allowed: torch.Tensor | None = None) -> torch.Tensor:
        """`top_entries_select` of the scores, restricted to the `allowed` entries [B, S, T] where given (the
        candidate pool), query rows in blocks."""
        B, S, T = scores.shape

        def block(r: slice) -> torch.Tensor:
            s = scores[:, r] if allowed is None else scores[:, r].masked_fill(~allowed[:, r], float("-inf"))
            return top_entries_select(s, k, n_visible[:, r])

        return _by_row_blocks(S, B * T, block)


class ReferenceIndexKernels(IndexKernels):
    """The reference computes the score as bf16 tensor ops: logits, ReLU, weighting, head sum."""

    def view_scores(self, q: torch.Tensor, view: CompressedView, w: torch.Tensor) -> torch.Tensor:
        return self.row_scores(q, view.index_k, w)  # (its bf16 rounding points: never a kernel's fp32 sums)

    def scores(self, q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        bf = torch.bfloat16
        logits = torch.einsum("bshd,btd->bsht", q.to(bf), index_k.to(bf))
        return (F.relu(logits) * w.to(bf).unsqueeze(-1)).sum(dim=2).float()


class TrainIndexKernels(IndexKernels):
    """Training speed, same math: the head sum as one batched product."""

    def scores(self, q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        B, S = q.shape[:2]
        logits = torch.einsum("bshd,btd->bsht", q, index_k.to(q.dtype))
        T = logits.shape[-1]  # [1, H] weights times [H, T] ReLU'd logits per query
        return torch.bmm(w.reshape(B * S, 1, -1), F.relu(logits).reshape(B * S, -1, T)).view(B, S, T)


def index_scores(q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum over heads of w * ReLU(q . k) (§5.8 step 4)."""
    logits = torch.einsum("bshd,btd->bsht", q, index_k.to(q.dtype))
    return (F.relu(logits) * w.unsqueeze(-1)).sum(dim=2)


class CompiledIndexKernels(IndexKernels):
    """The score's ReLU, weighting and head sum fused by torch.compile (model/compiled.py)."""

    def scores(self, q: torch.Tensor, index_k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return compiled(index_scores)(q, index_k, w)


@lru_cache(maxsize=None)
def index_kernels(numerics: Numerics) -> IndexKernels:
    if numerics.bf16_boundaries:
        return ReferenceIndexKernels()
    if numerics.fused_train_ops:
        return TrainIndexKernels()
    return CompiledIndexKernels() if numerics.compiled else IndexKernels()


class Indexer(nn.Module, NumericsMixin):
    def __init__(self, cfg: FlashConfig, topo: LayerTopology, rotary: Rotary) -> None:
        super().__init__()
        self.topo = topo
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.n_blocks, self.block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        dense = "fp8" if cfg.weight_dtype == "fp8" else "float"
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dense)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        if topo.mode == LayerMode.FULL:
            self.wk = Linear(cfg.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        # Head-weight scale index_head_dim^-0.5 * index_n_heads^-0.5 (1/64 released).
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5

    def index_keys(self, latent: torch.Tensor, entry_positions: torch.Tensor) -> torch.Tensor:
        """Index keys of new compressed entries from their pre-RoPE latent (FULL layers, §5.6)."""
        k = self.k_norm(self.wk(latent))
        cos, sin = self.rotary.angles(entry_positions)
        k = self.numerics.round(self.rotary.apply(k, cos, sin))
        return self.numerics.index_fp4(k)

    def scores(self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext,
               view: CompressedView) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked index scores [B, S, T] (-inf where not visible) and the visible count per query [B, S]."""
        n = self.numerics
        B, S, _ = x.shape
        q = self.wq_b(qr).view(B, S, self.n_heads, self.head_dim)
        cos, sin = self.rotary.angles(ctx.positions)
        q = n.index_fp4(n.round(self.rotary.apply(q, cos.unsqueeze(2), sin.unsqueeze(2))))
        w = n.round(self.weights_proj(x) * self.weight_scale)
        score = index_kernels(n).view_scores(q, view, w)
        T = view.size
        n_visible = torch.minimum(visible_entries(ctx.positions, self.topo.compress_ratio), view.length.unsqueeze(1))
        # In place: the kernels' backward passes keep their inputs, never this output ([B, S, T] is the indexer's
        # largest tensor on a long sequence).
        hidden = torch.arange(T, device=x.device) >= n_visible.unsqueeze(-1)
        return score.masked_fill_(hidden, float("-inf")), n_visible

    def forward(self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext,
                view: CompressedView) -> tuple[torch.Tensor, torch.Tensor]:
        """Publish this layer's top-k (and the candidate pool at the candidate source).

        Returns (top-k entry ids [B, S, k], scores [B, S, T] masked to the visible entries); the scores feed the
        indexer's KL loss. They are not restricted to the candidate pool: the dense warm-up attends to every
        visible entry, and the KL needs a finite score for each entry it compares.
        """
        score, n_visible = self.scores(x, qr, ctx, view)
        B, S, T = score.shape
        if self.topo.is_candidate_source:
            ctx.candidates = _by_row_blocks(S, B * T, lambda r: candidate_pool(score[:, r], n_visible[:, r],
                                                                               self.n_blocks, self.block_size))
            ctx.put(f"indexer{self.topo.index}.candidates", ctx.candidates)
        allowed = ctx.candidates if self.topo.uses_candidates else None
        picks = index_kernels(self.numerics).top_entries(score, min(self.topk, T), n_visible, allowed)
        if ctx.probe is not None:  # (the pool-restricted scores exist only for it: top_entries masks block by block)
            ctx.put(f"indexer{self.topo.index}.scores",
                    score if allowed is None else score.masked_fill(~allowed, float("-inf")))
        ctx.put(f"indexer{self.topo.index}.topk", picks)
        ctx.topk[self.topo.index] = picks
        return picks, score
