"""LoRA adapters on the model's linears: y = W x + (alpha / r) B A x, W frozen as stored (FP8, FP4, bf16).

The adapter's A [r, in] starts Kaiming-uniform and B [out, r] at zero, so a model with fresh adapters computes
exactly what it did without them. Gradients reach A and B, and flow on through the frozen base one dequantized tile
at a time (`model/layers.py` `_StoredProduct`), through its activation QDQ straight-through; the base never gets an
fp32 copy. The default targets follow the public V4.1 recipe: the attention projections (`wq_a`, `wq_b`, `wkv`,
`wo_b`) and the routed and shared experts; the indexer stays frozen (its top-k has no language-model gradient).

Groundwork for `train --lora` (not wired into the trainer yet): `add_lora(model, rank)` attaches adapters and
freezes everything else.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from openflash.model.layers import Linear

DEFAULT_TARGETS = (r"\.attn\.(wq_a|wq_b|wkv|wo_b)$", r"\.ffn\.(experts\.\d+|shared_experts)\.w[123]$")


class LoRA(nn.Module):
    """The low-rank update of one linear: (alpha / rank) * B(A(x)), in fp32."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def add_lora(model: nn.Module, rank: int, alpha: float | None = None,
             targets: tuple[str, ...] = DEFAULT_TARGETS) -> list[str]:
    """Attach an adapter to every Linear whose name matches one of `targets` (regular expressions) and freeze every
    other parameter; returns the adapted names. alpha defaults to 2 * rank."""
    patterns = [re.compile(t) for t in targets]
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and any(p.search(name) for p in patterns):
            module.adapter = LoRA(module.in_features, module.out_features, rank,
                                  float(2 * rank if alpha is None else alpha)).to(module.weight.device)
            adapted.append(name)
    if not adapted:
        raise ValueError(f"no linear matches the LoRA targets {list(targets)}")
    return adapted


__all__ = ["LoRA", "add_lora", "DEFAULT_TARGETS"]
