"""Native products on weights as stored (kernels/*.c): build, load, and the torch custom ops that call them.

The C files are compiled once per source version with the system C compiler (the gcc `--compile` needs as well)
into the cache folder ($OPENFLASH_CACHE/kernels, else ~/.cache/openflash/kernels): by `make setup`
(`python -m openflash.kernels`) or at first use, and loaded with ctypes. The instruction set is chosen once, at
run time, on the CPU's flags: AVX-512 with its bf16 dot product (avx512.c) where the CPU has it, else AVX2 + FMA +
F16C (avx2.c), whose one-row FP4 products with QDQ'd activations run in integers; OPENFLASH_KERNELS=avx2
keeps to AVX2, avx2-float to AVX2 in floats only, 0 turns the kernels off. The ops are
torch custom ops with fake implementations, so a traced graph calls them as single nodes. Where the library cannot
be built, or the CPU lacks AVX2, `status()` says why and `model/layers.py` keeps its PyTorch path, which is also
what every kernel test compares against.

Results equal dequantize-then-fp32-matmul to fp32 summation order (lanes, then a horizontal sum); the integer
products sum each 32-group's products exactly, 8 to a lane, before the one rounding of its scale (a lane past
2^24 rounds once more on its way to fp32, as an fp32 addition would).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from openflash.files.cache import cache_dir

log = logging.getLogger("openflash.kernels")

SOURCES = [Path(__file__).with_name(name) for name in ("gemv.c", "activations.c", "avx2.c", "avx512.c")]
HEADER = Path(__file__).with_name("kernels.h")
ISA_AVX2, ISA_AVX512_BF16, ISA_INTEGER_FP4 = 1, 2, 4  # kernels.h: of_cpu_features() bits, the entry points' `isa`
FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11"]
MAX_ROWS = 16  # activation rows per C call (decode, batched decode, verification); more go MAX_ROWS at a time
BLOCK = 32  # K per UE8M0 scale block (FP8 and FP4); every kernel takes whole blocks


@dataclass(frozen=True)
class Status:
    """Whether the kernels run here, and if not, why (for logs and `python -m openflash.kernels`)."""

    library: ctypes.CDLL | None
    reason: str  # what was loaded, or why nothing was
    isa: int = 0  # the instruction sets the products may use (ISA_* bits)

    @property
    def available(self) -> bool:
        return self.library is not None


def library_path() -> Path:
    """Where this source version's library lives (its name carries the hash of the source and flags)."""
    code = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    digest = hashlib.sha256(code + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"libopenflash_gemv-{digest}.so"


def build() -> Path:
    """Compile the library if this version is not built yet; returns its path. Raises RuntimeError naming the
    compiler's complaint."""
    target = library_path()
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc on PATH, or $CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: parallel builds race
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on the kernels: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)
    log.info("built the native kernels: %s", target)
    return target


@lru_cache(maxsize=None)
def status() -> Status:
    """The loaded library, built first if needed (once per process), and the instruction sets it may use; or why
    there is none. OPENFLASH_KERNELS: 0 (off), avx2 (no AVX-512 even where the CPU has it), avx2-float (AVX2 with
    FP4 products in floats only: the integer ones' baseline), 1 or unset (the best)."""
    choice = os.environ.get("OPENFLASH_KERNELS", "1")
    if choice not in ("0", "1", "avx2", "avx2-float"):
        raise ValueError(f"OPENFLASH_KERNELS={choice!r}: expected 0 (off), avx2, avx2-float or 1 (the best this CPU has)")
    if choice == "0":
        return Status(None, "turned off by OPENFLASH_KERNELS=0")
    if not (torch.backends.cpu.get_cpu_capability() or "").startswith(("AVX2", "AVX512")):
        return Status(None, f"this CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()!r})")
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as exc:
        log.warning("native kernels unavailable, stored weights use the PyTorch path: %s", exc)
        return Status(None, str(exc))
    features = lib.of_cpu_features()
    if not features & ISA_AVX2:
        return Status(None, "this CPU lacks AVX2, FMA or F16C")
    p, i = ctypes.c_void_p, ctypes.c_int  # tensors pass their data_ptr(): ctypes.cast costs a microsecond a pointer
    for name in ("of_fp8_gemv", "of_fp4_gemv"):
        getattr(lib, name).argtypes = [p, p, p, p, i, i, i, i, i, i]
    lib.of_bf16_gemv.argtypes = [p, p, p, i, i, i, i]
    ptrs = ctypes.POINTER(ctypes.c_void_p)
    lib.of_fp4_experts.argtypes = [p, i, i, i, ptrs, ptrs, ptrs, ptrs, ptrs, ptrs, i, p, p, p, ctypes.c_float, i, i,
                                   p, i]
    isa = {"1": features | ISA_INTEGER_FP4, "avx2": ISA_AVX2 | ISA_INTEGER_FP4, "avx2-float": ISA_AVX2}[choice]
    names = ("AVX-512 BF16 (FP8, and FP4 of several rows, after the activation QDQ) and AVX2 (one-row FP4 in "
             "integers)" if isa & ISA_AVX512_BF16
             else "AVX2 (FP4 after the activation QDQ in integers)" if isa & ISA_INTEGER_FP4 else "AVX2 (floats only)")
    return Status(lib, f"{names} kernels from {library_path()}", isa)


