"""Primitive layers: RMSNorm and a Linear that stores its weight as the checkpoint does (spec: architecture.md §3).

A `Linear` holds its weight in one of three storage kinds:
- "float": a trainable fp32 parameter `weight` (models trained here, and bf16/fp32 checkpoint tensors);
- "fp8": `weight` FP8 E4M3 [out, in] + `scale` UE8M0 [ceil(out/32), ceil(in/32)] (dense released linears);
- "fp4": `weight` I8 [out, in/2] (two E2M1 codes per byte) + `scale` UE8M0 [out, in/32] (routed experts).
Two residencies (`Linear.keep_dequantized`, set model-wide by `Transformer.set_weight_residency`):
- "dequantized" (the default for models that fit): quantized weights are dequantized to fp32 once and cached (the
  CPU path is compute-bound on small models, and re-dequantizing every call costs more than the matmul); the cache
  is rebuilt when the stored bytes change.
- "stored": nothing but the stored bytes stays resident (FP8 / FP4 codes and scales, bf16 matrices as bf16). On a CPU
  with AVX2 the native kernels multiply them straight from those bytes, 16 rows a call, a prefill's rows too where
  that is faster (kernels.native_rows; kernels/: decoded in registers, the activation QDQ fused), and on CUDA any
  number of rows of an FP8 or FP4 weight by Triton's (kernels/triton_products.py); otherwise each call dequantizes one
  tile of output rows at a time (at most TILE_BYTES of fp32) and multiplies it in fp32, so memory is the
  checkpoint's size plus one tile. Same values, same fp32 arithmetic (to summation order).
Inputs to quantized weights are FP8-quantized per 32 channels first, as the reference's GEMMs do.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from openflash import formats, kernels
from openflash.kernels import native, triton_products
from openflash.model.compiled import graph_linear, rowwise
from openflash.model.numerics import FP32, Numerics


class NumericsMixin:
    """Modules that round or quantize read the model's policy from `self.numerics` (set by the Transformer)."""

    numerics: Numerics = FP32


