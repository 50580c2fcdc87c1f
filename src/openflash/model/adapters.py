"""LoRA adapters put on a model (model/lora.py has their math). Training (`add_lora`): a fresh `LoRA` on each target
linear, everything else frozen. Serving (`serve --lora NAME=PATH`, `generate --lora PATH`, `attach_adapters`): each
adapted linear gets a bank of every adapter's update (`LoRABank`) and the model one `AdapterSelection`, which the
runtime sets per step from its rows' requests. Either way each MoE learns once whether its routed experts carry
adapters (`MoE.adapted`), which only the paths that call each expert apply."""

from __future__ import annotations

import re
from typing import Mapping, Protocol

import torch
from torch import nn

from openflash.model.layers import Linear
from openflash.model.lora import DEFAULT_TARGETS, AdapterSelection, LoRA, LoRABank, lora_alpha
from openflash.model.moe import MoE


class Adapter(Protocol):
    """One adapter's weights (files/peft.py reads them): module name -> (A [r, in], B [out, r]), alpha / rank."""

    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float


def add_lora(model: nn.Module, rank: int, alpha: float | None = None,
             targets: tuple[str, ...] = DEFAULT_TARGETS) -> list[str]:
    """Attach a fresh adapter to every Linear whose name matches one of `targets` (regular expressions) and freeze
    every other parameter; returns the adapted names. alpha defaults to 2 * rank (`lora_alpha`)."""
    patterns = [re.compile(t) for t in targets]
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and any(p.search(name) for p in patterns):
            module.adapter = LoRA(module.in_features, module.out_features, rank,
                                  lora_alpha(rank, alpha)).to(module.weight.device)
            adapted.append(name)
    if not adapted:
        raise ValueError(f"no linear matches the LoRA targets {list(targets)}")
    _mark_adapted_experts(model)
    return adapted


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
    for moe in _mark_adapted_experts(model):
        moe.adapters = selection  # it routes each adapter's tokens apart
    return selection


def _mark_adapted_experts(model: nn.Module) -> list[MoE]:
    """Tell each MoE whether its routed experts carry adapters (a fact of the model, not of each step); returns
    those that do."""
    adapted = []
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        moe.adapted = any(lin.adapter is not None for e in moe.experts for lin in (e.w1, e.w2, e.w3))
        if moe.adapted:
            adapted.append(moe)
    return adapted


__all__ = ["add_lora", "attach_adapters"]
