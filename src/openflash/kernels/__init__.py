"""Kernels for the stored weight formats. On the CPU: native.py builds, loads and registers them; the C code is gemv.c
(entry points, the experts' call), activations.c (QDQ, layouts), avx2.c and avx512.c (the products). On CUDA:
triton_products.py (FP8 and MXFP4 products in Triton)."""
