"""Mixture of experts: sqrt-softplus router with selection-only bias, SwiGLU experts with clamp (spec: §6).

Every layer's FFN is an MoE: `num_experts_per_tok` routed experts (FP4 in the release) plus a shared expert.
The router's bias only *selects* experts; the weights are the unbiased scores, normalised over the selection and
scaled by `routed_scaling_factor`. The bias is not learned by gradient: training adjusts it from the expert load
(aux-loss-free balancing), which `expert_load` accumulates.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from openflash import formats
from openflash.config import FlashConfig
from openflash.model.compiled import compiled, graph_linear, matmul_unshared
from openflash.model.context import StepContext
from openflash.model.layers import Linear, NumericsMixin
from openflash.model.numerics import Numerics

OFFLOAD_CHUNK = 16  # experts fetched (and alive) at once from an ExpertSource


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
        scores = torch.sqrt(F.softplus(graph_linear(v.float(), self.weight.float()) / self.temp))
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

    @classmethod
    def detached(cls, cfg: FlashConfig, storage: str, state: dict[str, torch.Tensor],
                 numerics: Numerics) -> "Expert":
        """A routed expert outside any model (memory/experts.py's store): built on `state`'s tensors as they are
        (stored bytes, on their device), under `numerics`, its linears never caching an fp32 copy."""
        with torch.device("meta"):
            expert = cls(cfg.hidden_size, cfg.moe_intermediate_size, storage, cfg.swiglu_limit)
        expert.load_state_dict(state, assign=True)
        expert.numerics = numerics
        for linear in (expert.w1, expert.w2, expert.w3):
            linear.numerics, linear.keep_dequantized = numerics, False
        return expert

    def forward(self, v: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return moe_kernels(self.numerics).expert(self, v, weight)

    def swiglu(self, v: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """w2(silu(clamp(w1 v)) * clamp(w3 v) * weight), the activation rounded at the policy's points."""
        gate = self.w1(v).float().clamp(max=self.limit)
        up = self.w3(v).float().clamp(-self.limit, self.limit)
        act = F.silu(gate) * up
        if weight is not None:
            act = weight.unsqueeze(-1) * act
        return self.w2(self.numerics.round(act))


class _SwiGLU(torch.autograd.Function):
    """weight * silu(min(gate, L)) * clamp(up, -L, L) with a direct backward (training; §6.2). Clamped entries
    pass no gradient, as torch.clamp's backward does. The forward keeps what the backward needs, so the backward
    is a handful of elementwise passes."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None, limit: float):
        gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
        s = torch.sigmoid(gc)
        silu = gc * s
        d_silu = (1.0 - s).mul_(gc).add_(1.0).mul_(s).masked_fill_(gate > limit, 0.0)  # d silu(min(g, L)) / dg
        act = silu * uc
        ctx.save_for_backward(silu, uc, d_silu, up.abs() > limit, act, weight)
        return act * weight.unsqueeze(-1) if weight is not None else act

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        silu, uc, d_silu, up_clamped, act, weight = ctx.saved_tensors
        d_weight = None
        if weight is not None:
            d_weight = torch.linalg.vecdot(g, act)
            g = g * weight.unsqueeze(-1)
        d_up = (g * silu).masked_fill_(up_clamped, 0.0)
        d_gate = g.mul(uc).mul_(d_silu)
        return d_gate, d_up, d_weight, None


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
        self._stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._stacked_key: tuple | None = None
        self._expert_linears = [lin for e in self.experts for lin in (e.w1, e.w3, e.w2)]  # the stack's sources

    def forward(self, v: torch.Tensor, ctx: StepContext, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        if ctx.lengths is not None:  # right-padded rows (a packed prefill): the padding is routed to no expert
            real = ctx.valid
            y = v.new_zeros(v.shape)
            y[real] = self._tokens(v[real], ctx, None if image_mask is None else image_mask[real])
            return y
        return self._tokens(v, ctx, image_mask)

    def _tokens(self, v: torch.Tensor, ctx: StepContext, image_mask: torch.Tensor | None) -> torch.Tensor:
        """The MoE of tokens v [..., dim] (image_mask [...]: image-span positions, routed with bias_vl)."""
        shape = v.shape
        x = v.reshape(-1, shape[-1])
        weights, ids = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        ctx.put(f"block{self.layer}.gate_indices", ids)
        ctx.put(f"block{self.layer}.gate_weights", weights)
        if ctx.static:
            return self._routed_gathered(x, weights, ids).view(shape)
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts)
        if self.training:
            self.expert_load += counts.to(self.expert_load.dtype)
        if self.offloaded:
            return self._routed_offloaded(x, weights, ids, counts, ctx).view(shape)
        experts = {e: self.experts[e] for e in counts.nonzero().flatten().tolist()}
        return moe_kernels(self.numerics).experts(self, x, weights, ids, counts, experts).view(shape)

    def likely_experts(self, v: torch.Tensor, limit: int) -> list[int]:
        """Up to `limit` experts this layer's router would pick for inputs v [..., D] (already normed), the most
        picked first: a prefetch hint computed from an earlier layer's input (pre-gating), never used to route."""
        _, ids = self.gate(v.reshape(-1, v.shape[-1]), None)
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts)
        order = torch.argsort(counts, descending=True, stable=True)[:limit]
        return [e for e in order.tolist() if counts[e] > 0]

    @property
    def offloaded(self) -> bool:
        """Loaded without its routed experts (they come from an ExpertSource)."""
        return self.experts[0].w1.weight.is_meta

    def _routed_offloaded(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                          ctx: StepContext) -> torch.Tensor:
        """Experts from the step's ExpertSource, OFFLOAD_CHUNK at a time (a prefill may pick most of a layer's
        experts: fetching them all at once would hold them all), each grouped as in `_routed_grouped`."""
        if ctx.experts is None:
            raise ValueError(f"layer {self.layer}: this model was loaded without its routed experts; pass "
                             f"experts=<an ExpertSource> (openflash.memory.experts.ExpertStore) to the step")
        active = counts.nonzero().flatten().tolist()
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for start in range(0, len(active), OFFLOAD_CHUNK):
            self._routed_sum(x, weights, ids, ctx.experts.experts(self.layer, active[start:start + OFFLOAD_CHUNK]), y)
        return self.numerics.round(ctx.experts.combine(y) + self.shared_experts(x).float())

    def _routed_sum(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: Mapping[int, "Expert"], y: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' contributions (fp32) added into y (zeros if None), one call per expert in `experts`
        that received tokens, in their order (the same summation order however the experts are fetched)."""
        if y is None:
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in experts.items():
            token, slot = (ids == e).nonzero(as_tuple=True)
            # (each token appears once per expert; index_add_ is pathologically slow on CPU for few rows)
            y[token] += expert(x[token], weights[token, slot]).float()
        return y

    def _routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        counts: torch.Tensor, experts: Mapping[int, "Expert"]) -> torch.Tensor:
        """Grouped by expert: one call per expert that received tokens, no per-token loop; plus the shared one."""
        y = self._routed_sum(x, weights, ids, experts) + self.shared_experts(x).float()
        return self.numerics.round(y)

    def _routed_batched(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        counts: torch.Tensor, experts: Mapping[int, "Expert"],
                        swiglu: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Inference, same math as `_routed_grouped`: the (token, slot) pairs padded per selected expert into
        [U, C, dim] and run through the U experts' stacked weights in three batched matmuls, with the quantization
        and rounding points of `Expert.swiglu`; no Python call per expert beyond stacking its cached weights."""
        n = self.numerics
        N, k = ids.shape
        active = counts.nonzero().flatten()
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        expert_of = flat[order]
        slot = torch.full((self.n_experts,), -1, dtype=torch.long, device=x.device)
        slot[active] = torch.arange(active.numel(), device=x.device)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(order.numel(), device=x.device) - starts[expert_of]
        row = slot[expert_of]
        pad_x = x.new_zeros(active.numel(), int(counts.max()), x.shape[-1])
        pad_x[row, rank] = x[torch.div(order, k, rounding_mode="floor")].to(pad_x.dtype)
        pad_w = x.new_zeros(pad_x.shape[:2], dtype=torch.float32)
        pad_w[row, rank] = weights.flatten()[order]
        chosen = [experts[e] for e in active.tolist()]
        w1, w3, w2 = (torch.stack([getattr(e, name).dequantized_weight() for e in chosen])
                      for name in ("w1", "w3", "w2"))
        first = chosen[0]
        out = swiglu(pad_x, pad_w, w1, w3, w2, first.limit, first.w1.quantized and n.act_quant, n)
        pairs = torch.empty(N * k, x.shape[-1], dtype=torch.float32, device=x.device)
        pairs[order] = out[row, rank]
        y = pairs.view(N, k, -1).sum(1) + self.shared_experts(x).float()
        return self.numerics.round(y)

    def stacked_experts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every routed expert's fp32 w1, w3, w2 stacked [E, out, in] (a copy beside the experts' own, kept while
        their weights are unchanged): what `_routed_gathered` indexes by expert id."""
        if self._stacked is not None and torch.compiler.is_compiling():
            return self._stacked  # a whole-step graph: its runner refreshed the stack before the call
        key = tuple((t.data_ptr(), t._version) for lin in self._expert_linears
                    for tensors in (lin._parameters, lin._buffers) for t in tensors.values())
        if self._stacked is None or self._stacked_key != key:
            self._stacked = tuple(torch.stack([getattr(e, name).dequantized_weight() for e in self.experts])
                                  for name in ("w1", "w3", "w2"))
            self._stacked_key = key
        return self._stacked

    def _routed_gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Inference in a whole-step graph, same math as `_routed_batched`: each routed (token, slot) pair runs
        through its expert's weights gathered by id, so no shape depends on the routing (quantization and rounding
        points of `Expert.swiglu`; the pairs summed in slot order, as there)."""
        n = self.numerics
        N, k = ids.shape
        w1, w3, w2 = self.stacked_experts()
        pair = ids.flatten()
        first = self.experts[0]
        # Each pair is its own one-row "expert" of batched_swiglu: [N * k, 1, dim] through its gathered weights.
        out = batched_swiglu(x.repeat_interleave(k, dim=0).unsqueeze(1), weights.reshape(-1, 1), w1[pair],
                             w3[pair], w2[pair], first.limit, first.w1.quantized and n.act_quant, n)
        return n.round(out.view(N, k, -1).sum(1) + self.shared_experts(x).float())

    def _routed_sorted(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       counts: torch.Tensor) -> torch.Tensor:
        """Training path (same math): one gather of the routed (token, slot) pairs sorted by expert, one
        contiguous slice per expert, one scatter-add of the results onto the shared expert's output. Autograd
        then also does one scatter and one gather, instead of one full-size zero-filled gradient per expert."""
        k = ids.shape[1]
        order = torch.argsort(ids.flatten(), stable=True)
        token = torch.div(order, k, rounding_mode="floor")
        x_sorted, w_sorted = x.index_select(0, token), weights.flatten()[order]
        sizes = counts.tolist()
        outs = [self.experts[e](xe, we) for e, (xe, we) in enumerate(zip(x_sorted.split(sizes), w_sorted.split(sizes)))
                if sizes[e]]
        y = self.shared_experts(x).float().index_add(0, token, torch.cat(outs).float())
        return self.numerics.round(y)


