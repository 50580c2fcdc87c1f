"""The configs of the model's attached parts, each parsed from its own keys: the vision tower and aligner
(`VisionConfig`, HF `vision_config`) and the DSpark draft head (`DSparkConfig`, from the text config's dspark_* keys);
`FlashConfig` (config.py) builds them on demand."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from openflash.errors import ConfigError

log = logging.getLogger("openflash.config")


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark draft head (vision_and_dspark.md part B): `stages` window-only blocks after the backbone
    (checkpoint `mtp.0`..), reading the hidden states of `target_layer_ids`; one call drafts `block_size` tokens."""

    stages: int
    block_size: int  # draft block [anchor, noise x (block_size - 1)]: block_size drafts per call
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    n_routed_experts: int
    num_experts_per_tok: int


# Preprocessing keys that writers of other engines' checkpoints often leave out: the released values (spec
# vision_and_dspark.md §A.1) apply, as for the text config's optional keys.
VISION_DEFAULTS: dict[str, Any] = {"min_pixels": 295_936, "max_wh_ratio": None}


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower and aligner (vision_and_dspark.md §A.1; HF `vision_config`): a ViT over 14x14 patches and a
    3x3 pixel-unshuffle MLP into the text model's width; an image costs at most `max_image_tokens` positions."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int  # LLM positions per image, delimiters included
    min_pixels: int  # smaller images are upscaled to about this many pixels
    max_wh_ratio: float | None  # null in the release (not active)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "vision_config") -> "VisionConfig":
        names = [f.name for f in dataclasses.fields(cls)]
        defaulted = [n for n in VISION_DEFAULTS if n not in raw]
        missing = [n for n in names if n not in raw and n not in VISION_DEFAULTS]
        if missing:
            raise ConfigError(f"{source}: missing key(s) {missing}")
        if defaulted:
            log.info("%s: %s not set; the released values apply (%s)", source, ", ".join(defaulted),
                     ", ".join(f"{n}={VISION_DEFAULTS[n]!r}" for n in defaulted))
        values = {n: raw.get(n, VISION_DEFAULTS.get(n)) for n in names}
        for n in names:
            v = values[n]
            if n == "max_wh_ratio":
                if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                    raise ConfigError(f"{source}.max_wh_ratio must be null or a positive number, got {v!r}")
            elif n == "rope_theta":
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                    raise ConfigError(f"{source}.rope_theta must be a positive number, got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{source}.{n} must be a positive integer, got {v!r}")
        cfg = cls(**values)
        if cfg.hidden_size % cfg.num_attention_heads or cfg.head_dim % 4:
            raise ConfigError(f"{source}: hidden_size {cfg.hidden_size} must split into num_attention_heads "
                              f"{cfg.num_attention_heads} heads of a size divisible by 4 (2D RoPE: half rows, half "
                              f"columns, each rotate-half)")
        if cfg.max_image_tokens < 4:
            raise ConfigError(f"{source}.max_image_tokens must be >= 4 (one token, a newline and the two delimiters), "
                              f"got {cfg.max_image_tokens}")
        return cfg


__all__ = ["DSparkConfig", "VisionConfig", "VISION_DEFAULTS"]
