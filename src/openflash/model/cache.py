"""Per-sequence inference state, held in explicit objects (spec: architecture.md §7.2).

A `ModelCache` holds a batch of B sequences, each at its own position:
- every layer's sliding-window ring (a `WindowStore`: the last `sliding_window` KV vectors and their positions);
- for every KV-owner (FULL) layer, the shared compressed KV and index keys (a `CompressedStore`), plus the
  compressor's partial group (the tokens of a group that is not complete yet);
- the Engram hash history (the last max_ngram - 1 compressed ids), kept here by the Engram memory;
- for bounded-replay prefill, the decoder-half input of the last `sliding_window` prompt positions.

REUSE and REINDEX layers hold nothing but their window ring: they read their owner's compressed store.
The stores are protocols, declared here where the model consumes them: the dense ones below, and the engine's
paged compressed blocks and FP8 window rings (engine/cache.py), behind the same methods. `ModelCache` delegates
to them to split and join batches (`select`, `concat`), account (`nbytes`) and free (`release`), with no type
dispatch, so an engine regroups sequences whatever the storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from openflash.config import FlashConfig
from openflash.topology import LayerMode


class RowHistory(Protocol):
    """Per-sequence state that the caller keeps in the cache beside the model's own: the Engram hash history
    (memory/hashing.py EngramHashState), created and advanced by the Engram memory, split and joined with the batch."""

    def select(self, rows: torch.Tensor) -> "RowHistory": ...

    @classmethod
    def concat(cls, states: list[Any]) -> "RowHistory": ...

    def rollback(self, drop: torch.Tensor) -> None:
        """Forget the last drop[b] tokens of row b."""


class WindowStore(Protocol):
    """A sliding-window KV ring of B sequences: slot = position % W; `pos` -1 marks an empty slot."""

    pos: torch.Tensor  # [B, W] long
    storage: str  # "fp32" or "packed" (engine/cache.py KV_STORAGES)
    plane_names: tuple[str, ...]  # the keys of `planes()`, which `from_planes` reads back

    @property
    def kv(self) -> torch.Tensor:
        """[B, W, head_dim] values (decoded, for packed storage)."""

    def planes(self) -> dict[str, torch.Tensor]:
        """The tensors that hold the ring, by name (what a saved prefix cache writes; `from_planes` reads)."""

    def write(self, kv: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None: ...

    def select(self, rows: torch.Tensor) -> "WindowStore": ...

    @classmethod
    def concat(cls, stores: list[Any]) -> "WindowStore": ...

    def clone(self) -> "WindowStore": ...

    def rollback(self, to_pos: torch.Tensor) -> None:
        """Forget the slots of positions >= to_pos[b] (the ring keeps `spare` extra slots for this)."""

    def nbytes(self) -> int: ...


class CompressedStore(Protocol):
    """One owner layer's compressed KV and index keys for B sequences, and its compressor's open group."""

    length: torch.Tensor  # [B] entries written
    partial_kv: torch.Tensor  # [B, ratio, head_dim] compressor inputs of the open group (slot = position % ratio)
    partial_score: torch.Tensor  # [B, ratio, head_dim] their gate scores (-inf = empty)
    inputs: "InputHistory | None"  # the compressor's raw inputs of the last tokens (rollback room), or None

    def write(self, rows: torch.Tensor, entries: torch.Tensor, kv: torch.Tensor, index_k: torch.Tensor) -> None:
        """Store compressed entries: batch row rows[i] gets entry id entries[i]."""

    def read(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [0, n) of every row: (kv [B, n, D], index_k [B, n, Dk])."""

    capacity: int  # entries each row can read (`read(capacity)`) without growing

    def reserve(self, capacity: int, next_entries: torch.Tensor) -> None:
        """Before a whole-step graph (model/decode_graph.py): room for `capacity` entries per row, and for the
        entry next_entries[b] that row b's open group will write, so the step itself allocates nothing. Every size
        in `growing_dims` is at least 2 afterwards: the graph compiles them as symbolic sizes, and dynamo
        specialises a size of 1."""

    def growing_dims(self) -> list[tuple[torch.Tensor, int]]:
        """(tensor, dim) pairs whose size grows over a sequence's or a server's life (the capacity, a shared
        pool): a whole-step graph compiles them as symbolic sizes rather than once per size."""

    def write_groups(self, entries: torch.Tensor, complete: torch.Tensor, kv: torch.Tensor,
                     index_k: torch.Tensor) -> None:
        """Store the complete ones of a step's groups (entry ids [B, G], distinct per row, reserved) by a masked
        write: shapes do not depend on which groups completed."""

    def select(self, rows: torch.Tensor) -> "CompressedStore": ...

    @classmethod
    def concat(cls, stores: list[Any]) -> "CompressedStore": ...

    def remember_inputs(self, positions: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
                        valid: torch.Tensor) -> None:
        """Keep the compressor's raw inputs of the last tokens (only with spare rollback room; `valid` [B, S]: the
        real ones, not a packed call's padding), so that a rollback can reopen a group that has since completed."""

    def rollback(self, to_pos: torch.Tensor) -> None:
        """Return to the state after to_pos[b] tokens: fewer entries, the open group rebuilt."""

    def release(self) -> None:
        """Give back shared storage (paged blocks); a dense store holds none."""

    def nbytes(self) -> int: ...


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

    def select(self, rows: torch.Tensor) -> "InputHistory":
        return InputHistory(_select(self.kv, rows), _select(self.score, rows), _select(self.pos, rows))

    @classmethod
    def concat(cls, parts: list["InputHistory"]) -> "InputHistory":
        return cls(torch.cat([p.kv for p in parts]), torch.cat([p.score for p in parts]),
                   torch.cat([p.pos for p in parts]))

    def nbytes(self) -> int:
        return _nbytes(self.kv, self.score, self.pos)


