"""A released-width decode step with every weight in RAM: a cut of the released model that fits (one layer with all
384 routed experts, the released head and vocabulary, Engram rows from the disk tier), greedy at batch 1 and through
the engine at 4 and 16 streams, against a read probe measured in the same run.

    python benchmarks/resident_decode.py [--dir runs/bench/resident_l1] [--layers 1] [--tokens 48] [--streams 1 4 16]

Writes the checkpoint first if the folder holds none (`openflash checkpoint synth flash DIR --layers N
--no-vision`, about a minute and 9.4 GiB a layer). Per decode token at batch 1: the bytes it reads from RAM (every
stored non-expert weight but the embedding's one row, and the 6 routed experts a layer picks), the roofline those
bytes give at the probe's bandwidth (a sum over 1 GiB, torch's threads), the share reached, and a profile of a few
steps (cProfile, by function: where the time goes that bytes do not explain). Writes
benchmarks/results/resident_decode.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernels import read_bandwidth  # noqa: E402 (beside this file)

from openflash.checkpoint import load_checkpoint  # noqa: E402
from openflash.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from openflash.engine.sampling import SamplingParams  # noqa: E402
from openflash.memory.experts import ExpertStore  # noqa: E402
from openflash.model.layers import Linear  # noqa: E402
from openflash.residency import resident_bytes  # noqa: E402
from openflash.runtime.runtime import Runtime  # noqa: E402
from openflash.tools.synth import synthesize  # noqa: E402

RESULTS = Path(__file__).parent / "results"
GiB = 1 << 30


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids = tokenizer.encode(text).ids
    return [ids[i * 7: i * 7 + length] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="runs/bench/resident_l1")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48, help="decode steps at batch 1 (and per stream)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--out", default=str(RESULTS / "resident_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    folder = Path(args.dir)
    if not (folder / "config.json").is_file():
        t = time.perf_counter()
        synthesize("flash", folder, layers=args.layers, vision=False)
        print(f"wrote {folder} in {time.perf_counter() - t:.0f} s", flush=True)

    model, report = load_checkpoint(folder, weights="stored", skip_experts=True, skip_engram_tables=True)
    store = ExpertStore(folder, model.cfg, model.numerics, "host")
    rt = Runtime.of(model, report.tokenizer, frontend=report.engram_frontend, experts=store, folder=folder)
    rt.place_engram("disk", cache_bytes=64 << 20)
    cfg = model.cfg
    probe = read_bandwidth()
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() + (m.scale.numel() if m.quantized else 0)
                       for m in model.modules() if isinstance(m, Linear) and not m.weight.is_meta)
    expert = next(iter(store._host.values()))  # one expert's stored tensors: w1, w2, w3 and their scales
    per_expert = sum(t.numel() * t.element_size() for t in expert.values())
    routed_bytes = cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert
    token_bytes = linear_bytes + routed_bytes
    print(f"read probe {probe / 1e9:.1f} GB/s; dense weights {resident_bytes(model) / GiB:.2f} GiB resident, "
          f"experts {len(store._host) * per_expert / GiB:.2f} GiB; a decode token reads {linear_bytes / 1e6:.0f} MB "
          f"dense + {routed_bytes / 1e6:.0f} MB routed", flush=True)

    ids = torch.tensor([prompts(report.tokenizer, 1, args.prompt_tokens)[0]])
    cache = rt.new_cache(1)
    logits = rt.step(ids, cache)
    times = []
    for _ in range(args.tokens):
        t = time.perf_counter()
        logits = rt.decode(logits.argmax(-1), cache)
        times.append(time.perf_counter() - t)
    steady = sorted(times[2:])[len(times[2:]) // 2]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        logits = rt.decode(logits.argmax(-1), cache)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    batch1 = {"decode_ms_median": 1e3 * steady, "tokens_per_second": 1 / steady,
              "bytes_per_token": {"dense": linear_bytes, "routed_experts": routed_bytes},
              "roofline_ms": 1e3 * token_bytes / probe, "roofline_share": token_bytes / probe / steady}
    print(json.dumps(batch1, indent=1), flush=True)
    print(text.getvalue(), flush=True)

    engine_rows = []
    for n in args.streams:
        engine = LLMEngine(rt, EngineConfig(max_batch=n, max_context=args.prompt_tokens + args.tokens + 8,
                                            prefill_chunk=args.prompt_tokens, prefix_cache=False))
        batch = prompts(report.tokenizer, n, args.prompt_tokens)
        params = SamplingParams(max_tokens=args.tokens)
        engine.generate(batch[:1], SamplingParams(max_tokens=2), ignore_eos=True)  # warm
        t = time.perf_counter()
        seqs = engine.generate(batch, params, ignore_eos=True)
        total = time.perf_counter() - t
        # decode alone: from the moment every stream has its first token (all prompts prefilled) to the end
        start = max(s.token_times[0] for s in seqs)
        decode = max(s.token_times[-1] for s in seqs) - start
        after = sum(1 for s in seqs for t in s.token_times if t > start)
        generated = sum(len(s.output_ids) for s in seqs)
        row = {"streams": n, "seconds": total, "generated": generated,
               "decode_tokens_per_second": after / decode if decode > 0 else None}
        engine_rows.append(row)
        print(json.dumps(row), flush=True)
    one = next((r for r in engine_rows if r["streams"] == 1), None)
    for r in engine_rows:
        r["vs_one_stream"] = r["decode_tokens_per_second"] / one["decode_tokens_per_second"] if one else None
    result = {"layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts, "read_probe": probe,
              "batch1": batch1, "engine": engine_rows, "profile_top": text.getvalue().splitlines()[:40],
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "profile_top"}, indent=1, default=str))
    store.close()


if __name__ == "__main__":
    main()
