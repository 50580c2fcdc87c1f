"""Model speed on this machine: prefill tokens/s and decode ms/token (batch 1), against measured rooflines.

    python benchmarks/model_speed.py [--presets tiny small] [--checkpoint DIR ...] [--backends eager compiled]
                                     [--weights dequantized stored] [--prompt 512] [--decode 64]

Rooflines are measured by the script itself: fp32 matmul peak (a large square matmul) and memory bandwidth (a large
tensor copy, read + write). Decode at batch 1 reads every active weight once per token: its roofline time is
active-weight bytes / bandwidth. Prefill is compute-bound: model FLOPs = 2 x active params per token + attention.
Backends: `eager` (the reference implementation) and `compiled` (model/compiled.py: fused kernels for prefill, each
decode step one graph, runtime/decode_graph.py), measured in turn in one process,
the best of `--rounds` each; the first warm-up of the compiled backend includes its compilation (less where
inductor's on-disk cache already holds the kernels). Weights (`--weights`): quantized weights dequantized to fp32
once, or kept as stored and computed by the native kernels (up to 16 rows) or dequantized tiles (the compiled
backend then runs decode per kernel, not as one graph). Writes benchmarks/results/model_speed.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from openflash.model.numerics import FP32
from openflash.runtime.decode_graph import DecodeGraph
from openflash.runtime.open import open_model
from openflash.runtime.runtime import Runtime
from openflash.tools.plan import build_plan

RESULTS = Path(__file__).parent / "results"


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - start)


def memory_bandwidth(mb: int = 512, reps: int = 5) -> float:
    src = torch.empty(mb * 2 ** 20 // 4)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - start)  # bytes read + written


def attention_flops_per_token(cfg, context: int) -> float:
    """Scores and value mixing over the window plus the selected compressed entries, per layer."""
    total = 0.0
    for t in cfg.topology.layers:
        keys = min(context, cfg.sliding_window) + (min(cfg.index_topk, context // max(t.compress_ratio, 1))
                                                   if t.compress_ratio else 0)
        total += 4 * cfg.num_attention_heads * cfg.head_dim * keys
        if t.has_indexer:
            total += 2 * cfg.index_n_heads * cfg.index_head_dim * context / t.compress_ratio
    return total


@torch.no_grad()
def measure(rt: Runtime, ids: torch.Tensor, decode_steps: int) -> tuple[float, float, float]:
    """(warm-up s: allocations, and compilation on the compiled backend; prefill s; decode s per token)."""
    start = time.perf_counter()
    for length in (32, ids.shape[1]):  # both shapes the timed calls use (a compiled kernel specialises on them)
        warm = rt.new_cache(1)
        token = rt.step(ids[:, :length], warm).argmax(-1)
        for _ in range(3):
            token = rt.decode(token, warm).argmax(-1)
    warm_s = time.perf_counter() - start
    cache = rt.new_cache(1)
    start = time.perf_counter()
    logits = rt.step(ids, cache, mode="exact")
    prefill_s = time.perf_counter() - start
    token = logits.argmax(-1)
    start = time.perf_counter()
    for _ in range(decode_steps):  # a decode step includes its hashing (the engine's cost too)
        token = rt.decode(token, cache).argmax(-1)
    return warm_s, prefill_s, (time.perf_counter() - start) / decode_steps


@torch.no_grad()
def profile_decode(rt: Runtime, ids: torch.Tensor, steps: int, rows: int = 15) -> str:
    cache = rt.new_cache(1)
    token = rt.step(ids, cache).argmax(-1)
    for _ in range(3):
        token = rt.decode(token, cache).argmax(-1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            token = rt.decode(token, cache).argmax(-1)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


@torch.no_grad()
def explain_decode(rt: Runtime, ids: torch.Tensor) -> dict:
    """torch._dynamo.explain of the body the compiled backend runs as one graph per decode step
    (`Transformer.static_decode`, runtime/decode_graph.py): how many graphs it makes, and where it breaks
    (file:line -> count). The body is examined on its own, so this supplies the rows the runtime would."""
    model = rt.model
    model.set_numerics(FP32.with_compile())
    cache = rt.new_cache(1)
    token = rt.step(ids, cache).argmax(-1).view(-1, 1)
    rows = DecodeGraph(model).prepare(cache, rt.memory.prepare(token, cache))
    out = torch._dynamo.explain(model.static_decode)(token, cache, rows)
    sites = Counter(f"{Path(b.user_stack[-1].filename).name}:{b.user_stack[-1].lineno}" if b.user_stack else "?"
                    for b in out.break_reasons)
    return {"graphs": out.graph_count, "graph_breaks": out.graph_break_count, "break_sites": dict(sites.most_common())}


def bench(name: str, prompt_len: int, decode_steps: int, peak: float, bandwidth: float, backends: list[str],
          rounds: int, profile: bool = False, explain: bool = False,
          weights: tuple[str, ...] = ("dequantized",)) -> list[dict]:
    """One model (a preset with random weights, or a checkpoint folder), every backend `rounds` times in turn;
    the best round of each is reported (the machine is shared: the minimum is the least disturbed)."""
    rt = open_model(name)
    model, cfg = rt.model, rt.cfg
    plan = build_plan(name)
    ids = torch.randint(3, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {(b, w): [] for b in backends for w in weights}
    for _ in range(rounds):
        for backend, residency in runs:
            model.set_numerics(FP32.with_compile(backend == "compiled")).set_weight_residency(residency)
            runs[backend, residency].append(measure(rt, ids, decode_steps))
    model.set_weight_residency(weights[0])
    # fp32 weights in memory: 4 bytes per active parameter, plus the KV entries one token reads
    decode_bytes = 4 * plan.active_decode_token
    prefill_flops = prompt_len * (2 * plan.active_decode_token + attention_flops_per_token(cfg, prompt_len))
    rows = []
    breaks = None
    if explain:
        breaks = explain_decode(rt, ids[:, :64])
        print(f"== {name}: a whole decode step under torch._dynamo.explain: {breaks['graphs']} graphs, "
              f"{breaks['graph_breaks']} breaks at {breaks['break_sites']}")
    if profile:
        for backend in backends:
            model.set_numerics(FP32.with_compile(backend == "compiled"))
            print(f"== {name}, {backend}: top ops of 10 decode steps (torch.profiler, self CPU time)")
            print(profile_decode(rt, ids[:, :64], 10))
    for (backend, residency), results in runs.items():
        prefill_s = min(r[1] for r in results)
        decode_s = min(r[2] for r in results)
        rows.append({
            "model": name, "backend": backend, "weights": residency, "prompt_tokens": prompt_len,
            "decode_steps": decode_steps,
            "first_warmup_s": results[0][0],
            "prefill_tokens_per_s": prompt_len / prefill_s,
            "decode_ms_per_token": 1000 * decode_s,
            "decode_bandwidth_fraction": decode_bytes / decode_s / bandwidth,
            "prefill_matmul_peak_fraction": prefill_flops / prefill_s / peak,
            "active_params_per_decode_token": plan.active_decode_token,
            **({"whole_step_explain": breaks} if breaks is not None else {}),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=["tiny", "small"])
    parser.add_argument("--checkpoint", nargs="*", default=[], metavar="DIR",
                        help="official-layout checkpoints (e.g. tests/goldens/A2, a `checkpoint synth` output)")
    parser.add_argument("--backends", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--weights", nargs="+", default=["dequantized"], choices=["dequantized", "stored"])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per backend (best one reported)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="print the top ops of 10 decode steps per backend")
    parser.add_argument("--explain", action="store_true",
                        help="count the graph breaks of the decode graph's body (torch._dynamo.explain)")
    parser.add_argument("--out", default=str(RESULTS / "model_speed.json"))
    args = parser.parse_args()
    peak, bandwidth = matmul_peak(), memory_bandwidth()
    print(f"machine: {torch.get_num_threads()} threads, fp32 matmul peak {peak / 1e9:.0f} GFLOP/s, "
          f"memory bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = [r for name in args.presets + args.checkpoint
            for r in bench(name, args.prompt, args.decode, peak, bandwidth, args.backends, args.rounds,
                           args.profile, args.explain, tuple(args.weights))]
    print(f"{'model':<22}{'backend':>9}{'weights':>12}{'warm-up s':>10}{'prefill tok/s':>15}{'of peak':>9}{'decode ms/tok':>15}"
          f"{'of bandwidth':>14}")
    for r in rows:
        print(f"{r['model']:<22}{r['backend']:>9}{r['weights']:>12}{r['first_warmup_s']:>10.1f}{r['prefill_tokens_per_s']:>15,.0f}"
              f"{r['prefill_matmul_peak_fraction']:>9.1%}{r['decode_ms_per_token']:>15.2f}"
              f"{r['decode_bandwidth_fraction']:>14.1%}")
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"matmul_peak_flops": peak, "memory_bandwidth_bytes_per_s": bandwidth,
                               "threads": torch.get_num_threads(), "results": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
