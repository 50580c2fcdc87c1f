"""Prefix caching: the state after a prompt prefix, keyed by hashes of fixed-size token blocks.

A prompt is cut into blocks of `block_tokens` tokens; block i's key hashes the key of block i-1 and block i's token
ids, so a key names a whole prefix. An entry holds the state after that prefix:
- the global compressed KV and index keys of every KV-owner layer, as references to pool blocks (shared with the
  sequence that made it and with every sequence that reuses it; a sequence appending to a shared block copies it
  first, so an entry's contents never change);
- the compressor's open group (empty when the prefix length is a multiple of every ratio), and the Engram hash
  history;
- what bounds the rest, depending on `restore`:
  * "snapshot": the window rings of every layer and, for bounded-replay prefill, the pending decoder-half input
    (ReplayBuffer). Restoring gives exactly the state a prefill that stopped there would have, so outputs equal
    those without the cache. Entries exist only where a prefill chunk ended (chunks end at block boundaries).
  * "replay": nothing more (bounded memory per entry: only the global cache). On a hit the engine rebuilds the
    window state by replaying the last `sliding_window` prefix tokens over the cached global KV
    (architecture.md §7.3 applied to the prefix; `ModelRunner.replay_prefix`). Exact when the prefix is no longer
    than the window; otherwise the replayed tokens' own windows start at the replay start, an approximation like
    CED bounded replay. Entries exist at every block boundary a prefill passed.
A restored state is always a copy: dense tensors are cloned and blocks are copy-on-write.

Capacity is in bytes (distinct pool blocks held by entries plus their dense tensors), evicting the least recently
used entry. `save` / `load` persist entries as safetensors plus a JSON index, checked against a fingerprint of the
model and the cache settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from openflash.engine.cache import WINDOW_STORES, CacheFactory
from openflash.engine.config import RESTORE_MODES, EngineConfig
from openflash.errors import OpenflashError
from openflash.memory.hashing import EngramHashState
from openflash.model.cache import ModelCache, ReplayBuffer
from openflash.model.transformer import Transformer

INDEX_FILE, TENSOR_FILE = "prefix_cache.json", "prefix_cache.safetensors"
FORMAT_VERSION = 1


@dataclass
class CachedPlane:
    """One owner layer's part of an entry."""

    blocks: list[int]  # pool blocks covering entries [0, length)
    length: int
    partial_kv: torch.Tensor | None  # [1, ratio, D]; None = empty open group
    partial_score: torch.Tensor | None


