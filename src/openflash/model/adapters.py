"""Served LoRA adapters on a model (`serve --lora NAME=PATH`, `generate --lora PATH`): each adapted linear gets a
bank of every adapter's update (model/lora.py `LoRABank`) and the model one `AdapterSelection`, which the runtime
sets per step from its rows' requests."""

from __future__ import annotations

from typing import Mapping, Protocol

import torch
from torch import nn

from openflash.model.layers import Linear
from openflash.model.lora import AdapterSelection, LoRABank
from openflash.model.moe import MoE


class Adapter(Protocol):
    """One adapter's weights (files/peft.py reads them): module name -> (A [r, in], B [out, r]), alpha / rank."""

    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float


def attach_adapters(model: nn.Module, adapters: Mapping[str, Adapter]) -> AdapterSelection:
    """Put every adapter of `adapters` (served name -> weights) on the model's linears as banks; returns the
    selection the runtime sets per step. Refuses a module name the model lacks or a shape that does not fit."""
    selection = AdapterSelection(list(adapters))
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    per_linear: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
    for slot, (served, adapter) in enumerate(adapters.items()):
        for module, (a, b) in adapter.weights.items():
            linear = linears.get(module)
            if linear is None:
                raise ValueError(f"adapter {served!r}: the model has no linear {module!r}")
            if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter {served!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, the "
                                 f"linear is [{linear.out_features}, {linear.in_features}]")
            pairs = per_linear.setdefault(module, [None] * len(adapters))
            pairs[slot] = (a.float().to(linear.weight.device), b.float().to(linear.weight.device))
    scalings = [a.scaling for a in adapters.values()]
    for module, pairs in per_linear.items():
        linears[module].adapter = LoRABank(selection, pairs, scalings)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if any(lin.adapter is not None for e in moe.experts for lin in (e.w1, e.w2, e.w3)):
            moe.adapters = selection  # its routed experts are adapted: it routes each adapter's tokens apart
    return selection


__all__ = ["attach_adapters"]