def _run(name: str, x: torch.Tensor, *args) -> None:
    code = getattr(status().library, name)(*args)
    if code != 0:
        raise RuntimeError(f"{name} refused its arguments (code {code}): x {tuple(x.shape)}")


# ---- the products: torch custom ops inside a traced graph, the calls themselves in eager mode (the dispatcher's
# cost per call would be paid by the hundreds of products a decode step makes) ---------------------------------

def _check(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, codes_per_byte: int,
           scale_rows: int) -> None:
    """The C code trusts its pointers: shapes and dtypes are checked here, each problem named."""
    problems = []
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[0] < 1:
        problems.append(f"x must be fp32 [rows >= 1, K], got {x.dtype} {tuple(x.shape)}")
    elif weight.dim() != 2 or weight.shape[1] * codes_per_byte != x.shape[1] or not weight.is_contiguous() or \
            (weight.dtype != torch.bfloat16 if scale is None else weight.element_size() != 1):
        problems.append(f"weight {weight.dtype} {tuple(weight.shape)} does not hold K = {x.shape[1]} inputs per row "
                        f"contiguously")
    elif scale is not None and (tuple(scale.shape) != (scale_rows, x.shape[1] // BLOCK) or scale.element_size() != 1
                                or not scale.is_contiguous()):
        problems.append(f"scale {tuple(scale.shape)} is not the [{scale_rows}, {x.shape[1] // BLOCK}] UE8M0 bytes of "
                        f"weight {tuple(weight.shape)}")
    if x.dim() == 2 and x.shape[1] % BLOCK and scale is not None:
        problems.append(f"K = {x.shape[1]} is not a multiple of {BLOCK}")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))


def _quantized(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_qdq: bool) -> torch.Tensor:
    n = weight.shape[0] if weight.dim() == 2 else 0
    _check(name, x, weight, scale, 2 if name == "of_fp4_gemv" else 1, n if name == "of_fp4_gemv" else -(-n // BLOCK))
    x = x.contiguous()
    (R, K), N = x.shape, weight.shape[0]
    y = x.new_empty(R, N)
    for r, rows in _row_slices(R):
        _run(name, x, x.data_ptr() + 4 * r * K, weight.data_ptr(), scale.data_ptr(), y.data_ptr() + 4 * r * N, rows,
             N, K, int(act_qdq), status().isa, torch.get_num_threads())
    return y


def _row_slices(R: int) -> list[tuple[int, int]]:
    """(first row, rows) of each C call: a prefill's rows go MAX_ROWS at a time, each call reading the weight once
    (where that beats dequantizing the weight for the BLAS: kernels.native_rows)."""
    return [(r, min(MAX_ROWS, R - r)) for r in range(0, R, MAX_ROWS)]


def _bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check("of_bf16_gemv", x, weight, None, 1, 0)
    x = x.contiguous()
    R, K = x.shape
    N = weight.shape[0]
    y = x.new_empty(R, N)
    for r, rows in _row_slices(R):
        _run("of_bf16_gemv", x, x.data_ptr() + 4 * r * K, weight.data_ptr(), y.data_ptr() + 4 * r * N, rows, N, K,
             torch.get_num_threads())
    return y


def _fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_qdq: bool) -> torch.Tensor:
    return _quantized("of_fp8_gemv", x, weight, scale, act_qdq)


def _fp4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_qdq: bool) -> torch.Tensor:
    return _quantized("of_fp4_gemv", x, weight, scale, act_qdq)


