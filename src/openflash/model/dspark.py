"""DSpark, the draft head for speculative decoding (spec: vision_and_dspark.md part B; golden D's README).

    main_x = main_norm(main_proj(main_hidden))        # main_hidden: mean over the mHC copies of the streams
                                                     #   entering the target layers, concatenated
    each stage's ring <- kv_norm(wkv(main_x)) at the target's positions (one per committed position)
    R = 4 copies of embed([anchor, noise x (B-1)]); pre = one-hot; positions p+1 .. p+B
    for each stage:  R, pre = Block(R, pre)          # attention: ring slots + the whole block (bidirectional)
    u = collapse(R, pre); logits = head(norm(u))      # embed and head are the target's
    for i in 0..B-1: logits[i] += markov(out[i]); out[i+1] = choose(logits[i])   # out[0] = the anchor
    confidence = proj(cat(u, markov embeddings))      # raw logits (no sigmoid)

The stages are window-only blocks with their own MoE size; their rings hold only the target's KV (the draft
block's own KV is never cached), written for positions the target has committed. The rings live in the cache
(`ModelCache.draft`), so they are batched and regrouped with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from openflash.config import FlashConfig
from openflash.model.attention import Attention
from openflash.model.sink_attention import reference_sparse_attention, sparse_attention
from openflash.model.block import Block
from openflash.model.cache import WindowStore
from openflash.model.context import StepContext
from openflash.model.layers import Linear, RMSNorm
from openflash.model.mhc import collapse
from openflash.topology import LayerMode, LayerTopology


def stage_topology(cfg: FlashConfig, stage: int) -> LayerTopology:
    """A draft stage's place: a window-only layer after the backbone (θ = rope_theta, no YaRN, no Engram)."""
    return LayerTopology(index=cfg.num_hidden_layers + stage, mode=LayerMode.WINDOW, compress_ratio=0,
                         rope_theta=cfg.rope_theta, rope_yarn=False, kv_owner=None, index_k_owner=None,
                         topk_owner=None, is_candidate_source=False, uses_candidates=False, engram_before=False,
                         engram_slot=None, half="decoder")


class DraftAttention(Attention):
    """A stage's attention: the backbone's weights and output path, over its ring of target KV plus the draft
    block itself (every draft position sees every ring slot and all block positions)."""

    def __init__(self, cfg: FlashConfig, topo: LayerTopology, stage: int) -> None:
        super().__init__(cfg, topo)
        self.stage = stage

    def target_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The ring entries of the target's positions: the window KV of main_x (no attn_norm: spec B.3)."""
        return self.window_entries(main_x, *self.rotary.angles(positions))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        n = self.numerics
        B, S, _ = x.shape
        q, kv, _, cos, sin = self.project(x, ctx.positions)
        ring: WindowStore = ctx.cache.draft[self.stage]
        if n.bf16_boundaries:
            o = _reference_draft_attention(self, q, kv, ring)
        else:  # keys: the ring's written slots and the whole block, for every draft position
            keys = torch.cat((ring.kv.to(kv.dtype), kv), dim=1)
            mask = torch.cat((ring.pos >= 0, torch.ones(B, S, dtype=torch.bool, device=x.device)), dim=1)
            none = torch.zeros(B, S, 0, dtype=torch.bool, device=x.device)
            o, _ = sparse_attention(q, keys, mask.unsqueeze(1).expand(B, S, -1), kv.new_zeros(B, S, 0, kv.shape[-1]),
                                    none, self.attn_sink.float(), self.scale, n.round)
        return self.output(o, cos, sin)


def _reference_draft_attention(attn: DraftAttention, q: torch.Tensor, kv: torch.Tensor,
                               ring: WindowStore) -> torch.Tensor:
    """The reference kernel's order: the written ring slots in SLOT order, then the block (golden D's README), so
    the 64-index blocks of the online softmax fall where the reference's do."""
    B, S = q.shape[:2]
    W = ring.pos.shape[1]
    keys = torch.cat((ring.kv.to(kv.dtype), kv), dim=1)
    ids = torch.full((B, W + S), -1, dtype=torch.long, device=q.device)
    for b in range(B):
        slots = (ring.pos[b] >= 0).nonzero().flatten()
        ids[b, :len(slots)] = slots
        ids[b, len(slots):len(slots) + S] = torch.arange(W, W + S, device=q.device)
    return reference_sparse_attention(q, keys, ids.unsqueeze(1).expand(B, S, -1), attn.attn_sink.float(),
                                      attn.scale)


