"""Optimizers, learning-rate schedule and MoE load balancing for training.

Parameter groups (spec facts for training, see the trainer's docs):
- Engram tables (`layers.N.engram.embed.weight`): Adam at `engram_lr_mult` (5x) the base rate, no weight decay;
- 2-D weight matrices: AdamW with weight decay (or Muon for the hidden Linear matrices, `--optimizer muon`);
- vectors (norm weights, attention sinks, mHC base/scale): AdamW without weight decay.

The MoE router bias is not learned by gradient. After each step it moves by `rate * sign(mean load - load)` per
expert (aux-loss-free balancing): overloaded experts get a smaller selection bias, idle ones a larger one.

The learning rate has two stages when the indexer is warmed up first (`indexer_warmup` steps where only the
lightning indexer learns, on a dense-attention KL target): that stage ramps up to the peak rate and holds it; the
main stage then has its own linear warm-up followed by a cosine decay to `min_ratio * peak` at the last step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from openflash.errors import OpenflashError
from openflash.model.layers import Linear
from openflash.model.moe import MoE

ENGRAM_TABLE_SUFFIX = "engram.embed.weight"
INDEXER_MARKER = ".attn.indexer."


def is_engram_table(name: str) -> bool:
    return name.endswith(ENGRAM_TABLE_SUFFIX)


def is_indexer_param(name: str) -> bool:
    return INDEXER_MARKER in name


# ---------------------------------------------------------------------------------------------------------------
# Learning-rate schedule


@dataclass
class Schedule:
    """Multiplier of each group's base learning rate at a step (0-based)."""

    warmup: int
    total: int
    indexer_warmup: int = 0
    min_ratio: float = 0.1

    def multiplier(self, step: int) -> float:
        if step < self.indexer_warmup:  # stage 1: the indexer alone; ramp up, then hold
            ramp = max(1, min(self.warmup, self.indexer_warmup))
            return min(1.0, (step + 1) / ramp)
        step -= self.indexer_warmup
        total = max(1, self.total - self.indexer_warmup)
        warmup = min(self.warmup, total)
        if step < warmup:
            return (step + 1) / warmup
        decay_steps = max(1, total - warmup)
        progress = min(1.0, (step - warmup) / decay_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def state_dict(self) -> dict[str, Any]:
        return {"warmup": self.warmup, "total": self.total, "indexer_warmup": self.indexer_warmup,
                "min_ratio": self.min_ratio}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.warmup, self.total = int(state["warmup"]), int(state["total"])
        self.indexer_warmup, self.min_ratio = int(state["indexer_warmup"]), float(state["min_ratio"])


# ---------------------------------------------------------------------------------------------------------------
# Muon


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately orthogonalise a matrix (U S V^T -> U V^T) with the quintic Newton-Schulz iteration."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    transposed = x.shape[0] > x.shape[1]
    if transposed:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.t()
    for _ in range(steps):
        gram = x @ x.t()
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.t() if transposed else x


class Muon(torch.optim.Optimizer):
    """Momentum SGD whose update is the orthogonalised (Nesterov) momentum, for 2-D hidden matrices.

    The update is rescaled to the RMS of a typical AdamW update (0.2 * sqrt(max(rows, cols))), so the same peak
    learning rate and decoupled weight decay as the AdamW groups apply.
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict], lr: float = 3e-3, momentum: float = 0.95,
                 weight_decay: float = 0.0, ns_steps: int = 5) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dim() != 2:
                    raise ValueError(f"Muon handles 2-D matrices only, got shape {tuple(p.shape)}")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad)
                update = p.grad.add(buf, alpha=group["momentum"])  # Nesterov
                update = newton_schulz(update, group["ns_steps"]) * (0.2 * math.sqrt(max(p.shape)))
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return None


# ---------------------------------------------------------------------------------------------------------------
# The optimizer set of a model


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    engram_lr_mult: float = 5.0
    optimizer: str = "adamw"  # or "muon" for the 2-D hidden matrices
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8


def _muon_names(model: nn.Module) -> set[str]:
    """Weights of the hidden Linear layers: every float `Linear` except the output head."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, Linear) and not module.quantized and module_name != "head":
            names.add(f"{module_name}.weight")
    return names


class TrainOptimizer:
    """The model's optimizers (AdamW/Adam groups, plus Muon when chosen) behind one step / state interface.

    Each group carries `base_lr`; `set_lr_multiplier` sets lr = base_lr * multiplier for all of them.
    """

    def __init__(self, model: nn.Module, cfg: OptimConfig) -> None:
        if cfg.optimizer not in ("adamw", "muon"):
            raise OpenflashError(f"optimizer must be 'adamw' or 'muon', got {cfg.optimizer!r}")
        self.cfg = cfg
        muon_names = _muon_names(model) if cfg.optimizer == "muon" else set()
        groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], "engram": [], "muon": []}
        self.names: dict[str, list[str]] = {k: [] for k in groups}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if is_engram_table(name):
                kind = "engram"
            elif name in muon_names:
                kind = "muon"
            elif p.dim() >= 2:
                kind = "decay"
            else:
                kind = "no_decay"
            groups[kind].append(p)
            self.names[kind].append(name)
        spec = [("decay", cfg.lr, cfg.weight_decay), ("no_decay", cfg.lr, 0.0),
                ("engram", cfg.lr * cfg.engram_lr_mult, 0.0)]
        adam_groups = [dict(params=groups[k], lr=lr, base_lr=lr, weight_decay=wd, name=k)
                       for k, lr, wd in spec if groups[k]]
        # fused: one kernel per parameter for the whole update (the CPU step is memory-bound).
        self.adam = torch.optim.AdamW(adam_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
        self.muon = None
        if groups["muon"]:
            self.muon = Muon([dict(params=groups["muon"], lr=cfg.lr, base_lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   name="muon")], lr=cfg.lr, weight_decay=cfg.weight_decay)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.adam] + ([self.muon] if self.muon is not None else [])

    def set_lr_multiplier(self, multiplier: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * multiplier

    def lr(self) -> float:
        """The current rate of the main (decayed) group."""
        return self.adam.param_groups[0]["lr"]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_dict(self, adam: Callable[[torch.optim.Optimizer], dict[str, Any]] | None = None) -> dict[str, Any]:
        """adam: how to take the AdamW state (default its own state_dict; a sharded run gathers it whole)."""
        return {"adam": (adam or torch.optim.Optimizer.state_dict)(self.adam),
                "muon": None if self.muon is None else self.muon.state_dict(), "names": self.names}

    def load_state_dict(self, state: dict[str, Any],
                        adam: Callable[[torch.optim.Optimizer, dict[str, Any]], None] | None = None) -> None:
        if state.get("names") != self.names:
            raise OpenflashError("optimizer state does not match the model's parameters (different config or "
                                 "optimizer choice than the run being resumed)")
        (adam or torch.optim.Optimizer.load_state_dict)(self.adam, state["adam"])
        if (state["muon"] is None) != (self.muon is None):
            raise OpenflashError("optimizer state was saved with a different --optimizer than the one requested")
        if self.muon is not None:
            self.muon.load_state_dict(state["muon"])


# ---------------------------------------------------------------------------------------------------------------
# MoE aux-loss-free balancing


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_loads(model: nn.Module) -> torch.Tensor:
    """Tokens routed to each expert since the last reset: float [n_moe_layers, n_experts]."""
    return torch.stack([m.expert_load.float() for m in moe_layers(model)])


def reset_expert_loads(model: nn.Module) -> None:
    for m in moe_layers(model):
        m.expert_load.zero_()


@torch.no_grad()
def update_router_bias(model: nn.Module, loads: torch.Tensor, rate: float) -> None:
    """bias += rate * sign(mean load - load), per layer and expert (loads: [n_moe_layers, n_experts])."""
    for m, load in zip(moe_layers(model), loads):
        delta = torch.sign(load.mean() - load).to(m.gate.bias.dtype) * rate
        m.gate.bias.add_(delta.to(m.gate.bias.device))


def load_stats(loads: torch.Tensor) -> dict[str, Any]:
    """Expert-load statistics for the metrics: max/mean load ratio per layer (1.0 = perfectly balanced)."""
    mean = loads.mean(dim=1).clamp(min=1e-9)
    ratio = loads.max(dim=1).values / mean
    return {"load_max_mean": [round(float(r), 3) for r in ratio],
            "load_max_mean_worst": round(float(ratio.max()), 3) if ratio.numel() else 1.0}


__all__ = ["Schedule", "Muon", "newton_schulz", "OptimConfig", "TrainOptimizer", "expert_loads",
           "reset_expert_loads", "update_router_bias", "load_stats", "is_engram_table", "is_indexer_param"]
