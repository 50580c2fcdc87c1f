"""The dense stores: a `ModelCache`'s window rings (`WindowCache`) and compressed KV (`CompressedCache`) as plain
fp32 tensors, batch-first, when no engine brings its paged ones (engine/cache.py), and the pieces every store
shares: the compressor inputs kept for rollback (`InputHistory`), the rollback of a compressed store, the masked
cache write. They implement the store protocols model/cache.py declares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from openflash import kernels
from openflash.kernels.triton_attention import Part


class GroupedStore(Protocol):
    """What a compressed store's rollback and restart rewrite (`rollback_compressed`, `restart_compressed`): its
    entry counts and open group."""

    length: torch.Tensor  # [B] complete entries
    inputs: "InputHistory | None"
    partial_kv: torch.Tensor
    partial_score: torch.Tensor


@dataclass
class InputHistory:
    """The compressor's raw inputs (kv and gate score) of the last `capacity` positions, slot = position %
    capacity: what a rollback needs to reopen a compressed group that completed after the rollback point."""

    kv: torch.Tensor  # [B, capacity, head_dim]
    score: torch.Tensor  # [B, capacity, head_dim]
    pos: torch.Tensor  # [B, capacity] position held by each slot, -1 = empty

    @classmethod
    def empty(cls, batch_size: int, capacity: int, dim: int, device: torch.device | str = "cpu") -> "InputHistory":
        return cls(torch.zeros(batch_size, capacity, dim, device=device),
                   torch.full((batch_size, capacity, dim), float("-inf"), device=device),
                   torch.full((batch_size, capacity), -1, dtype=torch.long, device=device))

    def write(self, positions: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the inputs of the real (`valid`) positions; only the last `capacity` of a chunk survive."""
        cap = self.pos.shape[1]
        keep = valid & (positions > positions.masked_fill(~valid, -1).amax(dim=1, keepdim=True) - cap)
        b_idx, s_idx = keep.nonzero(as_tuple=True)
        slots = positions[b_idx, s_idx] % cap
        self.kv[b_idx, slots] = kv[b_idx, s_idx].detach().float()
        self.score[b_idx, slots] = score[b_idx, s_idx].detach().float()
        self.pos[b_idx, slots] = positions[b_idx, s_idx]

    def rollback(self, to_pos: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forget the inputs of positions >= to_pos[b]; returns (partial_kv, partial_score) [B, ratio, D] of the
        group open after to_pos[b] tokens, rebuilt from the inputs kept."""
        start = torch.div(to_pos, ratio, rounding_mode="floor") * ratio
        want = start.unsqueeze(1) + torch.arange(ratio, device=to_pos.device)  # [B, ratio] positions
        held = want < to_pos.unsqueeze(1)
        slots = want % self.pos.shape[1]
        rows = torch.arange(want.shape[0], device=to_pos.device).unsqueeze(1)
        if bool((held & (self.pos[rows, slots] != want)).any()):
            raise ValueError("rollback reaches back further than the compressor inputs kept (spare too small)")
        kv = torch.where(held.unsqueeze(-1), self.kv[rows, slots], 0.0)
        score = torch.where(held.unsqueeze(-1), self.score[rows, slots], float("-inf"))
        self.pos.masked_fill_(self.pos >= to_pos.unsqueeze(1), -1)
        return kv, score

    def restart(self, rows: torch.Tensor) -> None:
        self.pos.index_fill_(0, rows, -1)

    def select(self, rows: torch.Tensor) -> "InputHistory":
        return InputHistory(select_rows(self.kv, rows), select_rows(self.score, rows), select_rows(self.pos, rows))

    @classmethod
    def concat(cls, parts: list["InputHistory"]) -> "InputHistory":
        return cls(torch.cat([p.kv for p in parts]), torch.cat([p.score for p in parts]),
                   torch.cat([p.pos for p in parts]))

    def nbytes(self) -> int:
        return nbytes_of(self.kv, self.score, self.pos)


def concat_inputs(parts: list[InputHistory | None]) -> InputHistory | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("caches to batch must all have the same rollback room (spare)")
    return InputHistory.concat(parts)


def rollback_compressed(store: GroupedStore, ratio: int, to_pos: torch.Tensor) -> None:
    """The rollback every compressed store shares: entries of incomplete groups dropped, the open group rebuilt."""
    store.length = torch.minimum(store.length, torch.div(to_pos, ratio, rounding_mode="floor"))
    if ratio > 1:
        if store.inputs is None:
            raise ValueError("this cache keeps no compressor inputs: create it with spare > 0 to roll back")
        store.partial_kv, store.partial_score = store.inputs.rollback(to_pos, ratio)


def restart_compressed(store: GroupedStore, rows: torch.Tensor) -> None:
    """The restart every compressed store shares: the rows hold no entry and no open group, in place."""
    store.length.index_fill_(0, rows, 0)
    store.partial_kv.index_fill_(0, rows, 0.0)
    store.partial_score.index_fill_(0, rows, float("-inf"))
    if store.inputs is not None:
        store.inputs.restart(rows)


def masked_put(t: torch.Tensor, index: tuple[torch.Tensor, ...], keep: torch.Tensor, value: torch.Tensor) -> None:
    """t[index] = value where keep (broadcast over trailing dims), the rest rewritten with what it holds: a cache
    write whose shapes do not depend on which entries are kept (index: distinct positions)."""
    keep = keep.view(*keep.shape, *([1] * (value.dim() - keep.dim())))
    t[index] = torch.where(keep, value.to(t.dtype), t[index])


def select_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return t.index_select(0, rows)


def row_of(picks: torch.Tensor) -> torch.Tensor:
    """Each pick's batch row, shaped to index beside picks [B, ...]: t[row_of(picks), picks]."""
    return torch.arange(picks.shape[0], device=picks.device).view(-1, *([1] * (picks.dim() - 1)))


def nbytes_of(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def pad_cat(tensors: list[torch.Tensor], dim: int, fill: float) -> torch.Tensor:
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
    storage = "fp32"
    plane_names = ("kv", "pos")

    def planes(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv, "pos": self.pos}

    def attend(self, q: torch.Tensor, positions: torch.Tensor, window: int,
               scale: float) -> Part | None:
        """The ring's part of the attention (WindowStore) by the kernel `kernels.cache_kernel` names, or None."""
        if kernels.cache_kernel(q.device) is None or self.kv.dtype != torch.float32:
            return None
        return kernels.triton_attention.ring_attention(q, positions, self.kv, self.kv, self.pos, window, scale, False)

    @classmethod
    def from_planes(cls, planes: dict[str, torch.Tensor]) -> "WindowCache":
        return cls(planes["kv"], planes["pos"])

    def write(self, kv: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Store tokens at slot position % W; only the last W of a chunk survive (they overwrite the rest)."""
        window = self.kv.shape[1]
        if positions.shape[1] <= window:
            # A chunk's positions are consecutive, so here each row's slots are distinct: a masked write, with no
            # data-dependent shapes (a decode step stays one graph, runtime/decode_graph.py).
            rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
            slots = positions % window
            masked_put(self.kv, (rows, slots), valid, kv)
            masked_put(self.pos, (rows, slots), valid, positions)
            return
        keep = valid & (positions > positions.masked_fill(~valid, -1).amax(dim=1, keepdim=True) - window)
        b_idx, s_idx = keep.nonzero(as_tuple=True)
        slots = positions[b_idx, s_idx] % window
        self.kv[b_idx, slots] = kv[b_idx, s_idx].to(self.kv.dtype)
        self.pos[b_idx, slots] = positions[b_idx, s_idx]

    def select(self, rows: torch.Tensor) -> "WindowCache":
        return WindowCache(select_rows(self.kv, rows), select_rows(self.pos, rows))

    @classmethod
    def concat(cls, stores: list["WindowCache"]) -> "WindowCache":
        return cls(torch.cat([w.kv for w in stores]), torch.cat([w.pos for w in stores]))

    def clone(self) -> "WindowCache":
        return WindowCache(self.kv.clone(), self.pos.clone())

    def rollback(self, to_pos: torch.Tensor) -> None:
        self.pos.masked_fill_(self.pos >= to_pos.unsqueeze(1), -1)

    def restart(self, rows: torch.Tensor) -> None:
        self.pos.index_fill_(0, rows, -1)

    def nbytes(self) -> int:
        return nbytes_of(self.kv, self.pos)


@dataclass
class CompressedCache:
    kv: torch.Tensor  # [B, capacity, head_dim]: compressed latents after RoPE and FP4 QDQ
    index_k: torch.Tensor  # [B, capacity, index_head_dim]: index keys after RoPE and MXFP4 QDQ
    length: torch.Tensor  # [B] entries written
    partial_kv: torch.Tensor  # [B, ratio, head_dim] compressor inputs of the open group (slot = position % ratio)
    partial_score: torch.Tensor  # [B, ratio, head_dim] their gate scores (-inf = empty)
    inputs: InputHistory | None = None  # with rollback room: the compressor inputs of the last ratio + spare tokens

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

    def read_index(self, n: int) -> torch.Tensor:
        return self.index_k[:, :n]

    def gather(self, picks: torch.Tensor) -> torch.Tensor:
        return self.kv[row_of(picks), picks]

    def index_scores(self, q: torch.Tensor, w: torch.Tensor, n: int) -> None:
        return None  # the keys are fp32 tensors already: the numerics' own ops score them

    def picked_attention(self, q: torch.Tensor, picks: torch.Tensor, scale: float) -> None:
        return None  # likewise the entries: gathered and attended by the numerics' own ops

    @property
    def capacity(self) -> int:
        return int(self.kv.shape[1])

    def write_groups(self, entries: torch.Tensor, complete: torch.Tensor, kv: torch.Tensor,
                     index_k: torch.Tensor) -> None:
        rows = torch.arange(entries.shape[0], device=entries.device).unsqueeze(1)
        masked_put(self.kv, (rows, entries), complete, kv)
        masked_put(self.index_k, (rows, entries), complete, index_k)

    def reserve(self, capacity: int, next_entries: torch.Tensor) -> None:
        """Grow to exactly `capacity` entries per row if it holds fewer (a whole-step graph's bucketed capacity,
        which covers next_entries), at least 2 (CompressedStore.reserve)."""
        capacity = max(2, capacity)
        if capacity > self.capacity:
            self.ensure_capacity(capacity, exact=True)

    def growing_dims(self) -> list[tuple[torch.Tensor, int]]:
        return [(self.kv, 1), (self.index_k, 1)]

    def ensure_capacity(self, needed: int, exact: bool = False) -> None:
        cap = self.kv.shape[1]
        if needed <= cap:
            return
        new_cap = needed if exact else max(needed, 2 * cap, 16)
        grow = new_cap - cap
        self.kv = torch.cat((self.kv, self.kv.new_zeros(self.kv.shape[0], grow, self.kv.shape[2])), dim=1)
        self.index_k = torch.cat(
            (self.index_k, self.index_k.new_zeros(self.index_k.shape[0], grow, self.index_k.shape[2])), dim=1)

    def remember_inputs(self, positions: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
                        valid: torch.Tensor) -> None:
        if self.inputs is not None:
            self.inputs.write(positions, kv, score, valid)

    def rollback(self, to_pos: torch.Tensor) -> None:
        rollback_compressed(self, self.partial_kv.shape[1], to_pos)

    def restart(self, rows: torch.Tensor) -> None:
        restart_compressed(self, rows)

    def select(self, rows: torch.Tensor) -> "CompressedCache":
        return CompressedCache(*(select_rows(t, rows) for t in (self.kv, self.index_k, self.length, self.partial_kv,
                                                              self.partial_score)),
                               inputs=None if self.inputs is None else self.inputs.select(rows))

    @classmethod
    def concat(cls, stores: list["CompressedCache"]) -> "CompressedCache":
        """Join along the batch, capacity padded to the longest."""
        return cls(kv=pad_cat([c.kv for c in stores], 1, 0.0), index_k=pad_cat([c.index_k for c in stores], 1, 0.0),
                   length=torch.cat([c.length for c in stores]),
                   partial_kv=torch.cat([c.partial_kv for c in stores]),
                   partial_score=torch.cat([c.partial_score for c in stores]),
                   inputs=concat_inputs([c.inputs for c in stores]))

    def release(self) -> None:
        pass  # dense tensors are freed with the object

    def nbytes(self) -> int:
        held = nbytes_of(self.kv, self.index_k, self.length, self.partial_kv, self.partial_score)
        return held + (self.inputs.nbytes() if self.inputs is not None else 0)


__all__ = ["InputHistory", "WindowCache", "CompressedCache", "GroupedStore", "concat_inputs", "rollback_compressed",
           "masked_put", "select_rows", "nbytes_of", "pad_cat"]
