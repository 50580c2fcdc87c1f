"""Packed prefill of prompts of different lengths: one right-padded call against one call per length.

    python benchmarks/packed_prefill.py [--presets tiny small] [--prompts 16] [--lengths 8 128]
                                        [--paddings 0 0.1 0.25 0.5 0.75] [--rounds 5] [--backends eager compiled]

1. What a prefill call costs on this machine: one prompt of S tokens per call, S from 8 to 128, median of
   `--rounds`; a least-squares line gives the fixed cost of a call and the cost of a token (what the engine's
   default `prefill_padding` weighs: padding a pack is worth it while it costs less than another call).
2. The engine on a burst: `--prompts` prompts of lengths drawn from `--lengths` (seeded), submitted at once with room
   for all in one step (max_step_tokens 8192, prefill_chunk 128), one generated token each, so the wall time is
   the prefill. One engine per `prefill_padding` (0: only chunks of equal length share a call), run in turn, the
   variants alternating round by round; reported: median wall time, prefill calls and whether the first tokens
   are equal across variants.

Random weights, fp32 numerics, one torch thread unless `--threads`. Writes benchmarks/results/packed_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.model.numerics import FP32
from openflash.runtime.open import open_model
from openflash.runtime.runtime import Runtime

RESULTS = Path(__file__).parent / "results" / "packed_prefill.json"


@torch.no_grad()
def call_cost(rt: Runtime, sizes: list[int], rounds: int) -> dict:
    """Median seconds of a one-row prefill call of each size, and the fitted line (fixed s, s per token)."""
    g = torch.Generator().manual_seed(0)
    medians = {}
    for s in sizes:
        times = []
        for _ in range(rounds + 1):  # the first one warms up
            ids = torch.randint(3, rt.cfg.vocab_size, (1, s), generator=g)
            cache = rt.new_cache(1)
            start = time.perf_counter()
            rt.step(ids, cache, mode="bounded")
            times.append(time.perf_counter() - start)
        medians[s] = statistics.median(times[1:])
    xs, ys = list(medians), list(medians.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"seconds_by_tokens": medians, "fixed_s": my - slope * mx, "per_token_s": slope}


def burst(rt: Runtime, prompts: list[list[int]], padding: float) -> tuple[float, int, list[int]]:
    """Wall seconds to prefill every prompt (one token generated each), prefill calls, the first tokens."""
    engine = LLMEngine(rt, EngineConfig(max_batch=len(prompts), max_context=4096, prefill_chunk=128,
                                        max_step_tokens=8192, prefix_cache=False, prefill_padding=padding))
    start = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=1), ignore_eos=True)
    return time.perf_counter() - start, engine.runner.prefill_calls, [s.output_ids[0] for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--lengths", nargs=2, type=int, default=[8, 128], metavar=("LO", "HI"))
    ap.add_argument("--paddings", nargs="+", type=float, default=[0.0, 0.1, 0.25, 0.5, 0.75])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["eager"], choices=["eager", "compiled"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    lo, hi = args.lengths
    if not 1 <= lo <= hi or args.prompts < 1 or args.rounds < 1:
        ap.error("need 1 <= LO <= HI, --prompts >= 1 and --rounds >= 1")
    if not all(0 <= p < 1 for p in args.paddings):
        ap.error(f"--paddings must be in [0, 1), got {args.paddings}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(lo, hi + 1, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]
    results: dict = {"load_average_at_start": os.getloadavg(), "threads": args.threads, "prompt_lengths": lengths,
                     "runs": []}
    print(f"{args.prompts} prompts of {lo}-{hi} tokens ({sum(lengths)} in all): {lengths}")
    for preset in args.presets:
        rt = open_model(preset)
        model = rt.model
        for backend in args.backends:
            model.set_numerics(FP32.with_compile(backend == "compiled"))
            cost = call_cost(rt, [8, 16, 32, 64, 96, 128], args.rounds)
            print(f"== {preset} ({backend}): a prefill call costs {cost['fixed_s'] * 1e3:.1f} ms + "
                  f"{cost['per_token_s'] * 1e3:.3f} ms per token "
                  f"(= {cost['fixed_s'] / cost['per_token_s']:.0f} tokens)")
            for padding in args.paddings:  # warm-up: every shape each variant will run
                burst(rt, prompts, padding)
            walls: dict[float, list[float]] = {p: [] for p in args.paddings}
            calls, firsts = {}, {}
            for _ in range(args.rounds):
                for padding in args.paddings:
                    wall, calls[padding], firsts[padding] = burst(rt, prompts, padding)
                    walls[padding].append(wall)
            base = statistics.median(walls[args.paddings[0]])
            for padding in args.paddings:
                wall = statistics.median(walls[padding])
                row = {"preset": preset, "backend": backend, "prefill_padding": padding, "wall_s": wall,
                       "walls_s": walls[padding], "prefill_calls": calls[padding], "speedup_vs_first": base / wall,
                       "first_tokens_equal": firsts[padding] == firsts[args.paddings[0]]}
                results["runs"].append(row)
                print(f"  prefill_padding {padding:4.2f}: {wall * 1e3:7.1f} ms ({calls[padding]:2d} calls), "
                      f"x{row['speedup_vs_first']:.2f}, first tokens equal: {row['first_tokens_equal']}")
            results.setdefault("call_cost", {})[f"{preset}/{backend}"] = cost
        model.set_numerics(FP32)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
