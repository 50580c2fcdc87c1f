"""Serving benchmark: throughput and latency of the engine and the HTTP server, prefix caching, prefill modes.

    python benchmarks/serve.py [--presets tiny small] [--levels 1 4 16 64] [--threads 1] [--skip-http]
                               [--backends eager compiled] [--prefill-batch 1 16] [--step-tokens 512 1024]
                               [--prefill-padding 0 0.5] [--prompt-len 64 | --prompt-len-range 16 256]

Presets run with random weights (throughput does not depend on the weights) and the default fp32 numerics;
prompts are random token ids below 1000 (valid for both presets) of `--prompt-len` tokens, or of a length drawn per
request from `--prompt-len-range` (mixed lengths: what right-padded packed prefill is for); completions have a fixed
length (ignore_eos).

1. Concurrency (engine, closed loop): C client threads each submit a request to the running engine (its background
   thread, as in the server), wait for it to finish, submit the next, until the request budget is spent. Reported:
   generated tokens/s over the wall time, time to first token (arrival -> first token) and inter-token latency
   (between consecutive tokens of a request) p50 / p99, from the engine's per-token timestamps.
2. Shared prefix: a long common system prompt plus a short distinct question, one request at a time, with and
   without the prefix cache ("snapshot" restore). The first request fills the cache; TTFT is the median over the
   rest. Outputs are checked equal.
3. Prefill mode: TTFT of a long prompt with bounded replay (CED, the decoder half only on the last sliding_window
   tokens) vs exact (every layer on every token), no prefix cache.
4. HTTP (tiny): `openflash serve` in a subprocess, C asyncio clients streaming /v1/completions; TTFT is the first
   SSE chunk, inter-token latency per request is (last chunk - first chunk) / (completion tokens - 1).

Writes benchmarks/results/serve.json and prints tables. Figures from a shared machine are noisy: the load average
at the start is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.sampling import SamplingParams
from openflash.model.numerics import FP32
from openflash.runtime.open import open_model
from openflash.runtime.runtime import Runtime

RESULTS = Path(__file__).parent / "results" / "serve.json"


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def random_prompt(n: int | tuple[int, int], seed: int) -> list[int]:
    """n tokens, or a length drawn from [lo, hi] by the same seed."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(n, tuple):
        n = int(torch.randint(n[0], n[1] + 1, (1,), generator=g))
    return torch.randint(3, 1000, (n,), generator=g).tolist()


# ---- engine-level ------------------------------------------------------------------------------------------------


def closed_loop(engine: LLMEngine, clients: int, requests: int, prompt_len: int | tuple[int, int],
                max_tokens: int, seed: int = 0) -> dict:
    """C clients, `requests` requests in total, each client one request at a time."""
    counter = iter(range(requests))
    lock = threading.Lock()
    done: list = []

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            finished = threading.Event()
            seq = engine.add_request(random_prompt(prompt_len, seed + i), SamplingParams(max_tokens=max_tokens),
                                     on_output=lambda o: o.finished and finished.set(), ignore_eos=True)
            finished.wait()
            with lock:
                done.append(seq)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = [s.first_token_time - s.arrival_time for s in done]
    itl = [b - a for s in done for a, b in zip(s.token_times, s.token_times[1:])]
    tokens = sum(len(s.output_ids) for s in done)
    return {"clients": clients, "requests": len(done), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "itl_p50_s": quantile(itl, 0.5), "itl_p99_s": quantile(itl, 0.99)}


