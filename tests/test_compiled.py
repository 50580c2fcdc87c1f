"""The compiled backend (model/compiled.py) against the eager reference implementation it compiles.

Same numerics, fused: logits agree to fp32 rounding (a fused reduction may sum in another order, so never bitwise),
greedy tokens agree under the plain numerics (no QDQ whose rounding could flip on a last-bit difference), and the
engine runs on it. The compiled kernels are built once per test module (inductor's cache keeps them on disk).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from openflash.checkpoint import open_model
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.errors import OpenflashError
from openflash.model import decode_graph
from openflash.model.numerics import FP32, NUMERICS
from openflash.serve.metrics import render

pytestmark = pytest.mark.usefixtures("one_thread")
# Inductor builds C++ for the CPU: where no compiler is installed, --compile refuses (tested below) and these skip.
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                               reason="no C++ compiler for torch.compile's CPU kernels")


@pytest.fixture(scope="module")
def tiny():
    loaded = open_model("tiny")
    return loaded.model, loaded.tokenizer, loaded.memory()


def _logits(model, memory, ids: torch.Tensor, decode_steps: int) -> torch.Tensor:
    cache = model.new_cache(1)
    out = [model.step(ids, cache, mode="exact", engram=memory.prepare(ids, cache))]
    for _ in range(decode_steps):
        token = out[-1].argmax(-1)
        out.append(model.decode(token, cache, engram=memory.prepare(token.view(-1, 1), cache)))
    return torch.stack(out)


@needs_cxx
def test_compiled_logits_match_eager_through_prefill_and_decode(tiny):
    model, _, memory = tiny
    ids = torch.randint(3, 1000, (1, 40), generator=torch.Generator().manual_seed(1))
    try:
        eager = _logits(model, memory, ids, 20)  # past a compressed group boundary and the window
        model.set_numerics(FP32.with_compile())
        fused = _logits(model, memory, ids, 20)
        assert model._decode_graph().steps == 20  # the decode steps ran as one graph each (model/decode_graph.py)
        torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
    finally:
        model.set_numerics(FP32)


@needs_cxx
def test_engine_on_the_compiled_backend_gives_the_eager_greedy_tokens(tiny, monkeypatch):
    """A batch of 4 on paged caches whose capacity, block tables and block pool grow while it decodes: they are
    symbolic sizes, so the only recompile is where the capacity first exceeds index_topk (model/decode_graph.py;
    without them symbolic, the table widening and the pool doubling recompile too)."""
    model, tok, _ = tiny
    monkeypatch.setattr(decode_graph, "CAPACITY_TOKENS", 16)
    plain = NUMERICS["plain"]
    prompts = [[5 + i] * n for i, n in enumerate((7, 12, 12, 14))]
    params = SamplingParams(max_tokens=12)
    try:
        model.set_numerics(plain)
        want = [generate(model, tok, p, params).token_ids for p in prompts]
        model.set_numerics(plain.with_compile())
        engine = LLMEngine(model, tok, EngineConfig(max_batch=4, prefill_chunk=16, prefix_cache=False,
                                                    kv_block_size=1))
        assert [s.output_ids for s in engine.generate(prompts, params, ignore_eos=True)] == want
        graph = engine.stats()["decode_graph"]
        assert graph["steps"] > 0 and engine.factory.pool.num_blocks > 64  # graphs ran; the pool grew past 64 blocks
        assert graph["graphs"] <= 2, graph
        assert f"openflash_decode_graphs_compiled_total {graph['graphs']}" in render(engine)
    finally:
        model.set_numerics(FP32)


def test_the_compiled_backend_refuses_the_reference_numerics():
    with pytest.raises(OpenflashError, match="compiled backend serves the fp32, plain and train numerics, not "
                                             "'reference'"):
        NUMERICS["reference"].with_compile()
    assert NUMERICS["train"].with_compile().compiled  # training compiles block by block (test_trainer.py)
    assert not FP32.with_compile().with_compile(False).compiled


def test_open_model_names_a_bad_numerics_and_a_missing_compiler(monkeypatch):
    with pytest.raises(OpenflashError, match="numerics must be one of .* got 'fp16'"):
        open_model("tiny", numerics="fp16")
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(OpenflashError, match="needs a C\\+\\+ compiler .*'no-such-c\\+\\+' is not on PATH"):
        open_model("tiny", compile=True)


@needs_cxx
def test_open_model_compile_sets_the_compiled_backend():
    assert open_model("tiny", compile=True).model.numerics.compiled


def test_prefill_batch_must_be_positive(tiny):
    model, tok, _ = tiny
    with pytest.raises(OpenflashError, match="prefill_batch must be >= 1, got 0"):
        LLMEngine(model, tok, EngineConfig(prefill_batch=0))


def test_one_row_gemms_in_a_graph_are_the_matmul():
    """`graph_linear` / `matmul_unshared` take the multiply-and-sum form only while a graph traces (dynamo with
    AOTAutograd's eager kernels here: the form itself, not inductor's code for it), for a single row or one row
    per weight, and equal the matmul to fp32 rounding; several rows share a weight through the plain GEMM."""
    from openflash.model.compiled import graph_linear, matmul_unshared
    g = torch.Generator().manual_seed(0)
    w, experts = torch.randn(48, 64, generator=g), torch.randn(5, 48, 64, generator=g)
    one, many, pairs = (torch.randn(shape, generator=g) for shape in ((1, 1, 64), (3, 1, 64), (5, 1, 64)))
    traced = torch.compile(lambda a, b, c: (graph_linear(a, w), graph_linear(b, w), matmul_unshared(c, experts)),
                           backend="aot_eager", fullgraph=True)
    got = traced(one, many, pairs)
    want = (one @ w.t(), many @ w.t(), torch.bmm(pairs, experts.transpose(1, 2)))
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
