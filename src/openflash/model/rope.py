"""Rotary position embedding on the last `rope_dim` channels, interleaved pairs (spec: architecture.md §5.2).

Ratio-0 layers use plain RoPE with `rope_theta`; ratio > 0 layers use `compress_rope_theta` with DeepSeek's YaRN
frequency blend (no mscale). Angles are the fp32 product position * frequency, computed on the fly from absolute
positions, so any position (and per-row positions in a batch) works without a precomputed table.
"""

from __future__ import annotations

import math

import torch

from openflash.config import FlashConfig
from openflash.formats import DeviceConstant


def rope_frequencies(cfg: FlashConfig, theta: float, yarn: bool) -> torch.Tensor:
    """Per-pair frequencies omega'_i, i = 0 .. rope_dim/2 - 1, as fp32."""
    dim = cfg.qk_rope_head_dim
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    if not yarn:
        return freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    # The ramp runs over frequency indices although low/high come from a "dim" formula: reproduce exactly.
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 0.001)).clamp(0, 1)
    return freqs * (1 - ramp) + freqs / cfg.rope_factor * ramp


class Rotary:
    """cos/sin for given absolute positions and rotation of the last rope_dim channels."""

    def __init__(self, cfg: FlashConfig, theta: float, yarn: bool) -> None:
        self.rope_dim = cfg.qk_rope_head_dim
        self.freqs = DeviceConstant(rope_frequencies(cfg, theta, yarn))

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [...] -> (cos, sin) fp32 [..., rope_dim/2]."""
        freqs = self.freqs.on(positions.device)
        angle = positions.to(torch.float32).unsqueeze(-1) * freqs
        if torch.compiler.is_compiling():  # (no complex ops in a compiled graph: polar(1, a) is cos a + i sin a)
            return torch.cos(angle), torch.sin(angle)
        rotation = torch.polar(torch.ones_like(angle), angle)  # the reference's table: cos/sin via polar
        return rotation.real, rotation.imag

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate pairs (x[2i], x[2i+1]) of the last rope_dim channels; cos/sin broadcast against x[..., :1].

        `inverse` uses the conjugate rotation (output de-rotation, architecture.md §5.11).
        """
        if torch.compiler.is_compiling():  # inductor generates no code for complex ops: the product in reals
            return _rotate_tail_real(x, cos, -sin if inverse else sin, self.rope_dim)
        return _Rotate.apply(x, torch.complex(cos, -sin if inverse else sin), self.rope_dim)


def _rotate_tail_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """`_rotate_tail` by (cos + i sin) written out in real arithmetic (equal up to the complex kernel's rounding)."""
    a, b = x[..., -rope_dim:].float().unflatten(-1, (-1, 2)).unbind(-1)
    out = x.clone()
    out[..., -rope_dim:] = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)
    return out


def _rotate_tail(x: torch.Tensor, rotation: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x with its last rope_dim channels (as complex pairs) multiplied by `rotation`."""
    # Complex multiplication, as the reference does it (same fp32 rounding as its kernels' inputs).
    pairs = torch.view_as_complex(x[..., -rope_dim:].float().unflatten(-1, (-1, 2)).contiguous())
    out = x.clone()
    out[..., -rope_dim:] = torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)
    return out


class _Rotate(torch.autograd.Function):
    """RoPE with a direct backward: the gradient is rotated back by the conjugate rotation (one pass, instead of
    autograd's slice, complex-view and concatenation steps)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rotation: torch.Tensor, rope_dim: int) -> torch.Tensor:
        ctx.save_for_backward(rotation)
        ctx.rope_dim = rope_dim
        return _rotate_tail(x, rotation, rope_dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (rotation,) = ctx.saved_tensors
        return _rotate_tail(g, rotation.conj(), ctx.rope_dim), None, None
