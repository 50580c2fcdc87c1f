"""The routed experts' weighted sum of an MoE layer, six ways with one math (spec: §6.2).

    y = shared(x) + sum over k slots of  weight[n, k] * Expert_{ids[n, k]}(x[n])

Every path computes this in fp32 and leaves the final rounding to the MoE; they differ in how the (token, slot)
pairs meet the experts' weights, which decides speed and what shapes depend on the routing:

    grouped    one call per expert that received tokens (inference default; any weight storage)
    batched    pairs padded per selected expert into [U, C, dim], three batched matmuls on stacked fp32 weights
               (decode-sized steps: up to BATCHED_PAIRS pairs)
    gathered   each pair through its expert's weights gathered by id: no shape depends on the routing (the
               compiled decode graph on fp32 experts)
    sorted     pairs sorted by expert, one contiguous slice each, one scatter-add (training: cheap autograd)
    offloaded  grouped, OFFLOAD_CHUNK experts at a time from an ExpertSource, summed over its processes
    native     every pair in one call of the experts kernel on their stored FP4 bytes (the native kernels on the
               CPU, kernels/triton_experts.py on CUDA: kernels.experts_kernel), for experts kept as stored, in
               the model or from an ExpertSource: decode-sized steps of up to NATIVE_PAIRS pairs on the CPU, any
               number on CUDA (tiled past a decode step's); in the compiled decode graph, any number, by expert id
               into every expert's bytes

`choose` picks one from the call's facts; tests/test_routed.py runs every path against `grouped` on the same
inputs. The functions are pure: the MoE hands them its experts (callables) or their stacked weights.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from openflash.model.numerics import Numerics

ROUTED_PATHS = ("grouped", "batched", "gathered", "sorted", "offloaded", "native")
BATCHED_PAIRS = 256  # the most (token, slot) pairs a step runs batched (measured: benchmarks/moe_decode.py)
OFFLOAD_CHUNK = 16  # experts fetched (and alive) at once from an ExpertSource
# The native call computes each pair as a one-row product: past a few pairs an expert with several tokens is read
# once per token, where `grouped` reads it once for all of them.
NATIVE_PAIRS = 16

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [n, dim], weight [n]) -> [n, dim]
# batched_swiglu with the expert's clamp, activation quantization and numerics bound: (x, weight, w1, w3, w2)
StackedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def choose(numerics: Numerics, *, static: bool, offloaded: bool, pairs: int, fp32_experts: bool,
           adapted: bool = False, native: bool = False, any_pairs: bool = False) -> str:
    """The path of one MoE call. static: a whole-step graph; offloaded: the experts come from an ExpertSource;
    pairs: the routed (token, slot) pairs; fp32_experts: the experts' fp32 weights are cached (stacking "stored"
    experts would materialise them all at once); adapted: the experts carry LoRA adapters, which only the paths
    that call each expert apply; native: an experts kernel serves these experts as stored (inference); any_pairs:
    it takes any number of pairs (CUDA's tiles a prefill chunk), not only up to NATIVE_PAIRS."""
    native_here = native and (any_pairs or pairs <= NATIVE_PAIRS)
    if adapted:
        if static or offloaded:
            raise ValueError("LoRA adapters on routed experts need the experts in the model (not offloaded) and "
                             "the eager step (not a whole-step graph)")
        return "sorted" if numerics.fused_train_ops else "grouped"
    if static:  # no shape may depend on the routing
        return "native" if native else "gathered"
    if offloaded:
        return "native" if native_here else "offloaded"
    if numerics.fused_train_ops:
        return "sorted"
    if numerics.batched_experts and pairs <= BATCHED_PAIRS and fp32_experts:
        return "batched"
    if native_here:
        return "native"
    return "grouped"


def grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Mapping[int, ExpertFn],
            shared: torch.Tensor) -> torch.Tensor:
    """shared + the contributions of `experts` (those that received tokens, in their order)."""
    return _add_experts(x, weights, ids, experts, torch.zeros(x.shape, dtype=torch.float32, device=x.device)) + shared


def offloaded(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
              fetch: Callable[[list[int]], Mapping[int, ExpertFn]], combine: Callable[[torch.Tensor], torch.Tensor],
              shared: torch.Tensor) -> torch.Tensor:
    """`grouped` over experts fetched OFFLOAD_CHUNK at a time (a prefill may pick most of a layer's experts:
    fetching them all at once would hold them all); `combine` sums the processes' shares (expert parallelism)."""
    active = counts.nonzero().flatten().tolist()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for start in range(0, len(active), OFFLOAD_CHUNK):
        _add_experts(x, weights, ids, fetch(active[start:start + OFFLOAD_CHUNK]), y)
    return combine(y) + shared


