"""Mixture of experts: sqrt-softplus router with selection-only bias, SwiGLU experts with clamp (spec: §6).

Every layer's FFN is an MoE: `num_experts_per_tok` routed experts (FP4 in the release) plus a shared expert.
The router's bias only *selects* experts; the weights are the unbiased scores, normalised over the selection and
scaled by `routed_scaling_factor`. The bias is not learned by gradient: training adjusts it from the expert load
(aux-loss-free balancing), which `expert_load` accumulates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openflash.config import FlashConfig
from openflash.model.context import StepContext
from openflash.model.layers import Linear, NumericsMixin


class Gate(nn.Module):
    def __init__(self, cfg: FlashConfig) -> None:
        super().__init__()
        self.top_k, self.temp = cfg.num_experts_per_tok, cfg.gate_temp
        self.normalize = cfg.norm_topk_prob and cfg.num_experts_per_tok > 1
        self.route_scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        nn.init.normal_(self.weight, std=cfg.hidden_size ** -0.5)
        self.register_buffer("bias", torch.zeros(cfg.n_routed_experts))
        if cfg.has_vision:  # image-span tokens select with their own bias (absent without a vision tower)
            self.register_buffer("bias_vl", torch.zeros(cfg.n_routed_experts))
        else:
            self.bias_vl = None

    def forward(self, v: torch.Tensor, image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] fp32, expert ids [N, k]) for tokens v [N, D]."""
        scores = torch.sqrt(F.softplus(F.linear(v.float(), self.weight.float()) / self.temp))
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl, self.bias)
        ids = torch.topk(scores.detach() + bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)  # a literal 1e-20, not norm_eps
        return weights * self.route_scale, ids


class Expert(nn.Module, NumericsMixin):
    """SwiGLU: w2( silu(min(w1 x, L)) * clamp(w3 x, -L, L) ), the routing weight applied before w2 (§6.2)."""

    def __init__(self, dim: int, inter: int, storage: str, limit: float) -> None:
        super().__init__()
        self.w1 = Linear(dim, inter, storage)
        self.w2 = Linear(inter, dim, storage)
        self.w3 = Linear(dim, inter, storage)
        self.limit = limit

    def forward(self, v: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.w1(v).float().clamp(max=self.limit)
        up = self.w3(v).float().clamp(-self.limit, self.limit)
        act = F.silu(gate) * up
        if weight is not None:
            act = weight.unsqueeze(-1) * act
        return self.w2(self.numerics.round(act))


class MoE(nn.Module, NumericsMixin):
    def __init__(self, cfg: FlashConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_experts = cfg.n_routed_experts
        self.gate = Gate(cfg)
        expert_storage = {"fp4": "fp4", "fp8": "fp8"}.get(cfg.expert_dtype, "float")
        dense = "fp8" if cfg.weight_dtype == "fp8" else "float"
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, expert_storage, cfg.swiglu_limit)
            for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dense,
                                     cfg.swiglu_limit)
        self.register_buffer("expert_load", torch.zeros(cfg.n_routed_experts), persistent=False)

    def forward(self, v: torch.Tensor, ctx: StepContext, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = v.shape
        x = v.reshape(-1, shape[-1])
        weights, ids = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        ctx.put(f"block{self.layer}.gate_indices", ids)
        ctx.put(f"block{self.layer}.gate_weights", weights)
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts)
        if self.training:
            self.expert_load += counts.to(self.expert_load.dtype)
        # Grouped by expert: one call per expert that received tokens, no per-token loop.
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in counts.nonzero().flatten().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            # (each token appears once per expert; index_add_ is pathologically slow on CPU for few rows)
            y[token] += self.experts[e](x[token], weights[token, slot]).float()
        y = y + self.shared_experts(x).float()
        return self.numerics.round(y).view(shape)
