"""Weights dequantized once (fp32 copies) against weights kept as stored (tile-by-tile dequantization), side by side.

    python benchmarks/weight_residency.py [--config small] [--layers 1 --experts 16] [--rounds 3] [--steps 8]

Two official-layout checkpoints written with `checkpoint synth`: the `small` preset (FP8 / FP4 at small width) and
the released widths cut to a few layers and experts. Each is loaded both ways; rounds alternate the two on the same
prompt. Prints decode ms/token (batch 1), prefill tokens/s and resident bytes; writes
benchmarks/results/weight_residency.json. This is what `--weights auto` is chosen by: dequantized wherever its copies
fit, stored where they would not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from openflash.residency import resident_bytes
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.runtime.runtime import Runtime
from openflash.tools.synth import synthesize

RESULTS = Path(__file__).parent / "results"


def timed(rt: Runtime, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    cache = rt.new_cache(1)
    start = time.perf_counter()
    logits = rt.step(prompt, cache)
    prefill = time.perf_counter() - start
    times = []
    for _ in range(steps):
        token = logits.argmax(-1)
        start = time.perf_counter()
        logits = rt.decode(token, cache)
        times.append(time.perf_counter() - start)
    return prompt.shape[1] / prefill, 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--layers", type=int, default=1, help="released-width layers (1: before the first Engram layer)")
    ap.add_argument("--experts", type=int, default=16, help="released-width experts per layer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="openflash-residency-") as tmp:
        cases = {args.config: synthesize(args.config, Path(tmp) / "a"),
                 f"released width, {args.layers} layers x {args.experts} experts":
                     synthesize("flash", Path(tmp) / "b", layers=args.layers, experts=args.experts, vision=False)}
        for name, report in cases.items():
            models = {w: open_model(str(report.folder), placement=Placement(weights=w))
                      for w in ("dequantized", "stored")}
            vocab = models["stored"].cfg.vocab_size
            prompt = torch.randint(3, min(vocab, 4000), (1, args.prompt), generator=torch.Generator().manual_seed(0))
            runs: dict[str, list] = {w: [] for w in models}
            for _ in range(args.rounds):
                for w, rt in models.items():
                    runs[w].append(timed(rt, prompt, args.steps))
            results[name] = {w: {"prefill_tokens_per_s": [round(r[0], 1) for r in rs],
                                 "decode_ms": [round(r[1], 1) for r in rs],
                                 "resident_bytes": resident_bytes(models[w].model),
                                 "checkpoint_bytes": report.logical_bytes} for w, rs in runs.items()}
            for w, r in results[name].items():
                print(f"{name:<42} {w:<12} decode {min(r['decode_ms']):8.1f}-{max(r['decode_ms']):8.1f} ms/token, "
                      f"prefill {min(r['prefill_tokens_per_s']):7.1f}-{max(r['prefill_tokens_per_s']):7.1f} tok/s, "
                      f"resident {r['resident_bytes'] / 2**20:9.1f} MiB (checkpoint "
                      f"{r['checkpoint_bytes'] / 2**20:.1f} MiB)", flush=True)
            del models
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "weight_residency.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
