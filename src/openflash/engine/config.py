"""The engine's settings (`EngineConfig`, validated with each field named), import-light: a command builds and
checks them from its flags before it loads a model (no torch, no model imported here)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

from openflash.config import FlashConfig
from openflash.errors import OpenflashError

PREFILL_MODES = ("bounded", "exact")  # CED bounded replay, or every layer on every token (engine/runner.py)
KV_STORAGES = ("fp32", "packed")  # the compressed stores' formats (engine/block_pool.py)
RESTORE_MODES = ("snapshot", "replay")  # how a prefix-cache hit restores a sequence (engine/prefix_cache.py)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32  # sequences admitted at once (prefilling + decoding)
    max_context: int = 4096  # prompt + completion tokens per sequence
    max_step_tokens: int = 512  # prompt + decode tokens per engine step
    prefill_chunk: int = 128  # prompt chunk length (chunks end at multiples of it)
    prefill_batch: int = 16  # prompt chunks packed into one model call (1: one at a time)
    prefill_padding: float = 0.25  # most of a packed call that may be padding (0: only chunks of equal length)
    max_waiting: int = 256  # queued requests before add_request refuses (QueueFullError)
    share_prompts: bool = True  # a prompt several requests share is prefilled once (scheduler.py: twins)
    prefill_mode: str = "bounded"  # CED bounded replay (architecture.md §7.3) or "exact"
    kv_storage: str = "fp32"  # "fp32" or "packed" (FP4 main KV, MXFP4 index keys, FP8 window rings)
    kv_block_size: int = 16  # compressed entries per pool block
    max_kv_blocks: int | None = None  # pool size limit (None: grows as needed)
    prefix_cache: bool = True
    prefix_cache_bytes: int = 256 << 20
    prefix_restore: str = "snapshot"  # "snapshot" (exact) or "replay" (global KV only; windows replayed)
    prefix_block_tokens: int | None = None  # default: prefill_chunk (snapshot) or 16 x max ratio (replay)
    prefix_cache_dir: str | None = None  # persist entries here (loaded at start, saved at shutdown)
    engram_speculate: int = 0  # with an Engram memory tier: prefetch rows of the k likeliest next tokens
    speculative: str | None = None  # "dspark": speculative decoding with the model's DSpark drafter
    num_speculative_tokens: int | None = None  # drafts verified per round (default: the drafter's block size)
    # Decode batch sizes a batch is padded up to with idle rows (engine/runner.py), so that a CUDA graph recorded
    # for one size replays for every batch up to it. None: 1, 2, 4, 8, the multiples of 16 and max_batch
    # where decode steps replay CUDA graphs (a compiled model on CUDA), else none; (): never pad.
    decode_buckets: tuple[int, ...] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The fields a command's flags name (`--max-batch` is `max_batch`; the rest keep their defaults),
        validated, a refusal naming the flag."""
        given = vars(args)
        named = [f.name for f in fields(cls) if f.name in given]
        try:
            return cls(**{name: given[name] for name in named}).validate()
        except OpenflashError as exc:  # the refusal names the flags the user typed, not the fields
            flags = re.compile(r"\b(" + "|".join(named) + r")\b")
            raise OpenflashError(flags.sub(lambda m: "--" + m.group(1).replace("_", "-"), str(exc))) from None

    def validate(self) -> "EngineConfig":
        for name in ("max_batch", "max_step_tokens", "prefill_chunk", "kv_block_size"):
            if getattr(self, name) < 1:
                raise OpenflashError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_mode not in PREFILL_MODES:
            raise OpenflashError(f"prefill_mode must be one of {list(PREFILL_MODES)}, got {self.prefill_mode!r}")
        if self.kv_storage not in KV_STORAGES:
            raise OpenflashError(f"kv_storage must be one of {list(KV_STORAGES)}, got {self.kv_storage!r}")
        if self.speculative not in (None, "dspark"):
            raise OpenflashError(f"speculative must be 'dspark' or None, got {self.speculative!r}")
        if self.num_speculative_tokens is not None and self.speculative is None:
            raise OpenflashError("num_speculative_tokens needs speculative='dspark'")
        if self.prefix_restore not in RESTORE_MODES:
            raise OpenflashError(f"prefix_restore must be one of {list(RESTORE_MODES)}, got {self.prefix_restore!r}")
        if self.prefill_batch < 1:
            raise OpenflashError(f"prefill_batch must be >= 1, got {self.prefill_batch}")
        if not 0 <= self.prefill_padding < 1:
            raise OpenflashError(f"prefill_padding must be in [0, 1), got {self.prefill_padding}")
        if self.max_context < 2:
            raise OpenflashError(f"max_context must be >= 2, got {self.max_context}")
        buckets = self.decode_buckets
        if buckets is not None and (any(not isinstance(b, int) or b < 1 for b in buckets)
                                    or list(buckets) != sorted(set(buckets))):
            raise OpenflashError(f"decode_buckets must be increasing batch sizes >= 1, got {buckets!r}")
        block = self.prefix_block_tokens
        if block is not None and self.prefix_restore == "snapshot" and self.prefill_chunk % block:
            raise OpenflashError(f"prefix_block_tokens {block} must divide prefill_chunk {self.prefill_chunk} in "
                                 f"snapshot mode (snapshots are taken where prefill chunks end)")
        return self

    def drafts(self, cfg: FlashConfig) -> int:
        """Drafts verified per speculative round on a model of this config (0: plain decoding); OpenflashError
        where the model cannot speculate as configured."""
        if self.speculative is None:
            return 0
        d = cfg.dspark
        if d is None:
            raise OpenflashError("speculative decoding with dspark needs a model with a DSpark draft head "
                                 "(num_nextn_predict_layers > 0; `openflash train --dspark --init RUN` adds one)")
        k = d.block_size if self.num_speculative_tokens is None else self.num_speculative_tokens
        if not 1 <= k <= d.block_size:
            raise OpenflashError(f"num_speculative_tokens must be in 1..{d.block_size} (the drafter's block), got {k}")
        if self.prefill_mode == "bounded" and not cfg.dspark_bounded_ok:
            raise OpenflashError(f"this model's DSpark target layers {list(d.target_layer_ids)} reach into the CED "
                                 f"encoder half (layers < {cfg.topology.decoder_start}), which bounded prefill "
                                 f"does not keep: use --prefill-mode exact with speculative decoding")
        return k

    def padded_batches(self, records_decode_graphs: bool) -> tuple[int, ...]:
        """The decode batch sizes to pad up to (`decode_buckets`): what vLLM and nano-vllm record graphs for."""
        if self.decode_buckets is not None:
            return tuple(self.decode_buckets)
        if not records_decode_graphs:
            return ()
        return tuple(b for b in (1, 2, 4, 8, *range(16, self.max_batch, 16)) if b < self.max_batch) + (self.max_batch,)


__all__ = ["EngineConfig", "PREFILL_MODES", "KV_STORAGES", "RESTORE_MODES"]
