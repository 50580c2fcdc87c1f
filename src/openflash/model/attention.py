"""CSA2 attention: sliding window + shared compressed KV chosen by the indexer (spec: architecture.md §5).

Every layer has a query path (q-LoRA), its own sliding-window KV (one 512-d latent serving as key and value for
all heads) and a grouped low-rank output. What else it does depends on its mode (config.LayerMode):
- FULL: its Compressor turns each group of `ratio` tokens into one latent; it publishes the compressed KV and the
  index keys (and runs its own indexer);
- REINDEX: runs its own indexer over its owner's index keys;
- REUSE: reads the owner's compressed KV and the latest top-k, recomputing nothing;
- WINDOW: window only.
Queries attend to [window keys | selected compressed entries] with a per-head sink logit in the denominator: that
softmax, in each kernel set's form, is model/sink_attention.py's.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from openflash import kernels
from openflash.config import FlashConfig
from openflash.kernels import native
from openflash.model.stores import CompressedCache
from openflash.model.compiled import compiled, matmul_unshared
from openflash.model.context import CompressedView, StepContext, real_tokens
from openflash.model.indexer import Indexer, visible_entries
from openflash.model.layers import Linear, NumericsMixin, RMSNorm
from openflash.model.numerics import Numerics
from openflash.model.rope import Rotary
from openflash.model.sink_attention import (MAX_FLOOR, dense_sparse_attention, reference_sparse_attention,
                                            reference_window_layout, sparse_attention)
from openflash.topology import LayerMode, LayerTopology


class Compressor(nn.Module, NumericsMixin):
    """Pools each group of `ratio` consecutive tokens into one latent, returned before RoPE (§5.5).

    Ratio 1: latent = norm(wkv(x)). Ratio >= 2: a per-channel softmax over the group's gate scores weights the
    group's kv (fp32), then the latent is normalised. A group may straddle calls: the tokens of the open group
    are kept in the cache (slot = position % ratio) until the group completes.
    """

    def __init__(self, cfg: FlashConfig, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        # Ratio >= 2 weights are fp32 in the reference (exact fp32 outputs); ratio 1 runs in bf16.
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim, exact_fp32=ratio > 1)
        if ratio > 1:
            self.wgate = Linear(cfg.hidden_size, cfg.head_dim, exact_fp32=True)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: CompressedCache | None,
                lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(latents [B, G, D], entry ids [B, G], complete [B, G]) for the groups this chunk touches. lengths: row
        b's real tokens (right-padded rows, StepContext.lengths); a group is complete only with real tokens."""
        B, S, _ = x.shape
        r = self.ratio
        valid = real_tokens(positions, lengths)
        if r == 1:
            latent = self.norm(self.wkv(x))
            return latent, positions, valid
        kv, score = self.wkv(x.float()), self.wgate(x.float())
        if state is not None:
            state.remember_inputs(positions, kv, score, valid)  # kept only with rollback room (ModelCache.spare)
        start = positions[:, 0]
        shift = start % r if state is not None else torch.zeros_like(start)
        # Padding sits after a row's real tokens: it completes no group and stays out of the open one.
        fill = shift + (S if lengths is None else lengths)
        # Groups this chunk can touch: shift < r, so at most ceil((S + r - 1) / r) (an empty trailing group pools
        # zeros and is not complete). A bound from the shape alone: no host read of the positions.
        groups = -(-(S + (r - 1 if state is not None else 0)) // r)
        buf_kv = x.new_zeros(B, groups * r, kv.shape[-1], dtype=torch.float32)
        # Empty slots get a huge finite negative score (not -inf) so that no softmax sees an all -inf group.
        buf_score = torch.full_like(buf_kv, MAX_FLOOR)
        if state is not None:
            held = torch.arange(r, device=x.device) < shift.unsqueeze(1)  # slots of the open group seen before
            buf_kv[:, :r] = torch.where(held.unsqueeze(-1), state.partial_kv, 0.0)
            buf_score[:, :r] = torch.where(held.unsqueeze(-1), state.partial_score, MAX_FLOOR)
        slot = (shift.unsqueeze(1) + torch.arange(S, device=x.device)).unsqueeze(-1).expand(-1, -1, kv.shape[-1])
        buf_kv = buf_kv.scatter(1, slot, kv)
        buf_score = buf_score.scatter(1, slot, score)
        grouped_kv = buf_kv.view(B, groups, r, -1)
        weights = torch.softmax(buf_score.view(B, groups, r, -1), dim=2)
        pooled = (grouped_kv * weights).sum(dim=2)
        complete = (torch.arange(groups, device=x.device) + 1) * r <= fill.unsqueeze(1)
        entry_ids = torch.div(start, r, rounding_mode="floor").unsqueeze(1) + torch.arange(groups, device=x.device)
        if state is not None:
            open_group = torch.div(fill, r, rounding_mode="floor")
            idx = (open_group.unsqueeze(1) * r + torch.arange(r, device=x.device)).clamp(max=groups * r - 1)
            idx = idx.unsqueeze(-1).expand(-1, -1, kv.shape[-1])
            has = (torch.arange(r, device=x.device) < (fill % r).unsqueeze(1)).unsqueeze(-1)
            state.partial_kv = torch.where(has, buf_kv.gather(1, idx), 0.0).detach()
            state.partial_score = torch.where(has, buf_score.gather(1, idx), float("-inf")).detach()
        latent = self.norm(self.numerics.round(pooled))
        return latent, entry_ids, complete


class Attention(nn.Module, NumericsMixin):
    def __init__(self, cfg: FlashConfig, topo: LayerTopology) -> None:
        super().__init__()
        self.topo = topo
        self.n_heads, self.head_dim, self.window = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
        self.o_groups, self.o_lora = cfg.o_groups, cfg.o_lora_rank
        self.scale = self.head_dim ** -0.5  # no YaRN mscale (§5.1)
        dense = "fp8" if cfg.weight_dtype == "fp8" else "float"
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, dense)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dense)
        self.wkv = Linear(cfg.hidden_size, self.head_dim, dense)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # wo_a is held unquantized (the reference dequantizes it at load); block-diagonal over o_groups.
        self.wo_a = Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora)
        self.wo_b = Linear(self.o_groups * self.o_lora, cfg.hidden_size, dense)
        self.rotary = Rotary(cfg, topo.rope_theta, topo.rope_yarn)
        if topo.mode == LayerMode.FULL:
            self.compressor = Compressor(cfg, topo.compress_ratio)
        if topo.has_indexer:
            self.indexer = Indexer(cfg, topo, self.rotary)

    # ---- compressed KV (FULL layers) -------------------------------------------------------------------------
    def publish_compressed(self, x: torch.Tensor, ctx: StepContext) -> None:
        """Compress this chunk, store new entries (cache) and publish the readable view in ctx."""
        ratio = self.topo.compress_ratio
        state = ctx.cache.compressed[self.topo.index] if ctx.cache is not None else None
        latent, entry_ids, complete = self.compressor(x, ctx.positions, state, ctx.lengths)
        entry_pos = entry_ids * ratio  # a latent stands for the first token of its group
        # Detached: the indexer learns only from its own KL term, never through the compressor (§5.6, §5.8).
        index_k = self.indexer.index_keys(latent.detach(), entry_pos)
        cos, sin = self.rotary.angles(entry_pos)
        kv = self.numerics.compressed_kv(self.numerics.round(self.rotary.apply(latent, cos, sin)))
        if state is None:
            # A training sequence starts at position 0: its complete groups are the first S // ratio (from the
            # shape, not a host read of `complete`, which would break a compiled graph).
            n = ctx.positions.shape[1] // ratio
            view = CompressedView(torch.full_like(ctx.positions[:, 0], n), n, kv=kv[:, :n], index_k=index_k[:, :n])
        elif ctx.static:  # the cache's whole capacity, entries past `length` masked by their readers
            state.write_groups(entry_ids, complete, kv.detach(), index_k.detach())
            state.length = visible_entries(ctx.last_positions, ratio)
            view = CompressedView(state.length, state.capacity, store=state)
        else:
            b_idx, g_idx = complete.nonzero(as_tuple=True)
            state.write(b_idx, entry_ids[b_idx, g_idx], kv[b_idx, g_idx].detach(), index_k[b_idx, g_idx].detach())
            if b_idx.numel():
                ctx.cache.index_k_publisher = self.topo.index
            state.length = visible_entries(ctx.last_positions, ratio)
            view = CompressedView(state.length, int(state.length.max()), store=state)
        ctx.compressed[self.topo.index] = view

    # ---- forward ----------------------------------------------------------------------------------------------
    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q [B,S,H,D] after RoPE, window KV [B,S,D] after RoPE and QDQ, the q latent, cos, sin)."""
        n = self.numerics
        B, S, _ = x.shape
        cos, sin = self.rotary.angles(positions)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(B, S, self.n_heads, self.head_dim)
        q = n.round(self.rotary.apply(q, cos.unsqueeze(2), sin.unsqueeze(2)))
        return q, self.window_entries(x, cos, sin), qr, cos, sin

    def window_entries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The sliding-window KV of x [B,S,dim]: kv_norm(wkv(x)), RoPE, FP8 QDQ (§5.3)."""
        n = self.numerics
        return n.window_kv(n.round(self.rotary.apply(self.kv_norm(self.wkv(x)), cos, sin)))

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE at the query positions, then the block-diagonal grouped low-rank output (§5.11)."""
        n = self.numerics
        B, S = o.shape[:2]
        o = n.round(self.rotary.apply(o, cos.unsqueeze(2), sin.unsqueeze(2), inverse=True))
        o = o.reshape(B, S, self.o_groups, -1)
        return self.wo_b(attention_kernels(n).grouped_output(o, self.wo_a).flatten(2))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        n, topo = self.numerics, self.topo
        B, S, _ = x.shape
        pos = ctx.positions
        q, kv, qr, cos, sin = self.project(x, pos)

        index_scores = picks = view = None
        if topo.mode != LayerMode.WINDOW:
            if topo.mode == LayerMode.FULL and topo.index not in ctx.compressed:
                self.publish_compressed(x, ctx)  # (bounded replay publishes it before the decoder tail runs)
            view = ctx.compressed[topo.kv_owner]
            if topo.has_indexer:
                # The indexer learns only from its own KL loss: its inputs are detached in training (§5.8, spec
                # training notes); at inference detaching changes nothing.
                key_view = _stale_index_keys(view, ctx) if n.stale_index_keys else view
                picks, index_scores = self.indexer(x.detach(), qr.detach(), ctx, key_view)
            else:
                picks = ctx.topk[topo.topk_owner]
            if ctx.dense_indexer:
                # Indexer warm-up: attend to every visible compressed entry (dense), no selection.
                T = view.size
                n_vis = torch.minimum(visible_entries(pos, topo.compress_ratio), view.length.unsqueeze(1))
                picks = torch.arange(T, device=x.device).expand(B, S, T)
                picks = torch.where(picks < n_vis.unsqueeze(-1), picks, torch.full_like(picks, -1))

        o, p_selected = attention_kernels(n).attend(self, q, kv, ctx, view, picks)
        if index_scores is not None and self.training:
            ctx.indexer_losses.append(_indexer_kl(index_scores, picks, p_selected))
        if ctx.cache is not None:
            ctx.cache.window[topo.index].write(kv.detach(), pos, ctx.valid)
        return self.output(o, cos, sin)


# ---- the attention kernels of each numerics policy (chosen once: attention_kernels) --------------------------

class AttentionKernels:
    """fp32 / plain: softmax over [sink | window keys | the selected compressed entries] (§5.10), then the
    block-diagonal grouped low-rank output (§5.11). At inference, where a cache store has a kernel that reads its
    planes in place (the engine's pool and the rings on CUDA: kernels/triton_attention.py), the ring's part and the
    picked entries' part come from it, merged with the rest in `sparse_attention`."""

    in_place = True  # the reference's kernel rounds probabilities to bf16 first: not the cache kernels' math

    def attend(self, attn: "Attention", q: torch.Tensor, kv: torch.Tensor, ctx: StepContext,
               view: CompressedView | None, picks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output [B, S, H, D], probabilities of the selected entries for the indexer's KL, or None)."""
        B, S = q.shape[:2]
        pos = ctx.positions
        in_place = self.in_place and not (attn.training or torch.is_grad_enabled())  # the kernels have no backward
        parts = []
        # Window keys: the ring of earlier tokens (if any) then this chunk; visible iff within `window` behind.
        window_kv, window_pos = kv, pos
        if ctx.cache is not None:
            ring = ctx.cache.window[attn.topo.index]
            ring_part = ring.attend(q, pos, attn.window, attn.scale) if in_place else None
            if ring_part is None:
                window_kv = torch.cat((ring.kv.to(kv.dtype), kv), dim=1)
                window_pos = torch.cat((ring.pos, pos), dim=1)
            else:
                parts.append(ring_part)
        kp, qp = window_pos.unsqueeze(1), pos.unsqueeze(2)
        window_mask = (kp >= 0) & (kp <= qp) & (kp > qp - attn.window)
        selected_kv = kv.new_zeros(B, S, 0, attn.head_dim)
        selected_mask = torch.zeros(B, S, 0, dtype=torch.bool, device=q.device)
        if picks is not None:
            picked_part = view.stored_attention(q, picks, attn.scale) if in_place else None
            if picked_part is None:
                selected_mask = picks >= 0
                selected_kv = view.picked(picks).to(q.dtype)
            else:
                parts.append(picked_part)
        return self.sparse_attention(q, window_kv, window_mask, selected_kv, selected_mask, attn.attn_sink.float(),
                                     attn.scale, attn.numerics.round, tuple(parts))

    def sparse_attention(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_attention(*args)

    def grouped_output(self, o: torch.Tensor, wo_a: Linear) -> torch.Tensor:
        """o [B, S, groups, d] through each group's block of wo_a [groups * r, d]: [B, S, groups, r]."""
        groups, d = o.shape[2], o.shape[3]
        if wo_a.stored_format == "bf16" and not o.requires_grad and not torch.compiler.is_compiling() and \
                kernels.serves(o[:, :, 0], wo_a.weight, "bf16"):
            # A weight kept as stored (bf16, as the reference holds it), at inference: each group's rows through the
            # bf16 product on it, not an fp32 copy of the whole matrix made every step (134 MB a layer at the
            # released widths: a third of a one-layer decode step, docs/benchmarks.md). (The kernel has no backward.)
            w, x = wo_a.weight.view(groups, -1, d), o.reshape(-1, groups, d)
            y = torch.stack([native.bf16_gemv(x[:, j].contiguous(), w[j]) for j in range(groups)], dim=1)
            return y.view(*o.shape[:3], -1)
        w = wo_a.dequantized_weight().view(groups, -1, d)
        if o.shape[0] * o.shape[1] == 1:  # one token: each group's weight meets one row, see matmul_unshared
            return matmul_unshared(o.reshape(groups, 1, d), w).view(*o.shape[:3], w.shape[1])
        return torch.einsum("bsgd,grd->bsgr", o, w)


class ReferenceAttentionKernels(AttentionKernels):
    """The reference kernel's numerics: one KV list [window | compressed] and index list in the reference's order
    (where its layout applies: not in the dense indexer warm-up), the bf16 output einsum."""

    in_place = False

    def attend(self, attn: "Attention", q: torch.Tensor, kv: torch.Tensor, ctx: StepContext,
               view: CompressedView | None, picks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        layout = None
        if not ctx.dense_indexer:
            ring = ctx.cache.window[attn.topo.index].kv if ctx.cache is not None else None
            layout = reference_window_layout(kv, ctx.positions, ring, attn.window)
        if layout is None:
            return super().attend(attn, q, kv, ctx, view, picks)
        kv_list, ids = layout
        if picks is not None:
            kv_list = torch.cat((kv_list, ctx.compressed[attn.topo.kv_owner].kv.to(kv.dtype)), dim=1)
            offset = layout[0].shape[1]
            ids = torch.cat((ids, torch.where(picks >= 0, picks + offset, -1)), dim=-1)
        return reference_sparse_attention(q, kv_list, ids, attn.attn_sink.float(), attn.scale), None

    def grouped_output(self, o: torch.Tensor, wo_a: Linear) -> torch.Tensor:
        w = wo_a.dequantized_weight().view(o.shape[2], -1, o.shape[3])
        return torch.einsum("bsgd,grd->bsgr", o.to(torch.bfloat16), w.to(torch.bfloat16)).float()


class TrainAttentionKernels(AttentionKernels):
    """Training on full sequences (no cache): block-wise dense attention with a hand-written backward."""

    def attend(self, attn: "Attention", q: torch.Tensor, kv: torch.Tensor, ctx: StepContext,
               view: CompressedView | None, picks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if ctx.cache is not None:
            return super().attend(attn, q, kv, ctx, view, picks)
        compressed_kv = view.kv if view is not None else kv.new_zeros(kv.shape[0], 0, attn.head_dim)
        return dense_sparse_attention(q, kv, attn.window, compressed_kv, picks, attn.attn_sink.float(), attn.scale)


class CompiledAttentionKernels(AttentionKernels):
    """The softmax over [sink | window | selected] through torch.compile (model/compiled.py)."""

    def sparse_attention(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        return compiled(sparse_attention)(*args)


@lru_cache(maxsize=None)
def attention_kernels(numerics: Numerics) -> AttentionKernels:
    if numerics.bf16_boundaries:
        return ReferenceAttentionKernels()
    if numerics.fused_train_ops:
        return TrainAttentionKernels()
    return CompiledAttentionKernels() if numerics.compiled else AttentionKernels()


def _stale_index_keys(view: CompressedView, ctx: StepContext) -> CompressedView:
    """The reference's decode quirk: index keys come from the layer that published them last (any layer)."""
    publisher = None if ctx.cache is None else ctx.cache.index_k_publisher
    if publisher is None:
        return view
    keys = ctx.cache.compressed[publisher].read_index(view.size)
    if keys.shape[1] < view.size:
        keys = F.pad(keys, (0, 0, 0, view.size - keys.shape[1]))
    return CompressedView(view.length, view.size, kv=view.kv, index_k=keys)


def _indexer_kl(index_scores: torch.Tensor, picks: torch.Tensor, p_selected: torch.Tensor) -> torch.Tensor:
    """KL(attention || indexer) over the attended compressed entries; only the indexer receives gradients.

    Target: the main attention's probability mass on each attended entry, summed over heads and renormalised
    (detached). Prediction: softmax of the index scores over the same entries.
    """
    valid = picks >= 0
    target = p_selected.detach().sum(dim=2).masked_fill(~valid, 0.0)
    total = target.sum(-1, keepdim=True)
    rows = (total.squeeze(-1) > 0) & valid.any(-1)
    target = target / total.clamp(min=1e-30)
    scores = index_scores.gather(-1, picks.clamp(min=0)).masked_fill(~valid, float("-inf"))
    log_q = F.log_softmax(scores.float(), dim=-1).masked_fill(~valid, 0.0)
    kl = (target * (torch.log(target.clamp(min=1e-30)) - log_q)).masked_fill(~valid, 0.0).sum(-1)
    # The mean over the rows that attended an entry, as a masked sum (0 when none did): no data-dependent shape
    # or branch, so a compiled training forward does not break here.
    return kl.masked_fill(~rows, 0.0).sum() / rows.sum().clamp(min=1)
