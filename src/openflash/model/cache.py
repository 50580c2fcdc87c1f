"""Per-sequence inference state, held in explicit objects (spec: architecture.md §7.2).

A `ModelCache` holds a batch of B sequences, each at its own position:
- every layer's sliding-window ring (`WindowCache`: the last `sliding_window` KV vectors and their positions);
- for every KV-owner (FULL) layer, the shared compressed KV and index keys (`CompressedCache`), plus the
  compressor's partial group (the tokens of a group that is not complete yet);
- the Engram hash history (the last max_ngram - 1 compressed ids);
- for bounded-replay prefill, the decoder-half input of the last `sliding_window` prompt positions.

REUSE and REINDEX layers hold nothing but their window ring: they read their owner's `CompressedCache`.
Caches can be split and joined along the batch (`select`, `concat`) so an engine can regroup sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch

from openflash.config import FlashConfig, LayerMode


class RowHistory(Protocol):
    """Per-sequence state that the caller keeps in the cache beside the model's own: the Engram hash history
    (memory/hashing.py EngramHashState), created and advanced by the Engram memory, split and joined with the batch."""

    def select(self, rows: torch.Tensor) -> "RowHistory": ...

    @classmethod
    def concat(cls, states: list[Any]) -> "RowHistory": ...


def _select(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return t.index_select(0, rows)


def _pad_cat(tensors: list[torch.Tensor], dim: int, fill: float) -> torch.Tensor:
    """Concatenate along batch, padding `dim` to the longest."""
    longest = max(t.shape[dim] for t in tensors)
    padded = []
    for t in tensors:
        if t.shape[dim] < longest:
            shape = list(t.shape)
            shape[dim] = longest - t.shape[dim]
            t = torch.cat((t, t.new_full(shape, fill)), dim=dim)
        padded.append(t)
    return torch.cat(padded, dim=0)


@dataclass
class WindowCache:
    kv: torch.Tensor  # [B, W, head_dim], QDQ'd values after RoPE
    pos: torch.Tensor  # [B, W] absolute position held by each slot, -1 = empty

    def write(self, kv: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Store tokens at slot position % W; only the last W of a chunk survive (they overwrite the rest)."""
        window = self.kv.shape[1]
        keep = valid & (positions > positions.masked_fill(~valid, -1).amax(dim=1, keepdim=True) - window)
        b_idx, s_idx = keep.nonzero(as_tuple=True)
        slots = positions[b_idx, s_idx] % window
        self.kv[b_idx, slots] = kv[b_idx, s_idx].to(self.kv.dtype)
        self.pos[b_idx, slots] = positions[b_idx, s_idx]