@dataclass
class PrefixEntry:
    key: str
    num_tokens: int
    planes: dict[int, CachedPlane]
    engram: torch.Tensor | None = None  # hash history [1, H] (snapshot mode)
    window: list | None = None  # per-layer rings (snapshot mode)
    replay: ReplayBuffer | None = None  # pending decoder-half input (snapshot mode, bounded prefill)
    dense_bytes: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    queried_tokens: int = 0  # prompt tokens looked up (each prompt counts its length)
    hit_tokens: int = 0  # of those, served from the cache
    inserts: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def _tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PrefixCache:
    def __init__(self, factory: CacheFactory, block_tokens: int, capacity_bytes: int, restore: str = "snapshot",
                 fingerprint: str = "") -> None:
        if restore not in RESTORE_MODES:
            raise OpenflashError(f"prefix-cache restore mode must be one of {list(RESTORE_MODES)}, got {restore!r}")
        ratios = list(factory.owner_ratios().values())
        if block_tokens < 1 or any(block_tokens % r for r in ratios):
            raise OpenflashError(f"prefix-cache block of {block_tokens} tokens must be a positive multiple of every "
                                 f"compress ratio {sorted(set(ratios))}")
        self.factory, self.pool = factory, factory.pool
        self.block_tokens, self.capacity_bytes, self.restore_mode = block_tokens, capacity_bytes, restore
        self.fingerprint = fingerprint
        self.entries: OrderedDict[str, PrefixEntry] = OrderedDict()  # least recently used first
        self.block_refs: Counter[int] = Counter()  # pool block -> number of entries holding it
        self.stats = PrefixCacheStats()

    # ---- keys ---------------------------------------------------------------------------------------------------
    def keys(self, token_ids: list[int], limit: int | None = None) -> list[str]:
        """Key of every full block of token_ids[:limit]; keys[i] names the prefix of (i + 1) blocks."""
        n = len(token_ids) if limit is None else min(limit, len(token_ids))
        arr = np.asarray(token_ids[: n - n % self.block_tokens], dtype=np.int64)
        out, prev = [], b""
        for i in range(0, len(arr), self.block_tokens):
            prev = hashlib.blake2b(prev + arr[i: i + self.block_tokens].tobytes(), digest_size=16).digest()
            out.append(prev.hex())
        return out

    # ---- lookup and restore -------------------------------------------------------------------------------------
    def lookup(self, token_ids: list[int]) -> PrefixEntry | None:
        """The entry of the longest cached prefix that leaves at least one prompt token to run."""
        self.stats.lookups += 1
        self.stats.queried_tokens += len(token_ids)
        for key in reversed(self.keys(token_ids, len(token_ids) - 1)):
            entry = self.entries.get(key)
            if entry is not None:
                self.entries.move_to_end(key)
                entry.last_used = time.monotonic()
                self.stats.hits += 1
                self.stats.hit_tokens += entry.num_tokens
                return entry
        return None

    def restore(self, entry: PrefixEntry) -> ModelCache:
        """A fresh one-row cache holding a copy of the entry's state (replay mode: global state only; the caller
        rebuilds the window state)."""
        cache = self.factory.empty(1)
        for layer, plane in entry.planes.items():
            c = cache.compressed[layer]
            c.table = torch.tensor([plane.blocks], dtype=torch.long).view(1, -1)
            self.pool.incref(c.table.flatten())
            c.length = torch.tensor([plane.length], dtype=torch.long, device=c.length.device)
            if plane.partial_kv is not None:
                c.partial_kv, c.partial_score = plane.partial_kv.clone(), plane.partial_score.clone()
        cache.pos = torch.tensor([entry.num_tokens], dtype=torch.long, device=cache.pos.device)
        if entry.window is not None:
            cache.window = [w.clone() for w in entry.window]
        if entry.engram is not None:
            cache.engram = EngramHashState(entry.engram.clone())
        if entry.replay is not None:
            cache.replay = entry.replay.clone()
        return cache

    # ---- insertion ----------------------------------------------------------------------------------------------
    def offer(self, token_ids: list[int], start: int, end: int, cache: ModelCache) -> None:
        """A prefill chunk took `cache` (one sequence's) from position `start` to `end` of the prompt `token_ids`:
        insert the states it passed that this mode keeps. A snapshot must be the state of a prefill that stops
        there, so only a chunk's end (a block boundary short of the prompt's end) is one; replay keeps every block
        boundary the chunk crossed."""
        block = self.block_tokens
        if self.restore_mode == "snapshot":
            if end < len(token_ids) and end % block == 0:
                self.insert(token_ids, end, cache)
            return
        for boundary in range((start // block + 1) * block, end + 1, block):
            self.insert(token_ids, boundary, cache)

    def insert(self, token_ids: list[int], num_tokens: int, cache: ModelCache) -> bool:
        """Cache the state after token_ids[:num_tokens] (a block boundary) from a one-row cache.

        snapshot mode: `cache` must hold exactly that prefix (cache.pos == num_tokens). replay mode: `cache` may
        have gone further; only its global entries for the prefix are used. Returns True if a new entry was made.
        """
        if num_tokens % self.block_tokens or num_tokens == 0:
            raise ValueError(f"prefix length {num_tokens} is not a multiple of the {self.block_tokens}-token block")
        key = self.keys(token_ids, num_tokens)[-1]
        if key in self.entries:
            self.entries.move_to_end(key)
            return False
        snapshot = self.restore_mode == "snapshot"
        if snapshot and int(cache.pos[0]) != num_tokens:
            raise ValueError(f"a snapshot needs the cache at position {num_tokens}, not {int(cache.pos[0])}")
        planes = {}
        for layer, ratio in self.factory.owner_ratios().items():
            c = cache.compressed[layer]
            length = num_tokens // ratio  # entries of complete groups (num_tokens is a multiple of ratio)
            nb = -(-length // self.pool.block_size)
            blocks = c.table[0, :nb].tolist()
            if len(blocks) < nb or 0 in blocks:
                raise ValueError(f"layer {layer}: the cache holds fewer than {length} compressed entries")
            partial = (c.partial_kv.clone(), c.partial_score.clone()) if snapshot else (None, None)
            planes[layer] = CachedPlane(blocks, length, *partial)
        entry = PrefixEntry(key, num_tokens, planes)
        if snapshot:
            entry.window = [w.clone() for w in cache.window]
            entry.engram = cache.engram.history.clone() if cache.engram is not None else None
            if cache.replay is not None:
                entry.replay = cache.replay.clone()
        entry.dense_bytes = self._dense_bytes(entry)
        self._add(entry)
        self.stats.inserts += 1
        self._evict()
        return True

    def _add(self, entry: PrefixEntry) -> None:
        for plane in entry.planes.values():
            self.pool.incref(torch.tensor(plane.blocks, dtype=torch.long))
            self.block_refs.update(plane.blocks)
        self.entries[entry.key] = entry

    @staticmethod
    def _dense_bytes(entry: PrefixEntry) -> int:
        total = sum(_tensor_bytes(p.partial_kv, p.partial_score) for p in entry.planes.values())
        total += _tensor_bytes(entry.engram)
        for w in entry.window or []:
            total += _tensor_bytes(*w.planes().values())
        if entry.replay is not None:
            total += _tensor_bytes(entry.replay.residual, entry.replay.pre_mix, entry.replay.positions)
        return total

    # ---- eviction -----------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return len(self.block_refs) * self.pool.block_bytes + sum(e.dense_bytes for e in self.entries.values())

    def _drop(self, key: str) -> None:
        entry = self.entries.pop(key)
        for plane in entry.planes.values():
            self.pool.decref(torch.tensor(plane.blocks, dtype=torch.long))
            self.block_refs.subtract(plane.blocks)
        self.block_refs = +self.block_refs  # drop zero counts

    def _evict(self) -> None:
        while self.entries and self.nbytes > self.capacity_bytes:
            self._drop(next(iter(self.entries)))
            self.stats.evictions += 1

    def clear(self) -> None:
        while self.entries:
            self._drop(next(iter(self.entries)))

    def summary(self) -> dict:
        s = self.stats
        return {"entries": len(self.entries), "bytes": self.nbytes, "capacity_bytes": self.capacity_bytes,
                "blocks": len(self.block_refs), "lookups": s.lookups, "hits": s.hits, "hit_rate": s.hit_rate,
                "token_hit_rate": s.token_hit_rate, "hit_tokens": s.hit_tokens, "inserts": s.inserts,
                "evictions": s.evictions, "restore": self.restore_mode, "block_tokens": self.block_tokens}

    # ---- persistence --------------------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        """Write every entry to folder/prefix_cache.{safetensors,json} (atomically: temporary files, renamed)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        distinct = sorted(self.block_refs)
        slot = {b: i for i, b in enumerate(distinct)}
        tensors: dict[str, torch.Tensor] = {}
        if distinct:
            for name, t in self.pool.read_blocks(distinct).items():
                tensors[f"blocks.{name}"] = t.contiguous()
        index = []
        for n, entry in enumerate(self.entries.values()):
            p = f"e{n}"
            item = {"key": entry.key, "num_tokens": entry.num_tokens, "planes": {}}
            for layer, plane in entry.planes.items():
                item["planes"][str(layer)] = {"blocks": [slot[b] for b in plane.blocks], "length": plane.length,
                                              "partial": plane.partial_kv is not None}
                if plane.partial_kv is not None:
                    tensors[f"{p}.l{layer}.partial_kv"] = plane.partial_kv.contiguous()
                    tensors[f"{p}.l{layer}.partial_score"] = plane.partial_score.contiguous()
            if entry.engram is not None:
                tensors[f"{p}.engram"] = entry.engram.contiguous()
            item["engram"] = entry.engram is not None
            item["window"] = None if entry.window is None else entry.window[0].storage
            for i, w in enumerate(entry.window or []):
                for name, t in w.planes().items():
                    tensors[f"{p}.w{i}.{name}"] = t.contiguous()
            item["replay"] = entry.replay is not None
            if entry.replay is not None:
                tensors[f"{p}.replay.residual"] = entry.replay.residual.contiguous()
                tensors[f"{p}.replay.pre_mix"] = entry.replay.pre_mix.contiguous()
                tensors[f"{p}.replay.positions"] = entry.replay.positions.contiguous()
                tensors[f"{p}.replay.image_mask"] = entry.replay.image_mask.contiguous()
            index.append(item)
        meta = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "block_tokens": self.block_tokens,
                "restore": self.restore_mode, "pool_block_size": self.pool.block_size,
                "storage": self.pool.layout.storage, "entries": index}
        tmp_t, tmp_j = folder / (TENSOR_FILE + ".tmp"), folder / (INDEX_FILE + ".tmp")
        save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp_t))
        tmp_j.write_text(json.dumps(meta))
        os.replace(tmp_t, folder / TENSOR_FILE)
        os.replace(tmp_j, folder / INDEX_FILE)
        return folder / INDEX_FILE

    def load(self, folder: str | Path) -> int:
        """Add the entries saved in folder (if any). Returns how many were loaded; raises OpenflashError if the
        files were written for another model or other cache settings."""
        folder = Path(folder)
        index_path, tensor_path = folder / INDEX_FILE, folder / TENSOR_FILE
        if not index_path.exists():
            return 0
        try:
            meta = json.loads(index_path.read_text())
            tensors = load_file(str(tensor_path))
        except (OSError, ValueError) as exc:
            raise OpenflashError(f"cannot read the prefix cache in {folder}: {exc}") from exc
        want = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "block_tokens": self.block_tokens,
                "restore": self.restore_mode, "pool_block_size": self.pool.block_size,
                "storage": self.pool.layout.storage}
        for name, value in want.items():
            if meta.get(name) != value:
                raise OpenflashError(f"{index_path}: {name} is {meta.get(name)!r} but this server needs {value!r} "
                                     f"(written for another model or other cache settings); delete the folder or "
                                     f"point the prefix cache elsewhere")
        n_stored = tensors["blocks.kv"].shape[0] if "blocks.kv" in tensors else 0
        new_blocks = self.pool.allocate(n_stored) if n_stored else []
        if n_stored:
            self.pool.write_blocks(new_blocks, {name[len("blocks."):]: t for name, t in tensors.items()
                                                if name.startswith("blocks.")})
        loaded = 0
        for n, item in enumerate(meta["entries"]):
            p = f"e{n}"
            planes = {}
            for layer, pl in item["planes"].items():
                planes[int(layer)] = CachedPlane(
                    [new_blocks[i] for i in pl["blocks"]], pl["length"],
                    tensors.get(f"{p}.l{layer}.partial_kv") if pl["partial"] else None,
                    tensors.get(f"{p}.l{layer}.partial_score") if pl["partial"] else None)
            entry = PrefixEntry(item["key"], item["num_tokens"], planes)
            if item["engram"]:
                entry.engram = tensors[f"{p}.engram"]
            if item["window"] is not None:
                n_layers = len(self.factory.cfg.topology.layers)
                store = WINDOW_STORES[item["window"]]
                entry.window = [store.from_planes({n: tensors[f"{p}.w{i}.{n}"] for n in store.plane_names})
                                for i in range(n_layers)]
            if item["replay"]:
                positions = tensors[f"{p}.replay.positions"]
                # Files written before images existed hold no mask: their prompts were all text.
                mask = tensors.get(f"{p}.replay.image_mask", torch.zeros_like(positions, dtype=torch.bool))
                entry.replay = ReplayBuffer(tensors[f"{p}.replay.residual"], tensors[f"{p}.replay.pre_mix"],
                                            positions, mask)
            entry.dense_bytes = self._dense_bytes(entry)
            if entry.key not in self.entries:
                self._add(entry)
                loaded += 1
        if new_blocks:  # the entries now hold the blocks; drop the loader's own reference
            self.pool.decref(torch.tensor(new_blocks, dtype=torch.long))
        self._evict()
        return loaded


def model_fingerprint(model: Transformer, config: EngineConfig) -> str:
    """Identifies what a persisted prefix cache depends on: config, weights, numerics and cache settings."""
    digest = hashlib.sha256()
    digest.update(json.dumps(model.cfg.to_hf_dict(), sort_keys=True, default=str).encode())
    digest.update(json.dumps([model.numerics.name, config.prefill_mode, config.kv_storage, config.prefix_restore,
                              config.prefix_block_tokens, config.prefill_chunk]).encode())
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
