"""KV state for the serving engine: a block pool for the global compressed cache, and batch regrouping.

The global cache (architecture.md §7.2; quant_and_cache.md §6) is one compressed KV plane plus one index-key plane
per KV-owner (FULL) layer; it grows with the sequence, so it lives in fixed-size blocks taken from one `BlockPool`
(block_pool.py) shared by every owner layer and every sequence. A sequence's `PagedCompressedCache` holds only a
block table per row. Regrouping the decode batch (select / concat) then copies block tables, never KV; a cached
prompt prefix shares its full blocks with the sequences that reuse it (reference counts, copy-on-write for the one
block a sequence still appends to). Everything bounded per sequence (window rings, the compressor's open group, the
Engram hash history) stays dense and is copied on regroup.

Storage formats (`kv_storage`):
- "fp32": planes hold the QDQ'd values as fp32 (what the model computes with);
- "packed": the trained formats, quant_and_cache.md §6: main KV as E2M1 with an E4M3 scale per 16 channels
  (288 B per 512-d entry), index keys as MXFP4 (E2M1 + UE8M0 per 32; 68 B per 128-d key), window rings as FP8
  E4M3 + UE8M0 per 32 (528 B per 512-d slot). The model already QDQs these tensors (numerics `cache_qdq`), so
  packing loses nothing: decode(encode(v)) == v for every QDQ'd v (block_pool.py `encode_kv_exact`).

`PagedCompressedCache` and `PackedWindowCache` implement the store protocols the model declares (`CompressedStore`,
`WindowStore` in model/cache.py), so the model computes with them as with its dense stores, and `ModelCache`'s
`select` / `concat` / `release` / `nbytes` regroup and account for them by delegation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openflash import formats, kernels
from openflash.config import FlashConfig
from openflash.engine.block_pool import BlockPool, EntryLayout
from openflash.kernels.triton_attention import Part
from openflash.model.cache import ModelCache, draft_rings
from openflash.model.stores import (InputHistory, WindowCache, concat_inputs, masked_put, restart_compressed,
                                    rollback_compressed, row_of)
from openflash.topology import LayerMode

# ----------------------------------------------------------------------------------------------------------------
# A paged compressed cache (one KV-owner layer, B rows)


class PagedCompressedCache:
    """The compressed KV and index keys of one owner layer for B sequences, as block tables into a pool.

    A `CompressedStore` (model/cache.py), like the dense CompressedCache.
    Each instance holds one pool reference per table entry; `release()` drops them (the engine calls it when a
    sequence finishes or a batch is regrouped).
    """

    def __init__(self, pool: BlockPool, table: torch.Tensor, length: torch.Tensor, partial_kv: torch.Tensor,
                 partial_score: torch.Tensor, inputs: InputHistory | None = None) -> None:
        self.pool = pool
        self.device_table: torch.Tensor = table  # the table where the pool's planes are (`_mirror`)
        self._uploaded: torch.Tensor | None = None  # what device_table holds, on the host (None: the table itself)
        self.table = table  # long [B, nb] on the host (allocation reads it there), 0 = no block
        self.length, self.partial_kv, self.partial_score = length, partial_kv, partial_score
        self.inputs = inputs  # with rollback room: the compressor inputs of the last ratio + spare tokens

    @property
    def table(self) -> torch.Tensor:
        return self._table

    @table.setter
    def table(self, value: torch.Tensor) -> None:
        self._table = value
        self._mirror()

    def _mirror(self) -> None:
        """The model's reads and writes index the pool with `device_table`, kept equal to the host table after
        every change to it, so that a decode step copies nothing from the host (a CUDA graph could not record
        that copy). Same shape: copied in place, so a recorded step still finds it where it was; unchanged (most
        decode steps' `reserve`): not copied at all, a host-to-device copy being a wait on the device."""
        table = self._table
        if table.device == self.pool.device:
            self.device_table, self._uploaded = table, None
            return
        if self._uploaded is not None and self._uploaded.shape == table.shape and torch.equal(self._uploaded, table):
            return
        if self.device_table.shape == table.shape and self.device_table.device == self.pool.device:
            self.device_table.copy_(table)
        else:
            self.device_table = table.to(self.pool.device)
        self._uploaded = table.clone()

    @classmethod
    def empty(cls, pool: BlockPool, batch_size: int, ratio: int, head_dim: int,
              device: torch.device | str = "cpu", spare: int = 0) -> "PagedCompressedCache":
        return cls(pool, torch.zeros(batch_size, 0, dtype=torch.long),
                   torch.zeros(batch_size, dtype=torch.long, device=device),
                   torch.zeros(batch_size, ratio, head_dim, device=device),
                   torch.full((batch_size, ratio, head_dim), float("-inf"), device=device),
                   InputHistory.empty(batch_size, ratio + spare, head_dim, device) if spare and ratio > 1 else None)

    @property
    def batch_size(self) -> int:
        return int(self.table.shape[0])

    # ---- the interface the model uses -----------------------------------------------------------------------
    def write(self, rows: torch.Tensor, entries: torch.Tensor, kv: torch.Tensor, index_k: torch.Tensor) -> None:
        """Store compressed entries: batch row rows[i] gets entry id entries[i]."""
        if rows.numel() == 0:
            return
        bs = self.pool.block_size
        rows_c, entries_c = rows.cpu(), entries.cpu()
        slot = entries_c // bs
        self._ensure_blocks(rows_c, slot)
        blocks = self._unshare(rows_c, slot)
        self._mirror()
        self.pool.store(blocks.to(self.pool.device), (entries_c % bs).to(self.pool.device), kv, index_k)

    @property
    def capacity(self) -> int:
        return int(self.table.shape[1]) * self.pool.block_size

    def reserve(self, capacity: int, next_entries: torch.Tensor) -> None:
        """The block of each row's next entry allocated (and copied if shared: copy-on-write now, not in the step),
        the table padded with the zero block to `capacity` entries."""
        bs = self.pool.block_size
        rows = torch.arange(self.batch_size)
        slot = torch.div(next_entries.cpu(), bs, rounding_mode="floor")
        self._ensure_blocks(rows, slot)
        self._unshare(rows, slot)
        self._widen(max(2, -(-capacity // bs)))  # at least 2 blocks (CompressedStore.reserve)
        self._mirror()

    def growing_dims(self) -> list[tuple[torch.Tensor, int]]:
        return [(self.table, 1)] + [(plane, 0) for plane in self.pool.planes.values()]

    def write_groups(self, entries: torch.Tensor, complete: torch.Tensor, kv: torch.Tensor,
                     index_k: torch.Tensor) -> None:
        # The blocks were allocated and unshared by `reserve`; the zero block is never a write's target.
        rows = torch.arange(entries.shape[0], device=entries.device).unsqueeze(1)
        bs = self.pool.block_size
        blocks = self.device_table[rows, torch.div(entries, bs, rounding_mode="floor")]
        self.pool.store_where(complete, blocks, entries % bs, kv, index_k)

    def read(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries [0, n) of every row: (kv [B, n, D], index_k [B, n, Dk]); rows with fewer read zeros."""
        kv, index_k = self.pool.gather(self._blocks(n))
        return kv[:, :n], index_k[:, :n]

    def read_index(self, n: int) -> torch.Tensor:
        return self.pool.gather(self._blocks(n), "index_k")[:, :n]

    def gather(self, picks: torch.Tensor) -> torch.Tensor:
        """Only the picked entries' blocks are read and decoded (a decode step's top-k, not the whole table)."""
        bs = self.pool.block_size
        blocks = self.device_table[row_of(picks), torch.div(picks, bs, rounding_mode="floor")]
        return self.pool.entries(blocks, picks % bs, "kv")

    def index_scores(self, q: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor | None:
        """The indexer's scores [B, S, n] of entries [0, n) from the pool's index-key planes, by the kernel
        `kernels.cache_kernel` names here (the keys never decoded into a copy); None where there is none."""
        if kernels.cache_kernel(q.device) is None:
            return None
        B, S, H, D = q.shape
        planes = self.pool.planes
        keys = planes["index_k"]
        rows = torch.arange(B, device=q.device).repeat_interleave(S)
        scores = kernels.triton_index.paged_index_scores(q.reshape(B * S, H, D), w.reshape(B * S, H), rows,
                                                         self._blocks(n), keys, planes.get("index_scale", keys), n,
                                                         self.pool.layout.storage == "packed")
        return scores.view(B, S, n)

    def picked_attention(self, q: torch.Tensor, picks: torch.Tensor,
                         scale: float) -> Part | None:
        """The partial softmax over the picked entries (CompressedStore), from the pool's main-KV planes by the
        kernel `kernels.cache_kernel` names (never a gathered fp32 copy of the entries); None where there is none."""
        if kernels.cache_kernel(q.device) is None:
            return None
        planes = self.pool.planes
        kv = planes["kv"]
        return kernels.triton_attention.picked_attention(q, picks, self.device_table, kv, planes.get("kv_scale", kv),
                                                         scale, self.pool.layout.storage == "packed")

    def _blocks(self, n: int) -> torch.Tensor:
        """The table's first ceil(n / block_size) blocks of every row, padded with the zero block."""
        nb = -(-n // self.pool.block_size)
        table = self.device_table[:, :nb]
        if table.shape[1] < nb:
            table = torch.cat((table, table.new_zeros(table.shape[0], nb - table.shape[1])), dim=1)
        return table

    def remember_inputs(self, positions: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
                        valid: torch.Tensor) -> None:
        if self.inputs is not None:
            self.inputs.write(positions, kv, score, valid)

    def rollback(self, to_pos: torch.Tensor) -> None:
        """Entries past the rollback point become invisible (their blocks stay with the row and are rewritten)."""
        rollback_compressed(self, self.partial_kv.shape[1], to_pos)

    def restart(self, rows: torch.Tensor) -> None:
        """The rows hold nothing (their blocks go back to the pool), in place: the table keeps its shape."""
        rows_c = rows.cpu()
        self.pool.decref(self._table[rows_c].flatten())
        self._table.index_fill_(0, rows_c, 0)
        self._mirror()
        restart_compressed(self, rows.to(self.length.device))

    # ---- block bookkeeping ----------------------------------------------------------------------------------
    def _widen(self, width: int) -> None:
        """The block table at least `width` blocks wide, padded with the zero block."""
        if width > self.table.shape[1]:
            self.table = torch.cat((self.table, self.table.new_zeros(self.batch_size, width - self.table.shape[1])),
                                   dim=1)

    def _unshare(self, rows: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Copy-on-write: table[rows, slot] made private where a cached prefix (or another row) still holds the
        block a row is about to write into; returns the blocks."""
        blocks = self.table[rows, slot]
        shared = self.pool.refcount[blocks] > 1
        if bool(shared.any()):
            for r, s in {(int(r), int(s)) for r, s in zip(rows[shared], slot[shared])}:
                old = int(self.table[r, s])
                if int(self.pool.refcount[old]) > 1:
                    self.table[r, s] = self.pool.copy_block(old)
                    self.pool.decref(torch.tensor([old]))
            blocks = self.table[rows, slot]
        return blocks

    def _ensure_blocks(self, rows: torch.Tensor, slot: torch.Tensor) -> None:
        have = (self.table > 0).sum(dim=1).tolist()
        need: dict[int, int] = {}
        for r, s in zip(rows.tolist(), slot.tolist()):
            if s >= have[r] and s + 1 > need.get(r, 0):
                need[r] = s + 1
        if not need:
            return
        self._widen(max(need.values()))
        for r, stop in need.items():
            self.table[r, have[r]:stop] = torch.tensor(self.pool.allocate(stop - have[r]), dtype=torch.long)

    def blocks_per_row(self) -> list[int]:
        return (self.table > 0).sum(dim=1).tolist()

    # ---- regrouping -------------------------------------------------------------------------------------------
    def select(self, rows: torch.Tensor) -> "PagedCompressedCache":
        """The given rows, as a new cache with its own block references (the blocks themselves are shared)."""
        table = self.table.index_select(0, rows.cpu())
        width = int((table > 0).sum(dim=1).max()) if table.numel() else 0
        table = table[:, :width].clone()
        self.pool.incref(table.flatten())
        dev = self.length.device
        rows = rows.to(dev)
        return PagedCompressedCache(self.pool, table, self.length.index_select(0, rows),
                                    self.partial_kv.index_select(0, rows), self.partial_score.index_select(0, rows),
                                    None if self.inputs is None else self.inputs.select(rows))

    @classmethod
    def concat(cls, caches: list["PagedCompressedCache"]) -> "PagedCompressedCache":
        pool = caches[0].pool
        width = max(c.table.shape[1] for c in caches)
        table = torch.cat([torch.cat((c.table, c.table.new_zeros(c.batch_size, width - c.table.shape[1])), dim=1)
                           for c in caches])
        pool.incref(table.flatten())
        return PagedCompressedCache(pool, table, torch.cat([c.length for c in caches]),
                                    torch.cat([c.partial_kv for c in caches]),
                                    torch.cat([c.partial_score for c in caches]),
                                    concat_inputs([c.inputs for c in caches]))

    def release(self) -> None:
        """Drop this cache's block references (idempotent)."""
        self.pool.decref(self.table.flatten())
        self.table = self.table.new_zeros(self.batch_size, 0)

    def nbytes(self) -> int:
        """Bytes of the blocks this cache references (shared blocks counted in full) plus its dense state."""
        blocks = int((self.table > 0).sum())
        dense = sum(t.numel() * t.element_size() for t in (self.length, self.partial_kv, self.partial_score))
        return blocks * self.pool.block_bytes + dense + (self.inputs.nbytes() if self.inputs is not None else 0)


# ----------------------------------------------------------------------------------------------------------------
# FP8 window rings


class PackedWindowCache:
    """A sliding-window ring stored as FP8 E4M3 codes with a UE8M0 scale per 32 channels (528 B per 512-d slot).

    A `WindowStore` (model/cache.py), like the dense WindowCache: `kv` is decoded on access.
    """

    storage = "packed"
    plane_names = ("codes", "scales", "pos")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, pos: torch.Tensor) -> None:
        self.codes, self.scales, self.pos = codes, scales, pos  # [B, W, D] u8, [B, W, D/32] u8, [B, W] long

    def planes(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales, "pos": self.pos}

    @classmethod
    def from_planes(cls, planes: dict[str, torch.Tensor]) -> "PackedWindowCache":
        return cls(planes["codes"], planes["scales"], planes["pos"])

    @classmethod
    def empty(cls, batch_size: int, window: int, dim: int, device: torch.device | str = "cpu") -> "PackedWindowCache":
        # Code 0 with scale byte 0 decodes to 0.0, like the dense ring's zeros.
        return cls(torch.zeros(batch_size, window, dim, dtype=torch.uint8, device=device),
                   torch.zeros(batch_size, window, dim // 32, dtype=torch.uint8, device=device),
                   torch.full((batch_size, window), -1, dtype=torch.long, device=device))

    @property
    def kv(self) -> torch.Tensor:
        return formats.decode_window_fp8(self.codes, self.scales)

    def attend(self, q: torch.Tensor, positions: torch.Tensor, window: int,
               scale: float) -> Part | None:
        """The ring's part of the attention (WindowStore), its codes decoded in registers where a kernel reads them."""
        if kernels.cache_kernel(q.device) is None:
            return None
        return kernels.triton_attention.ring_attention(q, positions, self.codes, self.scales, self.pos, window, scale,
                                                       True)

    def write(self, kv: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Store tokens at slot position % W; only the last W of a chunk survive."""
        window = self.codes.shape[1]
        if positions.shape[1] <= window:  # distinct slots per row: a masked write (as WindowCache.write)
            rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
            slots = positions % window
            codes, scales = formats.encode_window_fp8(kv.float())
            masked_put(self.codes, (rows, slots), valid, codes)
            masked_put(self.scales, (rows, slots), valid, scales)
            masked_put(self.pos, (rows, slots), valid, positions)
            return
        keep = valid & (positions > positions.masked_fill(~valid, -1).amax(dim=1, keepdim=True) - window)
        b_idx, s_idx = keep.nonzero(as_tuple=True)
        slots = positions[b_idx, s_idx] % window
        codes, scales = formats.encode_window_fp8(kv[b_idx, s_idx].float())
        self.codes[b_idx, slots] = codes
        self.scales[b_idx, slots] = scales
        self.pos[b_idx, slots] = positions[b_idx, s_idx]

    def select(self, rows: torch.Tensor) -> "PackedWindowCache":
        return PackedWindowCache(self.codes.index_select(0, rows), self.scales.index_select(0, rows),
                                 self.pos.index_select(0, rows))

    @classmethod
    def concat(cls, stores: list["PackedWindowCache"]) -> "PackedWindowCache":
        return cls(torch.cat([w.codes for w in stores]), torch.cat([w.scales for w in stores]),
                   torch.cat([w.pos for w in stores]))

    def clone(self) -> "PackedWindowCache":
        return PackedWindowCache(self.codes.clone(), self.scales.clone(), self.pos.clone())

    def rollback(self, to_pos: torch.Tensor) -> None:
        self.pos.masked_fill_(self.pos >= to_pos.unsqueeze(1), -1)

    def restart(self, rows: torch.Tensor) -> None:
        self.pos.index_fill_(0, rows, -1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.pos))


# The window ring of each kv_storage (a saved prefix cache names it; its planes rebuild the ring).
WINDOW_STORES: dict[str, type] = {"fp32": WindowCache, "packed": PackedWindowCache}


# ----------------------------------------------------------------------------------------------------------------
# Whole per-batch caches


@dataclass
class CacheFactory:
    """Builds engine caches: paged compressed planes from one pool, dense or FP8 window rings."""

    cfg: FlashConfig
    pool: BlockPool
    window_storage: str = "fp32"  # "fp32" or "packed" (FP8)
    device: torch.device | str = "cpu"
    spare: int = 0  # rollback room of every cache (speculative decoding: the verified block)
    draft: bool = False  # caches carry the DSpark drafter's rings

    @classmethod
    def create(cls, cfg: FlashConfig, kv_storage: str = "fp32", block_size: int = 16, max_blocks: int | None = None,
               device: torch.device | str = "cpu", spare: int = 0, draft: bool = False) -> "CacheFactory":
        layout = EntryLayout(cfg.head_dim, cfg.index_head_dim, kv_storage)
        return cls(cfg, BlockPool(layout, block_size, max_blocks=max_blocks, device=device), kv_storage, device,
                   spare, draft)

    def owner_ratios(self) -> dict[int, int]:
        return {t.index: t.compress_ratio for t in self.cfg.topology.layers if t.mode == LayerMode.FULL}

    def empty(self, batch_size: int = 1, spare: int | None = None) -> ModelCache:
        """A cache of `batch_size` empty sequences; `spare`: how many latest tokens `rollback` can undo (default:
        the factory's, which speculative decoding sets), with the drafter's rings when the factory has them."""
        spare = self.spare if spare is None else spare
        cfg = self.cfg
        ring = cfg.sliding_window + spare
        if self.window_storage == "packed":
            window = [PackedWindowCache.empty(batch_size, ring, cfg.head_dim, self.device)
                      for _ in cfg.topology.layers]
        else:
            window = [WindowCache(torch.zeros(batch_size, ring, cfg.head_dim, device=self.device),
                                  torch.full((batch_size, ring), -1, dtype=torch.long, device=self.device))
                      for _ in cfg.topology.layers]
        compressed = {i: PagedCompressedCache.empty(self.pool, batch_size, r, cfg.head_dim, self.device, spare)
                      for i, r in self.owner_ratios().items()}
        return ModelCache(pos=torch.zeros(batch_size, dtype=torch.long, device=self.device), window=window,
                          compressed=compressed, engram=None, spare=spare,  # the Engram memory adds its history
                          draft=draft_rings(cfg, batch_size, self.device) if self.draft else [])

    # ---- accounting -----------------------------------------------------------------------------------------
    def global_bytes_per_token(self) -> float:
        """Bytes of global (compressed) cache per token: each owner adds one entry per `ratio` tokens."""
        return sum(self.pool.layout.entry_bytes / r for r in self.owner_ratios().values())

    def window_bytes_per_sequence(self) -> int:
        """Bytes of the bounded per-sequence state: window rings (every layer)."""
        cfg = self.cfg
        slot = formats.cache_entry_bytes("window", cfg.head_dim) if self.window_storage == "packed" \
            else 4 * cfg.head_dim
        return len(cfg.topology.layers) * cfg.sliding_window * slot
