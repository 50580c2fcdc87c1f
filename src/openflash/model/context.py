"""What one forward call shares across its layers.

CSA2 layers publish results for later layers in the same call (architecture.md §5.4): a FULL layer publishes its
compressed KV and index keys, every index source publishes its top-k, the candidate source publishes its candidate
mask. The reference does this through a mutable slot that layers overwrite; here the slots live in a `StepContext`
that exists for one call only, and carried state lives in the `ModelCache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from openflash.model.cache import ModelCache
from openflash.model.numerics import Numerics


@dataclass
class CompressedView:
    """The compressed entries a layer may read: [0, length[b]) of row b."""

    kv: torch.Tensor  # [B, T, head_dim]
    index_k: torch.Tensor  # [B, T, index_head_dim]
    length: torch.Tensor  # [B]


@dataclass
class StepContext:
    positions: torch.Tensor  # [B, S] absolute positions of this call's tokens
    numerics: Numerics
    cache: ModelCache | None = None  # None: a full sequence from position 0 (training forward)
    compressed: dict[int, CompressedView] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # [B, S, k] entry ids, -1 = none
    candidates: torch.Tensor | None = None  # [B, S, T] bool
    dense_indexer: bool = False  # indexer warm-up: attend to every visible compressed entry
    indexer_losses: list[torch.Tensor] = field(default_factory=list)
    record: dict[str, torch.Tensor] | None = None  # intermediates for parity checks, keyed like the goldens
    record_prefix: str = ""
    # Teacher forcing for parity checks: recorded reference tensors that replace ours at the same points, so
    # each block is compared on identical inputs and a rounding difference in one cannot snowball into the next.
    teacher: dict[str, torch.Tensor] | None = None

    def put(self, name: str, value: torch.Tensor) -> None:
        if self.record is not None:
            self.record[f"{self.record_prefix}{name}"] = value.detach()

    def forced(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The teacher's tensor for `name` if one is given, else `value`."""
        if self.teacher is None:
            return value
        ref = self.teacher.get(f"{self.record_prefix}{name}")
        return value if ref is None else ref.to(value.dtype).to(value.device).view(value.shape)
