"""One-row GEMMs inside a compiled graph on the CPU: the BLAS call against a multiply-and-sum (model/compiled.py,
`matmul_unshared`), for the weight shapes of a `small` decode step.

    python benchmarks/one_row_gemm.py [--rows 1 8] [--repeats 20]

A decode step at batch 1 multiplies one activation row by each weight once; the weights of a whole step do not fit
in the caches, so each GEMM streams its weight from DRAM. Each case compiles (inductor) a chain of GEMMs over
distinct weights (more bytes than the last-level cache), `tanh` between them so that nothing folds, and reports the
time per GEMM and the weight bytes per second it streams, for both forms, side by side in one process. Writes
benchmarks/results/one_row_gemm.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "one_row_gemm.json"
# (in, out, how many distinct weights in the chain): the attention / expert projections, the mHC projection, the
# head; chains hold >= 48 MiB of weights (the development machine's last-level cache is 32 MiB).
SHAPES = [(256, 256, 200), (1024, 24, 500), (256, 4096, 12)]


def blas_chain(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    out = x.new_zeros(())
    for w in weights:
        out = out + torch.tanh(x @ w.t()).sum()
    return out


def reduction_chain(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    out = x.new_zeros(())
    for w in weights:
        out = out + torch.tanh((x.unsqueeze(-2) * w).sum(-1)).sum()
    return out


def time_per_gemm(fn, x: torch.Tensor, weights: list[torch.Tensor], repeats: int) -> tuple[float, float]:
    """(compile s, best seconds per GEMM over `repeats` runs of the chain)."""
    start = time.perf_counter()
    fn(x, weights)
    compile_s = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x, weights)
        best = min(best, time.perf_counter() - start)
    return compile_s, best / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if min(args.rows) < 1 or args.repeats < 1:
        parser.error(f"--rows and --repeats must be >= 1 (got --rows {args.rows}, --repeats {args.repeats})")
    print(f"{torch.get_num_threads()} threads")
    print(f"{'in x out':>12}{'rows':>6}{'BLAS us':>10}{'GB/s':>7}{'reduction us':>14}{'GB/s':>7}{'speed-up':>10}")
    rows_out = []
    for k, n, count in SHAPES:
        weights = [torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * k ** -0.5 for i in range(count)]
        for m in args.rows:
            x = torch.randn(m, k)
            result = {"in": k, "out": n, "rows": m, "weights": count}
            for name, body in (("blas", blas_chain), ("reduction", reduction_chain)):
                torch._dynamo.reset()  # one graph per case: no recompile limit, no shape guard carried over
                compile_s, per = time_per_gemm(torch.compile(body, dynamic=False), x, weights, args.repeats)
                result[name] = {"us_per_gemm": per * 1e6, "weight_gb_per_s": k * n * 4 / per / 1e9,
                                "compile_s": compile_s}
            rows_out.append(result)
            b, r = result["blas"], result["reduction"]
            print(f"{f'{k} x {n}':>12}{m:>6}{b['us_per_gemm']:>10.1f}{b['weight_gb_per_s']:>7.1f}"
                  f"{r['us_per_gemm']:>14.1f}{r['weight_gb_per_s']:>7.1f}{b['us_per_gemm'] / r['us_per_gemm']:>9.2f}x",
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": rows_out}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
