"""Mixture of experts: sqrt-softplus router with selection-only bias, SwiGLU experts with clamp (spec: §6).

Every layer's FFN is an MoE: `num_experts_per_tok` routed experts (FP4 in the release) plus a shared expert.
The router's bias only *selects* experts; the weights are the unbiased scores, normalised over the selection and
scaled by `routed_scaling_factor`. The bias is not learned by gradient: training adjusts it from the expert load
(aux-loss-free balancing), which `expert_load` accumulates.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import lru_cache, partial
from typing import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from openflash import formats, kernels
from openflash.config import FlashConfig
from openflash.kernels.triton_experts import ExpertTables
from openflash.model import routed
from openflash.model.compiled import compiled, graph_linear, matmul_unshared
from openflash.model.context import StepContext
from openflash.model.layers import Linear, NumericsMixin
from openflash.model.lora import AdapterSelection
from openflash.model.numerics import Numerics

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
        self._tables: ExpertTables | None = None  # the experts' addresses for the Triton experts call
        self._tables_key: tuple | None = None
        self._expert_linears = [lin for e in self.experts for lin in (e.w1, e.w3, e.w2)]  # the stack's sources
        # Served adapters (model/adapters.py attach_adapters): which adapter each token uses; None without banks.
        self.adapters: AdapterSelection | None = None
        self.adapted = False  # its routed experts carry LoRA adapters (model/adapters.py sets it)
        self._count_load = True  # training counts each step's routed tokens (off while a checkpoint reruns it)
        self.every_expert = False  # training sharded over ranks (train/sharded.py): call experts without tokens too

    def forward(self, v: torch.Tensor, ctx: StepContext, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        if ctx.lengths is not None:  # right-padded rows (a packed prefill): the padding is routed to no expert
            real = ctx.valid
            y = v.new_zeros(v.shape)
            with nullcontext() if self.adapters is None else self.adapters.narrowed(real):
                y[real] = self._tokens(v[real], ctx, None if image_mask is None else image_mask[real])
            return y
        return self._tokens(v, ctx, image_mask)

    def _tokens(self, v: torch.Tensor, ctx: StepContext, image_mask: torch.Tensor | None) -> torch.Tensor:
        """The MoE of tokens v [..., dim] (image_mask [...]: image-span positions, routed with bias_vl)."""
        shape = v.shape
        x = v.reshape(-1, shape[-1])
        groups = None if self.adapters is None else self.adapters.groups(x.shape[0])
        if groups is not None:  # tokens of several adapters: each adapter's tokens through the experts apart
            y = torch.empty_like(x)
            mask = None if image_mask is None else image_mask.reshape(-1)
            for slot, rows in groups:
                with self.adapters.use(slot):
                    y[rows] = self._tokens(x[rows], ctx, None if mask is None else mask[rows])
            return y.view(shape)
        weights, ids = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        ctx.put(f"block{self.layer}.gate_indices", ids)
        ctx.put(f"block{self.layer}.gate_weights", weights)
        offloaded = self.offloaded
        first = self.experts[0].w1
        # The native call: FP4 experts as stored (an ExpertSource's always are), inference, fp32 arithmetic.
        kernel = kernels.experts_kernel(x.device, first.stored_format)
        native = (offloaded or not first.fp32_resident) and not torch.is_grad_enabled() \
            and not self.numerics.bf16_boundaries and kernel is not None
        path = routed.choose(self.numerics, static=ctx.static, offloaded=offloaded, pairs=ids.numel(),
                             fp32_experts=not offloaded and first.fp32_resident,
                             adapted=self.adapted, native=native, any_pairs=kernel == "triton")
        shared = self.shared_experts(x).float()
        if path == "gathered":  # no host read of the routing: counts are not computed
            y = routed.gathered(x, weights, ids, self.stacked_experts(), self._stacked_swiglu(False), shared)
            return self.numerics.round(y).view(shape)
        # Every expert passed by id, no host read of the routing either: in the decode graph, and on CUDA always
        # (the Triton call sorts the pairs itself where it tiles them; a step's eager run sums as its graph does).
        if path == "native" and (ctx.static or (kernel == "triton" and not offloaded)):
            y = routed.native(x, weights, ids, partial(self._native_experts, None), lambda routed_sum: routed_sum,
                              shared, static=True)
            return self.numerics.round(y).view(shape)
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts)
        if self.training and self._count_load:
            self.expert_load += counts.to(self.expert_load.dtype)
        if path == "offloaded":
            y = routed.offloaded(x, weights, ids, counts, self._fetch(ctx), ctx.experts.combine, shared)
        elif path == "native":
            fetch = self._fetch(ctx) if offloaded else (lambda chosen: {e: self.experts[e] for e in chosen})
            y = routed.native(x, weights, ids, partial(self._native_experts, fetch),
                              ctx.experts.combine if offloaded else (lambda routed_sum: routed_sum), shared)
        elif path == "sorted":
            y = routed.sorted_pairs(x, weights, ids, counts, self.experts, shared, every=self.every_expert)
        elif path == "batched":
            y = routed.batched(x, weights, ids, counts, self._stack, self._stacked_swiglu(self.numerics.compiled),
                               shared)
        else:
            y = routed.grouped(x, weights, ids, {e: self.experts[e] for e in counts.nonzero().flatten().tolist()},
                               shared)
        return self.numerics.round(y).view(shape)

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Route without adding to `expert_load` (activation checkpointing's rerun of a counted forward)."""
        self._count_load = False
        try:
            yield
        finally:
            self._count_load = True

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

    def _fetch(self, ctx: StepContext) -> Callable[[list[int]], Mapping[int, "Expert"]]:
        if ctx.experts is None:
            raise ValueError(f"layer {self.layer}: this model was loaded without its routed experts; pass "
                             f"experts=<an ExpertSource> (openflash.memory.experts.ExpertStore) to the step")
        return lambda ids: ctx.experts.experts(self.layer, ids)

    def _native_experts(self, fetch: Callable[[list[int]], Mapping[int, "Expert"]] | None, x: torch.Tensor,
                        token: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                        active: list[int] | None) -> torch.Tensor:
        """`routed.native`'s call: the active experts' stored FP4 bytes handed to the experts kernel. `fetch` gives
        the experts (this process's share of them, under expert parallelism: the pairs of the others are left out);
        active None: every expert of the model, index being the expert id (a whole-step graph)."""
        if active is None:
            return self._native_call(x, list(self.experts), token, index, weight)
        experts = fetch(active)
        held = [i for i, e in enumerate(active) if e in experts]
        if len(held) < len(active):
            keep = torch.isin(index, torch.tensor(held, dtype=index.dtype))
            if not bool(keep.any()):
                return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            renumber = torch.full((len(active),), -1, dtype=index.dtype)
            renumber[held] = torch.arange(len(held), dtype=index.dtype)
            token, index, weight = token[keep], renumber[index[keep]], weight[keep]
        return self._native_call(x, [experts[active[i]] for i in held], token, index, weight)

    def _native_call(self, x: torch.Tensor, experts: list["Expert"], token: torch.Tensor, index: torch.Tensor,
                     weight: torch.Tensor) -> torch.Tensor:
        """The experts kernel's call on these experts' stored bytes (the tensors as they are, of one-byte elements:
        no view per expert, which a whole-step graph would trace): kernels/native.py `fp4_experts` on the CPU, on
        CUDA kernels/triton_experts.py through a table of their addresses (the layer's own for all its experts)."""
        if kernels.experts_kernel(x.device, "fp4") == "triton":
            tables = self.expert_tables() if len(experts) == self.n_experts and not self.offloaded else \
                ExpertTables.of(*_stored_parts(experts), x.shape[-1])
            return kernels.triton_experts.experts(x.float(), tables, token, index, weight, self.experts[0].limit,
                                                  self.numerics.act_quant)
        return kernels.native.fp4_experts(x.float(), *_stored_parts(experts), token, index, weight,
                                          self.experts[0].limit, self.numerics.act_quant)

    def _stack(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fp32 w1, w3, w2 of experts `ids`, stacked [U, out, in]."""
        return tuple(torch.stack([getattr(self.experts[e], name).dequantized_weight() for e in ids])
                     for name in ("w1", "w3", "w2"))

    def _stacked_swiglu(self, fused: bool) -> Callable[..., torch.Tensor]:
        """`batched_swiglu` with this layer's clamp, activation quantization and numerics; fused: through
        torch.compile (the compiled backend's eager dispatch; inside a whole-step graph it is traced anyway)."""
        first, n = self.experts[0], self.numerics
        kernel = compiled(batched_swiglu) if fused else batched_swiglu
        return lambda x, w, w1, w3, w2: kernel(x, w, w1, w3, w2, first.limit, first.w1.quantized and n.act_quant, n)

    def expert_tables(self) -> ExpertTables:
        """The addresses of every routed expert's stored bytes, for the Triton experts call: kept, and rebuilt when
        the first or last expert's tensors moved (the experts move together: `.to()`, a load)."""
        if self._tables is not None and torch.compiler.is_compiling():
            return self._tables  # a whole-step graph: its runner refreshed the table before the call
        first, last = self.experts[0], self.experts[-1]
        key = tuple((t.device, t.data_ptr()) for t in (first.w1.weight, first.w1.scale, last.w2.weight, last.w2.scale))
        if self._tables is None or self._tables_key != key:
            self._tables = ExpertTables.of(*_stored_parts(list(self.experts)), first.w1.in_features)
            self._tables_key = key
        return self._tables

    def stacked_experts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every routed expert's fp32 w1, w3, w2 stacked [E, out, in] (a copy beside the experts' own, kept while
        their weights are unchanged): what the `gathered` path indexes by expert id."""
        if self._stacked is not None and torch.compiler.is_compiling():
            return self._stacked  # a whole-step graph: its runner refreshed the stack before the call
        key = tuple((t.data_ptr(), t._version) for lin in self._expert_linears
                    for tensors in (lin._parameters, lin._buffers) for t in tensors.values())
        if self._stacked is None or self._stacked_key != key:
            self._stacked = self._stack(list(range(self.n_experts)))
            self._stacked_key = key
        return self._stacked


def _stored_parts(experts: list[Expert]) -> list[list[torch.Tensor]]:
    """The experts' stored w1, s1, w3, s3, w2, s2 (bytes and scales, the tensors as they are) as six lists: what the
    experts kernels take (triton_experts.PARTS order)."""
    return [[getattr(getattr(e, lin), part) for e in experts]
            for lin in ("w1", "w3", "w2") for part in ("weight", "scale")]


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


# ---- the expert kernel of each numerics policy (chosen once: moe_kernels) ---------------------------------------

class MoeKernels:
    """Inference: SwiGLU as written."""

    def expert(self, expert: Expert, v: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return expert.swiglu(v, weight)


class TrainMoeKernels(MoeKernels):
    """Training, same math: one matmul for both input projections of a float expert (twice as wide: better use
    of the GEMM on few tokens) with a fused SwiGLU backward."""

    def expert(self, expert: Expert, v: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if expert.w1.quantized or expert.w1.adapter is not None:
            return expert.swiglu(v, weight)
        gate, up = F.linear(v, torch.cat((expert.w1.weight, expert.w3.weight))).chunk(2, dim=-1)
        return expert.w2(_SwiGLU.apply(gate, up, weight, expert.limit))


@lru_cache(maxsize=None)
def moe_kernels(numerics: Numerics) -> MoeKernels:
    return TrainMoeKernels() if numerics.fused_train_ops else MoeKernels()
