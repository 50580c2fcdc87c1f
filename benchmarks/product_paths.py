"""The native products by instruction-set path, side by side in one process: each released shape (weights past the
cache, 2 threads) through the library with isa 7 (AVX-512 BF16 where the CPU has it), 5 (AVX2, one-row FP4 in
integers) and 1 (AVX2 floats), best of 5 passes, against a read probe.

    python benchmarks/product_paths.py
"""

import time, torch, sys
sys.path.insert(0, "benchmarks")
from kernels import stored_linear, read_bandwidth
from openflash import formats
from openflash.kernels import native
torch.set_num_threads(2)
lib = native.status().library
g = torch.Generator().manual_seed(0)
bw = read_bandwidth()
print(f"read probe {bw/1e9:.1f} GB/s")
for fmt, n, k in (("fp4", 2304, 5120), ("fp4", 5120, 2304), ("fp8", 1280, 5120), ("fp8", 5120, 8192)):
    copies = max(8, int((600 << 20) / (n * k // (2 if fmt == "fp4" else 1))))  # 600 MB: past the cache
    lins = [stored_linear(fmt, n, k, g) for _ in range(copies)]
    ws = [(formats.as_uint8(l.weight), formats.as_uint8(l.scale)) for l in lins]
    nbytes = ws[0][0].numel() + ws[0][1].numel()
    fn = lib.of_fp4_gemv if fmt == "fp4" else lib.of_fp8_gemv
    for rows in (1, 4):
        x = torch.randn(rows, k); y = torch.empty(rows, n)
        line = f"{fmt} {n}x{k} rows {rows}:"
        for isa in (7, 5, 1):
            def run():
                for w, s in ws:
                    fn(x.data_ptr(), w.data_ptr(), s.data_ptr(), y.data_ptr(), rows, n, k, 1, isa, 2)
            run()
            ts = []
            for _ in range(5):
                t = time.perf_counter(); run(); ts.append((time.perf_counter() - t) / len(ws))
            b = min(ts)
            line += f"  isa{isa} {b*1e3:.3f} ms ({nbytes / b / bw * 100:.0f}%)"
        print(line)