class DSparkStage(Block):
    """Draft stage `stage`: a window-only Block with the stage MoE size; stage 0 also projects the target's hidden
    state (main_proj, main_norm), the last one holds the output norm, the Markov head and the confidence head."""

    def __init__(self, cfg: FlashConfig, stage: int) -> None:
        d, topo = cfg.dspark, stage_topology(cfg, stage)
        super().__init__(cfg.dspark_stage_config(), topo, attn=DraftAttention(cfg, topo, stage))
        dim, dense = cfg.hidden_size, "fp8" if cfg.weight_dtype == "fp8" else "float"
        if stage == 0:
            self.main_proj = Linear(len(d.target_layer_ids) * dim, dim, dense)
            self.main_norm = RMSNorm(dim, cfg.rms_norm_eps)
        if stage == d.stages - 1:
            self.norm = RMSNorm(dim, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, d.markov_rank)
            self.confidence_head = ConfidenceHead(dim, d.markov_rank)


class MarkovHead(nn.Module):
    """A rank-r bigram bias: head(embed(previous token)) added to a draft row's logits before its choice."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.head = Linear(rank, vocab, exact_fp32=True)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.proj = Linear(dim + rank, 1, exact_fp32=True)


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, block + 1]: the anchor, then the block's drafts (positions p+2 .. p+block+1)
    logits: torch.Tensor  # [B, block, V] fp32, the Markov bias included (row i chose tokens[:, i + 1])
    confidence: torch.Tensor  # [B, block] raw logits


def main_x(stages: nn.ModuleList, main_hidden: torch.Tensor) -> torch.Tensor:
    """The target's hidden state as every stage reads it (stage 0's projection and norm)."""
    first = stages[0]
    return first.main_norm(first.main_proj(main_hidden))


def write_target(stages: nn.ModuleList, main_hidden: torch.Tensor, positions: torch.Tensor,
                 rings: list[WindowStore], valid: torch.Tensor | None = None) -> torch.Tensor:
    """Write the target's KV of `positions` [B, S] (main_hidden [B, S, n_targets * dim]) into every stage's
    ring; returns main_x. `valid` [B, S] masks positions that are not to be written."""
    x = main_x(stages, main_hidden)
    if valid is None:
        valid = torch.ones_like(positions, dtype=torch.bool)
    for stage, ring in zip(stages, rings):
        ring.write(stage.attn.target_kv(x, positions).detach(), positions, valid)
    return x


def block_ids(anchor: torch.Tensor, size: int, noise_token_id: int) -> torch.Tensor:
    """The draft block [anchor, noise x (size - 1)] of each row [B, size]."""
    ids = torch.full((anchor.shape[0], size), noise_token_id, dtype=torch.long, device=anchor.device)
    ids[:, 0] = anchor
    return ids


def draft_block(head: Linear, stages: nn.ModuleList, anchor: torch.Tensor, residual: torch.Tensor,
                pre: torch.Tensor, ctx: StepContext, choose: Callable[[torch.Tensor, int], torch.Tensor]) -> Draft:
    """Draft the block whose streams (the target's embedding of `block_ids`, Transformer.streams) are `residual`,
    `pre`, at ctx.positions (the rings hold the target before the anchor). `choose(logits [B, V], i)` picks the
    token after block row i (argmax, or a sample)."""
    n = ctx.numerics
    size = ctx.positions.shape[1]
    for m, stage in enumerate(stages):
        residual, pre = stage(residual, pre, ctx)
        ctx.put(f"mtp{m}.out", residual)
        residual = ctx.forced(f"mtp{m}.out", residual)
    last = stages[-1]
    u = collapse(residual, pre, n)
    ctx.put("final_hidden", u)
    x = last.norm(u)
    ctx.put("final_norm", x)
    logits = head(x.float())
    ctx.put("logits_head", logits.clone())
    out = [anchor]
    embeds, biases = [], []
    for i in range(size):
        e = n.round(last.markov_head.embed(out[i]).float())
        bias = last.markov_head.head(e)
        logits[:, i] += bias
        embeds.append(e)
        biases.append(bias)
        out.append(choose(logits[:, i], i))
    markov = torch.stack(embeds, dim=1)
    ctx.put("markov_embed", markov)
    ctx.put("markov_bias", torch.stack(biases, dim=1))
    confidence = last.confidence_head.proj(torch.cat((u.float(), markov.float()), dim=-1)).squeeze(-1)
    return Draft(torch.stack(out, dim=1), logits, confidence)
