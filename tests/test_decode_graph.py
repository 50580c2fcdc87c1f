"""A decode step as one compiled graph (runtime/decode_graph.py) against the eager path.

The shape-static forms (masked cache writes, compressed stores read at full capacity, experts gathered per routed
pair) are checked eagerly here, cheaply and tightly; the compiled graph itself (no graph break, no recompile across
a capacity bucket) is test_compiled.py's, which shares one compiled model between its tests. Plain numerics for the
tight comparisons: a QDQ rounding flip on a last-bit difference would hide a real one. Never bitwise: summation
order may differ. The model here has no Engram layers, so its steps take no rows: preparing rows is the runtime's
job, and test_compiled.py runs the graph through the runtime with them.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from openflash import kernels
from openflash.checkpoint import build_model
from openflash.config import load_config
from openflash.kernels import native
from openflash.model.numerics import NUMERICS
from openflash.runtime import decode_graph
from openflash.runtime.decode_graph import DecodeGraph
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement

pytestmark = pytest.mark.usefixtures("one_thread")
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                               reason="no C++ compiler for torch.compile's CPU kernels")
PLAIN = NUMERICS["plain"]


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset's layers without its Engram layers (seed-0 weights, plain numerics)."""
    torch.manual_seed(0)
    return build_model(load_config("tiny").replace(engram_layer_ids=[]), PLAIN).eval()


def _prefill(model, ids: torch.Tensor):
    cache = model.new_cache(ids.shape[0])
    return cache, model.step(ids, cache, mode="exact")


def _decode_run(model, ids: torch.Tensor, steps: int, static_eager: bool = False) -> torch.Tensor:
    """Logits of the prefill and `steps` greedy decode steps; static_eager: the graph's body run eagerly."""
    cache, logits = _prefill(model, ids)
    out = [logits]
    graph = DecodeGraph(model)
    for _ in range(steps):
        token = out[-1].argmax(-1).view(-1, 1)
        if static_eager:
            out.append(model.static_decode(token, cache, graph.prepare(cache, None)))
        else:
            out.append(model.step(token, cache))
    return torch.stack(out)


