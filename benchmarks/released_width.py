"""Decode a released-width checkpoint larger than this machine's RAM, under a memory budget well below it.

    python benchmarks/released_width.py [--ram-factor 1.5] [--budget-gib 8] [--tokens 200] [--dir DIR] [--delete]

Writes (once; reused while its settings match) a synthetic checkpoint in the official layout at the released widths
(hidden 5120, 64 heads, all 384 experts of 2304 per layer, the released vocabulary and Engram table sizes) with as
many layers as make it `--ram-factor` times this machine's RAM (`openflash checkpoint synth flash DIR --layers N
--no-vision`; its two 94.4 GiB Engram tables are sparse files of zero rows). Then decodes greedily at batch 1 from a
prompt of real text (a stdlib source file) with:
- weights in their stored formats (FP8 / FP4 / bf16; `--weights stored`),
- routed experts read from the shards on demand through an LRU that gets what the budget leaves
  (`--expert-placement disk --expert-cache-bytes`),
- the Engram tables on the disk tier (sparse table files written by synth).
Reports tokens/s, peak RSS against the budget, bytes each decode token reads from each tier, the expert cache's
hit rate, and the share of the roofline those bytes allow at this machine's measured RAM and disk bandwidths (disk
measured cold, after dropping the file's cached pages). Writes benchmarks/results/released_width.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

from openflash.checkpoint import load_checkpoint
from openflash.config import load_config
from openflash.memory.experts import ExpertStore
from openflash.model import routed
from openflash.model.layers import Linear
from openflash.residency import resident_bytes
from openflash.runtime.runtime import Runtime
from openflash.tools.placement_plan import disk_read_bandwidth, ram_bandwidth, StoredModel
from openflash.tools.synth import cut_config, synthesize

RESULTS = Path(__file__).parent / "results"
GiB = 1 << 30


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def stored_layout(layers: int) -> dict[str, int]:
    """Stored bytes of the checkpoint's parts at `layers` layers."""
    return StoredModel.of(cut_config(load_config("flash"), layers=layers, vision=False)).parts