def dispatch(name: str, call: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """The op openflash::`name` inside a traced graph, `call` itself in eager mode (module section comment)."""
    return getattr(torch.ops.openflash, name)(*args) if torch.compiler.is_compiling() else call(*args)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_qdq: bool) -> torch.Tensor:
    """x [R, K] fp32 times an FP8 E4M3 weight [N, K] (its bytes) with UE8M0 scales per 32 x 32 block
    [ceil(N/32), K/32]; act_qdq: FP8-QDQ x per 32 channels first. Returns [R, N] fp32."""
    return dispatch("fp8_gemv", _fp8, x, weight, scale, act_qdq)


def fp4_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_qdq: bool) -> torch.Tensor:
    """x [R, K] fp32 times an MXFP4 weight [N, K/2] (two E2M1 codes a byte, element 2j in the low nibble)
    with UE8M0 scales per 1 x 32 [N, K/32]; act_qdq as for fp8_gemv. Returns [R, N] fp32."""
    return dispatch("fp4_gemv", _fp4, x, weight, scale, act_qdq)


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [R, K] fp32 times a bf16 weight [N, K]. Returns [R, N] fp32."""
    return dispatch("bf16_gemv", _bf16, x, weight)


def fp4_experts(x: torch.Tensor, w1: list[torch.Tensor], s1: list[torch.Tensor], w3: list[torch.Tensor],
                s3: list[torch.Tensor], w2: list[torch.Tensor], s2: list[torch.Tensor], token: torch.Tensor,
                expert: torch.Tensor, weight: torch.Tensor, limit: float, act_qdq: bool) -> torch.Tensor:
    """The routed experts of one MoE layer in one call: for each pair p (int64 token[p] into x [T, K], expert[p]
    into the lists, routing weight[p]), h = weight * silu(min(x W1^T, limit)) * clamp(x W3^T, -limit, limit), then
    y[token] += h W2^T in pair order. The lists hold each expert's MXFP4 bytes and UE8M0 scales: w1, w3 [I, K/2],
    s1, s3 [I, K/32], w2 [K, I/2], s2 [K, I/32]. act_qdq: FP8-QDQ x and h per 32 (the experts' input rounding).
    Returns y [T, K] fp32."""
    return dispatch("fp4_experts", _experts, x, w1, s1, w3, s3, w2, s2, token, expert, weight, limit, act_qdq)


def _experts(x: torch.Tensor, w1: list[torch.Tensor], s1: list[torch.Tensor], w3: list[torch.Tensor],
             s3: list[torch.Tensor], w2: list[torch.Tensor], s2: list[torch.Tensor], token: torch.Tensor,
             expert: torch.Tensor, weight: torch.Tensor, limit: float, act_qdq: bool) -> torch.Tensor:
    E, P = len(w1), token.numel()
    K, I = x.shape[-1], (w1[0].shape[0] if w1 else 0)
    problems = []
    if x.dim() != 2 or x.dtype != torch.float32 or K % BLOCK or I % BLOCK or not E:
        problems.append(f"x must be fp32 [T, K], K and the experts' width I multiples of {BLOCK}, got x {x.dtype} "
                        f"{tuple(x.shape)}, I {I}, {E} experts")
    if not all(len(t) == E for t in (s1, w3, s3, w2, s2)):
        problems.append("every weight and scale list needs one tensor per expert")
    shapes = {"w1": (w1, (I, K // 2)), "s1": (s1, (I, K // BLOCK)), "w3": (w3, (I, K // 2)),
              "s3": (s3, (I, K // BLOCK)), "w2": (w2, (K, I // 2)), "s2": (s2, (K, I // BLOCK))}
    used: list[int] = []
    if token.dtype != torch.int64 or expert.dtype != torch.int64 or weight.dtype != torch.float32 or \
            not token.shape == expert.shape == weight.shape == (P,) or not P:
        problems.append("token, expert (int64) and weight (fp32) must be one value per pair")
    elif int(token.min()) < 0 or int(token.max()) >= x.shape[0] or int(expert.min()) < 0 or int(expert.max()) >= E:
        problems.append(f"a pair names a token outside 0..{x.shape[0] - 1} or an expert outside 0..{E - 1}")
    else:  # the C code reads the experts the pairs name: those are checked (a decode graph passes every expert)
        used = expert.unique().tolist()
    for name, (tensors, shape) in shapes.items():
        bad = next((tensors[e] for e in used if len(tensors) == E and (
            tuple(tensors[e].shape) != shape or tensors[e].element_size() != 1 or not tensors[e].is_contiguous())),
            None)
        if bad is not None:
            problems.append(f"{name} holds a {bad.dtype} {tuple(bad.shape)} tensor, not contiguous bytes {shape}")
    if problems:
        raise ValueError("of_fp4_experts: " + "; ".join(problems))
    x, token, expert, weight = x.contiguous(), token.contiguous(), expert.contiguous(), weight.contiguous()
    y = torch.zeros_like(x)
    tables = [(ctypes.c_void_p * E)(*(t.data_ptr() for t in tensors)) for tensors, _ in shapes.values()]
    _run("of_fp4_experts", x, x.data_ptr(), x.shape[0], K, I, *tables, P, token.data_ptr(), expert.data_ptr(),
         weight.data_ptr(), limit, int(act_qdq), status().isa, y.data_ptr(), torch.get_num_threads())
    return y


def _experts_fake(x: torch.Tensor, w1: list[torch.Tensor], s1: list[torch.Tensor], w3: list[torch.Tensor],
                  s3: list[torch.Tensor], w2: list[torch.Tensor], s2: list[torch.Tensor], token: torch.Tensor,
                  expert: torch.Tensor, weight: torch.Tensor, limit: float, act_qdq: bool) -> torch.Tensor:
    return torch.empty_like(x)


def _register_ops() -> torch.library.Library:
    """openflash::fp8_gemv, fp4_gemv, bf16_gemv and fp4_experts: the products above as graph nodes (CPU kernels),
    each with the fake implementation that gives a traced graph its output's shape. Defined with torch.library's
    Library, not custom_op: a compiled decode step calls them by the hundred, and custom_op's wrapper adds to
    each call. The returned Library keeps the registrations alive."""
    library = torch.library.Library("openflash", "DEF")
    quantized = "(Tensor x, Tensor weight, Tensor scale, bool act_qdq) -> Tensor"
    library.define("fp8_gemv" + quantized)
    library.define("fp4_gemv" + quantized)
    library.define("bf16_gemv(Tensor x, Tensor weight) -> Tensor")
    library.define("fp4_experts(Tensor x, Tensor[] w1, Tensor[] s1, Tensor[] w3, Tensor[] s3, Tensor[] w2, "
                   "Tensor[] s2, Tensor token, Tensor expert, Tensor weight, float limit, bool act_qdq) -> Tensor")
    for name, kernel in (("fp8_gemv", _fp8), ("fp4_gemv", _fp4), ("bf16_gemv", _bf16), ("fp4_experts", _experts)):
        library.impl(name, kernel, "CPU")

    def quantized_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_qdq: bool) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    torch.library.register_fake("openflash::fp8_gemv", quantized_fake, lib=library)
    torch.library.register_fake("openflash::fp4_gemv", quantized_fake, lib=library)
    torch.library.register_fake("openflash::bf16_gemv", lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]),
                                lib=library)
    torch.library.register_fake("openflash::fp4_experts", _experts_fake, lib=library)
    return library


_OPS = _register_ops()


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the kernels run in this process (`status()`; a constant to a traced graph, which calls it at trace
    time instead of tracing into the library's loading)."""
    return status().available


__all__ = ["Status", "status", "build", "library_path", "available", "fp8_gemv", "fp4_gemv", "bf16_gemv", "fp4_experts",
           "MAX_ROWS", "ISA_AVX2", "ISA_AVX512_BF16", "ISA_INTEGER_FP4"]
