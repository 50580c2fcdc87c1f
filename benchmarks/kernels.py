"""The native products on stored weights (src/openflash/kernels/) at the released shapes, in GB/s of stored bytes
read, against a read-bandwidth probe measured just before each row (on a shared machine the bandwidth drifts within a
run), with the PyTorch path they replace beside them.

    python benchmarks/kernels.py [--rows 1 4 16] [--threads 2] [--moe-experts 48] [--rounds 3]
                                 [--out benchmarks/results/kernels.json]

Shapes (DeepSeek-V4.1-Flash): a routed expert's w1/w3 (5120 -> 2304) and w2 (2304 -> 5120) in MXFP4, the
attention's wq_a (5120 -> 1280) and wo_b (8192 -> 5120) in FP8, the head (5120 -> 129280) in bf16. Each is cycled
over enough copies to exceed the last-level cache, so every product reads its weight from RAM. The PyTorch path:
`Linear` in "stored" residency with the kernels off (FP8 activation QDQ, then one dequantized fp32 tile at a time).
Each row names the instruction set that ran. Where the CPU has AVX-512 BF16, the AVX2 kernels (what a machine
without it runs) are timed beside them; on AVX2, the one-row FP4 products run in integers, and the float ones
they replace (OPENFLASH_KERNELS=avx2-float) are timed beside them.

A layer's routed experts (`--moe-experts E`, 0 to skip): E released-shape FP4 experts, each decode-sized step
(1 or 2 tokens, 6 experts each, drawn at random) through one native call for the layer (model/routed.py `native`)
against one call per expert and projection (`grouped`, the kernels still computing each product).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from functools import partial
import time
from pathlib import Path

import torch

from openflash import formats, kernels
from openflash.kernels import native
from openflash.model.layers import Linear
from openflash.model.numerics import FP32

RESULTS = Path(__file__).parent / "results"
SHAPES = [("expert w1/w3", "fp4", 2304, 5120), ("expert w2", "fp4", 5120, 2304), ("attn wq_a", "fp8", 1280, 5120),
          ("attn wo_b", "fp8", 5120, 8192), ("head", "bf16", 129280, 5120)]
WORKING_SET = 512 << 20  # bytes of weights cycled through: far past any last-level cache here


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s of summing a buffer larger than the caches (torch's threads), the best of `reps`."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def stored_linear(fmt: str, n: int, k: int, g: torch.Generator) -> Linear:
    """A Linear holding random weights as the checkpoint stores them, in "stored" residency."""
    w = torch.randn(n, k, generator=g) * k ** -0.5
    lin = Linear(k, n, "float" if fmt == "bf16" else fmt)
    with torch.no_grad():
        if fmt == "fp8":
            q, s = formats.quantize_fp8_blocks(w)
            lin.weight.copy_(q.view(torch.float8_e4m3fn))
            lin.scale.copy_(s.view(torch.float8_e8m0fnu))
        elif fmt == "fp4":
            q, s = formats.quantize_mxfp4(w)
            lin.weight.copy_(q.view(torch.int8))
            lin.scale.copy_(s.view(torch.float8_e8m0fnu))
        else:
            lin.weight = torch.nn.Parameter(w.to(torch.bfloat16), requires_grad=False)
    lin.keep_dequantized, lin.numerics = False, FP32
    return lin


def stored_bytes(lin: Linear) -> int:
    return sum(t.numel() * t.element_size() for t in (lin.weight, getattr(lin, "scale", None)) if t is not None)


@torch.no_grad()
def time_products(lins: list[Linear], x: torch.Tensor, reps: int) -> float:
    """Median seconds of one product, cycling over the copies (one warm pass first)."""
    for lin in lins:
        lin(x)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for lin in lins:
            lin(x)
        times.append((time.perf_counter() - start) / len(lins))
    return statistics.median(times)


INTEGER_ROWS = 1  # kernels/gemv.c: AVX2's FP4 products with QDQ'd activations in integers at one row


def isa_name(fmt: str, rows: int, choice: str = "1") -> str:
    """The instruction set (and arithmetic) a product of `rows` rows runs with under OPENFLASH_KERNELS=choice."""
    if fmt != "bf16" and choice == "1" and native.status().isa & native.ISA_AVX512_BF16:
        return "AVX-512 BF16"
    if fmt == "fp4" and rows <= INTEGER_ROWS and choice != "avx2-float":
        return "AVX2 integer"
    return "AVX2"


def use_isa(choice: str) -> None:
    """Products from now on with OPENFLASH_KERNELS=choice ("1": the best here, "avx2": the baseline)."""
    os.environ["OPENFLASH_KERNELS"] = choice
    native.status.cache_clear()


@torch.no_grad()
def moe_layer(experts: int, tokens: list[int], reps: int, bandwidth: float, g: torch.Generator) -> list[dict]:
    """Seconds per step of a layer's routed experts, one native call against one call per expert (module doc)."""
    from openflash.config import load_config
    from openflash.model import routed
    from openflash.model.moe import MoE

    cfg = load_config("flash").replace(n_routed_experts=experts)
    moe = MoE(cfg, 0)
    for expert in moe.experts:
        for name in ("w1", "w2", "w3"):
            lin = getattr(expert, name)
            setattr(expert, name, stored_linear("fp4", lin.out_features, lin.in_features, g))
    k, dim = cfg.num_experts_per_tok, cfg.hidden_size
    per_expert = sum(stored_bytes(getattr(moe.experts[0], n)) for n in ("w1", "w2", "w3"))
    out = []
    for t in tokens:
        x = torch.randn(t, dim, generator=g)
        steps = [torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)]) for _ in range(reps)]
        weights = torch.full((t, k), 1.0 / k)
        shared = torch.zeros(t, dim)
        timed = {}
        run = partial(moe._native_experts, lambda chosen: {e: moe.experts[e] for e in chosen})
        paths = ["grouped", "native"] + ([] if native.status().isa & native.ISA_AVX512_BF16 else ["native_float"])
        for path in paths:
            times = []
            if path == "native_float":
                use_isa("avx2-float")  # the same one call, its one-row FP4 products in floats
            for ids in steps:
                start = time.perf_counter()
                if path.startswith("native"):
                    routed.native(x, weights, ids, run, lambda y: y, shared)
                else:
                    routed.grouped(x, weights, ids, {int(e): moe.experts[int(e)] for e in ids.unique()}, shared)
                times.append(time.perf_counter() - start)
            use_isa("1")
            timed[path] = statistics.median(times[1:])
        nbytes = per_expert * len({int(e) for e in steps[0].flatten()})
        row = {"moe_tokens": t, "experts_per_token": k, "experts": experts, "grouped_ms": 1e3 * timed["grouped"],
               "native_ms": 1e3 * timed["native"], "native_of_bandwidth": nbytes / timed["native"] / bandwidth,
               "speedup": timed["grouped"] / timed["native"]}
        if "native_float" in timed:
            row["native_float_ms"] = 1e3 * timed["native_float"]
        out.append(row)
        print(f"MoE layer, {t} token(s) x {k} experts of {experts}: one call per expert {row['grouped_ms']:.2f} ms, "
              f"one call for the layer {row['native_ms']:.2f} ms (x{row['speedup']:.2f}; "
              f"{100 * row['native_of_bandwidth']:.0f}% of the probe)"
              + (f"; in floats (avx2-float) {row['native_float_ms']:.2f} ms" if "native_float_ms" in row else ""),
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4, 16], help="activation rows (none: skip the shapes)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of a product with its baseline (medians)")
    ap.add_argument("--pytorch-rows", type=int, nargs="*", default=[1], help="rows the PyTorch path is timed at")
    ap.add_argument("--moe-experts", type=int, default=48, help="experts of the layer timed (0: skip)")
    ap.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = ap.parse_args()
    if os.environ.get("OPENFLASH_KERNELS", "1") != "1":
        raise SystemExit(f"OPENFLASH_KERNELS={os.environ['OPENFLASH_KERNELS']}: this benchmark picks the instruction "
                         f"sets itself (the best here, with AVX2 beside it); run it with the variable unset")
    if not native.status().available:
        raise SystemExit(f"no native kernels here: {native.status().reason}")
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    print(f"{args.threads} threads; read probe {bandwidth / 1e9:.1f} GB/s; {native.status().reason}", flush=True)
    g = torch.Generator().manual_seed(0)
    rows_out = []
    also_avx2 = bool(native.status().isa & native.ISA_AVX512_BF16)
    for name, fmt, n, k in SHAPES if args.rows else []:
        first = stored_linear(fmt, n, k, g)
        copies = max(2, WORKING_SET // stored_bytes(first))
        lins = [first] + [stored_linear(fmt, n, k, g) for _ in range(copies - 1)]
        nbytes = stored_bytes(first)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g)
            probe = read_bandwidth()
            row = {"shape": name, "format": fmt, "out": n, "in": k, "rows": rows, "weight_bytes": nbytes,
                   "copies": copies, "read_bandwidth": probe}
            row["isa"] = isa_name(fmt, rows)
            baseline = "avx2" if also_avx2 else "avx2-float" if fmt == "fp4" and rows <= INTEGER_ROWS else None
            baseline = baseline if fmt != "bf16" else None
            timed = {"1": [], baseline: []} if baseline else {"1": []}
            for round_ in range(args.rounds if baseline else 1):  # the two alternate, each going first in turn
                for choice in list(timed)[:: 1 if round_ % 2 == 0 else -1]:
                    use_isa(choice)
                    try:
                        timed[choice].append(time_products(lins, x, args.reps))
                    finally:
                        use_isa("1")
            seconds = statistics.median(timed["1"])
            row.update(kernel_ms=1e3 * seconds, kernel_gbps=nbytes / seconds / 1e9,
                       kernel_of_bandwidth=nbytes / seconds / probe)
            if baseline:
                seconds = statistics.median(timed[baseline])
                row.update(avx2_isa=isa_name(fmt, rows, baseline), avx2_ms=1e3 * seconds,
                           avx2_of_bandwidth=nbytes / seconds / probe)
            if rows in args.pytorch_rows:
                off = kernels.serves
                kernels.serves = lambda *a: False  # the PyTorch path: what the kernels replace
                try:
                    seconds = time_products(lins[:2], x, 2)
                finally:
                    kernels.serves = off
                row.update(pytorch_ms=1e3 * seconds, pytorch_gbps=nbytes / seconds / 1e9)
                row["speedup"] = row["pytorch_ms"] / row["kernel_ms"]
            rows_out.append(row)
            print(f"{name:<13} {fmt:<4} {n:>6} x {k:<5} rows {rows:>2}: {row['isa']:<12} {row['kernel_ms']:8.3f} ms "
                  f"{row['kernel_gbps']:5.1f} GB/s ({100 * row['kernel_of_bandwidth']:4.1f}% of {probe / 1e9:.1f})"
                  + (f"; {row['avx2_isa']} {row['avx2_ms']:7.3f} ms ({100 * row['avx2_of_bandwidth']:4.1f}%)"
                     if "avx2_ms" in row else "")
                  + (f"; PyTorch path {row['pytorch_ms']:8.2f} ms (x{row['speedup']:.0f})" if "pytorch_ms" in row
                     else ""), flush=True)
        del lins
    if args.moe_experts:
        rows_out += moe_layer(args.moe_experts, [1, 2], max(args.reps, 8), read_bandwidth(), g)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    after = read_bandwidth()
    print(f"read probe again: {after / 1e9:.1f} GB/s (the machine is shared: figures drift)")
    args.out.write_text(json.dumps({"threads": args.threads, "read_bandwidth": bandwidth,
                                    "read_bandwidth_after": after, "kernels": native.status().reason,
                                    "cpu": torch.backends.cpu.get_cpu_capability(), "results": rows_out}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