def prompt_ids(tokenizer, n: int) -> list[int]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    return tokenizer.encode(text).ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="runs/bench/released_width", help="where the checkpoint is written (reused)")
    ap.add_argument("--ram-factor", type=float, default=1.5, help="checkpoint size / RAM")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--budget-gib", type=float, default=8.0, help="memory budget of the run (RSS)")
    ap.add_argument("--tokens", type=int, default=200, help="decode steps")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--experts", type=int, default=384, help="routed experts per layer (smoke tests only)")
    ap.add_argument("--delete", action="store_true", help="delete the checkpoint afterwards")
    ap.add_argument("--per-expert-calls", action="store_true",
                    help="the routed experts one native call per expert and projection, not one per layer (A/B)")
    ap.add_argument("--direct-io", action="store_true", help="read the experts with O_DIRECT (--expert-direct-io)")
    ap.add_argument("--out", default=str(RESULTS / "released_width.json"))
    args = ap.parse_args()
    if args.per_expert_calls:
        routed.NATIVE_PAIRS = 0  # no step takes the one-call-per-layer path
    torch.set_num_threads(os.cpu_count() or 1)

    ram = mem_total()
    per_layer = stored_layout(2)["experts"] // 2
    base = stored_layout(1)  # dense: embedding, head, one layer
    layers = args.layers or max(1, math.ceil((args.ram_factor * ram - base["dense"]) / (per_layer + 0.15 * GiB)))
    folder = Path(args.dir)
    marker = folder / "SYNTH_DONE.json"
    want = {"config": "flash", "layers": layers, "experts": args.experts, "vision": False, "seed": 0}
    if not (marker.is_file() and json.loads(marker.read_text()) == want):
        shutil.rmtree(folder, ignore_errors=True)
        t = time.perf_counter()
        report = synthesize("flash", folder, layers=layers, experts=args.experts, vision=False)
        marker.write_text(json.dumps(want))
        print(f"wrote {folder}: {report.bytes_written / GiB:.1f} GiB on disk ({report.shards} shards) in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    on_disk = sum(f.stat().st_blocks * 512 for f in folder.iterdir() if f.is_file())
    print(f"RAM {ram / GiB:.1f} GiB; checkpoint {on_disk / GiB:.1f} GiB on disk ({on_disk / ram:.2f}x RAM), "
          f"{layers} layers at released width", flush=True)

    shard = max((f for f in folder.glob("model-*.safetensors")), key=lambda f: f.stat().st_blocks)
    bw_disk, bw_ram = disk_read_bandwidth(shard), ram_bandwidth()
    print(f"measured: RAM copy {bw_ram / GiB:.1f} GiB/s, cold disk read {bw_disk / GiB:.2f} GiB/s", flush=True)

    model, report = load_checkpoint(folder, weights="stored", skip_experts=True, skip_engram_tables=True)
    dense_resident = resident_bytes(model)
    budget = int(args.budget_gib * GiB)
    cache = max(0, budget - dense_resident - 2 * GiB)  # 2 GiB for work buffers, the runtime and the Engram tier
    store = ExpertStore(folder, model.cfg, model.numerics, "disk", cache_bytes=cache, io_threads=8,
                        direct_io=args.direct_io)
    rt = Runtime.of(model, report.tokenizer, frontend=report.engram_frontend, experts=store, folder=folder)
    rt.place_engram("disk", cache_bytes=64 << 20)  # the folder's engram_tables/
    print(f"dense weights resident {dense_resident / GiB:.2f} GiB; expert cache {cache / GiB:.2f} GiB; budget "
          f"{budget / GiB:.1f} GiB", flush=True)

    ids = torch.tensor([prompt_ids(report.tokenizer, args.prompt_tokens)])
    cache_kv = rt.new_cache(1)
    t = time.perf_counter()
    logits = rt.step(ids, cache_kv)
    prefill_s = time.perf_counter() - t
    after_prefill = store.summary()
    times = []
    for _ in range(args.tokens):
        token = logits.argmax(-1)
        t = time.perf_counter()
        logits = rt.decode(token, cache_kv)
        times.append(time.perf_counter() - t)
    s = store.summary()
    decode_lookups = (s["hits"] - after_prefill["hits"]) + (s["misses"] - after_prefill["misses"])
    expert_bytes = (s["bytes_read"] - after_prefill["bytes_read"]) / args.tokens
    engram = rt.stats()["engram"]
    # Dense bytes a decode token reads from RAM: every stored non-expert weight but the embedding (one row).
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() + (m.scale.numel() if m.quantized else 0)
                       for m in model.modules() if isinstance(m, Linear) and not m.weight.is_meta)
    row_bytes = model.cfg.n_hash_columns * len(model.cfg.engram_layer_ids) * (model.cfg.engram_head_dim * 33 // 32)
    steady = sorted(times)[len(times) // 2]
    roofline_s = linear_bytes / bw_ram + expert_bytes / bw_disk + row_bytes / bw_disk
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "routed_experts": "one call per expert" if args.per_expert_calls else "one call per layer",
        "layers": layers, "ram_bytes": ram, "checkpoint_bytes_on_disk": on_disk, "budget_bytes": budget,
        "expert_cache_bytes": cache, "peak_rss_bytes": rss, "within_budget": rss <= budget,
        "ram_bandwidth": bw_ram, "disk_bandwidth": bw_disk, "prefill_tokens": ids.shape[1],
        "prefill_seconds": prefill_s, "decode_tokens": args.tokens,
        "decode_tokens_per_second": args.tokens / sum(times), "decode_ms_median": 1000 * steady,
        "decode_ms_first10_mean": 1000 * sum(times[:10]) / min(10, len(times)),
        "decode_ms_last50_mean": 1000 * sum(times[-50:]) / len(times[-50:]),
        "bytes_per_token": {"dense_ram": linear_bytes, "experts_disk": expert_bytes, "engram_disk": row_bytes},
        "expert_hit_rate_decode": (s["hits"] - after_prefill["hits"]) / decode_lookups if decode_lookups else None,
        "roofline_tokens_per_second": 1 / roofline_s, "roofline_share": (1 / steady) / (1 / roofline_s),
        "engram": {k: engram[k] for k in ("placement", "steps", "wait_seconds") if k in engram},
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }
    print(json.dumps(result, indent=1, default=str))
    RESULTS.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    store.close()
    if args.delete:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
