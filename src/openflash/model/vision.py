"""The vision tower, the aligner, and how image rows enter the text model (spec: vision_and_dspark.md §A.3-A.5).

    patches [N, 3, 14, 14] --ViT--> [N, vision_dim] --aligner (3x3 unshuffle + MLP)--> [cells, dim]
    span rows = IMAGE_START, (cells of a row + IMAGE_NEW_LINE) per row, IMAGE_END   (image_start/newline/end vectors)

The ViT attends bidirectionally over one image's patches with a 2D rotate-half RoPE (row angles on the first half
of each rotated pair, column angles on the second). Preprocessing (pixels to patches, the token grid) is not here:
the caller prepares it (openflash/vision/preprocess.py) and hands down patches and the span's token types.

Numerics: the reference runs all of this in bf16 (its model dtype); under the `reference` policy we compute in bf16
the same way (same ops, same dtypes), otherwise in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openflash.config_parts import VisionConfig
from openflash.model.layers import NumericsMixin

# Token types of an image span (spec §A.5); TEXT marks every other position.
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
VISION_NORM_EPS = 1e-6  # the ViT's RMSNorm (not the text model's 1e-20)


@dataclass
class ImageRows:
    """The embedding rows of the image-span positions of a step [B, S]: `mask` [B, S] (True on every span position,
    delimiters included) and `values` [mask.sum(), dim] in row-major order of `mask`. The text model overwrites
    its token embeddings there, routes them with `bias_vl` and gives them no Engram memory."""

    mask: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.mask.dtype != torch.bool or self.mask.dim() != 2:
            raise ValueError(f"ImageRows.mask must be a [B, S] bool tensor, got {self.mask.dtype} "
                             f"{tuple(self.mask.shape)}")
        n = int(self.mask.sum())
        if self.values.dim() != 2 or self.values.shape[0] != n:
            raise ValueError(f"ImageRows.values must hold one row per masked position ({n}), got "
                             f"{tuple(self.values.shape)}")

    def to(self, device: torch.device) -> "ImageRows":
        """The same rows on `device` (itself when they are there)."""
        if self.mask.device == device and self.values.device == device:
            return self
        return ImageRows(self.mask.to(device), self.values.to(device))

    @classmethod
    def stack(cls, rows: list["ImageRows | None"], length: int, device: torch.device) -> "ImageRows | None":
        """One [B, length] step's rows from B one-row steps (None: no image position there; a shorter row is
        right-padded with text positions); None if none has."""
        if all(r is None for r in rows):
            return None
        masks = [torch.zeros(1, length, dtype=torch.bool, device=device) if r is None else
                 F.pad(r.mask, (0, length - r.mask.shape[1])) for r in rows]
        return cls(torch.cat(masks), torch.cat([r.values for r in rows if r is not None]))


def _compute_dtype(module: NumericsMixin) -> torch.dtype:
    return torch.bfloat16 if module.numerics.bf16_boundaries else torch.float32


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return F.linear(x, layer.weight.to(x.dtype), bias)


class VisionRMSNorm(nn.Module):
    """RMSNorm in fp32 with an fp32 weight, eps 1e-6 (§A.3); the result in the input's dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight.float() * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + VISION_NORM_EPS))
                ).to(x.dtype)


def rope_2d(n_h: int, n_w: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """cos, sin [N, 1, head_dim/2] of a patch grid in row-major order: head_dim/4 frequencies theta^(-2j/(head_dim/2)),
    angles [row * f, col * f] (§A.3 step 2)."""
    rope_dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    rows = torch.arange(n_h, device=device).repeat_interleave(n_w).float()
    cols = torch.arange(n_w, device=device).repeat(n_h).float()
    angles = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (not interleaved) over the whole head, in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.heads, self.head_dim) for t in _linear(self.wqkv, x).chunk(3, dim=-1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Bidirectional over all patches of the image; scale 1/sqrt(head_dim).
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return _linear(self.wo, o.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # [gate | up]
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(self.w1, x).chunk(2, dim=-1)
        return _linear(self.w2, F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.norm2 = VisionRMSNorm(cfg.hidden_size)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * cfg.patch_size ** 2, cfg.hidden_size)


class VisionTower(nn.Module, NumericsMixin):
    """The ViT (checkpoint `vision.*`): patch embedding, pre-norm blocks, a final RMSNorm."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = VisionRMSNorm(cfg.hidden_size)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches [n_h * n_w, 3, p, p] (row-major grid) -> [n_h * n_w, hidden_size] in the compute dtype."""
        if patches.shape[0] != n_h * n_w:
            raise ValueError(f"{patches.shape[0]} patches for a {n_h}x{n_w} grid")
        x = _linear(self.patch_embed.proj, patches.flatten(1).to(_compute_dtype(self)))
        cos, sin = rope_2d(n_h, n_w, self.cfg.head_dim, self.cfg.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """3x3 pixel-unshuffle + w2(GELU(w1(.))) into the text model's width (checkpoint `aligner.*`, §A.4)."""

    def __init__(self, cfg: VisionConfig, dim: int) -> None:
        super().__init__()
        self.ratio = cfg.downsample_ratio
        self.w1 = nn.Linear(cfg.hidden_size * self.ratio ** 2, dim)
        self.w2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """ViT rows [n_h * n_w, C] -> cells [ceil(n_h/r) * ceil(n_w/r), dim] in row-major order."""
        r = self.ratio
        grid = x.view(n_h, n_w, -1).permute(2, 0, 1)
        grid = F.pad(grid, (0, -n_w % r, 0, -n_h % r))  # zero rows / columns at the bottom and right
        # Each cell's vector is ordered (channel, ky, kx), channel outermost: what unfold produces.
        cells = F.unfold(grid.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)
        return _linear(self.w2, F.gelu(_linear(self.w1, cells)))


def span_rows(types: torch.Tensor, cells: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
              newline: torch.Tensor) -> torch.Tensor:
    """The embedding rows of one image span [len(types), dim]: delimiter vectors where the types say so, the
    aligner cells in reading order on the IMAGE positions."""
    is_image = types == IMAGE
    if int(is_image.sum()) != cells.shape[0]:
        raise ValueError(f"the image span has {int(is_image.sum())} IMAGE positions but the aligner made "
                         f"{cells.shape[0]} rows")
    rows = torch.empty(types.numel(), cells.shape[-1], dtype=cells.dtype, device=cells.device)
    rows[types == IMAGE_START] = start.to(cells.dtype)
    rows[types == IMAGE_END] = end.to(cells.dtype)
    rows[types == IMAGE_NEW_LINE] = newline.to(cells.dtype)
    rows[is_image] = cells
    return rows


__all__ = ["ImageRows", "VisionTower", "Aligner", "span_rows", "rope_2d", "TEXT", "IMAGE_START", "IMAGE",
           "IMAGE_NEW_LINE", "IMAGE_END"]
