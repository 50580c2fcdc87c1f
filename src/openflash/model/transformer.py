"""The V4.1-Flash text model, top to bottom (spec: architecture.md §2, §4.4, §7).

    rows = the caller's Engram rows of the tokens (memory/)   # addresses depend on tokens only: prepared ahead
    h = embed(tokens), image-span positions overwritten        # ViT + aligner rows (model/vision.py)
    R = 4 copies of h; pre = one-hot                           # mHC residual streams
    for each layer L:
        if Engram sits before L: R = Engram_L(R, rows)         # looked up, not computed
        R, pre = Block_L(R, pre)                               # attention (CSA2) + MoE, each wrapped in mHC
    logits = head(norm(collapse(R, pre)))

Two ways to run it (a model with Engram layers also takes `engram=`, the `EngramRows` its memory prepared from the
same token ids; the model hashes nothing and imports nothing from memory/; a step with images takes `images=`, the
`ImageRows` of its image-span positions, made by `encode_image` from the caller's preprocessed patches). Callers
use the runtime (runtime/runtime.py), which prepares those and picks the compiled decode graph where it applies:
- `forward(input_ids, targets)`: a full causal sequence from position 0 (training), returning logits and loss,
  plus the indexer's KL term;
- `step(input_ids, cache)`: incremental inference; prefill chunks and decode steps carry all state in a
  `ModelCache`. CED: the encoder half (layers before the decoder's KV owner) runs on every prompt token; in
  `bounded` mode the decoder half runs only on the last `sliding_window` prompt positions (architecture.md §7.3),
  in `exact` mode (the reference's behaviour, the default here) on all of them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from openflash.config import FlashConfig
from openflash.model import dspark
from openflash.model.block import Block, RecomputedBlock
from openflash.model.cache import ModelCache, ReplayBuffer, append_replay
from openflash.model.compiled_blocks import CompiledBlock
from openflash.model.context import CompressedView, ExpertSource, Probe, StepContext, real_tokens
from openflash.model.dspark import DSparkStage
from openflash.model.engram import EngramRows
from openflash.model.engram_table import DeviceTable
from openflash.model.layers import Linear, NumericsMixin, RMSNorm
from openflash.model.mhc import collapse
from openflash.model.numerics import FP32, Numerics
from openflash.model.routed import OFFLOAD_CHUNK
from openflash.model.vision import Aligner, ImageRows, VisionTower, span_rows

log = logging.getLogger("openflash.model")

Method = TypeVar("Method", bound=Callable)


def _gemm_kernels(method: Method) -> Method:
    """Run an inference entry point under its numerics' GEMM kernels (Numerics.gemm_kernels: `reference` on the CPU
    keeps PyTorch's own bf16 GEMMs)."""
    @functools.wraps(method)
    def run(self: "Transformer", *args, **kwargs):
        with self.numerics.gemm_kernels(self.device):
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]

WEIGHT_RESIDENCIES = ("dequantized", "stored")
PREFETCH_TOKENS = 16  # steps of at most this many tokens hint this and the next layer's experts to an ExpertSource
NO_ROWS = ("this model has Engram layers: its steps take engram=<the rows of the call's token ids>; run it through "
           "its runtime (openflash.runtime.runtime.Runtime: open_model(...) or Runtime.of(model)), whose memory "
           "prepares them")


@dataclass
class TargetHidden:
    """The drafter's input from a target step: main_hidden [B, S', n_targets * dim] of positions [B, S'] (the
    positions the target layers ran on: every token, or the replayed tail of a bounded prefill); in a step of
    right-padded rows only row b's first lengths[b] are real."""

    values: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor | None:
        """[B, S'] bool: the real positions (None: all)."""
        return None if self.lengths is None else real_tokens(self.positions, self.lengths)

    def last(self) -> torch.Tensor:
        """main_hidden of each row's last real position [B, 1, n_targets * dim]."""
        return _last_real(self.values, self.lengths)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, S, V] fp32
    loss: torch.Tensor | None  # next-token cross-entropy (mean over targets != -100)
    indexer_loss: torch.Tensor | None  # mean KL(attention || indexer) over indexer layers
    main_hidden: torch.Tensor | None = None  # with hidden=True: the DSpark drafter's input [B, S, n_targets * dim]


