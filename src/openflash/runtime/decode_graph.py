"""A decode step as one compiled graph: the compiled backend's fast path for single-token steps.

The per-kernel compiled backend (model/compiled.py) fuses each elementwise chain but leaves a decode step as ~100
separate compiled calls with eager code between them, each paying dynamo's guard check and its wrapper: on a CPU
that overhead, not the arithmetic, is the step. Here the whole step (embedding, every layer, the head) is traced
once by torch.compile into one graph, so a step costs one guard check and one generated program.

What makes that possible is that no shape depends on a tensor's values (`StepContext.static`):
- the compressed stores are read whole at a fixed capacity, entries past each row's length masked by their readers
  (the indexer's visibility mask; top-k over the fixed width picks the same entries, the rest become -1);
- cache writes are masked writes (window ring slot = position % window; compressed groups where complete);
- routed experts run per (token, slot) pair on weights gathered by expert id (model/routed.py `gathered`), from an fp32
  stack of the experts kept beside their own fp32 copies (the routed experts' fp32 bytes twice: for models that
  fit); experts kept as stored go to the experts kernel in one call a layer (native on the CPU, Triton on CUDA), by
  expert id into every expert's bytes (routed.py `native`, static); offloaded experts decode on the per-kernel path.
GEMMs whose weight meets one row (every linear at batch 1, each gathered pair) are multiply-and-sum reductions on
the CPU (`matmul_unshared`): inductor streams the weight in one generated loop, the gather fused into its loads.
Weights in "stored" residency are read by the kernels `kernels.product_kernel` names, custom ops in the graph: the
native ones on the CPU, Triton's on CUDA.
The same eager functions are traced, so numerics are the compiled backend's: logits equal the eager path's to fp32
rounding (tests/test_decode_graph.py).

Shapes: what grows over a run (each compressed store's capacity, the engine's block pool: `growing_dims`) is marked
dynamic before every step, so the graph is compiled with those sizes symbolic and growth does not recompile it. The
batch size is left to dynamo (`dynamic=None`): the first graph is specialised to its batch, the first step at another
batch recompiles with the batch symbolic; a `generate` compiles one graph, a server two (its first batch size, then the
batch symbolic; `graphs` and `compile_seconds` count them), and each once more where a store's capacity first exceeds
what a top-k keeps (index_topk entries, the candidate pool's blocks): the picks' width is min(k, capacity). Before each
step the caches are reserved on the host (the only host read is the largest position): the compressed capacity in
power-of-two buckets of tokens from CAPACITY_TOKENS (the entries a step reads), and in the engine's paged stores the
block each row's open group writes into, allocated and unshared (copy-on-write) there, not in the step. Compiled code
is cached on disk by inductor.

On a CUDA device the compiled step is recorded as a CUDA graph per cache layout and replayed (cuda_graph.py): the
launches, not the arithmetic, are a small model's step there.

Where a step cannot be one graph it runs on the per-kernel path: prefill chunks, speculative rounds (several tokens
a step), steps with a probe, images or an ExpertSource, "stored" weights no kernel serves here (no kernels, a batch
past the native kernels' rows, stored experts without an experts kernel: no fp32 copies to gather), more than
STORED_EXPERTS_IN_GRAPH routed experts a layer kept as stored (each would be a graph input).
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from openflash import kernels
from openflash.model.cache import ModelCache
from openflash.model.compiled import quiet_lru_cache_warnings
from openflash.model.context import ExpertSource, Probe
from openflash.model.engram import EngramRows
from openflash.model.layers import Linear
from openflash.model.moe import MoE
from openflash.model.vision import ImageRows
from openflash.runtime.cuda_graph import CudaGraphStep, Recorder

if TYPE_CHECKING:
    from openflash.model.transformer import Transformer

log = logging.getLogger("openflash.model")

CAPACITY_TOKENS = 256  # the smallest compressed capacity, in tokens, a graph is built for
# The most routed experts a layer may keep as stored for a decode step to be one graph on the CPU: the native call
# takes every expert's six tensors as graph inputs (on CUDA the Triton call takes one table of their addresses).
# With golden A2's 8 the graph decodes 3.6x faster than the eager step (docs/benchmarks.md, weights as stored); with
# 384 on the tiny preset's widths dynamo's capture alone took minutes and the graph stepped slower than eager (a
# one-off check, not a kept benchmark).
STORED_EXPERTS_IN_GRAPH = 64
# torch.compile's backend. Tests of what dynamo decides (no graph break, no recompile as caches grow) use "eager":
# the captured graph run by PyTorch's own kernels, seconds instead of minutes of C++ code generation.
BACKEND = "inductor"


@dataclass
class FetchedRows:
    """EngramRows already gathered: a graph cannot wait on a tier's background fetch, so the step takes its rows
    up front (on the device tier that is where they are gathered anyway)."""

    rows: dict[int, torch.Tensor]

    def get(self, slot: int) -> torch.Tensor:
        return self.rows[slot]


class DecodeGraph:
    """One model's whole-step decode graph (module doc): `why_not` says whether a step can run here, `__call__`
    runs it."""

    def __init__(self, model: "Transformer", recorder: Recorder | None = None) -> None:
        self.model = model
        # Dynamo's per-call guard check on every module attribute and parameter is a large part of a small model's
        # step: it is skipped, which is safe because this graph serves one model under one numerics policy and
        # weight residency (the runtime keeps one DecodeGraph per pair), whose structure does not change, and
        # because its compiled code hangs on a code object of its own, never tried on another model. Guards on
        # the cache and the inputs (shapes, dtypes) stay. It must be one graph (fullgraph): after a graph break
        # dynamo resumes in frames of their own, which every layer shares, and without those guards one layer's
        # resumed code would run for the next (a data-dependent branch in the packed KV encoder did that: wrong
        # logits). A step that cannot be one graph is refused at tracing, before it runs (`broken`).
        own = _decode.__code__.replace(co_name=f"decode_graph_{id(self):x}")
        self._step: Callable[..., torch.Tensor] = torch.compile(
            types.FunctionType(own, _decode.__globals__, own.co_name), dynamic=None, backend=BACKEND, fullgraph=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.broken: str | None = None  # why tracing the step as one graph failed (then it runs per kernel)
        self._every_linear = [m for m in model.modules() if isinstance(m, Linear)]
        self._linears = [m for m in self._every_linear if m.quantized]
        self._moes = [m for m in model.modules() if isinstance(m, MoE)]
        self._engram_slots = [t.engram_slot for t in model.cfg.topology.layers if t.engram_before]
        self._noted: set[str] = set()
        # On a GPU the compiled step is replayed as a CUDA graph (cuda_graph.py; `recorder`: another way to record
        # and replay it, anywhere); the cache's Engram hash history (advanced before each step, outside it),
        # drafter rings and replay buffer are not the step's to touch.
        self._replayed = CudaGraphStep(self._step, FetchedRows, skip=("engram", "draft", "replay"), recorder=recorder) \
            if model.device.type == "cuda" or recorder is not None else None
        self.steps = 0  # decode steps run as one graph
        self.graphs = 0  # graphs compiled for them (module doc: one per batch class)
        self.compile_seconds = 0.0  # spent in the steps that compiled one (tracing and code generation)

    def why_not(self, cache: ModelCache, images: ImageRows | None, probe: Probe | None, hidden: bool,
                experts: ExpertSource | None) -> str | None:
        """None when the step can run as one graph, else the reason (logged once per reason)."""
        reason = None
        if self.broken is not None:
            reason = f"a step that could not be traced as one graph ({self.broken})"
        elif probe is not None or images is not None or hidden:
            reason = "a probe, images or drafter taps"
        elif experts is not None or any(m.offloaded for m in self._moes):
            reason = "routed experts from an ExpertSource"
        elif cache.replay is not None:
            reason = "a pending bounded-replay prefill"
        elif any(not m.fp32_resident and kernels.product_kernel(m.weight.device, m.stored_format,
                                                                 cache.pos.numel()) is None for m in self._linears):
            reason = '"stored" weights no kernel serves here (none built, or a batch past the native kernels\' rows)'
        elif any(not m.experts[0].w1.fp32_resident
                 and not kernels.experts_kernel(m.experts[0].w1.weight.device, m.experts[0].w1.stored_format)
                 for m in self._moes if m.experts):
            reason = "routed experts kept as stored without an experts kernel here"
        elif any(not m.experts[0].w1.fp32_resident and m.n_experts > STORED_EXPERTS_IN_GRAPH
                 and kernels.experts_kernel(m.experts[0].w1.weight.device, "fp4") == "native" for m in self._moes):
            reason = f"more than {STORED_EXPERTS_IN_GRAPH} routed experts a layer kept as stored"
        elif any(m.adapter is not None for m in self._every_linear):
            reason = "LoRA adapters"
        if reason is not None and reason not in self._noted:
            self._noted.add(reason)
            log.info("decode steps with %s run on the per-kernel compiled path, not as one graph", reason)
        return reason

    def __call__(self, input_ids: torch.Tensor, cache: ModelCache, engram: EngramRows | None) -> torch.Tensor:
        """Logits [B, V] of one decode step (input_ids [B, 1]), the cache advanced by one token."""
        rows = self.prepare(cache, engram)
        self.steps += 1
        compiled, start = _graphs_compiled(), time.perf_counter()
        try:
            with quiet_lru_cache_warnings():
                if self._replayed is not None:
                    logits = self._replayed(self.model, input_ids, cache, None if rows is None else rows.rows)
                else:
                    logits = self._step(self.model, input_ids, cache, rows)
        except torch._dynamo.exc.TorchDynamoException as exc:  # refused while tracing: nothing ran
            self.broken = str(exc).strip().splitlines()[0][:300]
            log.warning("the decode step could not be traced as one graph, it runs per kernel from now on: %s",
                        self.broken)
            self.steps -= 1
            return self.model.step(input_ids, cache, engram=engram)
        if _graphs_compiled() > compiled:  # this call compiled (nothing else compiles inside it)
            seconds = time.perf_counter() - start
            self.graphs += 1
            self.compile_seconds += seconds
            log.info("decode graph %d compiled in %.1f s (batch %d)", self.graphs, seconds, input_ids.shape[0])
        return logits

    def stats(self) -> dict[str, float]:
        """Steps run as one graph, graphs compiled and the seconds the compiling steps took; on CUDA, the CUDA
        graph recordings made and the steps replayed from them."""
        out = {"steps": self.steps, "graphs": self.graphs, "compile_seconds": self.compile_seconds}
        if self._replayed is not None:
            out.update(cuda_graphs_recorded=self._replayed.recorded, cuda_graph_replays=self._replayed.replays,
                       cuda_graphs_taken_over=self._replayed.taken_over, cuda_graphs_off=self._replayed.off)
        return out

    def prepare(self, cache: ModelCache, engram: EngramRows | None) -> EngramRows | None:
        """What the graph's body (`Transformer.static_decode`) needs before it runs: the cache's capacity
        reserved, the weight caches it reads brought up to date, the Engram rows fetched."""
        self._reserve(cache)
        growing = {(id(t), d): (t, d) for store in cache.compressed.values() for t, d in store.growing_dims()}
        for tensor, dim in growing.values():  # (paged stores share one pool: its planes once)
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        for linear in self._linears:
            if linear.fp32_resident:  # (stored weights are read as they are)
                linear.dequantized_weight()
        for moe in self._moes:
            first = moe.experts[0].w1
            if first.fp32_resident:
                moe.stacked_experts()
            elif kernels.experts_kernel(first.weight.device, first.stored_format) == "triton":
                moe.expert_tables()
        return None if engram is None else FetchedRows({s: engram.get(s) for s in self._engram_slots})

    def _reserve(self, cache: ModelCache) -> None:
        """Compressed capacity for this step's entries, in power-of-two buckets of tokens (one graph each)."""
        if not cache.compressed:
            return
        tokens = max(CAPACITY_TOKENS, 1 << int(cache.pos.max()).bit_length())  # > the step's position
        for store in cache.compressed.values():
            ratio = store.partial_kv.shape[1]
            store.reserve(-(-tokens // ratio), torch.div(cache.pos, ratio, rounding_mode="floor"))


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _decode(model: "Transformer", input_ids: torch.Tensor, cache: ModelCache,
            rows: EngramRows | None) -> torch.Tensor:
    return model.static_decode(input_ids, cache, rows)


__all__ = ["DecodeGraph", "FetchedRows", "CAPACITY_TOKENS", "STORED_EXPERTS_IN_GRAPH", "BACKEND"]
