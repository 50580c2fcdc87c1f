"""One layer: attention and MoE sublayers, each wrapped in single-pass mHC, with an Engram before it where the
config places one (spec: architecture.md §4.4). The backbone's layers and the DSpark draft stages are Blocks."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from openflash.config import FlashConfig
from openflash.model.attention import Attention
from openflash.model.context import StepContext
from openflash.model.engram import Engram
from openflash.model.layers import NumericsMixin, RMSNorm
from openflash.model.mhc import hc_kernels
from openflash.model.moe import MoE
from openflash.topology import LayerTopology


class Block(nn.Module, NumericsMixin):
    """Attention and MoE sublayers, each wrapped in single-pass mHC (architecture.md §4.4)."""

    def __init__(self, cfg: FlashConfig, topo: LayerTopology, attn: nn.Module | None = None) -> None:
        super().__init__()
        self.topo = topo
        hc, dim = cfg.hc_mult, cfg.hidden_size
        self.hc, self.iters, self.eps = hc, cfg.hc_sinkhorn_iters, cfg.hc_eps
        self.attn = Attention(cfg, topo) if attn is None else attn  # a draft stage brings its own
        self.ffn = MoE(cfg, topo.index)
        self.attn_norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(dim, cfg.rms_norm_eps)
        rows = (2 + hc) * hc
        for part in ("attn", "ffn"):
            init = torch.randn(rows, hc * dim) * 0.1 / (hc * dim) ** 0.5
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(init))
            # Start close to the identity mix: a strong diagonal in comb, neutral pre/post.
            base = torch.zeros(rows)
            base[2 * hc:] = torch.eye(hc).flatten() * 4.0
            self.register_parameter(f"hc_{part}_base", nn.Parameter(base))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))
        if topo.engram_before:
            self.engram = Engram(cfg, cfg.engram_num_embeddings[topo.engram_slot])

    def forward(self, residual: torch.Tensor, pre_in: torch.Tensor, ctx: StepContext,
                image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One path for every numerics: the policy's mHC kernels (model/mhc.py HcKernels) do the stream work.
        Returns the streams after the block and its FFN pre (the next sublayer's read weights)."""
        r1, ffn_in, f_pre, f_post, f_comb = self.attend(residual, pre_in, ctx)
        return self.feed_forward(ffn_in, r1, f_post, f_comb, ctx, image_mask), f_pre

    # The block in two halves, split where the routing's data-dependent shapes begin, so that a compiled training
    # forward compiles the first whole (model/compiled_blocks.py).
    def attend(self, residual: torch.Tensor, pre_in: torch.Tensor,
               ctx: StepContext) -> tuple[torch.Tensor, ...]:
        """The attention sublayer in its mHC, then the FFN sublayer's stream read: (streams after attention, the
        FFN's normed input, its pre, post and comb mixes)."""
        hc = hc_kernels(self.numerics)
        m, u = hc.read(residual, pre_in, self.hc_attn_fn)  # pre_in: the previous sublayer's pre
        a_pre, a_post, a_comb = hc.coefficients(m, self.hc_attn_base, self.hc_attn_scale, self.hc, self.iters,
                                                self.eps)
        r1 = hc.write(self.attn(self.attn_norm(u), ctx), residual, a_post, a_comb)
        m, v = hc.read(r1, a_pre, self.hc_ffn_fn)
        f_pre, f_post, f_comb = hc.coefficients(m, self.hc_ffn_base, self.hc_ffn_scale, self.hc, self.iters, self.eps)
        return r1, self.ffn_norm(v), f_pre, f_post, f_comb

    def feed_forward(self, ffn_in: torch.Tensor, r1: torch.Tensor, f_post: torch.Tensor, f_comb: torch.Tensor,
                     ctx: StepContext, image_mask: torch.Tensor | None) -> torch.Tensor:
        """The MoE on the FFN's input, written into the streams."""
        return hc_kernels(self.numerics).write(self.ffn(ffn_in, ctx, image_mask), r1, f_post, f_comb)


class RecomputedBlock:
    """A block run under activation checkpointing (`train --checkpoint-activations`): only its inputs are kept for
    the backward, which runs the block's forward again to rebuild the rest. The rerun sees the step context as the
    first run did and counts no expert load (the step's tokens were counted once already)."""

    def __init__(self, block: Block) -> None:
        self.block = block

    def __call__(self, residual: torch.Tensor, pre: torch.Tensor, ctx: StepContext,
                 image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        state = ctx.shared_state()  # the rerun must see the context as this run does

        @contextmanager
        def rerun() -> Iterator[None]:  # entered when the backward reruns the block
            with ctx.restored(state), self.block.ffn.uncounted():
                yield

        return checkpoint(self.block, residual, pre, ctx, image_mask, use_reentrant=False,
                          context_fn=lambda: (nullcontext(), rerun()))
