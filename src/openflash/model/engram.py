"""Engram gate: adds looked-up n-gram memory to the residual streams (spec: engram.md §6, §7).

The rows come from an Engram table (openflash.memory: device, host, disk or sharded tier), addressed by hash ids
that depend on token ids alone, and reach the model as `EngramRows` handed to its forward. This module only
consumes them: rows [B, S, C, dim] are projected by `wkv` into a
key per stream and one shared value; each stream gets its own scalar gate from a normalised key . residual dot
product passed through a signed square root and a sigmoid.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from openflash.config import FlashConfig
from openflash.model.engram_table import DeviceTable
from openflash.model.layers import Linear, NumericsMixin


class EngramRows(Protocol):
    """The Engram rows of one forward call, prepared by the caller before the call (memory/ implements it: it
    hashes the tokens and fetches the rows from whichever tier holds them, the model's own tables included)."""

    def get(self, slot: int) -> torch.Tensor:
        """Dequantized rows [B, S, C, dim] of Engram layer `slot` (its index in engram_layer_ids)."""


class Engram(nn.Module, NumericsMixin):
    def __init__(self, cfg: FlashConfig, num_rows: int) -> None:
        super().__init__()
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
        dense = "fp8" if cfg.weight_dtype == "fp8" else "float"
        # The table is part of the model's state (device tier); other tiers supply rows from outside.
        self.embed = DeviceTable(num_rows, cfg.engram_head_dim, storage="fp8" if dense == "fp8" else "fp32")
        self.wkv = Linear(cfg.n_hash_columns * cfg.engram_head_dim, (self.hc + 1) * self.dim, dense)
        self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim))
        self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim))

    def forward(self, residual: torch.Tensor, rows: torch.Tensor,
                token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """residual [B,S,hc,D], rows [B,S,C,dim] (dequantized) -> residual with memory added."""
        B, S = residual.shape[:2]
        kv = self.wkv(self.numerics.round(rows.flatten(-2)))  # column-major: element c*dim + d
        key = kv[..., : self.hc * self.dim].view(B, S, self.hc, self.dim).float()
        value = kv[..., self.hc * self.dim:].float()
        h = residual.float()
        wgt = self.q_weight.float() * self.k_weight.float()  # only ever used as this elementwise product
        # Each stream normalised separately over D (not jointly over streams).
        rstd = torch.rsqrt(h.pow(2).mean(-1) + self.eps) * torch.rsqrt(key.pow(2).mean(-1) + self.eps)
        dot = (h * wgt * key).sum(-1) * rstd * self.dim ** -0.5
        # Signed square root (copysign: +0 and -0 keep their sign), then a sigmoid.
        gate = torch.sigmoid(torch.copysign(torch.sqrt(dot.abs().clamp(min=1e-6)), dot))
        if token_mask is not None:
            gate = gate * token_mask.unsqueeze(-1).to(gate.dtype)  # image-span tokens get no memory
        return self.numerics.round(h + gate.unsqueeze(-1) * value.unsqueeze(2))
