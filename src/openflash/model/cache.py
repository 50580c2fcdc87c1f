"""Per-sequence inference state, held in explicit objects (spec: architecture.md §7.2).

A `ModelCache` holds a batch of B sequences, each at its own position:
- every layer's sliding-window ring (a `WindowStore`: the last `sliding_window` KV vectors and their positions);
- for every KV-owner (FULL) layer, the shared compressed KV and index keys (a `CompressedStore`), plus the
  compressor's partial group (the tokens of a group that is not complete yet);
- the Engram hash history (the last max_ngram - 1 compressed ids), kept here by the Engram memory;
- for bounded-replay prefill, the decoder-half input of the last `sliding_window` prompt positions.

REUSE and REINDEX layers hold nothing but their window ring: they read their owner's compressed store.
The stores are protocols, declared here where the model consumes them: the dense ones (model/stores.py), and the
engine's paged compressed blocks and FP8 window rings (engine/cache.py), behind the same methods. `ModelCache`
delegates to them to split and join batches (`select`, `concat`), account (`nbytes`) and free (`release`), with no
type dispatch, so an engine regroups sequences whatever the storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from openflash.config import FlashConfig
from openflash.kernels.triton_attention import Part
from openflash.model.stores import CompressedCache, InputHistory, WindowCache, nbytes_of, pad_cat, select_rows
from openflash.topology import LayerMode


class RowHistory(Protocol):
    """Per-sequence state that the caller keeps in the cache beside the model's own: the Engram hash history
    (memory/hashing.py EngramHashState), created and advanced by the Engram memory, split and joined with the batch."""

    def select(self, rows: torch.Tensor) -> "RowHistory": ...

    @classmethod
    def concat(cls, states: list[Any]) -> "RowHistory": ...

    def rollback(self, drop: torch.Tensor) -> None:
        """Forget the last drop[b] tokens of row b."""

    def restart(self, rows: torch.Tensor) -> None:
        """Those rows hold nothing (a sequence start), in place."""


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

    def attend(self, q: torch.Tensor, positions: torch.Tensor, window: int,
               scale: float) -> Part | None:
        """The partial softmax of queries q [B, S, H, D] at positions [B, S] over the slots within `window` behind
        each, by a kernel that reads the stored ring: (acc [B, S, H, D], running max [B, S, H], total [B, S, H]) as
        kernels/triton_attention.py defines them; None where there is none (the caller reads `kv`)."""

    def write(self, kv: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None: ...

    def select(self, rows: torch.Tensor) -> "WindowStore": ...

    @classmethod
    def concat(cls, stores: list[Any]) -> "WindowStore": ...

    def clone(self) -> "WindowStore": ...

    def rollback(self, to_pos: torch.Tensor) -> None:
        """Forget the slots of positions >= to_pos[b] (the ring keeps `spare` extra slots for this)."""

    def restart(self, rows: torch.Tensor) -> None:
        """Those rows hold no slot, in place (`ModelCache.restart`)."""

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

    def read_index(self, n: int) -> torch.Tensor:
        """The index keys of entries [0, n) of every row: [B, n, Dk] (`read`'s second half, alone)."""

    def gather(self, picks: torch.Tensor) -> torch.Tensor:
        """The kv of entries picks [B, ...] (ids >= 0, each below what row b can read) of each row b:
        [B, ..., D]."""

    def index_scores(self, q: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor | None:
        """The indexer's scores [B, S, n] (fp32 numerics: sum over heads of w * ReLU(q . key)) of entries [0, n)
        for queries q [B, S, H, Dk] and head weights w [B, S, H], by a kernel that reads the stored keys; None
        where the store has none (the caller reads the keys and scores them)."""

    def picked_attention(self, q: torch.Tensor, picks: torch.Tensor,
                         scale: float) -> Part | None:
        """The partial softmax of queries q [B, S, H, D] over the entries picks [B, S, k] names (-1 = none), by a
        kernel that reads the stored entries: (acc [B, S, H, D], running max [B, S, H], total [B, S, H]) as
        kernels/triton_attention.py defines them; None where the store has none (the caller gathers the entries)."""

    capacity: int  # entries each row can read (`read(capacity)`) without growing

    def reserve(self, capacity: int, next_entries: torch.Tensor) -> None:
        """Before a whole-step graph (runtime/decode_graph.py): room for `capacity` entries per row, and for the
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

    def restart(self, rows: torch.Tensor) -> None:
        """Those rows hold no entry and no open group, in place; shared storage they held is given back."""

    def release(self) -> None:
        """Give back shared storage (paged blocks); a dense store holds none."""

    def nbytes(self) -> int: ...


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
        lengths = select_rows(self.lengths, rows)
        n = int(lengths.max()) if lengths.numel() else 0
        return ReplayBuffer(*(select_rows(t, rows)[:, :n] for t in (self.residual, self.pre_mix, self.positions,
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
    return ReplayBuffer(*(pad_cat([getattr(b, name) for b in buffers], 1, fill)
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
            pos=select_rows(self.pos, rows),
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

    def restart(self, rows: list[int] | torch.Tensor) -> None:
        """The given rows become empty sequences at position 0, in place: every tensor the cache holds stays the
        same object (a recorded CUDA graph still finds it), and the blocks the rows held go back to the pool. The
        engine's idle rows (engine/runner.py) are restarted rows."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.pos.device)
        if self.replay is not None:
            raise ValueError("cannot restart rows during a bounded-replay prefill; finish the prefill first")
        self.pos.index_fill_(0, rows, 0)
        for w in self.window + self.draft:
            w.restart(rows)
        for c in self.compressed.values():
            c.restart(rows)
        if self.engram is not None:
            self.engram.restart(rows)

    def rewind(self, rows: list[int] | torch.Tensor) -> None:
        """Those rows run at position 0 again, in place, keeping what they hold: for the engine's idle rows, whose
        outputs are dropped and whose state no other row reads; it keeps their state from growing (at position 0
        a row writes one window slot and at most one compressed entry)."""
        self.pos.index_fill_(0, torch.as_tensor(rows, dtype=torch.long, device=self.pos.device), 0)

    def release(self) -> None:
        """Give back the shared storage (paged compressed blocks); idempotent."""
        for c in self.compressed.values():
            c.release()

    def nbytes(self) -> int:
        """Bytes held: positions, window rings, compressed stores (paged blocks counted in full), replay buffer."""
        total = nbytes_of(self.pos) + sum(w.nbytes() for w in self.window + self.draft)
        total += sum(c.nbytes() for c in self.compressed.values())
        if self.replay is not None:
            total += nbytes_of(self.replay.residual, self.replay.pre_mix, self.replay.positions)
        return total