class Transformer(nn.Module):
    def __init__(self, cfg: FlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, t) for t in cfg.topology.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, exact_fp32=True)  # fp32 logits
        self.weight_residency = "dequantized"  # every Linear's (set_weight_residency)
        # DSpark draft stages (checkpoint mtp.0..): they share embed and head with the backbone.
        self.mtp = nn.ModuleList(DSparkStage(cfg, m) for m in range(cfg.dspark.stages if cfg.dspark else 0))
        # The vision tower and aligner (checkpoint `vision.*`, `aligner.*`) and the span delimiter vectors.
        vision = cfg.vision
        self.vision = VisionTower(vision) if vision else None
        self.aligner = Aligner(vision, cfg.hidden_size) if vision else None
        if vision:
            self.image_start, self.image_end, self.image_newline = (
                nn.Parameter(torch.randn(cfg.hidden_size) * 0.02) for _ in range(3))
        self.numerics: Numerics = FP32
        self._noted_exact_prefill = False  # logged once: bounded prefill runs exact (Engram in the decoder half)
        # The compiled backend's training forward: each block's forward compiled on its own (compiled_blocks.py).
        self._compiled_blocks: list[CompiledBlock] | None = None
        # Training: recompute each block's activations in the backward instead of keeping them (block.py).
        self.checkpoint_blocks = False

    # ---- configuration ---------------------------------------------------------------------------------------
    def set_numerics(self, numerics: Numerics) -> "Transformer":
        self.numerics = numerics
        for module in self.modules():
            if isinstance(module, NumericsMixin):
                module.numerics = numerics
        return self

    def set_weight_residency(self, residency: str) -> "Transformer":
        """"dequantized": quantized weights cached in fp32 once (fast where it fits); "stored": only the stored
        bytes stay resident, linears dequantize one tile at a time (model/layers.py)."""
        if residency not in WEIGHT_RESIDENCIES:
            raise ValueError(f"weight residency must be one of {WEIGHT_RESIDENCIES}, got {residency!r}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.keep_dequantized = residency == "dequantized"
                if not module.keep_dequantized:
                    module.drop_dequantized()
        self.weight_residency = residency
        return self

    def engram_tables(self) -> dict[int, DeviceTable]:
        """The model's own Engram tables by slot (index in engram_layer_ids): what the `device` tier reads, and
        what another tier replaces (and releases) when it takes the rows over."""
        return {t.engram_slot: self.layers[t.index].engram.embed for t in self.cfg.topology.layers if t.engram_before}

    @torch.no_grad()
    def quantize_engram_tables(self) -> list[int]:
        """Turn fp32 (trained) Engram tables into the checkpoint's FP8 row format, which the host and disk tiers
        hold; returns the layer ids it changed."""
        changed = []
        for t in self.cfg.topology.layers:
            engram = self.layers[t.index].engram if t.engram_before else None
            if engram is not None and engram.embed.storage != "fp8":
                engram.embed = engram.embed.to_fp8()
                changed.append(t.index)
        return changed

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch_size: int = 1, capacity: int = 0, spare: int = 0) -> ModelCache:
        return ModelCache.empty(self.cfg, batch_size, device=self.device, capacity=capacity, spare=spare,
                                draft=bool(self.mtp))

    # ---- pieces ---------------------------------------------------------------------------------------------
    @_gemm_kernels
    def encode_image(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int, types: torch.Tensor,
                     probe: Probe | None = None) -> torch.Tensor:
        """The embedding rows [len(types), dim] of one image span (fp32): ViT over the patches [n_vit_h * n_vit_w,
        3, p, p], the aligner, and the delimiter vectors where `types` has them (spec §A.5)."""
        if self.vision is None:
            raise ValueError("this model has no vision tower (vision_config.num_hidden_layers = 0): it takes no "
                             "images")
        vit = self.vision(patches.to(self.device), n_vit_h, n_vit_w)
        cells = self.aligner(vit, n_vit_h, n_vit_w)
        if probe is not None:
            probe.record("vit_out", vit)
            probe.record("aligner_out", cells)
        return span_rows(types.to(self.device), cells, self.image_start, self.image_end, self.image_newline).float()

    def streams(self, input_ids: torch.Tensor, images: ImageRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The mHC residual streams of tokens [B, S]: hc copies of the embedding (image-span positions overwritten
        with `images`), and the one-hot first pre mix."""
        h = self.numerics.round(self.embed(input_ids).float())
        if images is not None:
            if tuple(images.mask.shape) != tuple(input_ids.shape):
                raise ValueError(f"images.mask has shape {tuple(images.mask.shape)} but input_ids "
                                 f"{tuple(input_ids.shape)}")
            h = h.masked_scatter(images.mask.unsqueeze(-1), self.numerics.round(images.values.float()))
        residual = h.unsqueeze(2).expand(*h.shape[:2], self.cfg.hc_mult, h.shape[-1]).contiguous()
        pre = torch.zeros(*h.shape[:2], self.cfg.hc_mult, device=h.device)
        pre[..., 0] = 1.0  # one-hot initial pre mix: selects stream 0 (all streams are equal here)
        return residual, pre

    def _layers(self, residual: torch.Tensor, pre: torch.Tensor, layers: range, ctx: StepContext,
                engram: EngramRows | None, image_mask: torch.Tensor | None,
                forwards: Sequence[Block | CompiledBlock | RecomputedBlock] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """forwards: what runs each block (default: the blocks themselves)."""
        token_mask = None if image_mask is None else ~image_mask
        forwards = self.layers if forwards is None else forwards
        hints = ctx.experts is not None and ctx.experts.prefetching and \
            residual.shape[0] * residual.shape[1] <= PREFETCH_TOKENS
        for i in layers:
            block = self.layers[i]
            if block.topo.engram_before:
                if engram is None:
                    raise ValueError(NO_ROWS)
                residual = block.engram(residual, engram.get(block.topo.engram_slot), token_mask)
                ctx.put(f"engram{i}.out", residual)
                residual = ctx.forced(f"engram{i}.out", residual)
            if hints:
                self._hint_experts(residual, pre, [j for j in (i, i + 1) if j in layers], ctx.experts)
            if i in ctx.taps:  # DSpark's input: the mean of the streams entering a target layer (spec B.2)
                ctx.taps[i] = self.numerics.round(residual.float().mean(2))
            residual, pre = forwards[i](residual, pre, ctx, image_mask)
            ctx.put(f"block{i}.pre", pre)  # the collapse weights a read-out after this block would use
            ctx.put(f"block{i}.out", residual)
            residual = ctx.forced(f"block{i}.out", residual)
        return residual, pre

    def _hint_experts(self, residual: torch.Tensor, pre: torch.Tensor, layers: list[int],
                      source: ExpertSource) -> None:
        """Pre-gating: the routers of this layer and the next, applied to this layer's input, predict the experts
        they will ask for, so the source can read them while attention (and the layer) compute. Decode-sized steps
        only: a prefill picks most experts anyway."""
        u = collapse(residual, pre, self.numerics)
        for j in layers:
            block = self.layers[j]
            source.prefetch(j, block.ffn.likely_experts(block.ffn_norm(u), OFFLOAD_CHUNK))

    def _logits(self, residual: torch.Tensor, pre: torch.Tensor, ctx: StepContext,
                at: torch.Tensor | None = None) -> torch.Tensor:
        u = collapse(residual, pre, self.numerics)  # collapse with the last block's FFN pre
        if at is not None:
            u = u.gather(1, at.unsqueeze(-1).expand(-1, -1, u.shape[-1]))
        ctx.put("final_hidden", u)
        x = self.norm(u)
        ctx.put("final_norm", x)
        return self.head(x.float())

    # ---- training forward -----------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None, *,
                engram: EngramRows | None = None, dense_indexer: bool = False,
                images: ImageRows | None = None,
                probe: Probe | None = None, hidden: bool = False,
                logits_at: torch.Tensor | None = None) -> ForwardOutput:
        """Full causal sequences [B, S] from position 0 (hidden: also the drafter's input, for training it;
        images: the rows of the image-span positions, from `encode_image`, which stays in autograd; logits_at
        [B, W]: the logits of these positions only, [B, W, V], without targets: an RL update scores a long
        prompt's completion, whose logits over the whole prompt would be S x V floats a row). On the compiled
        backend a training-mode forward runs each block compiled (model/compiled_blocks.py); an eval-mode one (a
        validation pass) runs the blocks themselves rather than compile a second set of graphs for a few batches.
        With `checkpoint_blocks`, a training forward keeps only each block's inputs for the backward."""
        if logits_at is not None and targets is not None:
            raise ValueError("forward: logits_at gives some positions' logits, targets a loss over all of them")
        B, S = input_ids.shape
        positions = torch.arange(S, device=input_ids.device).expand(B, S)
        ctx = StepContext(positions, self.numerics, dense_indexer=dense_indexer, probe=probe,
                          taps=self._taps() if hidden else {})
        residual, pre = self.streams(input_ids, images)
        forwards = None
        if self.numerics.compiled and self.training:
            forwards = self._blocks_compiled()
        elif self.checkpoint_blocks and self.training and torch.is_grad_enabled():
            forwards = [RecomputedBlock(block) for block in self.layers]
        residual, pre = self._layers(residual, pre, range(len(self.layers)), ctx, engram, _mask(images), forwards)
        logits = self._logits(residual, pre, ctx, logits_at)
        loss = None
        if targets is not None:
            # The mean over trained targets (-100: not trained on, e.g. a chat prompt); 0 when a batch has none.
            flat = targets.reshape(-1)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), flat, ignore_index=-100, reduction="sum") / \
                (flat != -100).sum().clamp(min=1)
        indexer_loss = torch.stack(ctx.indexer_losses).mean() if ctx.indexer_losses else None
        main_hidden = self._hidden(ctx)
        return ForwardOutput(logits, loss, indexer_loss, None if main_hidden is None else main_hidden.values)

    # ---- incremental inference -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, cache: ModelCache, *, mode: str = "exact", last_chunk: bool = True,
             engram: EngramRows | None = None, images: ImageRows | None = None,
             probe: Probe | None = None, all_logits: bool = False,
             experts: ExpertSource | None = None, lengths: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run a prefill chunk or a decode step [B, S] after what `cache` holds; returns fp32 logits [B, V] of
        each row's last position (or [B, S, V] with all_logits), or None for a non-final bounded prefill chunk.

        mode "exact": every layer on every token. mode "bounded": the decoder half waits for the last chunk and
        then runs only on the last `sliding_window` prompt positions (its KV owner's compressor still sees every
        token). Decode steps (S = 1) are the same in both modes. experts: where the routed experts come from when
        the model was loaded without them (memory/experts.py). lengths [B]: rows of different lengths packed into
        one call, right-padded: row b's first lengths[b] tokens are real, its padding leaves no trace in the cache
        (positions advance by lengths[b]) and the logits are those of its last real token (with all_logits, the
        padded positions' rows mean nothing).
        """
        return self._step(input_ids, cache, mode, last_chunk, engram, images, probe, all_logits, False, experts,
                          lengths=lengths)[0]

    @torch.no_grad()
    def step_hidden(self, input_ids: torch.Tensor, cache: ModelCache, *, mode: str = "exact",
                    last_chunk: bool = True, engram: EngramRows | None = None, images: ImageRows | None = None,
                    probe: Probe | None = None, all_logits: bool = False, experts: ExpertSource | None = None,
                    lengths: torch.Tensor | None = None) -> tuple[torch.Tensor | None, TargetHidden | None]:
        """`step`, plus what the drafter reads: main_hidden of the positions the target layers ran on (None for a
        non-final bounded prefill chunk, whose decoder half has not run yet)."""
        return self._step(input_ids, cache, mode, last_chunk, engram, images, probe, all_logits, True, experts,
                          lengths=lengths)

    @_gemm_kernels
    def _step(self, input_ids: torch.Tensor, cache: ModelCache, mode: str, last_chunk: bool,
              engram: EngramRows | None, images: ImageRows | None, probe: Probe | None, all_logits: bool,
              hidden: bool, experts: ExpertSource | None = None, static: bool = False,
              lengths: torch.Tensor | None = None) -> tuple[torch.Tensor | None, TargetHidden | None]:
        """static: this call is the body of a whole-step graph (runtime/decode_graph.py, StepContext.static)."""
        if mode not in ("exact", "bounded"):
            raise ValueError(f"prefill mode must be 'exact' or 'bounded', got {mode!r}")
        if mode == "bounded" and not self.cfg.topology.bounded_replay_ok:
            mode = "exact"
            self._note_exact_prefill()
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(1)
        B, S = input_ids.shape
        if cache.batch_size != B:
            raise ValueError(f"cache holds {cache.batch_size} sequences but input_ids has {B} rows")
        if lengths is not None:
            lengths = check_lengths(lengths, B, S, input_ids.device)
        positions = cache.pos.unsqueeze(1) + torch.arange(S, device=input_ids.device)
        taps = self._taps() if hidden else {}
        ctx = StepContext(positions, self.numerics, cache=cache, probe=probe, taps=taps, experts=experts,
                          static=static, lengths=lengths)
        advance = S if lengths is None else lengths
        residual, pre = self.streams(input_ids, images)
        if images is not None:
            ctx.put("embed_merged", residual[:, :, 0])
        image_mask = _mask(images)
        n_layers, split = len(self.layers), self.cfg.topology.decoder_start
        if mode == "exact" and cache.replay is not None:
            raise ValueError("this cache has a pending bounded-replay prefill; finish it in 'bounded' mode")
        if mode == "exact" or split >= n_layers:
            residual, pre = self._layers(residual, pre, range(n_layers), ctx, engram, image_mask)
            cache.pos = cache.pos + advance
            if all_logits:
                return self._logits(residual, pre, ctx), self._hidden(ctx)
            logits = self._logits(_last_real(residual, lengths), _last_real(pre, lengths), ctx)
            return logits[:, -1], self._hidden(ctx)

        # Bounded replay: encoder on every token, plus the decoder KV owner's compressor and index keys.
        if hidden and not self.cfg.dspark_bounded_ok:
            raise ValueError(f"DSpark target layers {list(self.cfg.dspark.target_layer_ids)} reach into the CED "
                             f"encoder half (layers < {split}): the drafter's input needs exact prefill")
        residual, pre = self._layers(residual, pre, range(split), ctx, engram, image_mask)
        owner = self.layers[split]
        owner_x = owner.attn_norm(collapse(residual, pre, self.numerics))
        owner.attn.publish_compressed(owner_x, ctx)
        if image_mask is None:
            image_mask = torch.zeros(B, S, dtype=torch.bool, device=input_ids.device)
        cache.replay = append_replay(cache.replay, residual, pre, positions, image_mask, lengths,
                                     self.cfg.sliding_window)
        cache.pos = cache.pos + advance
        if not last_chunk:
            return None, None
        replay, cache.replay = cache.replay, None
        tail_lengths = replay.lengths if replay.padded else None
        tail_ctx = StepContext(replay.positions, self.numerics, cache=cache,
                               compressed={split: ctx.compressed[split]}, probe=probe,
                               taps=self._taps() if hidden else {}, experts=experts, lengths=tail_lengths)
        tail_mask = replay.image_mask if bool(replay.image_mask.any()) else None  # decoder-half routing (bias_vl)
        residual, pre = self._layers(replay.residual, replay.pre_mix, range(split, n_layers), tail_ctx, None,
                                     tail_mask)
        logits = self._logits(_last_real(residual, tail_lengths), _last_real(pre, tail_lengths), tail_ctx)
        return logits[:, -1], self._hidden(tail_ctx)

    def static_decode(self, input_ids: torch.Tensor, cache: ModelCache, engram: EngramRows | None) -> torch.Tensor:
        """A decode step [B, 1] with every shape fixed by the cache (StepContext.static): the body that
        runtime/decode_graph.py compiles into one graph. Returns logits [B, V]."""
        return self._step(input_ids, cache, "exact", True, engram, None, None, False, False, static=True)[0]

    def _blocks_compiled(self) -> list[CompiledBlock]:
        if self._compiled_blocks is None:
            self._compiled_blocks = [CompiledBlock(block, f"block_{i}_attend") for i, block in enumerate(self.layers)]
        return self._compiled_blocks

    def _taps(self) -> dict[int, torch.Tensor | None]:
        if self.cfg.dspark is None:
            raise ValueError("this model has no DSpark draft head (num_nextn_predict_layers = 0)")
        return {i: None for i in self.cfg.dspark.target_layer_ids}

    def _hidden(self, ctx: StepContext) -> TargetHidden | None:
        if not ctx.taps:
            return None
        values = torch.cat([ctx.taps[i] for i in self.cfg.dspark.target_layer_ids], dim=-1)
        ctx.put("main_hidden", values)
        return TargetHidden(ctx.forced("main_hidden", values), ctx.positions, ctx.lengths)

    # ---- DSpark drafting -------------------------------------------------------------------------------------
    @torch.no_grad()
    def draft_seed(self, hidden: TargetHidden, cache: ModelCache, valid: torch.Tensor | None = None,
                   probe: Probe | None = None) -> torch.Tensor:
        """Write the target's KV of hidden.positions (where `valid`, and only real ones) into every draft stage's
        ring; returns main_x."""
        real = hidden.valid
        if real is not None:
            valid = real if valid is None else valid & real
        x = dspark.write_target(self.mtp, hidden.values, hidden.positions, cache.draft, valid)
        if probe is not None:
            probe.record("main_x", x)
        return x

    @torch.no_grad()
    def draft(self, anchor: torch.Tensor, hidden: TargetHidden, cache: ModelCache,
              choose: Callable[[torch.Tensor, int], torch.Tensor], probe: Probe | None = None) -> dspark.Draft:
        """Draft `block_size` tokens after each row's anchor [B], the token at position cache.pos (not yet run by
        the target); `hidden`: main_hidden of position cache.pos - 1, whose KV is written into the rings first."""
        d = self.cfg.dspark
        x = self.draft_seed(hidden, cache)
        positions = cache.pos.unsqueeze(1) + torch.arange(d.block_size, device=anchor.device)
        ctx = StepContext(positions, self.numerics, cache=cache, probe=probe)
        ctx.put("main_x", x)
        residual, pre = self.streams(dspark.block_ids(anchor, d.block_size, d.noise_token_id))
        return dspark.draft_block(self.head, self.mtp, anchor, residual, pre, ctx, choose)

    @torch.no_grad()
    @_gemm_kernels
    def replay(self, input_ids: torch.Tensor, cache: ModelCache, start: int, *, bounded: bool,
               engram: EngramRows | None = None, images: ImageRows | None = None,
               experts: ExpertSource | None = None) -> None:
        """Rebuild a cache's bounded state from the last tokens [1, S] (positions start..start+S-1) of a prefix
        whose global state (compressed KV and index keys) the cache already holds, as prefix caching restores one.

        Every owner layer's compressed view is published up front, so no compressor runs and no cached entry is
        rewritten; per-query visibility keeps the replay causal. With `bounded` (and a model whose bounded replay is
        exact, `Topology.bounded_replay_ok`) only the encoder half runs and its output becomes the pending
        decoder-half input, as a chunked bounded prefill would leave it. `engram`: the rows of these tokens, prepared
        by the caller with `cache.engram` advanced past the prefix; `images`: the image rows among them."""
        S = input_ids.shape[1]
        positions = torch.arange(start, start + S, device=input_ids.device).unsqueeze(0)
        views = {i: CompressedView(c.length, int(c.length.max()), store=c) for i, c in cache.compressed.items()}
        ctx = StepContext(positions, self.numerics, cache=cache, compressed=views, experts=experts)
        n_layers, split = len(self.layers), self.cfg.topology.decoder_start
        bounded = bounded and split < n_layers and self.cfg.topology.bounded_replay_ok
        residual, pre = self.streams(input_ids, images)
        image_mask = _mask(images)
        residual, pre = self._layers(residual, pre, range(split if bounded else n_layers), ctx, engram, image_mask)
        if bounded:
            cache.replay = ReplayBuffer(residual, pre, positions, torch.zeros_like(positions, dtype=torch.bool)
                                        if image_mask is None else image_mask)
        cache.pos = torch.tensor([start + S], dtype=torch.long, device=input_ids.device)

    def _note_exact_prefill(self) -> None:
        if not self._noted_exact_prefill:
            self._noted_exact_prefill = True
            log.info("Engram layer(s) %s sit in the CED decoder half (from layer %d): bounded prefill runs exact "
                     "for this model", [i for i in self.cfg.engram_layer_ids if i >= self.cfg.topology.decoder_start],
                     self.cfg.topology.decoder_start)


def _mask(images: ImageRows | None) -> torch.Tensor | None:
    return None if images is None else images.mask


def _last_real(t: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """t[:, -1:] of each row, or the row's last real entry t[b, lengths[b] - 1] of right-padded rows."""
    if lengths is None:
        return t[:, -1:]
    index = (lengths - 1).view(-1, 1, *([1] * (t.dim() - 2))).expand(-1, 1, *t.shape[2:])
    return t.gather(1, index)


def check_lengths(lengths: torch.Tensor, rows: int, width: int, device: torch.device) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
    if tuple(lengths.shape) != (rows,) or bool((lengths < 1).any()) or bool((lengths > width).any()):
        raise ValueError(f"lengths must hold one value in [1, {width}] per row of input_ids ({rows} rows), got "
                         f"{lengths.tolist()}")
    return lengths


__all__ = ["Transformer", "Block", "ForwardOutput", "CompressedView", "TargetHidden"]