def _add_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Mapping[int, ExpertFn],
                 y: torch.Tensor) -> torch.Tensor:
    """y += each expert's weighted output on its tokens, one call per expert, in `experts`' order (the same
    summation order however the experts are fetched)."""
    for e, expert in experts.items():
        token, slot = (ids == e).nonzero(as_tuple=True)
        # (each token appears once per expert; index_add_ is pathologically slow on CPU for few rows)
        y[token] += expert(x[token], weights[token, slot]).float()
    return y


def batched(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
            stacked: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], swiglu: StackedFn,
            shared: torch.Tensor) -> torch.Tensor:
    """The pairs padded per selected expert into [U, C, dim] through the U experts' stacked fp32 weights
    (`stacked(active ids)` -> w1, w3, w2 [U, out, in]); no Python call per expert beyond stacking."""
    N, k = ids.shape
    n_experts = counts.numel()
    active = counts.nonzero().flatten()
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    slot = torch.full((n_experts,), -1, dtype=torch.long, device=x.device)
    slot[active] = torch.arange(active.numel(), device=x.device)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=x.device) - starts[expert_of]
    row = slot[expert_of]
    pad_x = x.new_zeros(active.numel(), int(counts.max()), x.shape[-1])
    pad_x[row, rank] = x[torch.div(order, k, rounding_mode="floor")].to(pad_x.dtype)
    pad_w = x.new_zeros(pad_x.shape[:2], dtype=torch.float32)
    pad_w[row, rank] = weights.flatten()[order]
    out = swiglu(pad_x, pad_w, *stacked(active.tolist()))
    pairs = torch.empty(N * k, x.shape[-1], dtype=torch.float32, device=x.device)
    pairs[order] = out[row, rank]
    return pairs.view(N, k, -1).sum(1) + shared


def gathered(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             every: tuple[torch.Tensor, torch.Tensor, torch.Tensor], swiglu: StackedFn,
             shared: torch.Tensor) -> torch.Tensor:
    """Each pair as its own one-row "expert" [N * k, 1, dim] through its expert's weights gathered by id from
    `every` expert's stacked w1, w3, w2 [E, out, in]; the pairs summed in slot order, as `batched` does."""
    N, k = ids.shape
    w1, w3, w2 = every
    pair = ids.flatten()
    out = swiglu(x.repeat_interleave(k, dim=0).unsqueeze(1), weights.reshape(-1, 1), w1[pair], w3[pair], w2[pair])
    return out.view(N, k, -1).sum(1) + shared


def native(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
           run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int] | None], torch.Tensor],
           combine: Callable[[torch.Tensor], torch.Tensor], shared: torch.Tensor, static: bool = False) -> torch.Tensor:
    """Every pair in one call: `run(x, pair token, pair's index into the active experts, pair weight, active expert
    ids)` -> [N, dim], the pairs sorted by expert (ascending), so each token sums its experts in `grouped`'s order;
    `combine` sums the processes' shares (experts from an ExpertSource, as `offloaded`). static (a whole-step
    graph): no host read of the routing; the pairs in slot order (as `gathered` sums them), each by its expert id
    into every expert (active None)."""
    k = ids.shape[1]
    flat = ids.flatten()
    if static:
        token = torch.arange(ids.shape[0], device=x.device).repeat_interleave(k)
        return combine(run(x, token, flat, weights.flatten().float(), None)) + shared
    order = torch.argsort(flat, stable=True)
    active, index = torch.unique(flat, return_inverse=True)
    return combine(run(x, torch.div(order, k, rounding_mode="floor"), index[order], weights.flatten()[order].float(),
                       active.tolist())) + shared


def sorted_pairs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                 experts: Sequence[ExpertFn], shared: torch.Tensor, every: bool = False) -> torch.Tensor:
    """One gather of the pairs sorted by expert, one contiguous slice per expert (experts[e] for every e), one
    scatter-add onto the shared expert's output: autograd then also does one scatter and one gather, instead of
    one full-size zero-filled gradient per expert. every: call the experts that got no pair too (on an empty
    slice), so each of their parameters gets a (zero) gradient."""
    k = ids.shape[1]
    order = torch.argsort(ids.flatten(), stable=True)
    token = torch.div(order, k, rounding_mode="floor")
    x_sorted, w_sorted = x.index_select(0, token), weights.flatten()[order]
    sizes = counts.tolist()
    outs = [experts[e](xe, we) for e, (xe, we) in enumerate(zip(x_sorted.split(sizes), w_sorted.split(sizes)))
            if sizes[e] or every]
    return shared.index_add(0, token, torch.cat(outs).float())


__all__ = ["ROUTED_PATHS", "BATCHED_PAIRS", "OFFLOAD_CHUNK", "NATIVE_PAIRS", "choose", "grouped", "offloaded",
           "batched", "gathered", "sorted_pairs", "native"]
