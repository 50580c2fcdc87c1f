"""LoRA adapters on the model's linears: y = W x + (alpha / r) B A x, W frozen as stored (FP8, FP4, bf16).

Training (`train --lora`): one `LoRA` per adapted linear. Its A [r, in] starts Kaiming-uniform and B [out, r] at
zero, so a model with fresh adapters computes exactly what it did without them. Gradients reach A and B, and flow
on through the frozen base one dequantized tile at a time (`model/layers.py` `_StoredProduct`), through its
activation QDQ straight-through; the base never gets an fp32 copy. The default targets follow the public V4.1
recipe: the attention projections (`wq_a`, `wq_b`, `wkv`, `wo_b`) and the routed and shared experts of the main
layers; the indexer stays frozen (its top-k has no language-model gradient).

Serving (`serve --lora NAME=PATH ...`): one `LoRABank` per adapted linear holds every served adapter, and the
model's `AdapterSelection` says which adapter each token of the running step uses (-1: none), set by the runtime
from its rows' requests; a batch mixes adapters, each row getting its own low-rank product. The MoE routes the
tokens of each adapter separately (`AdapterSelection.groups`), so an expert's linears see one adapter per call.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator

import torch
from torch import nn

from openflash.model.layers import Linear

DEFAULT_TARGETS = (r"^layers\.\d+\.attn\.(wq_a|wq_b|wkv|wo_b)$",
                   r"^layers\.\d+\.ffn\.(experts\.\d+|shared_experts)\.w[123]$")
BASE = -1  # the adapter slot of a token that uses none


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


def lora_alpha(rank: int, alpha: float | None) -> float:
    """An adapter's alpha: as given, else 2 x its rank."""
    return float(2 * rank if alpha is None else alpha)


def adapter_weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A [r, in], B [out, r]) of every trained adapter, detached."""
    return {name: (m.adapter.lora_A.detach(), m.adapter.lora_B.detach()) for name, m in model.named_modules()
            if isinstance(m, Linear) and isinstance(m.adapter, LoRA)}


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """The adapter's update of the weight, [out, in] in fp32: scaling * B A."""
    return (b.float() @ a.float()) * scaling


# ---- serving: several adapters, chosen per token -----------------------------------------------------------------

class AdapterSelection:
    """The adapter slot of each token of the running step (BASE outside a step). The runtime sets one slot per
    batch row (`use`): a linear's input [B, S, ...] (any S: a bounded prefill's decoder half runs on fewer tokens)
    takes each row's slot for its tokens. The MoE narrows it to the tokens it passes on (`narrowed`), one adapter
    at a time (`groups`)."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self._stack: list[int | tuple[torch.Tensor, bool]] = []  # a slot for all, or (slots, per_row)

    def slot(self, name: str | None) -> int:
        return BASE if name is None else self.names.index(name)

    def use(self, slots: torch.Tensor | int, per_row: bool = True) -> AbstractContextManager[None]:
        """Select `slots`: one for every token, or a tensor per batch row (per_row) or per token."""
        if isinstance(slots, torch.Tensor) and slots.numel() and bool((slots == slots.flatten()[0]).all()):
            slots = int(slots.flatten()[0])  # one adapter for the whole step: no per-row split
        return self._pushed(slots if isinstance(slots, int) else (slots.flatten(), per_row))

    @contextmanager
    def _pushed(self, entry: int | tuple[torch.Tensor, bool]) -> Iterator[None]:
        self._stack.append(entry)
        try:
            yield
        finally:
            self._stack.pop()

    def narrowed(self, mask: torch.Tensor) -> AbstractContextManager[None]:
        """The selection of the tokens where mask [B, S] is true (a packed prefill's real tokens)."""
        top = self.current(mask.numel())
        return self.use(top if isinstance(top, int) else top[mask.flatten()], per_row=False)

    def current(self, tokens: int) -> torch.Tensor | int:
        """The slot of every one of `tokens` tokens (batch-row order): an int for all, or a tensor [tokens]."""
        top = self._stack[-1] if self._stack else BASE
        if isinstance(top, int):
            return top
        slots, per_row = top
        if per_row and tokens % slots.numel() == 0:
            return slots.repeat_interleave(tokens // slots.numel())
        if not per_row and tokens == slots.numel():
            return slots
        raise RuntimeError(f"the adapter selection covers {slots.numel()} {'rows' if per_row else 'tokens'} but a "
                           f"linear got {tokens} rows")

    def groups(self, tokens: int) -> list[tuple[int, torch.Tensor]] | None:
        """(slot, token positions) per adapter when the current tokens mix adapters, else None."""
        top = self.current(tokens)
        if isinstance(top, int):
            return None
        return [(int(s), (top == s).nonzero().flatten()) for s in torch.unique(top).tolist()]


class LoRABank(nn.Module):
    """Every served adapter's update of one linear (slot i: `A[i]`, `B[i]`, `scaling[i]`; None where adapter i
    does not adapt this linear), applied per token by the model's `AdapterSelection`."""

    def __init__(self, selection: AdapterSelection, pairs: list[tuple[torch.Tensor, torch.Tensor] | None],
                 scalings: list[float]) -> None:
        super().__init__()
        self.selection, self.pairs, self.scalings = selection, pairs, scalings
        self.out_features = next(p[1].shape[0] for p in pairs if p is not None)

    def _one(self, x: torch.Tensor, slot: int) -> torch.Tensor | None:
        pair = self.pairs[slot] if slot != BASE else None
        return None if pair is None else (x.float() @ pair[0].t() @ pair[1].t()) * self.scalings[slot]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, out_features = x.reshape(-1, x.shape[-1]), self.out_features
        slots = self.selection.current(x2.shape[0])
        if isinstance(slots, int):
            y = self._one(x2, slots)
            return (y if y is not None else x2.new_zeros(x2.shape[0], out_features, dtype=torch.float32)) \
                .view(*x.shape[:-1], out_features)
        y = x2.new_zeros(x2.shape[0], out_features, dtype=torch.float32)
        for slot, rows in self.selection.groups(x2.shape[0]):
            part = self._one(x2[rows], slot)
            if part is not None:
                y[rows] = part
        return y.view(*x.shape[:-1], out_features)


__all__ = ["LoRA", "LoRABank", "AdapterSelection", "BASE", "lora_alpha", "adapter_weights",
           "lora_delta", "DEFAULT_TARGETS"]
