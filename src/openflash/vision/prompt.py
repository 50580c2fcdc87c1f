"""Image spans in a prompt: where each sits, what the prefix cache keys on, and the rows a step hands the model.

Every span position carries `image_token_id` (spec §A.5); the span's token types tell its parts apart. A prompt
is assembled from text token ids and prepared images in order; a step over prompt positions [a, b) gets the
`ImageRows` of the span positions inside it, so image spans may fall in any prefill chunk (or straddle two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from openflash.model.vision import ImageRows
from openflash.vision.preprocess import PreparedImage

KEY_SPACE = 1 << 62


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


class EncodedImages:
    """A prompt's image spans with their embedding rows, encoded once (model.encode_image) on first use; hands out
    the ImageRows of any window of prompt positions."""

    def __init__(self, images: Sequence[PromptImage],
                 encode: Callable[[PreparedImage], torch.Tensor]) -> None:
        self.images = list(images)
        self._encode = encode
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, k: int) -> torch.Tensor:
        if k not in self._rows:
            self._rows[k] = self._encode(self.images[k].image)
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


__all__ = ["PromptImage", "assemble", "check_spans", "key_ids", "image_mask", "EncodedImages"]