def bench_concurrency(rt: Runtime, levels: list[int], prompt_len: int | tuple[int, int], max_tokens: int,
                      prefill_batches: list[int], step_tokens: list[int], backends: list[str],
                      paddings: list[float]) -> tuple[list[dict], dict]:
    """Each level run on one engine per (backend, prefill_batch, max_step_tokens, prefill_padding), back to back
    (variants side by side); the model's numerics switch to each engine's backend before it runs. Returns the rows
    and, per backend, the warm-up's seconds and decode graphs (compiled backend)."""
    numerics = {"eager": FP32, "compiled": FP32.with_compile()}
    model = rt.model
    engines = {(be, b, st, pad): LLMEngine(rt, EngineConfig(
        max_batch=max(levels), max_context=4096, prefill_chunk=128, max_step_tokens=st, prefix_cache=False,
        prefill_batch=b, prefill_padding=pad))
        for be in backends for b in prefill_batches for st in step_tokens for pad in paddings}
    warm: dict[str, dict] = {}
    for engine in engines.values():
        engine.start()
    try:
        for (be, *_), engine in engines.items():
            model.set_numerics(numerics[be])
            # Warm-up at every level, largest first: the compiled backend's graphs (its first batch size is a graph of
            # its own, the others share a symbolic one) and the grown block pool are built here, not in a measurement.
            start = time.perf_counter()
            for c in sorted(levels, reverse=True):
                closed_loop(engine, c, c, prompt_len, 4, seed=10_000 + c)
            seconds = time.perf_counter() - start
            warm.setdefault(be, {"seconds": 0.0})["seconds"] += seconds
            warm[be]["decode_graph"] = rt.stats()["decode_graph"]
            print(f"  warm-up ({be}): {seconds:.1f} s, decode graph {warm[be]['decode_graph']}", flush=True)
        rows = []
        for c in levels:
            requests = max(4, c) if c < 64 else c  # bounded: every client sends 1-4 requests
            for (be, b, st, pad), engine in engines.items():
                model.set_numerics(numerics[be])
                calls = engine.runner.prefill_calls
                rows.append({"backend": be, "prefill_batch": b, "max_step_tokens": st, "prefill_padding": pad,
                             **closed_loop(engine, c, requests, prompt_len, max_tokens, seed=1000 * c),
                             "prefill_calls": engine.runner.prefill_calls - calls})
                print(f"  {c:3d} clients, {be}, prefill_batch {b:2d}, step tokens {st}, padding {pad}: "
                      f"{rows[-1]['tokens_per_s']:8.1f} tok/s, TTFT p50 {rows[-1]['ttft_p50_s'] * 1000:.0f} ms, "
                      f"{rows[-1]['prefill_calls']} prefill calls", flush=True)
        return rows, warm
    finally:
        model.set_numerics(FP32)
        for engine in engines.values():
            engine.shutdown(0)


def run_alone(engine: LLMEngine, prompt: list[int], max_tokens: int):
    finished = threading.Event()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens),
                             on_output=lambda o: o.finished and finished.set(), ignore_eos=True)
    finished.wait()
    return seq