def test_the_shape_static_step_equals_the_eager_step(tiny, monkeypatch):
    """Past compressed group boundaries, the window and a capacity bucket, for one row and for a batch of two."""
    model = tiny
    monkeypatch.setattr(decode_graph, "CAPACITY_TOKENS", 16)
    model.set_numerics(PLAIN)
    for ids in (torch.randint(3, 1000, (1, 9), generator=torch.Generator().manual_seed(2)),
                torch.randint(3, 1000, (2, 13), generator=torch.Generator().manual_seed(3))):
        if ids.shape[0] == 2:
            ids[1, :5] = 0  # (same length; the rows differ in content and so in routing and top-k)
        want = _decode_run(model, ids, 24)
        got = _decode_run(model, ids, 24, static_eager=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_static_step_writes_a_row_at_its_own_position(tiny):
    """Rows at different positions (an engine's batch): each row's window slot and compressed entries land where
    the eager step puts them."""
    model = tiny
    model.set_numerics(PLAIN)
    caches = []
    for n in (5, 12):
        cache, _ = _prefill(model, torch.randint(3, 1000, (1, n), generator=torch.Generator().manual_seed(n)))
        caches.append(cache)
    both = [type(caches[0]).concat(caches) for _ in range(2)]
    for c in both[1].compressed.values():
        c.reserve(64, torch.div(both[1].pos, c.partial_kv.shape[1], rounding_mode="floor"))
    token = torch.tensor([[7], [9]])
    want = model.step(token, both[0])
    got = model.static_decode(token, both[1], None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(both[0].window, both[1].window):
        assert torch.equal(a.pos, b.pos)
        torch.testing.assert_close(a.kv, b.kv, rtol=1e-5, atol=1e-5)
    for i, a in both[0].compressed.items():
        b = both[1].compressed[i]
        assert torch.equal(a.length, b.length)
        n = int(a.length.max())
        torch.testing.assert_close(b.read(n)[0], a.read(n)[0], rtol=1e-5, atol=1e-5)


def test_steps_that_cannot_be_one_graph_say_why(tiny):
    model = tiny
    graph = DecodeGraph(model)
    cache, _ = _prefill(model, torch.tensor([[5, 6, 7]]))
    assert graph.why_not(cache, None, None, False, None) is None
    assert "probe" in graph.why_not(cache, None, object(), False, None)
    assert "ExpertSource" in graph.why_not(cache, None, None, False, object())


def test_stored_weights_without_kernels_run_decode_on_the_per_kernel_path(monkeypatch):
    """No fp32 copies to read (FP8/FP4 checkpoint in "stored" residency) and no native kernels, or more routed
    experts as stored than a graph takes as inputs: not one graph."""
    model = open_model("tests/goldens/A2", placement=Placement(weights="stored")).model
    cache = model.new_cache(1)
    if native.status().available:
        assert DecodeGraph(model).why_not(cache, None, None, False, None) is None
        monkeypatch.setattr(decode_graph, "STORED_EXPERTS_IN_GRAPH", 4)  # A2 has 8 a layer
        assert DecodeGraph(model).why_not(cache, None, None, False, None) == \
            "more than 4 routed experts a layer kept as stored"
    monkeypatch.setenv("OPENFLASH_KERNELS", "0")
    native.status.cache_clear()
    try:
        assert "stored" in DecodeGraph(model).why_not(cache, None, None, False, None)
        model.set_weight_residency("dequantized")
        assert DecodeGraph(model).why_not(cache, None, None, False, None) is None
    finally:
        monkeypatch.undo()
        native.status.cache_clear()


@pytest.mark.skipif(not native.status().available, reason=f"no native kernels: {native.status().reason}")
@pytest.mark.parametrize("experts", ["native", "triton"])
def test_stored_weights_decode_as_one_graph_through_the_kernels(monkeypatch, experts):
    """Golden A2 kept as stored (FP8 attention, FP4 experts, Engram rows through its runtime): the whole step is one
    graph (captured by dynamo, run by PyTorch's own kernels) calling the native kernels as custom ops, the routed
    experts in one call a layer by expert id; its logits are the per-kernel step's. "triton": the routed experts
    through CUDA's experts call instead (kernels/triton_experts.py, in Triton's interpreter), by its table."""
    if experts == "triton":
        if not kernels.triton_products.available():
            pytest.skip("Triton is not installed")
        monkeypatch.setattr(kernels, "experts_kernel", lambda device, stored: "triton" if stored == "fp4" else None)
    monkeypatch.setattr(decode_graph, "BACKEND", "eager")
    runtime = open_model("tests/goldens/A2", numerics="fp32", placement=Placement(weights="stored"))
    steps = 6 if experts == "native" else 3  # (Triton's interpreter takes ~0.3 s a layer's call)

    def run(compiled: bool) -> torch.Tensor:
        runtime.model.set_numerics(NUMERICS["fp32"])  # prefill eager: inductor's prefill is test_compiled.py's
        cache = runtime.model.new_cache(1)
        out = [runtime.step(torch.tensor([[5, 6, 7, 8]]), cache)]
        runtime.model.set_numerics(NUMERICS["fp32"].with_compile(compiled))
        for _ in range(steps):
            out.append(runtime.decode(out[-1].argmax(-1), cache))
        return torch.stack(out)

    want = run(False)
    torch._dynamo.utils.counters.clear()
    got = run(True)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    graph = runtime.stats()["decode_graph"]
    assert graph["steps"] == steps and graph["graphs"] == 1, graph
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_graph_captures_whole_and_grows_without_recompiling(tiny, monkeypatch):
    """The dense caches' decode step (`generate --compile`) as dynamo captures it, the graph run by PyTorch's own
    kernels (inductor's code for the decode graph is test_compiled.py's, on the engine's paged caches): no graph
    break, one graph across the capacity buckets of 16 and 32 tokens, the eager step's logits."""
    model = tiny
    monkeypatch.setattr(decode_graph, "CAPACITY_TOKENS", 16)
    monkeypatch.setattr(decode_graph, "BACKEND", "eager")
    model.set_numerics(PLAIN)
    ids = torch.randint(3, 1000, (1, 10), generator=torch.Generator().manual_seed(4))
    want = _decode_run(model, ids, 12)  # positions 10..21: both buckets
    cache, logits = _prefill(model, ids)
    graph, got = DecodeGraph(model), [logits]
    torch._dynamo.utils.counters.clear()
    for _ in range(12):
        token = got[-1].argmax(-1).view(-1, 1)
        got.append(graph(token, cache, None))
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert graph.steps == 12 and graph.graphs == 1
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)


def test_a_step_that_cannot_be_one_graph_is_refused_before_it_runs_and_runs_per_kernel(tiny, monkeypatch):
    """A graph break inside the step (here a data-dependent branch around it) is refused while tracing (fullgraph):
    dynamo's resumed frames would be shared by every layer without the module guards the graph skips. The step
    runs per kernel, with the eager step's logits, and so do the next ones (why_not names the reason)."""
    model = tiny
    monkeypatch.setattr(decode_graph, "BACKEND", "eager")
    model.set_numerics(PLAIN)
    ids = torch.randint(3, 1000, (1, 10), generator=torch.Generator().manual_seed(5))
    want = _decode_run(model, ids, 2)
    static = model.static_decode

    def branching(input_ids, cache, rows):
        if bool(input_ids.sum() >= 0):  # a data-dependent branch: not one graph
            return static(input_ids, cache, rows)
        return static(input_ids, cache, rows)

    monkeypatch.setattr(model, "static_decode", branching)
    cache, logits = _prefill(model, ids)
    graph, got = DecodeGraph(model), [logits]
    for _ in range(2):
        got.append(graph(got[-1].argmax(-1).view(-1, 1), cache, None))
    assert graph.broken is not None and graph.steps == 0
    assert "could not be traced as one graph" in graph.why_not(cache, None, None, False, None)
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_place", [False, True])
def test_the_engine_s_packed_cache_decodes_as_one_graph(monkeypatch, in_place):
    """The engine's packed storage (FP4 KV, MXFP4 index keys, FP8 rings) written by the whole-step graph: one
    graph (its exact KV encoder has no data-dependent branch), the eager step's logits. It broke in two before,
    and the resumed halves, shared across layers, gave wrong logits. in_place: the pool's keys scored, its picked
    entries and the rings attended by the Triton kernels as custom ops (forced here: CUDA's `kernels.cache_kernel`)."""
    from openflash.engine.cache import CacheFactory

    if in_place and not kernels.triton_products.available():
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(decode_graph, "BACKEND", "eager")
    runtime = open_model("tiny", numerics="fp32")
    cache = CacheFactory.create(runtime.cfg, "packed", 4).empty(2)
    runtime.step(torch.randint(3, 900, (2, 45), generator=torch.Generator().manual_seed(6)), cache)
    twin = cache.select([0, 1])
    tokens = torch.tensor([5, 6])
    monkeypatch.setattr(runtime, "_graph", lambda: None)
    want = [runtime.decode(tokens, twin) for _ in range(3)]
    graph = DecodeGraph(runtime.model)
    monkeypatch.setattr(runtime, "_graph", lambda: graph)
    if in_place:
        monkeypatch.setattr(kernels, "cache_kernel", lambda device: "triton")

        def read_out(self, *args):
            raise AssertionError("the index keys or the picked entries were read out")

        for name in ("read_index", "gather"):
            monkeypatch.setattr(type(next(iter(cache.compressed.values()))), name, read_out)
        monkeypatch.setattr(type(cache.window[0]), "kv", property(read_out))
    got = [runtime.decode(tokens, cache) for _ in range(3)]
    assert graph.broken is None and graph.steps == 3 and graph.graphs == 1, (graph.broken, graph.stats())
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-5)
