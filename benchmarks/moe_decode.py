"""Decode steps with the routed experts batched (one set of matmuls over the step's selected experts) against the
per-expert loop, side by side in one process.

    python benchmarks/moe_decode.py [--preset small] [--batches 1 8 32] [--steps 20] [--rounds 3]

The same model and caches run both variants in alternating rounds (fp32 numerics; the variants differ only in
`Numerics.batched_experts`). Prints the median decode-step milliseconds and the mean milliseconds of a step spent in
the MoE sublayers (forward hooks, which add a little to both variants); writes
benchmarks/results/moe_decode.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from openflash.config import load_config
from openflash.model.moe import MoE
from openflash.model.numerics import FP32
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime

RESULTS = Path(__file__).parent / "results"
GROUPED = dataclasses.replace(FP32, name="fp32-per-expert", batched_experts=False)


class MoeClock:
    """Wall time spent inside the model's MoE sublayers (forward hooks), per decode step."""

    def __init__(self, model) -> None:
        self.seconds, self._start = 0.0, 0.0
        for module in model.modules():
            if isinstance(module, MoE):
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._leave)

    def _enter(self, *_) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_) -> None:
        self.seconds += time.perf_counter() - self._start


def time_steps(rt: Runtime, clock: MoeClock, batch: int, steps: int) -> tuple[float, float]:
    """Median ms of a decode step after a 64-token prompt (a fresh cache per call of this function), and the mean
    ms of it spent in the MoE sublayers."""
    cache = rt.new_cache(batch)
    ids = torch.randint(3, rt.cfg.vocab_size - 1, (batch, 64), generator=torch.Generator().manual_seed(batch))
    rt.step(ids, cache)
    token = ids[:, -1]
    times = []
    clock.seconds = 0.0
    for _ in range(steps):
        begin = time.perf_counter()
        rt.decode(token, cache)
        times.append(time.perf_counter() - begin)
    return 1000 * statistics.median(times[2:]), 1000 * clock.seconds / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "moe_decode.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(load_config(args.preset)).eval()
    rt = Runtime.of(model)
    clock = MoeClock(model)
    results = []
    for batch in args.batches:
        ms = {"batched": [], "per_expert": []}
        moe = {"batched": [], "per_expert": []}
        for _ in range(args.rounds):
            for name, numerics in (("batched", FP32), ("per_expert", GROUPED)):
                model.set_numerics(numerics)
                step, in_moe = time_steps(rt, clock, batch, args.steps)
                ms[name].append(step)
                moe[name].append(in_moe)
        row = {"batch": batch, **{f"{k}_ms": statistics.median(v) for k, v in ms.items()},
               **{f"{k}_moe_ms": statistics.median(v) for k, v in moe.items()}}
        row["speedup"] = row["per_expert_ms"] / row["batched_ms"]
        results.append(row)
        print(f"batch {batch}: decode step {row['per_expert_ms']:.1f} ms per expert -> {row['batched_ms']:.1f} ms "
              f"batched (x{row['speedup']:.2f}); in the MoE {row['per_expert_moe_ms']:.1f} -> "
              f"{row['batched_moe_ms']:.1f} ms")
    model.set_numerics(FP32)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"preset": args.preset, "threads": args.threads, "results": results}, indent=1)
                        + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
