"""Prefill at the released widths on the CPU: the products of many activation rows on weights kept as stored, and a
MoE layer's routed experts over a prefill chunk, in GFLOP/s against the fp32 FMA peak measured in the same run.

    python benchmarks/released_prefill.py [--rows 16 64 256 1024] [--experts 48] [--per-expert 2 16 64]
                                          [--threads N] [--out benchmarks/results/released_prefill.json]

The peak: the best of several fp32 products [2048 x 5120] x [5120 x 2304] through torch (its BLAS: the most fp32
multiply-adds a second these cores retire in practice, the arithmetic every stored format is computed in here).
The products: `Linear` in "stored" residency at the released shapes (a routed expert's w1 in MXFP4, attention's
wq_a in FP8, an eighth of the bf16 head), each row count as the model runs it (kernels.product_kernel: the native
kernels 16 rows a call, or the PyTorch path: one dequantized fp32 tile at a time, then the same BLAS).
OPENFLASH_KERNELS=0 times the PyTorch path at every row count, =avx2 the kernels a machine without AVX-512 runs.
The experts: a `MoE` of `--experts` released-shape FP4 experts, each of `--per-expert` mean rows (the released
model's 384 experts over a 128-token chunk get 2 rows each on average, over 4,096 tokens 64), routed at random 6 a
token, through the path `MoE` picks for those pairs (model/routed.py `choose`): 2 x 3 x 5120 x 2304 flops a routed
pair. The shared expert and the router are left out. Inference: the modules in eval mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kernels import stored_linear  # (benchmarks/ is this script's own folder on sys.path)
from openflash.config import load_config
from openflash.model.context import StepContext
from openflash.model.moe import MoE
from openflash.model.numerics import FP32

RESULTS = Path(__file__).parent / "results"
SHAPES = [("expert w1", "fp4", 2304, 5120), ("attn wq_a", "fp8", 1280, 5120), ("head 1/8", "bf16", 16160, 5120)]


def best_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def fma_peak(reps: int) -> float:
    """fp32 flop/s of the BLAS on an expert-sized product, the best of `reps`."""
    a, b = torch.randn(2048, 5120), torch.randn(5120, 2304)
    return 2 * 2048 * 5120 * 2304 / best_seconds(lambda: torch.mm(a, b), reps)


@torch.no_grad()
def moe_prefill(experts: int, per_expert: int, reps: int, g: torch.Generator) -> dict:
    cfg = load_config("flash").replace(n_routed_experts=experts)
    with torch.device("meta"):  # (the fp32 weights are never made: each expert's linears are replaced below)
        moe = MoE(cfg, 0)
    for expert in moe.experts:
        for name in ("w1", "w2", "w3"):
            lin = getattr(expert, name)
            setattr(expert, name, stored_linear("fp4", lin.out_features, lin.in_features, g))
    moe.eval()
    k, dim = cfg.num_experts_per_tok, cfg.hidden_size
    tokens = max(1, per_expert * experts // k)
    x = torch.randn(1, tokens, dim, generator=g)
    ctx = StepContext(torch.arange(tokens).unsqueeze(0), FP32)
    # the routing at random, 6 distinct experts a token (the gate's own choice would follow its random weights)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.full((tokens, k), 1.0 / k)
    moe.gate.forward = lambda x_, image_mask=None: (weights, ids)
    moe.shared_experts.forward = lambda x_: torch.zeros_like(x_)
    seconds = best_seconds(lambda: moe(x, ctx), reps)
    flops = 2 * 3 * dim * cfg.moe_intermediate_size * tokens * k
    return {"experts": experts, "rows_per_expert": per_expert, "tokens": tokens, "pairs": tokens * k,
            "ms": 1e3 * seconds, "gflops": flops / seconds / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[16, 64, 256, 1024])
    ap.add_argument("--formats", nargs="*", default=["fp4", "fp8", "bf16"], help="the product shapes timed, by format")
    ap.add_argument("--experts", type=int, default=48, help="experts of the MoE layer timed (0: skip)")
    ap.add_argument("--per-expert", type=int, nargs="*", default=[2, 16, 64], help="mean rows each expert gets")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "released_prefill.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    peak = fma_peak(args.reps)
    print(f"{args.threads} threads; fp32 FMA peak (BLAS, [2048 x 5120] x [5120 x 2304]): {peak / 1e9:.1f} GFLOP/s",
          flush=True)
    out = []
    for name, fmt, n, k in [s for s in SHAPES if s[1] in args.formats]:
        lin = stored_linear(fmt, n, k, g).eval()  # inference (a training-mode forward keeps many rows on PyTorch's)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g)
            with torch.no_grad():
                seconds = best_seconds(lambda: lin(x), args.reps)
            row = {"shape": name, "format": fmt, "out": n, "in": k, "rows": rows, "ms": 1e3 * seconds,
                   "gflops": 2 * rows * n * k / seconds / 1e9}
            row["of_peak"] = row["gflops"] * 1e9 / peak
            out.append(row)
            print(f"{name:<10} {fmt} {n} x {k}, {rows:>5} rows: {row['ms']:8.2f} ms {row['gflops']:7.1f} GFLOP/s "
                  f"({100 * row['of_peak']:4.1f}% of peak)", flush=True)
    for per_expert in args.per_expert if args.experts else []:
        row = moe_prefill(args.experts, per_expert, args.reps, g)
        row["of_peak"] = row["gflops"] * 1e9 / peak
        out.append(row)
        print(f"MoE, {row['experts']} FP4 experts, {row['tokens']} tokens ({per_expert} rows an expert): "
              f"{row['ms']:8.1f} ms {row['gflops']:7.1f} GFLOP/s ({100 * row['of_peak']:4.1f}% of peak)", flush=True)
    after = fma_peak(args.reps)
    print(f"peak again: {after / 1e9:.1f} GFLOP/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "fma_peak": peak, "fma_peak_after": after,
                                    "cpu": torch.backends.cpu.get_cpu_capability(), "results": out}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
