"""Image spans in a prompt: where each sits, what the prefix cache keys on, and the rows a step hands the model.

Every span position carries `image_token_id` (spec §A.5); the span's token types tell its parts apart. A prompt
is assembled from text token ids and prepared images in order; a step over prompt positions [a, b) gets the
`ImageRows` of the span positions inside it, so image spans may fall in any prefill chunk (or straddle two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from tokenizers import Tokenizer

from openflash.config import FlashConfig
from openflash.errors import RequestError
from openflash.model.context import Probe
from openflash.model.vision import ImageRows
from openflash.vision.preprocess import ImageLimits, ImageSource, PreparedImage, prepare_image

KEY_SPACE = 1 << 62
IMAGE_PLACEHOLDER = "<image>"  # where an image goes in a plain-text prompt (generate --prompt, text_prompt)


@dataclass(frozen=True)
class PromptImage:
    """A prepared image placed at prompt positions [start, start + num_tokens)."""

    start: int
    image: PreparedImage

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens


def assemble(segments: Sequence[list[int] | PreparedImage], image_token_id: int) -> tuple[list[int], list[PromptImage]]:
    """Token ids of text segments and image spans in order, and where each image sits."""
    ids: list[int] = []
    placed: list[PromptImage] = []
    for segment in segments:
        if isinstance(segment, PreparedImage):
            placed.append(PromptImage(len(ids), segment))
            ids += [image_token_id] * segment.num_tokens
        else:
            ids += list(segment)
    return ids, placed


def text_prompt(tokenizer: Tokenizer, text: str, images: Sequence[ImageSource], cfg: FlashConfig,
                limits: ImageLimits = ImageLimits()) -> tuple[list[int], list[PromptImage]]:
    """Token ids of a plain-text prompt with images: each `<image>` in the text is replaced by the next image's
    span; without any `<image>`, the images come first, in order, then the text."""
    if images and cfg.vision is None:
        raise RequestError("this model has no vision tower (vision_config.num_hidden_layers = 0): it takes no images",
                           param="images")
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) == 1 and images:
        pieces = [""] * len(images) + [text]
    if len(pieces) - 1 != len(images):
        raise RequestError(f"the prompt has {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholders but {len(images)} "
                           f"images were given", param="images")
    segments: list[list[int] | PreparedImage] = []
    for k, piece in enumerate(pieces):
        segments.append(tokenizer.encode(piece, add_special_tokens=k == 0).ids)
        if k < len(images):
            segments.append(prepare_image(images[k], cfg.vision, limits, where=f"image {k}"))
    return assemble(segments, cfg.image_token_id)


def check_spans(prompt_ids: Sequence[int], images: Sequence[PromptImage], image_token_id: int | None) -> None:
    """Spans in order, inside the prompt, not overlapping, every position holding image_token_id."""
    end = 0
    for k, img in enumerate(images):
        if img.start < end or img.end > len(prompt_ids):
            raise ValueError(f"image {k} spans [{img.start}, {img.end}), which overlaps the previous span or leaves "
                             f"the {len(prompt_ids)}-token prompt")
        if any(t != image_token_id for t in prompt_ids[img.start:img.end]):
            raise ValueError(f"image {k}: the prompt positions [{img.start}, {img.end}) must all hold the image "
                             f"token id {image_token_id}")
        end = img.end


def key_ids(prompt_ids: Sequence[int], images: Sequence[PromptImage]) -> list[int]:
    """The ids the prefix cache hashes: the prompt, with each span position replaced by a negative number derived
    from its image's digest and its offset, so prompts that differ only in an image never share a block key."""
    if not images:
        return list(prompt_ids)
    out = list(prompt_ids)
    for img in images:
        base = int(img.image.digest[:16], 16)
        for offset in range(img.image.num_tokens):
            out[img.start + offset] = -1 - (base + offset) % KEY_SPACE
    return out


def image_mask(length: int, images: Sequence[PromptImage]) -> torch.Tensor:
    """[length] bool: True on every span position."""
    mask = torch.zeros(length, dtype=torch.bool)
    for img in images:
        mask[img.start:img.end] = True
    return mask


class ImageEncoder(Protocol):
    """What EncodedImages needs of a model (Transformer.encode_image)."""

    def encode_image(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int, types: torch.Tensor,
                     probe: Probe | None = None) -> torch.Tensor: ...


class EncodedImages:
    """A prompt's image spans with their embedding rows, encoded once on first use; hands out the ImageRows of
    any window of prompt positions. probe_of: a probe per image index (parity checks)."""

    def __init__(self, images: Sequence[PromptImage], encoder: ImageEncoder,
                 probe_of: Callable[[int], Probe | None] | None = None) -> None:
        self.images = list(images)
        self._encoder, self._probe_of = encoder, probe_of
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, k: int) -> torch.Tensor:
        if k not in self._rows:
            image = self.images[k].image
            probe = None if self._probe_of is None else self._probe_of(k)
            self._rows[k] = self._encoder.encode_image(image.patches, image.grid.n_vit_h, image.grid.n_vit_w,
                                                       image.types, probe)
        return self._rows[k]

    def window(self, start: int, end: int, device: torch.device) -> ImageRows | None:
        """The ImageRows of prompt positions [start, end) as a [1, end - start] step; None without images there."""
        mask = torch.zeros(1, end - start, dtype=torch.bool)
        values = []
        for k, img in enumerate(self.images):
            lo, hi = max(start, img.start), min(end, img.end)
            if lo >= hi:
                continue
            mask[0, lo - start:hi - start] = True
            values.append(self.rows(k)[lo - img.start:hi - img.start])
        if not values:
            return None
        return ImageRows(mask.to(device), torch.cat(values).to(device))


__all__ = ["ImageEncoder", "PromptImage", "assemble", "text_prompt", "IMAGE_PLACEHOLDER", "check_spans", "key_ids", "image_mask", "EncodedImages"]
