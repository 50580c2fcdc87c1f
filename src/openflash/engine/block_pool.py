"""The engine's block pool: fixed-size blocks of compressed-KV entries (one KV plane and one index-key plane per
entry) shared by every KV-owner layer and every sequence, with reference counts for the prefix cache's shared
blocks and copy-on-write; and the entry layouts of its two storage formats (`kv_storage`, engine/cache.py's doc):
"fp32" planes, or the trained formats packed exactly (`encode_kv_exact`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openflash import formats
from openflash.engine.config import KV_STORAGES
from openflash.errors import OpenflashError
from openflash.model.stores import masked_put

_E4M3_MIN_NORMAL_CODE = 8  # E4M3 code of 2^-6; below it the scale grid is the coarse subnormal one


class CacheFullError(OpenflashError):
    """The block pool reached its configured size."""


# ----------------------------------------------------------------------------------------------------------------
# Exact packing of already-QDQ'd values


def encode_kv_exact(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_kv_fp4 for values that are already FP4/E4M3-per-16 QDQ'd, such that decoding gives v back exactly.

    The plain encoder recomputes the scale from the QDQ'd block's amax. That reproduces the original scale
    whenever it is an E4M3 normal (the block's max then sits at code 6), but a subnormal scale (amax < 6 * 2^-6)
    can come back one grid step smaller. The original scale is one of the few subnormal codes above the recomputed
    one, so those blocks try the next codes until the round trip is exact. Every block is tried with masks, no
    shape depending on which blocks need it: a whole-step decode graph writes through here, and a data-dependent
    branch would break it in two (runtime/decode_graph.py).
    """
    packed, scales = formats.encode_kv_fp4(v)
    blocks = v.float().unflatten(-1, (-1, 16))
    done = _round_trips(formats.e2m1_decode(formats.unpack_fp4(packed)).unflatten(-1, (-1, 16)), scales, blocks)
    if not torch.compiler.is_compiling() and bool(done.all()):
        return packed, scales  # (eager: the common case, nothing to repair)
    base = scales.int()
    codes = packed.unflatten(-1, (-1, 8))
    for step in range(1, _E4M3_MIN_NORMAL_CODE + 1):
        code = (base + step).clamp(max=126).to(torch.uint8)
        s = formats.e4m3_decode(code).unsqueeze(-1)
        q = formats.e2m1_encode((blocks / s).clamp(-formats.E2M1_MAX, formats.E2M1_MAX))
        ok = ~done & _round_trips(formats.e2m1_decode(q), code, blocks)
        scales = torch.where(ok, code, scales)
        codes = torch.where(ok.unsqueeze(-1), formats.pack_fp4(q), codes)
        done = done | ok
    if not torch.compiler.is_compiling() and not bool(done.all()):
        raise ValueError("encode_kv_exact: the input is not an FP4/E4M3-per-16 QDQ'd tensor")
    return codes.flatten(-2), scales