def batched_swiglu(x: torch.Tensor, weight: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   limit: float, act_quant: bool, n: Numerics) -> torch.Tensor:
    """`Expert.swiglu` over U experts at once: x [U, C, dim] (C padded rows each), routing weights [U, C], stacked
    weights [U, out, in]; the same quantization and rounding points."""
    # matmul_unshared: with one row per expert (the decode graph's gathered pairs) each weight meets one row.
    xin = formats.act_quant_qdq(x) if act_quant else x
    gate = n.round(matmul_unshared(xin.to(w1.dtype), w1)).float().clamp(max=limit)
    up = n.round(matmul_unshared(xin.to(w3.dtype), w3)).float().clamp(-limit, limit)
    act = n.round(weight.unsqueeze(-1) * (F.silu(gate) * up))
    act = formats.act_quant_qdq(act) if act_quant else act
    return n.round(matmul_unshared(act.to(w2.dtype), w2)).float()


# ---- the kernels of each numerics policy (chosen once: moe_kernels) ---------------------------------------------

class MoeKernels:
    """Inference (fp32, plain, reference): experts grouped by expert, SwiGLU as written."""

    def expert(self, expert: Expert, v: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return expert.swiglu(v, weight)

    def experts(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor, experts: Mapping[int, Expert]) -> torch.Tensor:
        return moe._routed_grouped(x, weights, ids, counts, experts)


class BatchedMoeKernels(MoeKernels):
    """fp32 / plain inference: decode-sized steps (up to BATCHED_PAIRS routed pairs) through `_routed_batched`
    when the experts' fp32 weights are cached; larger ones (prefill), whose per-expert GEMMs amortize their calls,
    and "stored" weights, grouped by expert."""

    BATCHED_PAIRS = 256

    def experts(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor, experts: Mapping[int, Expert]) -> torch.Tensor:
        # Only with fp32 weights at hand: stacking "stored" experts would materialise them all at once.
        if ids.numel() <= self.BATCHED_PAIRS and moe.experts[0].w1.fp32_resident:
            return moe._routed_batched(x, weights, ids, counts, experts, self.batched_swiglu)
        return moe._routed_grouped(x, weights, ids, counts, experts)

    def batched_swiglu(self, *args) -> torch.Tensor:
        return batched_swiglu(*args)


class CompiledMoeKernels(BatchedMoeKernels):
    """The batched SwiGLU (QDQ, clamps, SiLU, routing weight) fused by torch.compile (model/compiled.py); the
    dispatch around it has data-dependent shapes and stays eager."""

    def batched_swiglu(self, *args) -> torch.Tensor:
        return compiled(batched_swiglu)(*args)


class TrainMoeKernels(MoeKernels):
    """Training, same math: one matmul for both input projections of a float expert (twice as wide: better use
    of the GEMM on few tokens) with a fused SwiGLU backward; routed pairs sorted by expert."""

    def expert(self, expert: Expert, v: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if expert.w1.quantized:
            return expert.swiglu(v, weight)
        gate, up = F.linear(v, torch.cat((expert.w1.weight, expert.w3.weight))).chunk(2, dim=-1)
        return expert.w2(_SwiGLU.apply(gate, up, weight, expert.limit))

    def experts(self, moe: "MoE", x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor, experts: Mapping[int, Expert]) -> torch.Tensor:
        return moe._routed_sorted(x, weights, ids, counts)  # training: every expert is the model's own


@lru_cache(maxsize=None)
def moe_kernels(numerics: Numerics) -> MoeKernels:
    if numerics.fused_train_ops:
        return TrainMoeKernels()
    if not numerics.batched_experts:
        return MoeKernels()
    return CompiledMoeKernels() if numerics.compiled else BatchedMoeKernels()
