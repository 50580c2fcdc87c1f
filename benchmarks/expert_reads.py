"""Reading routed experts from the shards: through the page cache (the default) against O_DIRECT
(`--expert-direct-io`), the way the expert store reads them (memory/experts.py: the six tensors of an expert by
positioned reads, `--io-threads` readers in parallel).

    python benchmarks/expert_reads.py [--dir runs/bench/released_width] [--experts 64] [--io-threads 4]
                                      [--out benchmarks/results/expert_reads.json]

The checkpoint is benchmarks/released_width.py's (written by it). Each round reads the same `--experts` random
experts three ways: buffered with the shards' pages dropped first (posix_fadvise DONTNEED: a cold miss), buffered
again right after (what the page cache gives a re-read, when RAM allows it to keep the pages), and O_DIRECT (pages
dropped again first).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openflash.files.shards import ShardReader, tensor_locations

RESULTS = Path(__file__).parent / "results"
ROUTED = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.")


def drop_pages(paths: set[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(experts: list[list], direct: bool, threads: int) -> float:
    """Seconds to read every tensor of `experts` with `threads` readers (one expert per task, as the store)."""
    reader = ShardReader(direct=direct)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda parts: [reader.read(loc) for loc in parts], experts))
    seconds = time.perf_counter() - start
    reader.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("runs/bench/released_width"))
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "expert_reads.json")
    args = ap.parse_args()
    if not args.dir.is_dir():
        raise SystemExit(f"{args.dir}: no checkpoint (benchmarks/released_width.py writes it)")
    by_expert: dict[tuple[int, int], list] = {}
    for name, loc in tensor_locations(args.dir).items():
        m = ROUTED.match(name)
        if m:
            by_expert.setdefault((int(m[1]), int(m[2])), []).append(loc)
    rng = random.Random(0)
    rounds = []
    for r in range(args.rounds):
        chosen = [by_expert[k] for k in rng.sample(sorted(by_expert), args.experts)]
        nbytes = sum(loc.nbytes for parts in chosen for loc in parts)
        paths = {loc.path for parts in chosen for loc in parts}
        drop_pages(paths)
        cold = read_all(chosen, False, args.io_threads)
        warm = read_all(chosen, False, args.io_threads)  # the pages the cold read left
        drop_pages(paths)
        direct = read_all(chosen, True, args.io_threads)
        row = {"experts": args.experts, "bytes": nbytes, "page_cache_cold_gbps": nbytes / cold / 1e9,
               "direct_gbps": nbytes / direct / 1e9, "page_cache_warm_gbps": nbytes / warm / 1e9}
        rounds.append(row)
        print(f"round {r + 1}: {args.experts} experts, {nbytes / 2**20:.0f} MiB, {args.io_threads} readers: page cache "
              f"cold {row['page_cache_cold_gbps']:.2f} GB/s, O_DIRECT {row['direct_gbps']:.2f} GB/s, page cache "
              f"warm {row['page_cache_warm_gbps']:.2f} GB/s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"checkpoint": str(args.dir), "io_threads": args.io_threads, "rounds": rounds},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