def _round_trips(values: torch.Tensor, scales: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Per block of 16: E2M1 values [..., n, 16] times their E4M3 scale bytes [..., n] give `blocks` back (NaN
    blocks round-trip as NaN)."""
    decoded = values * formats.e4m3_decode(scales).unsqueeze(-1)
    return ((decoded == blocks) | (decoded.isnan() & blocks.isnan())).all(-1)


# ----------------------------------------------------------------------------------------------------------------
# The block pool


@dataclass(frozen=True)
class EntryLayout:
    """What one compressed-cache entry holds: a main-KV vector and an index key."""

    head_dim: int
    index_head_dim: int
    storage: str = "fp32"

    def __post_init__(self) -> None:
        if self.storage not in KV_STORAGES:
            raise OpenflashError(f"kv storage must be one of {list(KV_STORAGES)}, got {self.storage!r}")

    def planes(self) -> dict[str, tuple[int, torch.dtype]]:
        """Storage planes: name -> (width, dtype)."""
        if self.storage == "fp32":
            return {"kv": (self.head_dim, torch.float32), "index_k": (self.index_head_dim, torch.float32)}
        return {"kv": (self.head_dim // 2, torch.uint8), "kv_scale": (self.head_dim // 16, torch.uint8),
                "index_k": (self.index_head_dim // 2, torch.uint8),
                "index_scale": (self.index_head_dim // 32, torch.uint8)}

    @property
    def entry_bytes(self) -> int:
        if self.storage == "fp32":
            return 4 * (self.head_dim + self.index_head_dim)
        return formats.cache_entry_bytes("main_kv", self.head_dim) + \
            formats.cache_entry_bytes("index_k", self.index_head_dim)

    def encode(self, kv: torch.Tensor, index_k: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.storage == "fp32":
            return {"kv": kv.float(), "index_k": index_k.float()}
        kv_packed, kv_scale = encode_kv_exact(kv.float())
        ik_packed, ik_scale = formats.encode_index_mxfp4(index_k.float())
        return {"kv": kv_packed, "kv_scale": kv_scale, "index_k": ik_packed, "index_scale": ik_scale}

    def decode(self, planes: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_part(planes, "kv"), self.decode_part(planes, "index_k")

    def decode_part(self, planes: dict[str, torch.Tensor], part: str) -> torch.Tensor:
        """One half of the entries: "kv" or "index_k" (from its planes: the value and, packed, its scales)."""
        if self.storage == "fp32":
            return planes[part]
        if part == "kv":
            return formats.decode_kv_fp4(planes["kv"], planes["kv_scale"])
        return formats.decode_index_mxfp4(planes["index_k"], planes["index_scale"])

    def part_planes(self, part: str) -> tuple[str, ...]:
        """The planes that hold one half of the entries ("kv" or "index_k")."""
        return tuple(name for name in {"kv": ("kv", "kv_scale"), "index_k": ("index_k", "index_scale")}[part]
                     if name in self.planes())


class BlockPool:
    """Fixed-size blocks of compressed-cache entries, shared by all owner layers and sequences.

    Block 0 is a permanent all-zero block: block tables are padded with it. Blocks are reference counted; a block
    returns to the free list when its count drops to 0. The pool grows (doubling) when it runs out, up to
    `max_blocks` if set.
    """

    def __init__(self, layout: EntryLayout, block_size: int = 16, initial_blocks: int = 64,
                 max_blocks: int | None = None, device: torch.device | str = "cpu") -> None:
        if block_size < 1:
            raise OpenflashError(f"KV block size must be >= 1 entry, got {block_size}")
        self.layout, self.block_size, self.max_blocks = layout, block_size, max_blocks
        self.device = torch.device(device)
        n = max(2, initial_blocks if max_blocks is None else min(initial_blocks, max_blocks))
        self.planes = {name: torch.zeros(n, block_size, width, dtype=dtype, device=self.device)
                       for name, (width, dtype) in layout.planes().items()}
        self.refcount = torch.zeros(n, dtype=torch.int32)
        self.refcount[0] = 1  # the zero block is never handed out
        self.free: list[int] = list(range(n - 1, 0, -1))  # pop() hands out low ids first

    # ---- accounting -------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return int(self.refcount.shape[0])

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.layout.entry_bytes

    def nbytes(self) -> int:
        """Bytes allocated for the planes (used or free)."""
        return sum(t.numel() * t.element_size() for t in self.planes.values())

    # ---- allocation ---------------------------------------------------------------------------------------
    def _grow(self, needed: int) -> None:
        n = self.num_blocks
        target = max(2 * n, n + needed)
        if self.max_blocks is not None:
            target = min(target, self.max_blocks)
        if target - n < needed:
            raise CacheFullError(f"the KV block pool is full ({self.max_blocks} blocks of {self.block_size} "
                                 f"entries); lower --max-batch / --max-context or raise the pool size")
        for name, t in self.planes.items():
            self.planes[name] = torch.cat((t, t.new_zeros(target - n, *t.shape[1:])))
        self.refcount = torch.cat((self.refcount, torch.zeros(target - n, dtype=torch.int32)))
        self.free.extend(range(target - 1, n - 1, -1))

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks, each with reference count 1."""
        if count > len(self.free):
            self._grow(count - len(self.free))
        blocks = [self.free.pop() for _ in range(count)]
        self.refcount[blocks] = 1
        return blocks

    def incref(self, blocks: torch.Tensor) -> None:
        blocks = blocks[blocks > 0]
        if blocks.numel():
            self.refcount.index_add_(0, blocks.cpu(), torch.ones(blocks.numel(), dtype=torch.int32))

    def decref(self, blocks: torch.Tensor) -> None:
        blocks = blocks[blocks > 0].cpu()
        if not blocks.numel():
            return
        self.refcount.index_add_(0, blocks, torch.full((blocks.numel(),), -1, dtype=torch.int32))
        touched = blocks.unique()
        counts = self.refcount[touched]
        if bool((counts < 0).any()):
            raise RuntimeError("KV block released more often than it was referenced")
        self.free.extend(touched[counts == 0].tolist())

    def copy_block(self, src: int) -> int:
        """A new block holding the contents of `src` (copy-on-write)."""
        (dst,) = self.allocate(1)
        for t in self.planes.values():
            t[dst] = t[src]
        return dst

    # ---- data ---------------------------------------------------------------------------------------------
    def store(self, blocks: torch.Tensor, offsets: torch.Tensor, kv: torch.Tensor, index_k: torch.Tensor) -> None:
        for name, value in self.layout.encode(kv, index_k).items():
            self.planes[name][blocks, offsets] = value.to(self.planes[name].dtype)

    def store_where(self, keep: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, kv: torch.Tensor,
                    index_k: torch.Tensor) -> None:
        """`store` of the entries where keep [B, G] is set, the others rewritten with what they hold (a masked
        write with no data-dependent shape: a whole-step graph's)."""
        for name, value in self.layout.encode(kv, index_k).items():
            plane = self.planes[name]
            masked_put(plane, (blocks, offsets), keep, value)

    def gather(self, table: torch.Tensor, part: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Entries of block table [B, nb] -> (kv [B, nb * block_size, D], index_k [B, nb * block_size, Dk]), or
        only `part` of them ("kv" or "index_k")."""
        B, nb = table.shape
        names = self.planes if part is None else self.layout.part_planes(part)
        planes = {name: self.planes[name][table].reshape(B, nb * self.block_size, self.planes[name].shape[-1])
                  for name in names}
        return self.layout.decode(planes) if part is None else self.layout.decode_part(planes, part)

    def entries(self, blocks: torch.Tensor, offsets: torch.Tensor, part: str) -> torch.Tensor:
        """`part` of the entries at (blocks, offsets) [...], decoded: [..., width]."""
        planes = {name: self.planes[name][blocks, offsets] for name in self.layout.part_planes(part)}
        return self.layout.decode_part(planes, part)

    def read_blocks(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        """Raw plane contents of some blocks (for persisting a prefix cache)."""
        index = torch.tensor(blocks, dtype=torch.long)
        return {name: t[index].clone() for name, t in self.planes.items()}

    def write_blocks(self, blocks: list[int], planes: dict[str, torch.Tensor]) -> None:
        index = torch.tensor(blocks, dtype=torch.long)
        for name, t in self.planes.items():
            t[index] = planes[name].to(t.dtype)


__all__ = ["CacheFullError", "encode_kv_exact", "EntryLayout", "BlockPool"]
