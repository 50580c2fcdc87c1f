"""`python -m openflash.kernels [build]`: build the native kernels (make setup runs it) and say which kernels run
here: the native ones on the CPU, the Triton ones on CUDA."""

from __future__ import annotations

import os
import sys

import torch

from openflash.kernels import triton_on, triton_products
from openflash.kernels.native import status


def main() -> int:
    s = status()
    print(f"openflash kernels: {'available' if s.available else 'not available'}: {s.reason}")
    if not s.available:
        print("stored FP8/FP4/bf16 weights use the PyTorch path (dequantize one tile at a time): correct, slower")
    if triton_on():
        where = "this machine's CUDA device" if torch.cuda.is_available() else "CUDA devices (none visible here)"
        print(f"Triton kernels: on for {where}: products on FP8/FP4 weights, a layer's routed experts, the "
              f"attention's reads of the cache")
    elif not triton_products.available():
        print("Triton kernels: not available (Triton is not installed; PyTorch's CUDA builds bring it)")
    else:
        print(f"Triton kernels: turned off by OPENFLASH_KERNELS={os.environ.get('OPENFLASH_KERNELS')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
