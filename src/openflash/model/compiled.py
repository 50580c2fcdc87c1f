"""The compiled backend: the eager kernels' pure, shape-stable functions through torch.compile (inductor).

A decode step of the eager path is hundreds of tiny ops per layer (20 Sinkhorn iterations per sublayer, the FP8 /
FP4 quantize-dequantize of activations and caches, RoPE, the indexer's score); on a CPU each costs microseconds of
dispatch while its arithmetic costs nanoseconds. Inductor fuses each of those chains into one generated C++ loop
(Triton on CUDA). What is compiled is exactly the eager function, so the numerics are the same: the same
quantization points, the same rounding; only the summation order inside a fused reduction can differ in the last
bits (tests compare the two paths with a tolerance).

What stays eager here: everything with data-dependent shapes (cache writes, the compressor's completed groups,
the router's dispatch, top-k over a growing cache), which would break a graph anyway. A decode step avoids those
shapes and runs as one graph instead (runtime/decode_graph.py); these kernels serve prefill and the steps it cannot.

Shapes: `dynamic=None` lets a function specialise on its first shapes and turn a dimension symbolic the first
time it changes (batch size, chunk length, cache length), so a server compiles each function about twice. The
compiled code is cached on disk by inductor (TORCHINDUCTOR_CACHE_DIR, by default under /tmp), so the next
process loads it instead of compiling.

A policy runs compiled when its `Numerics.compiled` is set (`Numerics.with_compile`); the kernel sets of each
mechanism pick the compiled functions from it (mhc.py, layers.py, attention.py, indexer.py, moe.py).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import warnings
from contextlib import contextmanager
from functools import lru_cache
from typing import Callable, Iterator, TypeVar

import torch

from openflash.errors import OpenflashError

F = TypeVar("F", bound=Callable)


@lru_cache(maxsize=None)
def compiled(fn: F) -> F:
    """fn through torch.compile, one compiled wrapper per function (compiled lazily, at its first call)."""
    return torch.compile(fn, dynamic=None)  # type: ignore[return-value]


@contextmanager
def quiet_lru_cache_warnings() -> Iterator[None]:
    """Tracing a model passes through the kernel sets' lru_cache'd getters (pure functions of the numerics
    policy), which dynamo warns about generically at each: silence that one warning while a graph traces."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")
        yield


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """compiled(fn) on x seen as [rows, last dim], for a fn that works on each row alone (the block QDQs): one
    graph serves every rank and leading shape, instead of one per shape."""
    return compiled(fn)(x.reshape(-1, x.shape[-1])).view(x.shape)


def matmul_unshared(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., M, in] @ w [..., out, in]^T -> [..., M, out]. Where each weight meets one row (M = 1: a batch-1
    linear, the decode graph's gathered experts) in a graph compiled for the CPU, a multiply-and-sum, which inductor
    turns into one streaming reduction loop: a one-row GEMM is bound by reading its weight from DRAM, and the BLAS
    call streamed 4-8 GB/s there against 13-29 GB/s for the generated loop (2.2-3.9x on a `small` decode's weight
    shapes, benchmarks/one_row_gemm.py). Elsewhere (eager, CUDA: not measured) the plain matmul."""
    if x.shape[-2] == 1 and torch.compiler.is_compiling() and x.device.type == "cpu":
        return (x.unsqueeze(-2) * w.unsqueeze(-3)).sum(-1)
    return torch.matmul(x, w.transpose(-1, -2))


def graph_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) (no bias), through `matmul_unshared` when x is a single row."""
    if x.numel() == x.shape[-1]:
        return matmul_unshared(x.reshape(1, -1), w).view(*x.shape[:-1], w.shape[0])
    return torch.nn.functional.linear(x, w)


def check_toolchain(device: str | torch.device) -> None:
    """Refuse up front, with what to do, when torch.compile cannot build kernels for `device` here: inductor
    compiles C++ for the CPU (the compiler in $CXX, else g++) and Triton kernels for CUDA."""
    if torch.device(device).type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise OpenflashError("--compile on CUDA needs Triton (pip install triton), or run without --compile")
        return
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        raise OpenflashError(f"--compile needs a C++ compiler for the CPU kernels torch.compile builds; {cxx!r} is "
                             f"not on PATH (install g++, or set CXX), or run without --compile")


__all__ = ["compiled", "rowwise", "matmul_unshared", "graph_linear", "check_toolchain", "quiet_lru_cache_warnings"]
