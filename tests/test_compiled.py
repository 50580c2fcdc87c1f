"""The compiled backend (model/compiled.py, runtime/decode_graph.py) against the eager reference it compiles.

Compilation is the expensive part of this suite on a fresh machine (inductor's disk cache empty: every kernel is
generated C++ built by gcc), so inductor builds one model's kernels once (`compiled_tiny`), on the smallest run
that exercises them all: an engine batch whose prefill kernels see several shapes and whose decode graph crosses
capacity buckets, checked for what compilation must preserve: the eager greedy tokens, no graph break, no recompile
while the caches grow. The dense caches' decode graph is checked for the same on dynamo's capture run by eager
kernels (test_decode_graph.py). Plain numerics: a QDQ rounding flip on a last-bit difference would hide a real one;
the fp32 policy's QDQ kernels are compared on their own (cheaply) below.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from openflash import formats
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.errors import OpenflashError
from openflash.model.compiled import rowwise
from openflash.model.numerics import FP32, NUMERICS
from openflash.runtime import decode_graph
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.serve.metrics import render

pytestmark = pytest.mark.usefixtures("one_thread")
# Inductor builds C++ for the CPU: where no compiler is installed, --compile refuses (tested below) and these skip.
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None,
                               reason="no C++ compiler for torch.compile's CPU kernels")
# The smallest compressed capacity a decode graph is built for: small, so the run crosses a bucket (32 -> 64 tokens),
# yet past the tiny preset's index_topk (8) entries in every compressed table from the first step: top-k keeps
# min(topk, entries), so a table that starts narrower compiles a second graph once it widens past topk (as a
# released model does once, at index_topk entries), and one graph of this size takes minutes of inductor on 2 cores.
CAPACITY_TOKENS = 32


@pytest.fixture(scope="module")
def compiled_tiny():
    """(compiled, eager): runtimes of the tiny preset (plain numerics, the same seed-0 weights) on the compiled
    backend and on the eager one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_graph, "CAPACITY_TOKENS", CAPACITY_TOKENS)
        yield (open_model("tiny", numerics="plain", placement=Placement(compile=True)),
               open_model("tiny", numerics="plain"))


@needs_cxx
def test_engine_on_the_compiled_backend_gives_the_eager_greedy_tokens(compiled_tiny):
    """A batch of 4 on paged caches whose capacity (two buckets), block tables and block pool grow while it decodes:
    the prefill kernels and the decode graph through inductor give the eager greedy tokens, with no graph break;
    the growing sizes are symbolic, so one graph serves every step (without them symbolic, the capacity bucket,
    the table widening and the pool doubling would each recompile)."""
    rt, eager = compiled_tiny
    prompts = [[5 + i] * n for i, n in enumerate((7, 12, 12, 14))]
    params = SamplingParams(max_tokens=24)  # positions up to 37: past the first bucket
    want = [generate(eager, p, params).token_ids for p in prompts]
    engine = LLMEngine(rt, EngineConfig(max_batch=4, prefill_chunk=16, prefix_cache=False, kv_block_size=1))
    torch._dynamo.utils.counters.clear()
    assert [s.output_ids for s in engine.generate(prompts, params, ignore_eos=True)] == want
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    graph = engine.stats()["decode_graph"]
    assert graph["steps"] > 0 and engine.factory.pool.num_blocks > 64  # graphs ran; the pool grew past 64 blocks
    assert graph["graphs"] == 1, graph
    assert f"openflash_decode_graphs_compiled_total {float(graph['graphs'])}" in render(engine)


@needs_cxx
def test_the_fp32_policy_qdq_kernels_compile_to_the_same_values():
    """The fp32 policy adds FP8 / FP4 quantize-dequantize chains to the same graphs (numerics.py); compiled, each
    gives the eager values (a scale division may become a reciprocal multiply: an exact tie can round the other
    way, so a rare element may land on the neighbouring code)."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    for fn in (formats.act_quant_qdq, formats.fp4_qdq_ue8m0, formats.fp4_qdq_e4m3):
        want, got = fn(x), rowwise(fn, x)
        differ = (got != want).float().mean().item()
        assert differ < 1e-3, (fn.__name__, differ)


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
        open_model("tiny", placement=Placement(compile=True))


@needs_cxx
def test_open_model_compile_sets_the_compiled_backend():
    assert open_model("tiny", placement=Placement(compile=True)).model.numerics.compiled


def test_prefill_batch_must_be_positive():
    with pytest.raises(OpenflashError, match="prefill_batch must be >= 1, got 0"):
        LLMEngine(open_model("tiny", numerics="plain"), EngineConfig(prefill_batch=0))


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