class RMSNorm(nn.Module, NumericsMixin):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 (architecture.md §3.1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_kernels(self.numerics).rmsnorm(self, x)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm for training with a direct backward. With r = rsqrt(mean(x^2) + eps), n = x r and y = w n:
    dx = r (g w - n mean(g w n)), dw = sum over tokens of g n."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
        normed = x * r
        ctx.save_for_backward(normed, weight, r)
        return normed * weight

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        normed, weight, r = ctx.saved_tensors
        gw = g * weight
        dx = gw.sub_(normed * torch.linalg.vecdot(gw, normed).unsqueeze(-1).div_(normed.shape[-1])).mul_(r)
        d_weight = (g * normed).reshape(-1, normed.shape[-1]).sum(0)
        return dx, d_weight, None


TILE_BYTES = 16 << 20  # "stored" residency: fp32 bytes of weight rows dequantized at once


class Linear(nn.Module, NumericsMixin):
    """y = x W^T with W stored as "float", "fp8" or "fp4" (see module doc). No bias: V4.1 has none."""

    keep_dequantized: bool = True  # residency: False = "stored" (module doc)

    def __init__(self, in_features: int, out_features: int, storage: str = "float", exact_fp32: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.storage = in_features, out_features, storage
        # fp32 weights in the reference (head, ratio-2 compressor) give fp32 outputs: never rounded to bf16.
        self.exact_fp32 = exact_fp32
        if storage == "float":
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
            nn.init.normal_(self.weight, std=in_features ** -0.5)
        elif storage == "fp8":
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
            self.register_buffer("scale", torch.full((-(-out_features // 32), -(-in_features // 32)), 1.0,
                                                     dtype=torch.float8_e8m0fnu))
        elif storage == "fp4":
            if in_features % 32:
                raise ValueError(f"fp4 weights need in_features divisible by 32, got {in_features}")
            self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.int8))
            self.register_buffer("scale", torch.full((out_features, in_features // 32), 1.0,
                                                     dtype=torch.float8_e8m0fnu))
        else:
            raise ValueError(f"unknown weight storage {storage!r} (float, fp8, fp4)")
        self._dequant: torch.Tensor | None = None
        self._dequant_key: tuple | None = None
        # A trainable low-rank update added to the output (model/lora.py); None: the weight alone.
        self.adapter: nn.Module | None = None

    @property
    def quantized(self) -> bool:
        return self.storage != "float"

    @property
    def stored_format(self) -> str | None:
        """The format a kernel would read the weight in as stored (kernels.product_kernel): fp8, fp4, bf16, or None
        for an fp32 weight."""
        if self.quantized:
            return self.storage
        return "bf16" if self.weight.dtype == torch.bfloat16 else None

    @property
    def fp32_resident(self) -> bool:
        """The fp32 weight is at hand without converting: an fp32 parameter, or the dequantized cache."""
        return self.weight.dtype == torch.float32 or self.keep_dequantized

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as fp32 [out, in]: cached for quantized storage when keeping it dequantized, a temporary
        otherwise."""
        if not self.quantized:
            return self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        if not self.keep_dequantized:
            return self.dequantized_rows(0, self.out_features)
        if self._dequant is not None and torch.compiler.is_compiling():
            return self._dequant  # a whole-step graph: its runner refreshed the cache before the call
        key = (self.weight.data_ptr(), self.weight._version, self.scale._version, self.weight.device)
        if self._dequant is None or self._dequant_key != key:
            self._dequant = self.dequantized_rows(0, self.out_features)
            self._dequant_key = key
        return self._dequant

    def dequantized_rows(self, start: int, stop: int) -> torch.Tensor:
        """Output rows [start, stop) of the weight in fp32 (start a multiple of 32 for fp8: its scale blocks)."""
        if self.storage == "fp8":
            return formats.dequantize_fp8_blocks(self.weight[start:stop], self.scale[start // 32: -(-stop // 32)])
        if self.storage == "fp4":
            return formats.dequantize_mxfp4(self.weight[start:stop], self.scale[start:stop])
        return self.weight[start:stop].float()

    def tile_rows(self) -> int:
        """Output rows per tile in "stored" residency: a multiple of 32 within TILE_BYTES of fp32."""
        return max(32, TILE_BYTES // (4 * self.in_features) // 32 * 32)

    def drop_dequantized(self) -> None:
        self._dequant = self._dequant_key = None

    @property
    def dequantized_bytes(self) -> int:
        """Bytes the fp32 copy of a quantized weight holds now (0 until first use, and in "stored" residency)."""
        return 0 if self._dequant is None else self._dequant.numel() * self._dequant.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = layer_kernels(self.numerics).linear(self, x)
        return y if self.adapter is None else y + self.adapter(x)

    def _block_scaled_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The reference GEMM's summation order (quant_and_cache.md §3): per K block of 32, an exact fp32 partial
        product of FP8 activations and FP8/FP4 weight codes, scaled and accumulated sequentially in K order."""
        shape = x.shape
        a, a_scale = formats.act_quant(x.reshape(-1, shape[-1]))
        if self.storage == "fp8":
            codes = formats.e4m3_decode(self.weight)
            w_scale = formats.ue8m0_decode(self.scale).repeat_interleave(32, dim=0)[: self.out_features]
        else:
            codes = formats.e2m1_decode(formats.unpack_fp4(self.weight))
            w_scale = formats.ue8m0_decode(self.scale)
        acc = torch.zeros(a.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for k in range(self.in_features // 32):
            block = slice(32 * k, 32 * (k + 1))
            acc += (a[:, block] @ codes[:, block].t()) * a_scale[:, k: k + 1] * w_scale[:, k].unsqueeze(0)
        return acc.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, storage={self.storage}"


# ---- the kernels of each numerics policy (chosen once: layer_kernels) -------------------------------------------

class LayerKernels:
    """fp32 / plain: RMSNorm in fp32; a Linear on its dequantized weight, FP8 activations into quantized weights
    where the policy quantizes them (`act_quant`), outputs rounded at the policy's points."""

    def rmsnorm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
        return norm.numerics.round(y)

    def linear(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        qdq = layer.quantized and layer.numerics.act_quant
        if x.numel() == 0:  # an expert without tokens, called for its (zero) gradients: nothing to read
            y = x.new_zeros(*x.shape[:-1], layer.out_features, dtype=torch.float32)
        elif not (layer.fp32_resident or x.requires_grad) and _kernel_serves(layer, x):
            y = _native_linear(layer, x, qdq)  # the QDQ inside the call
        else:
            if qdq:  # with a gradient to pass on (fine-tuning a quantized base), straight-through
                x = formats.ste(x, self.act_quant) if x.requires_grad else self.act_quant(x)
            if layer.fp32_resident:
                w = layer.dequantized_weight()
                y = graph_linear(x.to(w.dtype), w)
            elif x.requires_grad:  # through a frozen stored weight (LoRA): never an fp32 copy of it
                y = _StoredProduct.apply(x, layer)
            else:
                y = _tiled_linear(layer, x)
        return y if layer.exact_fp32 else layer.numerics.round(y)

    def act_quant(self, x: torch.Tensor) -> torch.Tensor:
        """FP8 QDQ of an activation entering a quantized weight."""
        return formats.act_quant_qdq(x)


class CompiledLayerKernels(LayerKernels):
    """The activation QDQ through torch.compile (model/compiled.py): its dozen ops fuse into one loop. The GEMM
    stays outside: a compiled graph specialises on each weight's shape, and a GEMM gains nothing from fusion."""

    def act_quant(self, x: torch.Tensor) -> torch.Tensor:
        return rowwise(formats.act_quant_qdq, x)


def _kernel_serves(layer: Linear, x: torch.Tensor) -> bool:
    """Whether a kernel multiplies x by the weight as stored (kernels.serves: Triton's on CUDA, the native ones on
    the CPU; a training-mode forward's rows as kernels.native_rows allows them)."""
    return kernels.serves(x, layer.weight, layer.stored_format, layer.training)


def _native_linear(layer: Linear, x: torch.Tensor, act_qdq: bool) -> torch.Tensor:
    """x W^T from the stored bytes by the kernels (kernels/native.py on the CPU, kernels/triton_products.py on
    CUDA), the activation QDQ in the call (act_qdq: whether)."""
    x2 = x.reshape(-1, layer.in_features).float()
    if x.is_cuda:
        y = triton_products.product(x2, layer.weight, layer.scale, layer.storage, act_qdq)
    elif layer.storage == "fp8":
        y = native.fp8_gemv(x2, formats.as_uint8(layer.weight), formats.as_uint8(layer.scale), act_qdq)
    elif layer.storage == "fp4":
        y = native.fp4_gemv(x2, formats.as_uint8(layer.weight), formats.as_uint8(layer.scale), act_qdq)
    else:  # a bf16 matrix kept as stored
        y = native.bf16_gemv(x2, layer.weight)
    return y.view(*x.shape[:-1], layer.out_features)


class _StoredProduct(torch.autograd.Function):
    """x W^T with W frozen as stored: the forward as inference computes it (kernels, else tiles), the backward
    dx = g W one dequantized tile at a time, so training through it never holds an fp32 copy of W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        ctx.layer = layer
        if _kernel_serves(layer, x):
            return _native_linear(layer, x, False)
        return _tiled_linear(layer, x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        layer = ctx.layer
        g2 = g.reshape(-1, layer.out_features).float()
        dx = g2.new_zeros(g2.shape[0], layer.in_features)
        step = layer.tile_rows()
        for start in range(0, layer.out_features, step):
            stop = min(start + step, layer.out_features)
            dx += g2[:, start:stop] @ layer.dequantized_rows(start, stop)
        return dx.view(*g.shape[:-1], layer.in_features), None


def _tiled_linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """x W^T in fp32 from the stored weight, one tile of output rows dequantized at a time."""
    x2 = x.reshape(-1, layer.in_features).float()
    out = x2.new_empty(x2.shape[0], layer.out_features)
    step = layer.tile_rows()
    for start in range(0, layer.out_features, step):
        stop = min(start + step, layer.out_features)
        out[:, start:stop] = x2 @ layer.dequantized_rows(start, stop).t()
    return out.view(*x.shape[:-1], layer.out_features)


class ReferenceLayerKernels(LayerKernels):
    """The reference's GEMMs: block-scaled FP8/FP4 in its K order, bf16 for bf16 weights (summation order
    included); fp32 weights (head, ratio-2 compressor) stay exact fp32."""

    def linear(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.quantized:
            return layer.numerics.round(layer._block_scaled_gemm(x))
        if not layer.exact_fp32:
            return F.linear(x.to(torch.bfloat16), layer.weight.to(torch.bfloat16)).float()
        return super().linear(layer, x)


class TrainLayerKernels(LayerKernels):
    """Training: RMSNorm with a direct backward."""

    def rmsnorm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x.float(), norm.weight, norm.eps)


@lru_cache(maxsize=None)
def layer_kernels(numerics: Numerics) -> LayerKernels:
    if numerics.bf16_boundaries:
        return ReferenceLayerKernels()
    if numerics.fused_train_ops:
        return TrainLayerKernels()
    return CompiledLayerKernels() if numerics.compiled else LayerKernels()
