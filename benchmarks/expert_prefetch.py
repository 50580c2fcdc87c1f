"""What pre-gating prefetch buys routed experts read from disk: decode with the hints on and off, side by side.

    python benchmarks/expert_prefetch.py [--checkpoint DIR ...] [--synth-layers 2] [--synth-experts 96]
                                         [--cache-fraction 0.1] [--tokens 48] [--rounds 2]

Each checkpoint (default: a released-width cut written once by `checkpoint synth flash` with --synth-layers layers
and --synth-experts experts per layer; pass trained checkpoints with --checkpoint to see how well a trained
router's pre-gating predicts) decodes greedily at batch 1 from a prompt of real text, routed experts on the disk
tier (`--expert-placement disk`) behind an LRU of --cache-fraction of the experts' bytes, the checkpoint's pages
dropped from the page cache before every run. Variants, interleaved round by round:

    off   every miss reads its experts when its layer asks (parallel positioned reads)
    on    ExpertStore(prefetch=True): before each layer, its own and the next layer's routers applied to the layer's
          input name the experts to start reading (model/transformer.py `_hint_experts`)

Reports decode tokens/s, the share of misses a hint had already started (`prefetched / misses`), the share of
hinted reads a layer then used (`useful`), and disk bytes per token (hints that missed cost extra reads). Logits of
the two variants must be identical (checked). Writes benchmarks/results/expert_prefetch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from openflash.checkpoint import load_checkpoint
from openflash.files.run_dir import latest_checkpoint
from openflash.files.shards import tensor_locations
from openflash.memory.experts import ROUTED, ExpertStore
from openflash.runtime.runtime import Runtime

RESULTS = Path(__file__).parent / "results"


def drop_page_cache(folder: Path) -> None:
    for f in folder.rglob("*.safetensors"):
        with open(f, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def synth_checkpoint(layers: int, experts: int) -> Path:
    from openflash.tools.synth import synthesize

    folder = Path(f"runs/bench/prefetch_flash_l{layers}_e{experts}")
    marker = folder / "SYNTH_DONE.json"
    if not marker.is_file():
        t = time.perf_counter()
        synthesize("flash", folder, layers=layers, experts=experts, vision=False)
        marker.write_text("{}\n")
        print(f"wrote {folder} in {time.perf_counter() - t:.0f} s", flush=True)
    return folder


def decode(folder: Path, prefetch: bool, cache_fraction: float, ids: torch.Tensor, tokens: int) -> dict:
    tables = folder / "engram_tables"  # synth writes the released-size tables as files for the disk tier
    model, report = load_checkpoint(folder, weights="stored", skip_experts=True, skip_engram_tables=tables.is_dir())
    total = sum(loc.nbytes for name, loc in tensor_locations(folder).items() if ROUTED.match(name))
    store = ExpertStore(folder, model.cfg, model.numerics, "disk", cache_bytes=max(1, int(cache_fraction * total)),
                        io_threads=8, prefetch=prefetch)
    rt = Runtime.of(model, report.tokenizer, frontend=report.engram_frontend, experts=store)
    if tables.is_dir():
        rt.place_engram("disk", table_dir=tables, cache_bytes=0)
    drop_page_cache(folder)
    cache = rt.new_cache(1)
    logits = rt.step(ids, cache)
    before = store.summary()
    times, out = [], []
    for _ in range(tokens):
        token = logits.argmax(-1)
        start = time.perf_counter()
        logits = rt.decode(token, cache)
        times.append(time.perf_counter() - start)
        out.append(logits)
    s = store.summary()
    rt.close()
    misses = s["misses"] - before["misses"]
    prefetched = s["prefetched"] - before["prefetched"]
    reads = s["prefetch_reads"] - before["prefetch_reads"]
    return {"tokens_per_s": tokens / sum(times), "ms_median": 1e3 * statistics.median(times),
            "misses_per_token": misses / tokens, "prefetched_share": prefetched / misses if misses else None,
            "useful": prefetched / reads if reads else None,
            "disk_mib_per_token": (s["bytes_read"] - before["bytes_read"]) / tokens / 2**20,
            "hit_rate": (s["hits"] - before["hits"]) / max(1, s["hits"] - before["hits"] + misses),
            "logits": torch.stack(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", nargs="*", default=[], help="checkpoint or run folders (default: a synth cut)")
    ap.add_argument("--synth-layers", type=int, default=2)
    ap.add_argument("--synth-experts", type=int, default=96)
    ap.add_argument("--cache-fraction", type=float, default=0.1, help="expert LRU, share of all experts' bytes")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    folders = [Path(c) for c in args.checkpoint] or [synth_checkpoint(args.synth_layers, args.synth_experts)]
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    results = []
    for folder in folders:
        folder = latest_checkpoint(folder) or folder
        _, report = load_checkpoint(folder, weights="stored", skip_experts=True, skip_engram_tables=True)
        ids = torch.tensor([report.tokenizer.encode(text).ids[:args.prompt_tokens]])
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for name in runs:
                runs[name].append(decode(folder, name == "on", args.cache_fraction, ids, args.tokens))
        if not all(torch.equal(a["logits"], b["logits"]) for a, b in zip(runs["off"], runs["on"])):
            raise SystemExit(f"{folder}: prefetch changed the logits")
        row = {"checkpoint": str(folder), "variants": {}}
        for name, rs in runs.items():
            row["variants"][name] = {k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None
                                     for k in rs[0] if k != "logits"}
        off, on = row["variants"]["off"], row["variants"]["on"]
        row["speedup"] = on["tokens_per_s"] / off["tokens_per_s"]
        print(f"{folder}: decode {off['tokens_per_s']:.2f} -> {on['tokens_per_s']:.2f} tok/s "
              f"({row['speedup']:.2f}x); misses a hint had started {on['prefetched_share']}, hinted reads used "
              f"{on['useful']}, disk MiB/token {off['disk_mib_per_token']:.1f} -> {on['disk_mib_per_token']:.1f}",
              flush=True)
        results.append(row)
    out = {"threads": torch.get_num_threads(), "cache_fraction": args.cache_fraction, "tokens": args.tokens,
           "rounds": args.rounds, "results": results,
           "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "expert_prefetch.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
