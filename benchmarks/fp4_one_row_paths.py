"""One-row MXFP4 products on released expert shapes (weights past the cache, 2 threads) by the kernel library as
built before the one-row dispatch change (its BF16 path on AVX-512 BF16 machines) and as built now (the integer
path for one row), through ctypes, and now through `Linear`; interleaved rounds, best and median, against a read
probe in the same process.

    python benchmarks/fp4_one_row_paths.py OLD_LIBRARY.so

OLD_LIBRARY.so: a build of src/openflash/kernels/ before the change (check out the commit before it, run
`python -m openflash.kernels`, copy the library it names).
"""

import time, torch, sys, ctypes
sys.path.insert(0, "benchmarks")
from kernels import stored_linear, read_bandwidth
from openflash import formats
from openflash.kernels import native
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
old = ctypes.CDLL(sys.argv[1])
new = native.status().library
for lib in (old,):
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.of_fp4_gemv.argtypes = [p, p, p, p, i, i, i, i, i, i]
rows = {}
bw = read_bandwidth()
for n, k in ((2304, 5120), (5120, 2304)):
    lins = [stored_linear("fp4", n, k, g) for _ in range(100)]
    ws = [(formats.as_uint8(l.weight), formats.as_uint8(l.scale)) for l in lins]
    nbytes = ws[0][0].numel() + ws[0][1].numel()
    x = torch.randn(1, k); y = torch.empty(1, n)
    res = {}
    for _ in range(15):
        for name, lib in (("before (BF16 path)", old), ("after (integer path)", new)):
            t = time.perf_counter()
            for w, s in ws:
                lib.of_fp4_gemv(x.data_ptr(), w.data_ptr(), s.data_ptr(), y.data_ptr(), 1, n, k, 1, 7, 2)
            res.setdefault(name, []).append((time.perf_counter() - t) / len(ws))
        t = time.perf_counter()
        with torch.no_grad():
            for l in lins: l(x)
        res.setdefault("after, through Linear", []).append((time.perf_counter() - t) / len(ws))
    for name, ds in res.items():
        ds.sort()
        print(f"fp4 {n}x{k} 1 row, {name:22s}: best {ds[0] * 1e3:.3f} ms ({nbytes / ds[0] / bw * 100:.0f}% of "
              f"{bw / 1e9:.1f} GB/s), median {ds[7] * 1e3:.3f} ms")
