"""The native kernels of this checkout against those of another git revision, side by side in one process: the two
libraries take turns round by round on the same products (benchmarks/kernels.py's shapes, weights cycled past the
caches), so a change to the C code is measured against its predecessor on the same machine at the same time.

    python benchmarks/kernel_ab.py --against REV [--isa avx2|avx2-float|1] [--rows 1 4 16] [--threads 2] [--rounds 3]
        [--formats fp4 fp8 bf16]

The other revision's kernel sources (src/openflash/kernels/*.c, kernels.h) are read with `git show` and compiled
with this checkout's flags into a temporary folder. Prints ms and the share of a read-bandwidth probe for each, and
the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels import SHAPES, WORKING_SET, read_bandwidth, stored_bytes, stored_linear, time_products
from openflash.kernels import native

ROOT = Path(__file__).resolve().parent.parent


def build_revision(rev: str, folder: Path) -> Path:
    """The kernels of git revision `rev`, compiled with this checkout's flags into `folder`."""
    for path in (*native.SOURCES, native.HEADER):
        relative = path.relative_to(ROOT)
        shown = subprocess.run(["git", "show", f"{rev}:{relative.as_posix()}"], cwd=ROOT, capture_output=True)
        if shown.returncode != 0:
            raise SystemExit(f"git show {rev}:{relative}: {shown.stderr.decode().strip()}")
        (folder / path.name).write_bytes(shown.stdout)
    target = folder / f"libopenflash_gemv-{rev}.so"
    compiler = os.environ.get("CC") or "cc"
    done = subprocess.run([compiler, *native.FLAGS, "-o", str(target), *(str(folder / p.name) for p in native.SOURCES),
                           "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{compiler} failed on {rev}'s kernels: {done.stderr.strip()[-2000:]}")
    return target


def load(path: Path) -> None:
    """From now on the products run with the library at `path` (native.status loads what native.build returns)."""
    native.build = lambda: path
    native.status.cache_clear()
    if not native.status().available:
        raise SystemExit(f"{path}: {native.status().reason}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the git revision whose kernels are the baseline")
    ap.add_argument("--isa", default="avx2", choices=["avx2", "avx2-float", "1"], help="OPENFLASH_KERNELS for both")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", nargs="+", default=["fp4", "fp8", "bf16"], choices=["fp4", "fp8", "bf16"],
                    help="only the shapes stored in these formats")
    args = ap.parse_args()
    os.environ["OPENFLASH_KERNELS"] = args.isa
    torch.set_num_threads(args.threads)
    current = native.build()
    with tempfile.TemporaryDirectory() as tmp:
        baseline = build_revision(args.against, Path(tmp))
        libraries = {args.against: baseline, "this checkout": current}
        probe = read_bandwidth()
        print(f"{args.threads} threads, OPENFLASH_KERNELS={args.isa}, read probe {probe / 1e9:.1f} GB/s", flush=True)
        g = torch.Generator().manual_seed(0)
        for name, fmt, n, k in (shape for shape in SHAPES if shape[1] in args.formats):
            first = stored_linear(fmt, n, k, g)
            copies = max(2, WORKING_SET // stored_bytes(first))
            lins = [first] + [stored_linear(fmt, n, k, g) for _ in range(copies - 1)]
            for rows in args.rows if fmt != "bf16" else args.rows[:1]:
                x = torch.randn(rows, k, generator=g)
                times: dict[str, list[float]] = {label: [] for label in libraries}
                for round_ in range(args.rounds):  # each goes first in turn
                    for label in list(libraries)[:: 1 if round_ % 2 == 0 else -1]:
                        load(libraries[label])
                        times[label].append(time_products(lins, x, 3))
                before, after = (statistics.median(times[label]) for label in libraries)
                nbytes = stored_bytes(first)
                print(f"{name:13s} {fmt:4s} rows {rows:2d}: {args.against} {1e3 * before:8.3f} ms "
                      f"({100 * nbytes / before / probe:5.1f}%), this checkout {1e3 * after:8.3f} ms "
                      f"({100 * nbytes / after / probe:5.1f}%), x{before / after:.2f}", flush=True)
        print(f"read probe again: {read_bandwidth() / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
