"""Disk-tier row reads: DiskTable.gather of random rows, warm and cold page cache.

    python benchmarks/disk_table_reads.py [--rows 2000000] [--dim 256] [--lookups 16 512 8192] [--rounds 5]

Writes one table file of --rows FP8 rows (record = dim + dim/32 bytes), then times gathers of --lookups random ids
(a decode step reads ~16 rows per Engram layer at batch 1, a 512-token prefill ~8k): warm (pages cached) and cold
(posix_fadvise DONTNEED before each gather), no row cache, one reader thread and four. Prints the median microseconds
per gather and per row, and writes benchmarks/results/disk_table_reads.json. The import path decides which
implementation runs, so two checkouts can be compared side by side (PYTHONPATH=<checkout>/src).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from openflash.memory.table_file import table_file_name, write_table_file
from openflash.memory.tiers.disk import DiskTable

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--lookups", type=int, nargs="+", default=[16, 512, 8192])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "disk_table_reads.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results = []
    with tempfile.TemporaryDirectory(prefix="openflash-disk-reads-") as tmp:
        path = Path(tmp) / table_file_name(0)
        weight = rng.integers(0, 127, (args.rows, args.dim), dtype=np.uint8)  # small E4M3 codes: finite values
        scale = np.full((args.rows, args.dim // 32), 127, dtype=np.uint8)
        write_table_file(path, weight, scale, "bench")
        del weight, scale
        for threads in (1, 4):
            with DiskTable.open(path, args.rows, args.dim, "bench", io_threads=threads) as table:
                table.parallel_min_rows = 512
                for n in args.lookups:
                    for cache in ("warm", "cold"):
                        times = []
                        for _ in range(args.rounds):
                            ids = torch.from_numpy(rng.integers(0, args.rows, n))
                            if cache == "cold":
                                table.drop_page_cache()
                            else:
                                table.gather(ids)  # the same ids once first: their pages are cached
                            start = time.perf_counter()
                            table.gather(ids)
                            times.append(time.perf_counter() - start)
                        us = statistics.median(times) * 1e6
                        results.append({"threads": threads, "lookups": n, "page_cache": cache,
                                        "us_per_gather": round(us, 1), "us_per_row": round(us / n, 3)})
                        print(f"threads {threads}  {n:>6} rows  {cache:<4}  {us:>10.1f} us/gather  "
                              f"{us / n:>7.3f} us/row")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": args.rows, "dim": args.dim, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
