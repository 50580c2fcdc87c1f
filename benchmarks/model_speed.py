"""Model speed on this machine: prefill tokens/s and decode ms/token (batch 1), against measured rooflines.

    python benchmarks/model_speed.py [--presets tiny small] [--prompt 512] [--decode 64]

Rooflines are measured by the script itself: fp32 matmul peak (a large square matmul) and memory bandwidth (a large
tensor copy, read + write). Decode at batch 1 reads every active weight once per token: its roofline time is
active-weight bytes / bandwidth. Prefill is compute-bound: model FLOPs = 2 x active params per token + attention.
Writes benchmarks/results/model_speed.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from openflash.checkpoint import build_model
from openflash.config import load_config
from openflash.memory.placement import EngramMemory
from openflash.model.numerics import FP32
from openflash.plan import build_plan
from openflash.tokenizer import preset_tokenizer

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
def bench(preset: str, prompt_len: int, decode_steps: int, peak: float, bandwidth: float) -> dict:
    cfg = load_config(preset)
    torch.manual_seed(0)
    model = build_model(cfg, FP32).eval()
    memory = EngramMemory.attach(model, "device", tokenizer=preset_tokenizer(cfg))
    plan = build_plan(preset)
    ids = torch.randint(3, cfg.vocab_size, (1, prompt_len))
    warm = model.new_cache(1)
    model.step(ids[:, :32], warm, engram=memory.prepare(ids[:, :32], warm))  # warm-up (allocations)
    cache = model.new_cache(1)
    start = time.perf_counter()
    logits = model.step(ids, cache, mode="exact", engram=memory.prepare(ids, cache))
    prefill_s = time.perf_counter() - start
    token = logits.argmax(-1)
    for _ in range(3):
        scratch = cache.select([0])
        model.decode(token, scratch, engram=memory.prepare(token.view(-1, 1), scratch))
    start = time.perf_counter()
    for _ in range(decode_steps):  # a decode step includes its hashing (the engine's cost too)
        token = model.decode(token, cache, engram=memory.prepare(token.view(-1, 1), cache)).argmax(-1)
    decode_s = (time.perf_counter() - start) / decode_steps
    # fp32 weights in memory: 4 bytes per active parameter, plus the KV entries one token reads
    decode_bytes = 4 * plan.active_decode_token
    prefill_flops = prompt_len * (2 * plan.active_decode_token + attention_flops_per_token(cfg, prompt_len))
    return {
        "preset": preset, "prompt_tokens": prompt_len, "decode_steps": decode_steps,
        "prefill_tokens_per_s": prompt_len / prefill_s,
        "decode_ms_per_token": 1000 * decode_s,
        "decode_bandwidth_fraction": decode_bytes / decode_s / bandwidth,
        "prefill_matmul_peak_fraction": prefill_flops / prefill_s / peak,
        "active_params_per_decode_token": plan.active_decode_token,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    args = parser.parse_args()
    peak, bandwidth = matmul_peak(), memory_bandwidth()
    print(f"machine: {torch.get_num_threads()} threads, fp32 matmul peak {peak / 1e9:.0f} GFLOP/s, "
          f"memory bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = [bench(p, args.prompt, args.decode, peak, bandwidth) for p in args.presets]
    print(f"{'preset':<8}{'prefill tok/s':>15}{'of peak':>10}{'decode ms/tok':>15}{'of bandwidth':>14}")
    for r in rows:
        print(f"{r['preset']:<8}{r['prefill_tokens_per_s']:>15,.0f}{r['prefill_matmul_peak_fraction']:>10.1%}"
              f"{r['decode_ms_per_token']:>15.2f}{r['decode_bandwidth_fraction']:>14.1%}")
    RESULTS.mkdir(exist_ok=True)
    out = {"matmul_peak_flops": peak, "memory_bandwidth_bytes_per_s": bandwidth, "results": rows}
    (RESULTS / "model_speed.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
