"""The CPU's work when another process keeps one core busy: one-row FP4 and FP8 products through `Linear` on
released expert shapes (weights past the cache) and `small`'s greedy decode, quiet and then beside a busy loop
this script starts itself, side by side in one run.

    python benchmarks/sharing.py [--what products decode] [--tokens 64] [--out benchmarks/results/sharing.json]

Products: 100 copies of each shape cycled (benchmarks/kernels.py `stored_linear`, `time_products`), five
measurements of three passes each; decode: `generate` of 64 tokens after a 64-token prompt, three times after a
warm-up, ms a token (`--tokens`: how many). Each figure is "best / median". The busy loop is a child `python -c "while True: pass"`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernels import stored_linear, time_products  # noqa: E402 (beside this file)

RESULTS = Path(__file__).parent / "results" / "sharing.json"
SHAPES = (("fp4", 2304, 5120), ("fp8", 1280, 5120))


def products() -> dict[str, str]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for fmt, n, k in SHAPES:
        lins = [stored_linear(fmt, n, k, g) for _ in range(100)]
        x = torch.randn(1, k)
        t = sorted(time_products(lins, x, 3) for _ in range(5))
        out[f"{fmt} {n}x{k} ms"] = f"{t[0] * 1e3:.3f} / {t[2] * 1e3:.3f}"
    return out


def decode(runtime, tokens: int) -> dict[str, str]:
    from openflash.engine.generate import generate
    from openflash.engine.sampling import SamplingParams

    prompt, params = list(range(3, 67)), SamplingParams(max_tokens=tokens, temperature=0.0)
    generate(runtime, prompt, params)
    ms = [generate(runtime, prompt, params).decode_seconds / (tokens - 1) * 1e3 for _ in range(3)]
    return {"small decode ms/token": f"{min(ms):.1f} / {statistics.median(ms):.1f}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", nargs="+", choices=("products", "decode"), default=["products", "decode"])
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded a measurement (at least 2)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.tokens < 2:
        ap.error(f"--tokens must be at least 2, got {args.tokens}")
    runtime = None
    if "decode" in args.what:
        from openflash.runtime.open import open_model

        runtime = open_model("small")
    results = {}
    for setting in ("quiet", "one core busy"):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if setting != "quiet" else None
        try:
            row = {}
            if "products" in args.what:
                row.update(products())
            if runtime is not None:
                row.update(decode(runtime, args.tokens))
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        results[setting] = row
        print(setting, row, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