@dataclass
class CompressedCache:
    kv: torch.Tensor  # [B, capacity, head_dim]: compressed latents after RoPE and FP4 QDQ
    index_k: torch.Tensor  # [B, capacity, index_head_dim]: index keys after RoPE and MXFP4 QDQ
    length: torch.Tensor  # [B] entries written
    partial_kv: torch.Tensor  # [B, ratio, head_dim] compressor inputs of the open group (slot = position % ratio)
    partial_score: torch.Tensor  # [B, ratio, head_dim] their gate scores (-inf = empty)

    def write(self, rows: torch.Tensor, entries: torch.Tensor, kv: torch.Tensor, index_k: torch.Tensor) -> None:
        """Store compressed entries: batch row rows[i] gets entry id entries[i]."""
        if rows.numel() == 0:
            return
        self.ensure_capacity(int(entries.max()) + 1)
        self.kv[rows, entries] = kv.to(self.kv.dtype)
        self.index_k[rows, entries] = index_k.to(self.index_k.dtype)

    def read(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [0, n) of every row: (kv [B, n, D], index_k [B, n, Dk])."""
        return self.kv[:, :n], self.index_k[:, :n]

    def ensure_capacity(self, needed: int) -> None:
        cap = self.kv.shape[1]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap, 16)
        grow = new_cap - cap
        self.kv = torch.cat((self.kv, self.kv.new_zeros(self.kv.shape[0], grow, self.kv.shape[2])), dim=1)
        self.index_k = torch.cat(
            (self.index_k, self.index_k.new_zeros(self.index_k.shape[0], grow, self.index_k.shape[2])), dim=1)


@dataclass
class ReplayBuffer:
    """Decoder-half input of the most recent prompt positions (bounded replay, architecture.md §7.3)."""

    residual: torch.Tensor  # [B, n, hc, D]
    pre_mix: torch.Tensor  # [B, n, hc]
    positions: torch.Tensor  # [B, n]


def _concat_history(states: list[RowHistory | None]) -> RowHistory | None:
    if all(s is None for s in states):
        return None
    if any(s is None for s in states):
        raise ValueError("caches to batch must all have an Engram hash history (prepare every sequence's tokens "
                         "through the Engram memory) or none")
    return type(states[0]).concat(states)


@dataclass
class ModelCache:
    pos: torch.Tensor  # [B] tokens consumed so far
    window: list[WindowCache]
    compressed: dict[int, CompressedCache]
    engram: RowHistory | None  # set by the Engram memory at the first prepare (None until then, or no Engram)
    replay: ReplayBuffer | None = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def empty(cls, cfg: FlashConfig, batch_size: int, device: torch.device | str = "cpu",
              capacity: int = 0, dtype: torch.dtype = torch.float32) -> "ModelCache":
        topo = cfg.topology
        w, d, dk = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim
        window = [WindowCache(torch.zeros(batch_size, w, d, dtype=dtype, device=device),
                              torch.full((batch_size, w), -1, dtype=torch.long, device=device))
                  for _ in topo.layers]
        compressed = {}
        for t in topo.layers:
            if t.mode == LayerMode.FULL:
                cap = -(-capacity // t.compress_ratio)
                compressed[t.index] = CompressedCache(
                    kv=torch.zeros(batch_size, cap, d, dtype=dtype, device=device),
                    index_k=torch.zeros(batch_size, cap, dk, dtype=dtype, device=device),
                    length=torch.zeros(batch_size, dtype=torch.long, device=device),
                    partial_kv=torch.zeros(batch_size, t.compress_ratio, d, dtype=torch.float32, device=device),
                    partial_score=torch.full((batch_size, t.compress_ratio, d), float("-inf"), device=device),
                )
        return cls(pos=torch.zeros(batch_size, dtype=torch.long, device=device), window=window,
                   compressed=compressed, engram=None)

    @property
    def batch_size(self) -> int:
        return int(self.pos.shape[0])

    def select(self, rows: list[int] | torch.Tensor) -> "ModelCache":
        """A new cache holding only the given batch rows (copies)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.pos.device)
        return ModelCache(
            pos=_select(self.pos, rows),
            window=[WindowCache(_select(w.kv, rows), _select(w.pos, rows)) for w in self.window],
            compressed={i: CompressedCache(**{f.name: _select(getattr(c, f.name), rows) for f in fields(c)})
                        for i, c in self.compressed.items()},
            engram=self.engram.select(rows) if self.engram is not None else None,
            replay=None if self.replay is None else ReplayBuffer(
                *(_select(getattr(self.replay, f.name), rows) for f in fields(self.replay))),
        )

    @classmethod
    def concat(cls, caches: list["ModelCache"]) -> "ModelCache":
        """Join caches along the batch (compressed capacity padded to the longest)."""
        if any(c.replay is not None for c in caches):
            raise ValueError("caches with a pending bounded-replay prefill cannot be batched; finish the prefill")
        first = caches[0]
        return cls(
            pos=torch.cat([c.pos for c in caches]),
            window=[WindowCache(torch.cat([c.window[i].kv for c in caches]),
                                torch.cat([c.window[i].pos for c in caches])) for i in range(len(first.window))],
            compressed={i: CompressedCache(
                kv=_pad_cat([c.compressed[i].kv for c in caches], 1, 0.0),
                index_k=_pad_cat([c.compressed[i].index_k for c in caches], 1, 0.0),
                length=torch.cat([c.compressed[i].length for c in caches]),
                partial_kv=torch.cat([c.compressed[i].partial_kv for c in caches]),
                partial_score=torch.cat([c.compressed[i].partial_score for c in caches]),
            ) for i in first.compressed},
            engram=_concat_history([c.engram for c in caches]),
        )

    def nbytes(self) -> int:
        """Bytes held (storage as allocated here, fp32 unless the engine packs real formats)."""
        total = self.pos.numel() * 8
        for w in self.window:
            total += w.kv.numel() * w.kv.element_size() + w.pos.numel() * 8
        for c in self.compressed.values():
            for f in fields(c):
                t = getattr(c, f.name)
                total += t.numel() * t.element_size()
        return total
