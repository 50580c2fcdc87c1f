"""A prompt sampled G times (an RL group, a completion's n): prefilled once and forked, against prefilled G times.

    python benchmarks/shared_prompts.py [--presets tiny small] [--prompt-tokens 512] [--groups 2] [--group-size 8]
                                        [--max-tokens 8] [--rounds 3]

`--groups` prompts of `--prompt-tokens` random ids, each submitted `--group-size` times at once with its own seed
(temperature 1, `--max-tokens` tokens, exact prefill, no prefix cache), to an engine with `share_prompts` on (the
twins wait for one prefill and take copies of its state) and one with it off; the variants alternate round by
round. Reported per variant: median wall seconds, prompt tokens prefilled, and whether the sampled tokens agree.

Random weights, fp32 numerics, one torch thread unless `--threads`. Writes benchmarks/results/shared_prompts.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.runtime.open import open_model
from openflash.runtime.runtime import Runtime

RESULTS = Path(__file__).parent / "results" / "shared_prompts.json"


def run(rt: Runtime, prompts: list[list[int]], params: list[SamplingParams], share: bool
        ) -> tuple[float, int, list[list[int]]]:
    """Wall seconds of the whole batch, prompt tokens prefilled, each request's tokens."""
    engine = LLMEngine(rt, EngineConfig(max_batch=len(prompts), max_context=4096, prefill_chunk=128,
                                        max_step_tokens=2048, prefill_mode="exact", prefix_cache=False,
                                        share_prompts=share))
    start = time.perf_counter()
    seqs = engine.generate(prompts, params, ignore_eos=True)
    return time.perf_counter() - start, engine.metrics.prompt_tokens, [s.output_ids for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if min(args.prompt_tokens, args.groups, args.group_size, args.max_tokens, args.rounds, args.threads) < 1:
        ap.error("every count must be >= 1")
    torch.set_num_threads(args.threads)
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "presets": {}}
    for preset in args.presets:
        rt = open_model(preset, numerics="fp32")
        g = torch.Generator().manual_seed(0)
        unique = [torch.randint(3, rt.cfg.vocab_size, (args.prompt_tokens,), generator=g).tolist()
                  for _ in range(args.groups)]
        prompts = [p for p in unique for _ in range(args.group_size)]
        params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=i) for i in range(len(prompts))]
        times: dict[str, list[float]] = {"shared": [], "apart": []}
        prefilled, tokens = {}, {}
        run(rt, prompts[:1], params[:1], True)  # warm-up
        for _ in range(args.rounds):
            for name in times:
                seconds, prefilled[name], tokens[name] = run(rt, prompts, params, name == "shared")
                times[name].append(seconds)
        row = {name: {"median_s": round(statistics.median(t), 3), "prompt_tokens_prefilled": prefilled[name]}
               for name, t in times.items()}
        row["speedup"] = round(row["apart"]["median_s"] / row["shared"]["median_s"], 2)
        row["same_tokens"] = tokens["shared"] == tokens["apart"]
        results["presets"][preset] = row
        print(f"{preset}: {args.groups} prompts x {args.group_size} samples of {args.prompt_tokens} tokens, "
              f"{args.max_tokens} generated: shared {row['shared']['median_s']:.2f} s "
              f"({row['shared']['prompt_tokens_prefilled']} prompt tokens prefilled), apart "
              f"{row['apart']['median_s']:.2f} s ({row['apart']['prompt_tokens_prefilled']}): "
              f"{row['speedup']}x, same tokens: {row['same_tokens']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
