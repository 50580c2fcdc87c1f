"""One-row GEMMs on weights kept in their stored formats, dequantized inside a compiled graph, against fp32 weights.

    python benchmarks/weight_format_gemv.py [--out-features 2304] [--in-features 5120] [--repeats 50]

A decode step at batch 1 reads every weight once, so FP8 (1 byte) or FP4 (half a byte) weights dequantized inside
the multiply-and-sum would stream 4-8x fewer bytes than the fp32 copies the decode graph reads now
(model/compiled.py `matmul_unshared`). Each form is compiled by torch.compile (inductor's C++ on CPU) and timed per
product, one process, every form in turn:
- fp32: the decode graph's form, weights dequantized once;
- fp8 cast: E4M3 codes [out, in] with UE8M0 scales per 32 x 32 block (the checkpoint's dense layout), `codes.float()`;
- fp8 bits: the same codes decoded with integer arithmetic (sign, exponent and mantissa moved into fp32 bits);
- fp4 table: packed E2M1 pairs [out, in / 2] with a UE8M0 scale per 32 (the experts' layout), through a 16-entry table.
Each result is checked against the dequantized weight's matmul. Writes benchmarks/results/weight_format_gemv.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from openflash import formats

RESULTS = Path(__file__).parent / "results" / "weight_format_gemv.json"


def fp32_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.unsqueeze(-2) * w).sum(-1)


def fp8_cast_gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    w = codes.float().view(n // 32, 32, k // 32, 32) * scale[:, None, :, None]
    return (x.view(1, 1, 1, k // 32, 32) * w).sum((-1, -2)).view(1, n)


def e4m3_bits(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes to fp32 by integer arithmetic (normal, subnormal and NaN codes)."""
    c = codes.view(torch.uint8).to(torch.int32)
    sign = (c & 0x80) << 24
    e, m = (c >> 3) & 0xF, c & 0x7
    normal = (sign | ((e + 120) << 23) | (m << 20)).view(torch.float32)
    subnormal = m.to(torch.float32) * 2.0 ** -9 * torch.where(sign != 0, -1.0, 1.0)
    return torch.where((c & 0x7F) == 0x7F, float("nan"), torch.where(e == 0, subnormal, normal))


def fp8_bits_gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    w = e4m3_bits(codes).view(n // 32, 32, k // 32, 32) * scale[:, None, :, None]
    return (x.view(1, 1, 1, k // 32, 32) * w).sum((-1, -2)).view(1, n)


def fp4_table_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    n, k = packed.shape[0], packed.shape[1] * 2
    values = torch.stack((table[(packed & 15).long()], table[(packed >> 4).long()]), -1).view(n, k // 32, 32)
    return (x.view(1, 1, k // 32, 32) * (values * scale[:, :, None])).sum((-1, -2)).view(1, n)


def timed(fn, args: tuple, repeats: int) -> tuple[float, torch.Tensor]:
    compiled = torch.compile(fn)
    for _ in range(3):
        out = compiled(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        compiled(*args)
    return (time.perf_counter() - start) / repeats, out


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-features", type=int, default=2304)
    ap.add_argument("--in-features", type=int, default=5120)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    n, k = args.out_features, args.in_features
    if n < 32 or k < 32 or n % 32 or k % 32 or args.repeats < 1:
        ap.error("--out-features and --in-features must be positive multiples of 32, --repeats >= 1")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=g)
    codes8 = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn)
    scale8 = formats.ue8m0_decode(torch.randint(120, 130, (n // 32, k // 32), dtype=torch.uint8, generator=g))
    w8 = codes8.float() * scale8.repeat_interleave(32, 0).repeat_interleave(32, 1)
    packed4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale4 = formats.ue8m0_decode(torch.randint(120, 130, (n, k // 32), dtype=torch.uint8, generator=g))
    table = formats.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    w4 = formats.e2m1_decode(formats.unpack_fp4(packed4)) * scale4.repeat_interleave(32, 1)
    forms = {
        "fp32": (fp32_gemv, (x, w8), n * k * 4, w8),
        "fp8 cast": (fp8_cast_gemv, (x, codes8, scale8), n * k, w8),
        "fp8 bits": (fp8_bits_gemv, (x, codes8, scale8), n * k, w8),
        "fp4 table": (fp4_table_gemv, (x, packed4, scale4, table), n * k // 2, w4),
    }
    rows = []
    print(f"{n} x {k} one-row products, {torch.get_num_threads()} threads")
    for name, (fn, fargs, nbytes, w) in forms.items():
        seconds, out = timed(fn, fargs, args.repeats)
        err = float((out - x @ w.T).abs().max())
        rows.append({"form": name, "ms": seconds * 1e3, "weight_bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9,
                     "max_abs_error": err})
        print(f"  {name:9s} {seconds * 1e3:7.3f} ms  ({nbytes / 2 ** 20:6.1f} MiB of weights, "
              f"{nbytes / seconds / 1e9:5.1f} GB/s)  max |error| {err:.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"shape": [n, k], "threads": torch.get_num_threads(), "results": rows},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
