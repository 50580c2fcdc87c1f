"""The training forward compiled block by block: the compiled backend of `openflash train --compile`.

A training step of the eager `train` policy spends about 40% of its time outside the matmuls, in hundreds of
small elementwise ops per layer (mHC's streams and Sinkhorn, RMSNorm, RoPE, the indexer's scores and its KL, the
straight-through cache QDQs), each run forward and again backward. torch.compile traces each block's forward
into graphs and AOTAutograd derives their backward, so inductor fuses those chains in both directions.

What a block compiles to: `Block.attend` as one graph (mHC, attention, the indexer and its KL term, the FFN's
stream read and norm), then `Block.feed_forward` eagerly: the MoE's routing decides every shape there (expert
counts, per-expert slices), which would break a graph at each data-dependent op and recompile it for every
routing. The whole model is not one `torch.compile` call on purpose: a graph break inside a block makes dynamo
compile the block's inner frames on their own, shared by every layer, and each layer's different topology
recompiles them until dynamo's recompile limit (8) sends the rest back to eager. Here each block compiles a code
object of its own, so each has its own cache of graphs.

The math is the eager `train` policy's, the same ops through the same fused autograd functions; only the
summation order inside a fused reduction can differ in the last bits, which can flip a near-tie choice (an expert,
an indexer pick): tests/test_trainer.py compares a compiled run's loss and gradient norm with a tolerance,
benchmarks/train_speed.py also the gradients and the routing. Compilation happens at the first training step
(minutes on a CPU; cached on disk by inductor, so the next run loads it).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

from openflash.model.compiled import quiet_lru_cache_warnings
from openflash.model.context import StepContext

if TYPE_CHECKING:
    from openflash.model.block import Block

# Inductor generates the kernels; tests swap in "aot_eager" (the same graphs and derived backward, run by eager
# kernels: seconds to compile instead of minutes) where they check the structure rather than the codegen.
BACKEND = "inductor"


class CompiledBlock:
    """Runs one block as `Block.forward` does, its `attend` half through torch.compile (module doc)."""

    def __init__(self, block: "Block", name: str) -> None:
        self.block = block
        code = type(block).attend.__code__.replace(co_name=name)  # a code object of this block's own
        attend = types.FunctionType(code, type(block).attend.__globals__, name)
        self._attend = torch.compile(types.MethodType(attend, block), dynamic=None, backend=BACKEND)

    def __call__(self, residual: torch.Tensor, pre: torch.Tensor, ctx: StepContext,
                 image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        with quiet_lru_cache_warnings():
            r1, ffn_in, f_pre, f_post, f_comb = self._attend(residual, pre, ctx)
        return self.block.feed_forward(ffn_in, r1, f_post, f_comb, ctx, image_mask), f_pre


__all__ = ["CompiledBlock"]
