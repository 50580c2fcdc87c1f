"""Numerics policies: where the model rounds and quantizes.

The reference runs in bf16 and quantize-dequantizes (QDQ) activations and caches (spec: quant_and_cache.md §5).
openflash computes in fp32 (bf16 matmuls are slow on CPU and gain nothing for accuracy) and lets a policy decide
which of the reference's rounding points to reproduce:

- `fp32` (default for inference): the model's own quantization points (FP8 activations into FP8/FP4 linears,
  FP8 window KV, FP4 compressed KV, MXFP4 index q/k) in fp32 arithmetic. These are part of the trained model.
- `reference`: additionally rounds to bf16 wherever the reference's bf16 tensors do, so that integer outputs
  (top-k, routing) match the official code exactly; used by `openflash parity`.
- `train`: fp32 with the cache QDQs applied through a straight-through estimator, so gradients flow, and the
  fused training ops (`fused_train_ops`); `finetune` (LoRA on a quantized base) keeps the activation QDQs too.

The flags decide where QDQ and rounding happen; where the computation itself differs per policy, each mechanism
holds one kernel set per policy, chosen once from these flags and cached (`hc_kernels` in mhc.py,
`attention_kernels`, `index_kernels`, `layer_kernels`, `moe_kernels`), so every forward reads as one path and a
compiled backend can slot in as one more kernel set.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import ContextManager

import torch

from openflash import formats
from openflash.errors import OpenflashError
from openflash.model.compiled import rowwise


@dataclass(frozen=True)
class Numerics:
    name: str
    bf16_boundaries: bool  # round to bf16 at the reference's op boundaries
    act_quant: bool  # FP8 QDQ of activations entering FP8 / FP4 weights
    cache_qdq: bool  # FP8 window KV, FP4 (E4M3/16) compressed KV, MXFP4 index q and k
    straight_through: bool  # QDQ with a straight-through gradient (training)
    # Reproduce a decode-time quirk of the reference code (docs/parity.md): when a ratio-2 FULL layer's group
    # is still open, its indexer scores against whatever index keys were published last (another layer's),
    # not its own. Only the `reference` policy turns this on; openflash's own behaviour uses the layer's keys.
    stale_index_keys: bool = False
    # Training speed: the same math through fused ops with hand-written backward passes (mHC, attention softmax,
    # routed experts); the summation order differs from the unfused ops, so only the `train` policy uses them.
    fused_train_ops: bool = False
    # Inference: the routed experts of a decode-sized step in batched matmuls over the selected experts instead of
    # one call per expert (model/moe.py); summation order differs in the last bits, so `reference` keeps the loop.
    batched_experts: bool = True
    # The compiled backend (model/compiled.py): the same math, its elementwise chains fused by torch.compile.
    compiled: bool = False

    def with_compile(self, on: bool = True) -> "Numerics":
        """This policy on the compiled backend (or back on the eager one)."""
        if on and self.bf16_boundaries:
            raise OpenflashError(f"the compiled backend serves the fp32, plain and train numerics, not "
                                 f"{self.name!r} (its bf16 rounding points are the reference's eager ops)")
        return replace(self, compiled=on)

    def gemm_kernels(self, device: torch.device) -> ContextManager[None]:
        """Where the bf16 GEMM kernel decides the reference's rounding: its CPU goldens come from PyTorch's own bf16
        GEMMs (fp32 sums in ATen's order, one rounding). On CPUs with AVX512-BF16 or AMX, oneDNN takes bf16 GEMMs
        over and sums in another order: golden B2's vit_out then misses by over 2 bf16 ulps (an Intel Xeon,
        2026-12-05), and passes with oneDNN off, as on AVX2-only CPUs. `reference` on the CPU runs with it off."""
        if self.bf16_boundaries and device.type == "cpu":
            return torch.backends.mkldnn.flags(enabled=False)
        return nullcontext()

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """Round to bf16 where the reference holds a bf16 tensor (no-op outside `reference`)."""
        if self.bf16_boundaries:
            return x.to(torch.bfloat16).to(x.dtype)
        return x

    def _qdq(self, x: torch.Tensor, fn) -> torch.Tensor:
        if not self.cache_qdq:
            return x
        if self.straight_through:
            return formats.ste(x, fn)
        return rowwise(fn, x) if self.compiled else fn(x)

    def window_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Sliding-window KV: FP8 E4M3 with a UE8M0 scale per 32 channels (architecture.md §5.3)."""
        return self._qdq(x, formats.act_quant_qdq)

    def index_fp4(self, x: torch.Tensor) -> torch.Tensor:
        """Indexer query and index keys: MXFP4 (E2M1, UE8M0 per 32) (architecture.md §5.6, §5.8)."""
        return self._qdq(x, formats.fp4_qdq_ue8m0)

    def compressed_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Compressed main KV: E2M1 with an E4M3 scale per 16 channels (architecture.md §5.7)."""
        return self._qdq(x, formats.fp4_qdq_e4m3)


FP32 = Numerics("fp32", bf16_boundaries=False, act_quant=True, cache_qdq=True, straight_through=False)
REFERENCE = Numerics("reference", bf16_boundaries=True, act_quant=True, cache_qdq=True, straight_through=False,
                     stale_index_keys=True, batched_experts=False)
TRAIN = Numerics("train", bf16_boundaries=False, act_quant=False, cache_qdq=True, straight_through=True,
                 fused_train_ops=True)

# Fine-tuning on a quantized base kept as stored (`train --lora`): the model's own rounding points (FP8 activations
# into FP8/FP4 weights, the cache QDQs) all straight-through, and the fused training ops.
FINETUNE = Numerics("finetune", bf16_boundaries=False, act_quant=True, cache_qdq=True, straight_through=True,
                    fused_train_ops=True)

# No quantization at all: for consistency tests, where a QDQ rounding flip would hide a real difference.
PLAIN = Numerics("plain", bf16_boundaries=False, act_quant=False, cache_qdq=False, straight_through=False)

NUMERICS = {n.name: n for n in (FP32, REFERENCE, TRAIN, PLAIN)}
