"""`python -m openflash.kernels [build]`: build the native kernels (make setup runs it) and say whether they run."""

from __future__ import annotations

import sys

from openflash.kernels.native import status


def main() -> int:
    s = status()
    print(f"openflash kernels: {'available' if s.available else 'not available'}: {s.reason}")
    if not s.available:
        print("stored FP8/FP4/bf16 weights use the PyTorch path (dequantize one tile at a time): correct, slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
