"""Image preprocessing exactly as the reference (spec: vision_and_dspark.md §A.2).

    bytes --decode (limits)--> RGB --plan the size--> (best_w, best_h), token grid
          --ImageOps.pad to best size, gray 127, centred--> normalise (x/255 - 0.5)/0.5, bf16
          --14x14 patches, row-major, each (c, y, x)--> patches [n_vit_h * n_vit_w, 3, 14, 14]

Size planning: below `min_pixels` both sides scale by sqrt(min_pixels / (w h)) (truncated), then round up to
multiples of 14. If the grid then costs more than `max_image_tokens` positions, the largest aspect-preserving size
that fits is solved for (very tall images become one column, very wide ones one row).

Decoding is guarded: the encoded size, the pixel count (read from the header, before any pixel is decoded) and
the format are checked, so a decompression bomb or a truncated file is refused with a message naming the input.
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from openflash.config_parts import VisionConfig
from openflash.errors import RequestError
from openflash.model.vision import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START

PAD_GRAY = (127, 127, 127)
ImageSource = Union[bytes, str, Path, Image.Image]


class ImageError(RequestError):
    """An image that cannot be used: undecodable, too large, or over a limit. `param` names the request field."""


@dataclass(frozen=True)
class ImageLimits:
    """Refuse images above these sizes before decoding them (a server sets them per request)."""

    max_bytes: int = 20 << 20  # encoded size
    max_pixels: int = 40_000_000  # width x height from the header (PIL's own bomb limit is ~179M)


@dataclass(frozen=True)
class ImageGrid:
    """The resize plan of one image: pixel size after resizing, ViT patch grid, LLM token grid."""

    height: int
    width: int
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def num_tokens(self) -> int:
        """Positions of the image's span: start, rows of (cells + newline), end (spec §A.2 step 3)."""
        return num_image_tokens(self.n_llm_h, self.n_llm_w)


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def _llm_grid(best_h: int, best_w: int, patch: int, ratio: int) -> tuple[int, int]:
    return math.ceil((best_h // patch) / ratio), math.ceil((best_w // patch) / ratio)


def _shrink(height: int, width: int, patch: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-preserving size whose grid fits in max_tokens (spec §A.2 step 4)."""
    r = height / width
    max_w = math.sqrt((max_tokens - 2) / r + 0.25) - 0.5
    max_h = max_w * r
    cell = patch * ratio
    if max_w < 1.0:  # very tall: a single column
        return (max_tokens - 2) // 2 * cell, cell
    if max_h < 1.0:  # very wide: a single row
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / patch) * patch, math.floor(width * beta / patch) * patch


def plan_grid(width: int, height: int, cfg: VisionConfig) -> ImageGrid:
    """The resize plan of an image of this original size (a pure function of its arguments)."""
    p, ratio = cfg.patch_size, cfg.downsample_ratio
    if cfg.max_wh_ratio is not None and width > height * cfg.max_wh_ratio:
        width = height * cfg.max_wh_ratio
    if 0 < width * height < cfg.min_pixels:
        scale = (cfg.min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    n_llm_h, n_llm_w = _llm_grid(best_h, best_w, p, ratio)
    if num_image_tokens(n_llm_h, n_llm_w) > cfg.max_image_tokens:
        best_h, best_w = _shrink(height, width, p, ratio, cfg.max_image_tokens)
        n_llm_h, n_llm_w = _llm_grid(best_h, best_w, p, ratio)
        if num_image_tokens(n_llm_h, n_llm_w) > cfg.max_image_tokens:  # the reference asserts this
            raise AssertionError(f"shrunk grid {n_llm_h}x{n_llm_w} still exceeds {cfg.max_image_tokens} tokens")
    return ImageGrid(best_h, best_w, best_h // p, best_w // p, n_llm_h, n_llm_w)


def span_types(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """Token types of an image span in reading order: IMAGE_START, per row cells + IMAGE_NEW_LINE, IMAGE_END."""
    types = [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]
    return torch.tensor(types, dtype=torch.int64)


@dataclass(frozen=True)
class PreparedImage:
    """One image as the model takes it: patches [n_vit_h * n_vit_w, 3, p, p] (bf16 values, as the reference),
    its grid, the token types of its span, and a digest of the patches (what the prefix cache keys on)."""

    patches: torch.Tensor
    grid: ImageGrid
    types: torch.Tensor
    digest: str

    @property
    def num_tokens(self) -> int:
        return self.grid.num_tokens


def usable_aspect(cfg: VisionConfig, wide: bool) -> int:
    """The most elongated image (long side / short side) the preprocessing can use: the plan's most extreme grid
    is one row of max_image_tokens - 3 cells (wide) or one column of (max_image_tokens - 2) // 2 (tall; each row
    also holds a newline), a cell being downsample_ratio x patch_size pixels across; resized into that strip, a
    longer image would keep less than one pixel of its short side, that is nothing of its content."""
    cells = cfg.max_image_tokens - 3 if wide else (cfg.max_image_tokens - 2) // 2
    return cells * cfg.downsample_ratio * cfg.patch_size


def check_shape(width: int, height: int, limits: ImageLimits, cfg: VisionConfig | None, where: str) -> None:
    """An image's size from its header against the limits, and (given the vision config) its aspect ratio."""
    if width * height > limits.max_pixels:
        raise ImageError(f"{where}: the image is {width}x{height} = {width * height} pixels, over the limit of "
                         f"{limits.max_pixels}", where)
    if width < 1 or height < 1:
        raise ImageError(f"{where}: the image has no pixels ({width}x{height})", where)
    if cfg is not None:
        wide = width >= height
        aspect, limit = max(width, height) / min(width, height), usable_aspect(cfg, wide)
        if aspect > limit:
            raise ImageError(f"{where}: the image is {width}x{height}, {aspect:.0f}:1 {'wide' if wide else 'tall'}; "
                             f"beyond {limit}:1 this model's preprocessing keeps less than one pixel of the short "
                             f"side (vision_config max_image_tokens {cfg.max_image_tokens})", where)


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), where: str = "image",
                 cfg: VisionConfig | None = None) -> Image.Image:
    """RGB pixels of encoded image bytes (any format Pillow reads: PNG, JPEG, WebP, GIF, BMP, ...); the size is
    checked from the header before any pixel is decoded (check_shape)."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: the image is {len(data)} bytes, over the limit of {limits.max_bytes}", where)
    if not data:
        raise ImageError(f"{where}: the image is empty (0 bytes)", where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as source:
                check_shape(*source.size, limits, cfg, where)
                return _to_rgb(source)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{where}: not a readable image (no image format Pillow knows: PNG, JPEG, WebP, GIF, BMP, "
                         f"...)", where) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"{where}: not a readable image ({exc})", where) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # truncated or corrupt data
        raise ImageError(f"{where}: the image data is damaged or truncated ({exc})", where) from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """`convert("RGB")` as the reference: alpha is dropped (not composited), palettes and grey expand."""
    image.load()
    return image.convert("RGB")


def load_image(source: ImageSource, limits: ImageLimits = ImageLimits(), where: str = "image",
               cfg: VisionConfig | None = None) -> Image.Image:
    """RGB pixels of a PIL image, a file path, or encoded bytes (sizes checked first: check_shape)."""
    if isinstance(source, Image.Image):
        check_shape(*source.size, limits, cfg, where)
        return _to_rgb(source.copy())
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ImageError(f"{where}: cannot read {path}: {exc.strerror or exc}", where) from None
        return decode_image(data, limits, f"{where} ({path})", cfg)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), limits, where, cfg)
    raise ImageError(f"{where}: expected a PIL image, a path or bytes, got {type(source).__name__}", where)


def prepare_image(source: ImageSource, cfg: VisionConfig, limits: ImageLimits = ImageLimits(),
                  where: str = "image") -> PreparedImage:
    """Decode (with limits), resize and pad, normalise and cut into patches (spec §A.2)."""
    image = load_image(source, limits, where, cfg)
    grid = plan_grid(image.width, image.height, cfg)
    if cfg.max_wh_ratio is not None and image.width >= cfg.max_wh_ratio * image.height:
        image = image.resize((grid.width, grid.height))
    else:
        image = ImageOps.pad(image, (grid.width, grid.height), color=PAD_GRAY)
    x = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    p = cfg.patch_size
    patches = (x.reshape(3, grid.n_vit_h, p, grid.n_vit_w, p).permute(1, 3, 0, 2, 4)
               .reshape(grid.n_vit_h * grid.n_vit_w, 3, p, p).contiguous())
    digest = hashlib.blake2b(patches.view(torch.int16).numpy().tobytes() +
                             f"{grid.n_vit_h}x{grid.n_vit_w}".encode(), digest_size=16).hexdigest()
    return PreparedImage(patches, grid, span_types(grid.n_llm_h, grid.n_llm_w), digest)


__all__ = ["ImageError", "ImageLimits", "ImageGrid", "PreparedImage", "plan_grid", "span_types", "decode_image",
           "load_image", "prepare_image", "num_image_tokens", "usable_aspect", "check_shape"]
