"""Routed experts outside the model: read from the checkpoint's own shards, kept in a byte-budgeted cache.

The routed experts are over 95% of the released backbone (384 per layer, 17.7 MiB each as stored). A model loaded
with `load_checkpoint(..., skip_experts=True)` holds none of them; its MoE layers ask an `ExpertSource` (declared in
model/moe.py) for the experts their router picked, and this module is one:

- `host`: every routed expert read once into host RAM at start, in its stored format (FP4 codes + UE8M0 scales;
  pinned when the model runs on CUDA, and copied to the device per use through the cache);
- `disk`: nothing resident at start; a miss reads the expert's six tensors straight from the official safetensors
  shards with positioned reads (os.pread, several experts of a layer in parallel), no conversion step; with
  `direct_io`, through O_DIRECT (past the page cache: only the LRU holds experts in RAM).

In front of either sits an LRU of ready-to-run experts under `cache_bytes` (0 = no limit), on the model's device.
On disk, with `prefetch`, hints (the model's pre-gating: this and the next layer's routers applied to the layer's
input, in decode-sized steps) start reads in the background; a miss then waits for the read in flight instead of
starting it, and hinted experts no call wanted go into the LRU once read, at its cold end. Off by default: on a
read-bound machine the wrong guesses' extra bytes cost more than the overlap gains (docs/benchmarks.md).
Counters per layer (hits, misses, bytes read) feed `/metrics` and the benchmarks. Outputs are bit-identical to the
model's own experts: the same Expert module runs on the same stored bytes.

Expert parallelism (`group`, a torch.distributed process group of N ranks): rank r holds only the experts e with
e % N == r (of every layer) and runs the router's picks among them for every token; `combine` sums the ranks'
routed outputs with one all_reduce per MoE layer. Every other weight and all activations are replicated, so this
trades one [tokens, hidden] all_reduce per layer for 1/N of the experts' memory (an all-to-all dispatch of tokens to
their experts' ranks would move less data at large batch; at decode batch sizes the all_reduce is one message).
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from openflash.config import FlashConfig
from openflash.errors import CheckpointError, OpenflashError
from openflash.files.shards import ShardReader, TensorLocation, tensor_locations
from openflash.model.moe import Expert
from openflash.model.numerics import Numerics

EXPERT_PLACEMENTS = ("device", "host", "disk")
ROUTED = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_STORAGE = {"I8": "fp4", "U8": "fp4", "F8_E4M3": "fp8", "BF16": "float", "F16": "float", "F32": "float"}


@dataclass
class LayerCounters:
    hits: int = 0  # asked for and in the cache
    misses: int = 0  # asked for and not in the cache (read now, or waited for a prefetch read)
    bytes_read: int = 0  # from disk (or host to device), prefetch reads included
    prefetched: int = 0  # misses a prefetch read had already started
    prefetch_reads: int = 0  # experts read on a hint (used or not)


@dataclass
class ExpertStats:
    layers: dict[int, LayerCounters] = field(default_factory=dict)
    read_seconds: float = 0.0

    def layer(self, index: int) -> LayerCounters:
        return self.layers.setdefault(index, LayerCounters())

    def totals(self) -> dict[str, Any]:
        hits = sum(c.hits for c in self.layers.values())
        misses = sum(c.misses for c in self.layers.values())
        prefetched = sum(c.prefetched for c in self.layers.values())
        reads = sum(c.prefetch_reads for c in self.layers.values())
        return {"hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else None,
                "bytes_read": sum(c.bytes_read for c in self.layers.values()), "read_seconds": self.read_seconds,
                "prefetched": prefetched, "prefetch_reads": reads,
                "prefetch_useful": prefetched / reads if reads else None}


class ExpertGroup(Protocol):
    """The processes sharing the experts (train/distributed.py's DistContext is one)."""

    rank: int
    world_size: int

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor: ...


class ExpertStore:
    """An ExpertSource over a checkpoint folder (module doc)."""

    def __init__(self, folder: str | Path, cfg: FlashConfig, numerics: Numerics, placement: str = "disk",
                 cache_bytes: int = 0, device: str | torch.device = "cpu", io_threads: int = 4,
                 group: ExpertGroup | None = None, prefetch: bool = False, direct_io: bool = False) -> None:
        if placement not in ("host", "disk"):
            raise OpenflashError(f"expert placement {placement!r}: the store serves host or disk (device experts "
                                 f"are the model's own)")
        if cache_bytes < 0:
            raise OpenflashError(f"--expert-cache-bytes must be >= 0, got {cache_bytes}")
        self.folder, self.cfg, self.numerics = Path(folder), cfg, numerics
        self.placement, self.cache_bytes, self.device = placement, cache_bytes, torch.device(device)
        self.stats = ExpertStats()
        self.group = group if group is not None and group.world_size > 1 else None
        self._locations = self._index(tensor_locations(self.folder))
        self._reader = ShardReader(direct=direct_io)
        self._pool = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="openflash-experts")
        self._cache: OrderedDict[tuple[int, int], tuple[Expert, int]] = OrderedDict()  # -> (expert, bytes)
        self._cached_bytes = 0
        # disk: hinted experts being read in the background (host experts are in RAM already: hints are ignored)
        self.prefetching = prefetch and placement == "disk"
        self._pending: dict[tuple[int, int], Future] = {}
        self._host: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        if placement == "host":
            pin = self.device.type == "cuda"
            keys = list(self._locations)
            for key, tensors in zip(keys, self._pool.map(self._read, keys)):
                self._host[key] = {k: t.pin_memory() if pin else t for k, t in tensors.items()}

    # ---- layout ---------------------------------------------------------------------------------------------
    def _index(self, locations: dict[str, TensorLocation]) -> dict[tuple[int, int], dict[str, TensorLocation]]:
        cfg = self.cfg
        experts: dict[tuple[int, int], dict[str, TensorLocation]] = {}
        for name, loc in locations.items():
            m = ROUTED.match(name)
            if m:
                layer, e, w, kind = int(m[1]), int(m[2]), m[3], m[4]
                experts.setdefault((layer, e), {})[f"{w}.{kind}"] = loc
        want = {(layer, e) for layer in range(cfg.num_hidden_layers) for e in range(cfg.n_routed_experts)
                if self.owns(e)}
        experts = {key: parts for key, parts in experts.items() if key in want}
        missing = sorted(want - set(experts))
        if missing:
            layer, e = missing[0]
            raise CheckpointError(f"{self.folder}: {len(missing)} routed experts missing from the shards, e.g. "
                                  f"layers.{layer}.ffn.experts.{e}.*")
        for key, parts in experts.items():
            storage = _STORAGE.get(parts.get("w1.weight", next(iter(parts.values()))).dtype)
            need = {"w1.weight", "w2.weight", "w3.weight"} | ({"w1.scale", "w2.scale", "w3.scale"}
                                                             if storage in ("fp4", "fp8") else set())
            if storage is None or not need <= set(parts):
                raise CheckpointError(f"{self.folder}: layers.{key[0]}.ffn.experts.{key[1]} needs {sorted(need)}, "
                                      f"has {sorted(parts)}")
        return experts

    def owns(self, e: int) -> bool:
        """This process runs expert e (every expert without a group)."""
        return self.group is None or e % self.group.world_size == self.group.rank

    def expert_bytes(self, layer: int, e: int) -> int:
        return sum(loc.nbytes for loc in self._locations[(layer, e)].values())

    # ---- reading --------------------------------------------------------------------------------------------
    def _read(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        return {part: self._reader.read(loc) for part, loc in self._locations[key].items()}

    def _module(self, key: tuple[int, int], tensors: dict[str, torch.Tensor]) -> Expert:
        storage = _STORAGE[self._locations[key]["w1.weight"].dtype]
        state = {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}
        if storage == "float":
            state = {k: v for k, v in state.items() if k.endswith("weight")}
        return Expert.detached(self.cfg, storage, state, self.numerics)  # the cache holds stored bytes only

    # ---- the ExpertSource protocol ---------------------------------------------------------------------------
    def combine(self, routed: torch.Tensor) -> torch.Tensor:
        return routed if self.group is None else self.group.all_reduce_sum_(routed)

    def prefetch(self, layer: int, ids: list[int]) -> None:
        if not self.prefetching:
            return  # models ask only when prefetching; a direct caller's hint is ignored
        counters = self.stats.layer(layer)
        for e in ids:
            key = (layer, e)
            if self.owns(e) and key not in self._cache and key not in self._pending:
                self._pending[key] = self._pool.submit(self._read, key)
                counters.prefetch_reads += 1
                counters.bytes_read += self.expert_bytes(layer, e)

    def _settle(self, layer: int, wanted: list[int]) -> None:
        """Hinted experts of `layer` that this call does not want: into the cache once read, at its cold end (a
        wrong guess is evicted before anything that was used), so pending reads never pile up."""
        for key in [k for k in self._pending if k[0] == layer and k[1] not in wanted]:
            if self._pending[key].done():
                tensors = self._pending.pop(key).result()
                self._insert(key, self._module(key, tensors), self.expert_bytes(*key), cold=True)

    def experts(self, layer: int, ids: list[int]) -> Mapping[int, Expert]:
        counters = self.stats.layer(layer)
        if self._pending:
            self._settle(layer, ids)
        out: dict[int, Expert] = {}
        misses = []
        for e in (e for e in ids if self.owns(e)):
            cached = self._cache.get((layer, e))
            if cached is not None:
                self._cache.move_to_end((layer, e))
                out[e] = cached[0]
                counters.hits += 1
            else:
                misses.append(e)
        if misses:
            counters.misses += len(misses)
            start = time.perf_counter()
            hinted: dict[int, Future] = {}
            if self.placement == "host":
                fetched = [self._host[(layer, e)] for e in misses]
            else:
                hinted = {e: self._pending.pop((layer, e)) for e in misses if (layer, e) in self._pending}
                cold = [e for e in misses if e not in hinted]
                reads = dict(zip(cold, self._pool.map(self._read, [(layer, e) for e in cold])))
                counters.prefetched += len(hinted)
                fetched = [hinted[e].result() if e in hinted else reads[e] for e in misses]
            self.stats.read_seconds += time.perf_counter() - start
            for e, tensors in zip(misses, fetched):
                nbytes = self.expert_bytes(layer, e)
                if (self.placement == "disk" or self.device.type != "cpu") and e not in hinted:  # hints: counted
                    counters.bytes_read += nbytes
                out[e] = self._module((layer, e), tensors)
                self._insert((layer, e), out[e], nbytes)
        return out

    def _insert(self, key: tuple[int, int], expert: Expert, nbytes: int, cold: bool = False) -> None:
        if self.cache_bytes and nbytes > self.cache_bytes:
            return  # larger than the whole cache: used once, not kept
        self._cache[key] = (expert, nbytes)
        if cold:
            self._cache.move_to_end(key, last=False)
        self._cached_bytes += nbytes
        while self.cache_bytes and self._cached_bytes > self.cache_bytes:
            _, (_, old_bytes) = self._cache.popitem(last=False)
            self._cached_bytes -= old_bytes

    # ---- reporting and shutdown ------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        return {"placement": self.placement, "cache_bytes": self.cache_bytes, "cached_bytes": self._cached_bytes,
                "cached_experts": len(self._cache), **self.stats.totals(),
                "layers": {i: vars(c) for i, c in sorted(self.stats.layers.items())}}

    def close(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=True)
        self._reader.close()

    def __del__(self) -> None:  # descriptors are the only OS resource held
        try:
            self.close()
        except Exception:
            pass


__all__ = ["ExpertStore", "ExpertStats", "EXPERT_PLACEMENTS"]
