"""Native kernels for the stored weight formats: native.py builds, loads and registers them; the C code is gemv.c
(entry points, the experts' call), activations.c (QDQ, layouts), avx2.c and avx512.c (the products)."""