def concat_inputs(parts: list[InputHistory | None]) -> InputHistory | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("caches to batch must all have the same rollback room (spare)")
    return InputHistory.concat(parts)


def rollback_compressed(store: CompressedStore, ratio: int, to_pos: torch.Tensor) -> None:
    """The rollback every compressed store shares: entries of incomplete groups dropped, the open group rebuilt."""
    store.length = torch.minimum(store.length, torch.div(to_pos, ratio, rounding_mode="floor"))
    if ratio > 1:
        if store.inputs is None:
            raise ValueError("this cache keeps no compressor inputs: create it with spare > 0 to roll back")
        store.partial_kv, store.partial_score = store.inputs.rollback(to_pos, ratio)


def masked_put(t: torch.Tensor, index: tuple[torch.Tensor, ...], keep: torch.Tensor, value: torch.Tensor) -> None:
    """t[index] = value where keep (broadcast over trailing dims), the rest rewritten with what it holds: a cache
    write whose shapes do not depend on which entries are kept (index: distinct positions)."""
    keep = keep.view(*keep.shape, *([1] * (value.dim() - keep.dim())))
    t[index] = torch.where(keep, value.to(t.dtype), t[index])


def _select(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return t.index_select(0, rows)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
    storage = "fp32"
    plane_names = ("kv", "pos")

    def planes(self) -> dict[str, torch.Tensor]:
        return {"kv": self.kv, "pos": self.pos}

    @classmethod
    def from_planes(cls, planes: dict[str, torch.Tensor]) -> "WindowCache":
        return cls(planes["kv"], planes["pos"])

    def write(self, kv: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Store tokens at slot position % W; only the last W of a chunk survive (they overwrite the rest)."""
        window = self.kv.shape[1]
        if positions.shape[1] <= window:
            # A chunk's positions are consecutive, so here each row's slots are distinct: a masked write, with no
            # data-dependent shapes (a decode step stays one graph, model/decode_graph.py).
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
        return WindowCache(_select(self.kv, rows), _select(self.pos, rows))

    @classmethod
    def concat(cls, stores: list["WindowCache"]) -> "WindowCache":
        return cls(torch.cat([w.kv for w in stores]), torch.cat([w.pos for w in stores]))

    def clone(self) -> "WindowCache":
        return WindowCache(self.kv.clone(), self.pos.clone())

    def rollback(self, to_pos: torch.Tensor) -> None:
        self.pos.masked_fill_(self.pos >= to_pos.unsqueeze(1), -1)

    def nbytes(self) -> int:
        return _nbytes(self.kv, self.pos)


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

    def select(self, rows: torch.Tensor) -> "CompressedCache":
        return CompressedCache(*(_select(t, rows) for t in (self.kv, self.index_k, self.length, self.partial_kv,
                                                              self.partial_score)),
                               inputs=None if self.inputs is None else self.inputs.select(rows))

    @classmethod
    def concat(cls, stores: list["CompressedCache"]) -> "CompressedCache":
        """Join along the batch, capacity padded to the longest."""
        return cls(kv=_pad_cat([c.kv for c in stores], 1, 0.0), index_k=_pad_cat([c.index_k for c in stores], 1, 0.0),
                   length=torch.cat([c.length for c in stores]),
                   partial_kv=torch.cat([c.partial_kv for c in stores]),
                   partial_score=torch.cat([c.partial_score for c in stores]),
                   inputs=concat_inputs([c.inputs for c in stores]))

    def release(self) -> None:
        pass  # dense tensors are freed with the object

    def nbytes(self) -> int:
        held = _nbytes(self.kv, self.index_k, self.length, self.partial_kv, self.partial_score)
        return held + (self.inputs.nbytes() if self.inputs is not None else 0)


@dataclass
class ReplayBuffer:
    """Decoder-half input of the most recent prompt positions (bounded replay, architecture.md §7.3). Rows are
    right-padded where they hold fewer (packed prompts of different lengths): row b's first lengths[b] entries."""

    residual: torch.Tensor  # [B, n, hc, D]
    pre_mix: torch.Tensor  # [B, n, hc]
    positions: torch.Tensor  # [B, n]
    image_mask: torch.Tensor  # [B, n] bool: image-span positions (their MoE routing uses bias_vl)
    lengths: torch.Tensor | None = None  # [B] real entries per row; None: all n (set in __post_init__)

    def __post_init__(self) -> None:
        if self.lengths is None:
            B, n = self.positions.shape
            self.lengths = torch.full((B,), n, dtype=torch.long, device=self.positions.device)

    @property
    def padded(self) -> bool:
        """Whether some row holds fewer entries than the buffer's width (a host read)."""
        return bool((self.lengths < self.positions.shape[1]).any())

    def clone(self) -> "ReplayBuffer":
        return ReplayBuffer(self.residual.clone(), self.pre_mix.clone(), self.positions.clone(),
                            self.image_mask.clone(), self.lengths.clone())

    def select(self, rows: torch.Tensor) -> "ReplayBuffer":
        """The given rows, trimmed to the longest of them (a single row holds no padding)."""
        lengths = _select(self.lengths, rows)
        n = int(lengths.max()) if lengths.numel() else 0
        return ReplayBuffer(*(_select(t, rows)[:, :n] for t in (self.residual, self.pre_mix, self.positions,
                                                                  self.image_mask)), lengths)


def append_replay(old: ReplayBuffer | None, residual: torch.Tensor, pre_mix: torch.Tensor, positions: torch.Tensor,
                  image_mask: torch.Tensor, lengths: torch.Tensor | None, window: int) -> ReplayBuffer:
    """The buffer after a chunk [B, S] (row b's first lengths[b] real, None: all): each row's last `window` real
    entries, right-padded. Padding takes positions after the row's last real one, so that no real query of the
    decoder half sees it (windows are masked by position), and its cache writes are masked (StepContext.lengths)."""
    B, S = positions.shape
    dev = positions.device
    new_len = torch.full((B,), S, dtype=torch.long, device=dev) if lengths is None else lengths
    if old is None:
        old_n, old_len = 0, torch.zeros(B, dtype=torch.long, device=dev)
        parts = (residual, pre_mix, positions, image_mask)
    else:
        old_n, old_len = old.positions.shape[1], old.lengths
        parts = tuple(torch.cat(p, dim=1) for p in ((old.residual, residual), (old.pre_mix, pre_mix),
                                                    (old.positions, positions), (old.image_mask, image_mask)))
    count = old_len + new_len
    keep = count.clamp(max=window)
    width = int(keep.max())
    # Entry j of row b is its real entry number count - keep + j: the old buffer's, or the chunk's after them.
    k = (count - keep).unsqueeze(1) + torch.arange(width, device=dev)
    src = torch.where(k < old_len.unsqueeze(1), k, old_n + k - old_len.unsqueeze(1))
    real = torch.arange(width, device=dev) < keep.unsqueeze(1)
    src = torch.where(real, src, 0)
    out = [t.gather(1, src.view(B, width, *([1] * (t.dim() - 2))).expand(B, width, *t.shape[2:])) for t in parts]
    last = out[2].gather(1, (keep - 1).clamp(min=0).unsqueeze(1))
    out[2] = torch.where(real, out[2], last + torch.arange(width, device=dev) - keep.unsqueeze(1) + 1)
    out[3] = out[3] & real
    return ReplayBuffer(*out, keep)


def _concat_replay(buffers: list[ReplayBuffer | None]) -> ReplayBuffer | None:
    """Join pending bounded-replay prefills (packed prefill chunks): all or none; shorter ones right-padded (their
    padding is replaced by the next `append_replay`, which a pending buffer gets before the decoder half runs)."""
    if all(b is None for b in buffers):
        return None
    if any(b is None for b in buffers):
        raise ValueError("caches to batch must all hold a pending bounded-replay prefill or none")
    return ReplayBuffer(*(_pad_cat([getattr(b, name) for b in buffers], 1, fill)
                          for name, fill in (("residual", 0.0), ("pre_mix", 0.0), ("positions", -1),
                                             ("image_mask", False))),
                        torch.cat([b.lengths for b in buffers]))


def _concat_history(states: list[RowHistory | None]) -> RowHistory | None:
    if all(s is None for s in states):
        return None
    if any(s is None for s in states):
        raise ValueError("caches to batch must all have an Engram hash history (prepare every sequence's tokens "
                         "through the Engram memory) or none")
    return type(states[0]).concat(states)


def draft_rings(cfg: FlashConfig, batch_size: int, device: torch.device | str = "cpu") -> list[WindowStore]:
    """One empty ring of `sliding_window` slots per DSpark stage (they hold committed positions only: no spare)."""
    stages = cfg.dspark.stages if cfg.dspark is not None else 0
    return [WindowCache(torch.zeros(batch_size, cfg.sliding_window, cfg.head_dim, device=device),
                        torch.full((batch_size, cfg.sliding_window), -1, dtype=torch.long, device=device))
            for _ in range(stages)]


@dataclass
class ModelCache:
    pos: torch.Tensor  # [B] tokens consumed so far
    window: list[WindowStore]
    compressed: dict[int, CompressedStore]
    engram: RowHistory | None  # set by the Engram memory at the first prepare (None until then, or no Engram)
    replay: ReplayBuffer | None = None
    # The layer whose index keys were published last: only the `reference` numerics read it, to reproduce the
    # reference's stale-index-key quirk (docs/parity.md).
    index_k_publisher: int | None = None
    # Rollback room: how many of the latest tokens `rollback` can undo (speculative decoding). Window rings keep
    # that many extra slots (attention masks them by position, so they change nothing), and compressed stores keep
    # the compressor inputs of the last ratio + spare tokens.
    spare: int = 0
    # DSpark: each draft stage's ring of the target's KV (model/dspark.py); empty without a drafter.
    draft: list[WindowStore] = field(default_factory=list)

    @classmethod
    def empty(cls, cfg: FlashConfig, batch_size: int, device: torch.device | str = "cpu",
              capacity: int = 0, dtype: torch.dtype = torch.float32, spare: int = 0,
              draft: bool = False) -> "ModelCache":
        topo = cfg.topology
        w, d, dk = cfg.sliding_window + spare, cfg.head_dim, cfg.index_head_dim
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
                    inputs=InputHistory.empty(batch_size, t.compress_ratio + spare, d, device)
                    if spare and t.compress_ratio > 1 else None,
                )
        return cls(pos=torch.zeros(batch_size, dtype=torch.long, device=device), window=window,
                   compressed=compressed, engram=None, spare=spare,
                   draft=draft_rings(cfg, batch_size, device) if draft else [])

    @property
    def batch_size(self) -> int:
        return int(self.pos.shape[0])

    def select(self, rows: list[int] | torch.Tensor) -> "ModelCache":
        """A new cache holding only the given batch rows (bounded state copied; paged blocks shared by
        reference, so `release` the old cache when done with it)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.pos.device)
        return ModelCache(
            pos=_select(self.pos, rows),
            window=[w.select(rows) for w in self.window],
            compressed={i: c.select(rows) for i, c in self.compressed.items()},
            engram=self.engram.select(rows) if self.engram is not None else None,
            replay=None if self.replay is None else self.replay.select(rows),
            index_k_publisher=self.index_k_publisher, spare=self.spare, draft=[w.select(rows) for w in self.draft],
        )

    @classmethod
    def concat(cls, caches: list["ModelCache"]) -> "ModelCache":
        """Join caches along the batch (new references to paged blocks: release the parts afterwards). Pending
        bounded-replay prefills join with others (packed prefill chunks), not with caches that have none."""
        first = caches[0]
        if any(c.spare != first.spare for c in caches):
            raise ValueError(f"caches to batch must have the same rollback room, got spare {[c.spare for c in caches]}")
        return cls(
            pos=torch.cat([c.pos for c in caches]),
            window=[type(first.window[i]).concat([c.window[i] for c in caches]) for i in range(len(first.window))],
            compressed={i: type(first.compressed[i]).concat([c.compressed[i] for c in caches])
                        for i in first.compressed},
            engram=_concat_history([c.engram for c in caches]), replay=_concat_replay([c.replay for c in caches]),
            index_k_publisher=first.index_k_publisher, spare=first.spare,
            draft=[type(first.draft[i]).concat([c.draft[i] for c in caches]) for i in range(len(first.draft))],
        )

    def rollback(self, to_pos: torch.Tensor | int) -> None:
        """Undo the latest tokens: afterwards the cache is as if only to_pos[b] tokens of row b had been run (at
        most `spare` tokens back). Window slots and compressed entries of the dropped positions are forgotten,
        the compressor's open group is rebuilt from its kept inputs, and the Engram hash history is cut back."""
        to_pos = torch.as_tensor(to_pos, dtype=torch.long, device=self.pos.device).expand_as(self.pos)
        drop = self.pos - to_pos
        if bool((drop < 0).any()) or int(drop.max()) > self.spare:
            raise ValueError(f"cannot roll back from positions {self.pos.tolist()} to {to_pos.tolist()}: only the "
                             f"last {self.spare} tokens can be undone (the cache's spare)")
        if self.replay is not None:
            raise ValueError("cannot roll back during a bounded-replay prefill; finish the prefill first")
        for w in self.window + self.draft:
            w.rollback(to_pos)
        for c in self.compressed.values():
            c.rollback(to_pos)
        if self.engram is not None:
            self.engram.rollback(drop)
        self.pos = to_pos.clone()

    def release(self) -> None:
        """Give back the shared storage (paged compressed blocks); idempotent."""
        for c in self.compressed.values():
            c.release()

    def nbytes(self) -> int:
        """Bytes held: positions, window rings, compressed stores (paged blocks counted in full), replay buffer."""
        total = _nbytes(self.pos) + sum(w.nbytes() for w in self.window + self.draft)
        total += sum(c.nbytes() for c in self.compressed.values())
        if self.replay is not None:
            total += _nbytes(self.replay.residual, self.replay.pre_mix, self.replay.positions)
        return total
