"""Where a one-row FP4 product's time goes between the kernel and `Linear`: the same 100 released-shape weights
(2304 x 5120, past the cache) through each layer of the call path (the raw library call, the Python wrapper, the
format views, `Linear`'s product, the numerics' kernels, `Linear()`), interleaved rounds, best and median.

    python benchmarks/product_call_path.py                      # 2 threads
    OMP_WAIT_POLICY=active python benchmarks/product_call_path.py
    python benchmarks/product_call_path.py --threads 1
"""

import time, torch, sys
sys.path.insert(0, "benchmarks")
from kernels import stored_linear
from openflash import formats
from openflash.kernels import native
from openflash.model import layers
THREADS = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 2
torch.set_num_threads(THREADS)
g = torch.Generator().manual_seed(0)
n, k = 2304, 5120
lins = [stored_linear("fp4", n, k, g) for _ in range(100)]
ws = [(formats.as_uint8(l.weight), formats.as_uint8(l.scale)) for l in lins]
x = torch.randn(1, k); y = torch.empty(1, n)
lib, ISA = native.status().library, native.status().isa
kern = layers.layer_kernels(lins[0].numerics)
V = {
 "raw": lambda: [lib.of_fp4_gemv(x.data_ptr(), w.data_ptr(), s.data_ptr(), y.data_ptr(), 1, n, k, 1, ISA, THREADS)
        for w, s in ws],
 "_quantized": lambda: [native._quantized("of_fp4_gemv", x, w, s, True) for w, s in ws],
 "fp4_gemv(as_uint8)": lambda: [native.fp4_gemv(x, formats.as_uint8(l.weight), formats.as_uint8(l.scale), True)
                                for l in lins],
 "_native_linear": lambda: [layers._native_linear(l, x, True) for l in lins],
 "kernels.linear": lambda: [kern.linear(l, x) for l in lins],
 "Linear()": lambda: [l(x) for l in lins],
}
res = {}
with torch.no_grad():
    for _ in range(12):
        for name, f in V.items():
            t = time.perf_counter(); f(); res.setdefault(name, []).append((time.perf_counter() - t) / 100)
for name, ds in res.items():
    ds.sort(); print(f"{name:20s} best {ds[0]*1e3:.3f} median {ds[6]*1e3:.3f}")