def bench_shared_prefix(rt: Runtime, system_len: int, question_len: int, requests: int, chunk: int) -> dict:
    system = random_prompt(system_len, 7)
    prompts = [system + random_prompt(question_len, 100 + i) for i in range(requests)]
    out = {"system_tokens": system_len, "question_tokens": question_len, "requests": requests, "prefill_chunk": chunk}
    outputs = {}
    variants = {"without_prefix_cache": dict(prefix_cache=False),
                "with_prefix_cache": dict(prefix_cache=True, prefix_restore="snapshot"),
                "with_prefix_cache_replay": dict(prefix_cache=True, prefix_restore="replay")}
    for key, options in variants.items():
        engine = LLMEngine(rt, EngineConfig(max_context=8192, prefill_chunk=chunk, max_step_tokens=chunk,
                                                    **options))
        engine.start()
        try:
            seqs = [run_alone(engine, p, 8) for p in prompts]
        finally:
            engine.shutdown(0)
        ttft = [s.first_token_time - s.arrival_time for s in seqs]
        out[key] = {"first_ttft_s": ttft[0], "ttft_p50_s": statistics.median(ttft[1:]),
                    "cached_tokens": [s.num_cached for s in seqs]}
        outputs[key] = [s.output_ids for s in seqs]
        if engine.prefix_cache is not None:
            out[key]["hit_rate"] = engine.prefix_cache.stats.hit_rate
            out[key]["cache_bytes"] = engine.prefix_cache.nbytes
    base = outputs["without_prefix_cache"]
    out["ttft_speedup"] = out["without_prefix_cache"]["ttft_p50_s"] / out["with_prefix_cache"]["ttft_p50_s"]
    out["ttft_speedup_replay"] = out["without_prefix_cache"]["ttft_p50_s"] / \
        out["with_prefix_cache_replay"]["ttft_p50_s"]
    out["outputs_equal"] = outputs["with_prefix_cache"] == base
    # Replay restore approximates the windows: the fraction of greedy tokens equal to the uncached run.
    pairs = [(a, b) for x, y in zip(outputs["with_prefix_cache_replay"], base) for a, b in zip(x, y)]
    out["replay_token_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
    return out


def bench_prefill_modes(rt: Runtime, prompt_len: int, repeats: int, chunk: int) -> dict:
    out = {"prompt_tokens": prompt_len, "sliding_window": rt.cfg.sliding_window}
    firsts = {}
    for mode in ("bounded", "exact"):
        engine = LLMEngine(rt, EngineConfig(max_context=8192, prefill_chunk=chunk, max_step_tokens=chunk,
                                                    prefill_mode=mode, prefix_cache=False))
        engine.start()
        try:
            seqs = [run_alone(engine, random_prompt(prompt_len, 500 + i), 2) for i in range(repeats)]
        finally:
            engine.shutdown(0)
        out[f"{mode}_ttft_s"] = statistics.median(s.first_token_time - s.arrival_time for s in seqs)
        firsts[mode] = [s.output_ids[0] for s in seqs]
    out["speedup"] = out["exact_ttft_s"] / out["bounded_ttft_s"]
    out["first_tokens_agree"] = sum(a == b for a, b in zip(firsts["bounded"], firsts["exact"])) / repeats
    return out


# ---- HTTP ------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_clients(url: str, clients: int, requests: int, prompt_len: int, max_tokens: int) -> dict:
    import httpx

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    ttft, itl, tokens = [], [], 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            body = {"model": "tiny", "prompt": random_prompt(prompt_len, 2000 + i), "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            start, first, last, n = time.perf_counter(), None, None, 0
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"]:
                        last = time.perf_counter()
                        first = first or last
            ttft.append(first - start)
            if n > 1:
                itl.append((last - first) / (n - 1))
            tokens += n

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - start
    return {"clients": clients, "requests": requests, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "itl_p50_s": quantile(itl, 0.5), "itl_p99_s": quantile(itl, 0.99)}


def bench_http(levels: list[int], prompt_len: int, max_tokens: int, threads: int) -> list[dict]:
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "openflash.cli", "serve", "--model", "tiny", "--port", str(port),
           "--max-batch", str(max(levels))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("openflash serve did not start")
            time.sleep(0.2)
        asyncio.run(http_clients(url, 2, 2, prompt_len, 4))  # warm-up
        rows = []
        for c in levels:
            rows.append(asyncio.run(http_clients(url, c, max(4, c) if c < 64 else c, prompt_len, max_tokens)))
            print(f"  http {c:3d} clients: {rows[-1]['tokens_per_s']:8.1f} tok/s", flush=True)
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ---- main ----------------------------------------------------------------------------------------------------------


def fmt(v: float | None, scale: float = 1000.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--levels", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prompt-len-range", nargs=2, type=int, default=None, metavar=("LO", "HI"),
                    help="concurrency part: each request's prompt length drawn from [LO, HI] (instead of --prompt-len)")
    ap.add_argument("--prefill-padding", nargs="+", type=float, default=[0.25],
                    help="engine prefill_padding values compared side by side (the last one is the default's figures)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=1536, help="shared system prompt of the prefix workload")
    ap.add_argument("--long-prompt", type=int, default=1024, help="prompt of the prefill-mode comparison")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (engine and HTTP server)")
    ap.add_argument("--prefill-batch", nargs="+", type=int, default=[1, 16],
                    help="engine prefill_batch values compared side by side (the last one is the default's figures)")
    ap.add_argument("--step-tokens", nargs="+", type=int, default=[512],
                    help="engine max_step_tokens values compared side by side (the last one is the default's figures)")
    ap.add_argument("--backends", nargs="+", default=["eager"], choices=["eager", "compiled"],
                    help="engine backends compared side by side in the concurrency part (compiled: --compile)")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--concurrency-only", action="store_true", help="skip the shared-prefix and prefill-mode parts")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    for name in ("levels", "prefill_batch", "step_tokens"):
        if min(getattr(args, name)) < 1:
            ap.error(f"--{name.replace('_', '-')} values must be >= 1, got {getattr(args, name)}")
    if not all(0 <= p < 1 for p in args.prefill_padding):
        ap.error(f"--prefill-padding values must be in [0, 1), got {args.prefill_padding}")
    if args.prompt_len_range is not None and not 1 <= args.prompt_len_range[0] <= args.prompt_len_range[1]:
        ap.error(f"--prompt-len-range needs 1 <= LO <= HI, got {args.prompt_len_range}")
    prompt_len = args.prompt_len if args.prompt_len_range is None else tuple(args.prompt_len_range)
    torch.set_num_threads(args.threads)
    results: dict = {"load_average_at_start": os.getloadavg(), "threads": args.threads,
                     "cpu_count": os.cpu_count(), "prompt_len": prompt_len, "max_tokens": args.max_tokens,
                     "presets": {}}
    for preset in args.presets:
        print(f"== {preset}", flush=True)
        rt = open_model(preset)
        r: dict = {}
        r["concurrency"], r["warm_up"] = bench_concurrency(rt, args.levels, prompt_len,
                                                           args.max_tokens, args.prefill_batch, args.step_tokens,
                                                           args.backends, args.prefill_padding)
        main_rows = [x for x in r["concurrency"] if x["prefill_batch"] == args.prefill_batch[-1]
                     and x["max_step_tokens"] == args.step_tokens[-1] and x["backend"] == args.backends[0]
                     and x["prefill_padding"] == args.prefill_padding[-1]]
        one = next((x for x in main_rows if x["clients"] == 1), None)
        sixteen = next((x for x in main_rows if x["clients"] == 16), None)
        if one and sixteen:
            r["throughput_16_vs_1"] = sixteen["tokens_per_s"] / one["tokens_per_s"]
        results["presets"][preset] = r
        if args.concurrency_only:
            continue
        r["shared_prefix"] = bench_shared_prefix(rt, args.system_len, 16, 5, 256)
        sp = r["shared_prefix"]
        print(f"  shared prefix: TTFT x{sp['ttft_speedup']:.1f} (replay x{sp['ttft_speedup_replay']:.1f})", flush=True)
        r["prefill_modes"] = bench_prefill_modes(rt, args.long_prompt, 3, 256)
        print(f"  bounded vs exact prefill: x{r['prefill_modes']['speedup']:.2f}", flush=True)
    if not args.skip_http:
        print("== http (tiny, openflash serve)", flush=True)
        results["http_tiny"] = bench_http(args.levels, args.prompt_len, args.max_tokens, args.threads)

    print(f"\nload average at start {results['load_average_at_start']}, torch threads {args.threads}")
    print(f"{'preset':6s} {'clients':>7s} {'backend':>9s} {'pack':>4s} {'step':>5s} {'pad':>4s} {'req':>4s} "
          f"{'tok/s':>8s} {'TTFT p50':>9s} "
          f"{'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s}   (ms)")
    rows = [(p, x) for p, r in results["presets"].items() for x in r["concurrency"]]
    rows += [("http", x) for x in results.get("http_tiny", [])]
    for name, x in rows:
        print(f"{name:6s} {x['clients']:7d} {x.get('backend', '-'):>9s} {x.get('prefill_batch', '-'):>4} "
              f"{x.get('max_step_tokens', '-'):>5} {x.get('prefill_padding', '-'):>4} {x['requests']:4d} "
              f"{x['tokens_per_s']:8.1f} {fmt(x['ttft_p50_s']):>9s} "
              f"{fmt(x['ttft_p99_s']):>9s} {fmt(x['itl_p50_s']):>8s} {fmt(x['itl_p99_s']):>8s}")
    for p, r in results["presets"].items():
        if "shared_prefix" not in r:
            continue
        sp, pm = r["shared_prefix"], r["prefill_modes"]
        ttft_off, ttft_on = sp["without_prefix_cache"]["ttft_p50_s"], sp["with_prefix_cache"]["ttft_p50_s"]
        print(f"{p}: 16 vs 1 client throughput x{r.get('throughput_16_vs_1', float('nan')):.2f}; shared prefix "
              f"({sp['system_tokens']} + {sp['question_tokens']} tokens) TTFT {fmt(ttft_off)}"
              f" -> {fmt(ttft_on)} ms (x{sp['ttft_speedup']:.1f}, outputs equal: {sp['outputs_equal']}; replay "
              f"restore x{sp['ttft_speedup_replay']:.1f}, {sp['replay_token_agreement']:.0%} tokens agree); "
              f"{pm['prompt_tokens']}-token prefill bounded {fmt(pm['bounded_ttft_s'])} ms vs "
              f"exact {fmt(pm['exact_ttft_s'])} ms (x{pm['speedup']:.2f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
