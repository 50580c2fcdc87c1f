"""`openflash plan MODEL --memory 24GiB [--accelerator-memory 80GiB]`: where each part goes so that it fits.

The parts, from the model built on the meta device (stored bytes, as in the checkpoint): dense weights (attention,
shared experts, router, norms, embedding, head, vision tower), routed experts, Engram tables, and the KV cache at a
context and batch. The rule, fastest tier first:

1. the compute tier (the accelerator if one is given, else host RAM) holds the dense weights, the KV cache and a work
   reserve; if they do not fit, nothing does, and the plan says so;
2. the routed experts go to the compute tier if they fit there, else to host RAM (with an accelerator) if they fit
   there, else to disk (read from the checkpoint's shards); the tier in front of a slower one gets what room is left
   as the expert cache;
3. the Engram tables go to host RAM if they fit in what is left, else to the disk tier.

Per decode token each tier is read for: the dense weights (all but the embedding, of which one row, the DSpark head
and the vision tower; they stay resident with the dense weights), the routed
experts the router picks (num_experts_per_tok per layer; the share a cache of c bytes serves is estimated as
c / all experts' bytes, i.e. uniform routing: real text hits more often, docs/benchmarks.md measures it), and the
Engram rows. tokens/s is the inverse of the time those bytes take at each tier's bandwidth: defaults below, or this
machine's with `--measure`.

`--out plan.json` writes the placement as `generate` / `serve --placement plan.json` take it (weights residency,
expert placement and cache, Engram placement).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from openflash.checkpoint import build_model
from openflash.config import FlashConfig, load_config
from openflash.errors import OpenflashError
from openflash.tools.plan import format_bytes, kv_bytes, stored_bytes

GiB = 1 << 30
WORK_RESERVE = 2 * GiB  # activations, runtime, allocator slack
ENGRAM_ROW_CACHE = 64 << 20  # the disk tier's row cache when the tables go to disk (serve's default)
# Bandwidths when not measured (bytes/s): a server's DRAM, PCIe 4 x16, an NVMe SSD, HBM3.
DEFAULT_BANDWIDTH = {"host": 50e9, "host_to_accelerator": 25e9, "disk": 3e9, "accelerator": 3e12}
@dataclass
class PlacementPlan:
    memory: int
    accelerator_memory: int | None
    context: int
    batch: int
    parts: dict[str, int]  # stored bytes: dense, experts, engram, kv
    where: dict[str, str]  # part -> accelerator | host | disk
    expert_cache_bytes: int
    engram_cache_bytes: int
    bytes_per_token: dict[str, float]  # tier -> bytes read per decode token
    bandwidth: dict[str, float]
    measured: bool
    tokens_per_second: float
    notes: list[str] = field(default_factory=list)

    def run_settings(self) -> dict[str, Any]:
        """What generate / serve take (--placement)."""
        compute = "accelerator" if self.accelerator_memory else "host"
        experts = "device" if self.where["experts"] == compute else self.where["experts"]
        return {"weights": "stored", "expert_placement": experts, "expert_cache_bytes": self.expert_cache_bytes,
                "engram_placement": "host" if self.where["engram"] == "host" else
                ("disk" if self.where["engram"] == "disk" else "device"),
                "engram_cache_bytes": self.engram_cache_bytes}


@dataclass(frozen=True)
class StoredModel:
    """A model's stored bytes by part and what one decode token reads, from the model built on the meta device once
    (seconds at the released size: build it once where several plans are made)."""
    cfg: FlashConfig
    parts: dict[str, int]  # dense, experts, engram
    dense_per_token: int
    expert_bytes: int  # one routed expert
    active_expert_bytes: int  # the routed experts one token reads, all layers
    engram_row_bytes: int  # the Engram rows one token reads, all layers

    @classmethod
    def of(cls, config: str | FlashConfig) -> "StoredModel":
        cfg = config if isinstance(config, FlashConfig) else load_config(config)
        model = build_model(cfg, device="meta")
        experts = sum(stored_bytes(block.ffn.experts) for block in model.layers)
        tables = sum(stored_bytes(t) for t in model.engram_tables().values())
        parts = {"dense": stored_bytes(model) - experts - tables, "experts": experts, "engram": tables}
        expert = experts // max(1, cfg.num_hidden_layers * cfg.n_routed_experts)
        # Read by every decode token: the dense weights but the embedding (one row), the DSpark head (speculation
        # only) and the vision tower (prompts with images only).
        idle = 2 * cfg.vocab_size * cfg.hidden_size + stored_bytes(model.mtp) + \
            (stored_bytes(model.vision) + stored_bytes(model.aligner) if model.vision is not None else 0)
        return cls(cfg, parts, parts["dense"] - idle, expert, cfg.num_hidden_layers * cfg.num_experts_per_tok * expert,
                   cfg.n_hash_columns * len(cfg.engram_layer_ids) * (cfg.engram_head_dim * 33 // 32))


def ram_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s of a large fp32 copy (its read and its write both counted), best of 3."""
    a = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def disk_read_bandwidth(path: str | Path, nbytes: int = 2 * GiB, chunk: int = 16 << 20) -> float:
    """Cold sequential read bandwidth of (the first nbytes of) a file, its cached pages dropped first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = min(nbytes, os.fstat(fd).st_size)
        t, done = time.perf_counter(), 0
        while done < size:
            got = len(os.pread(fd, chunk, done))
            if not got:
                break
            done += got
        return done / (time.perf_counter() - t)
    finally:
        os.close(fd)


def measure_bandwidth(scratch: str | Path | None = None, nbytes: int = 1 * GiB) -> dict[str, float]:
    """This machine's host RAM copy bandwidth and cold disk read bandwidth (a scratch file, written then read)."""
    with tempfile.NamedTemporaryFile(dir=scratch, prefix="openflash-bw-") as f:
        block = os.urandom(16 << 20)
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        disk = disk_read_bandwidth(f.name, nbytes)
    return {**DEFAULT_BANDWIDTH, "host": ram_bandwidth(), "disk": disk}


def plan_placement(model: str | StoredModel, memory: int, accelerator_memory: int | None = None, context: int = 65536,
                   batch: int = 1, bandwidth: dict[str, float] | None = None) -> PlacementPlan:
    """The placement of the module doc; OpenflashError when nothing fits."""
    if memory < 1 or (accelerator_memory is not None and accelerator_memory < 1) or context < 1 or batch < 1:
        raise OpenflashError("--memory, --accelerator-memory, --context and --batch must be positive")
    facts = model if isinstance(model, StoredModel) else StoredModel.of(model)
    parts = dict(facts.parts)
    kv_per_token, window = kv_bytes(facts.cfg)
    parts["kv"] = batch * (kv_per_token * context + window)
    bw = dict(bandwidth or DEFAULT_BANDWIDTH)
    compute = "accelerator" if accelerator_memory else "host"
    room = {"accelerator": accelerator_memory or 0, "host": memory}
    must = parts["dense"] + parts["kv"] + WORK_RESERVE
    if must > room[compute]:
        raise OpenflashError(
            f"nothing fits: the dense weights ({format_bytes(parts['dense'])}), the KV cache at {context:,} tokens x "
            f"{batch} ({format_bytes(parts['kv'])}) and a {format_bytes(WORK_RESERVE)} work reserve need "
            f"{format_bytes(must)}, but the {compute} has {format_bytes(room[compute])}; lower --context / --batch "
            f"or add memory")
    room[compute] -= must
    where = {"dense": compute, "kv": compute}
    notes = []
    # Engram tables that will not fit next to everything else get the disk tier's row cache, reserved first.
    engram_on_disk = parts["engram"] > room["host"]
    if engram_on_disk:
        room["host"] = max(0, room["host"] - ENGRAM_ROW_CACHE)
    if parts["experts"] <= room[compute]:
        where["experts"], cache = compute, 0
        room[compute] -= parts["experts"]
    elif compute == "accelerator" and parts["experts"] <= room["host"]:
        where["experts"], cache = "host", max(1, room["accelerator"])
        room["host"] -= parts["experts"]
        room["accelerator"] = 0
    else:
        where["experts"], cache = "disk", max(1, room[compute])  # 1 byte: keep nothing (0 would mean no limit)
        room[compute] = 0
        if cache < facts.expert_bytes * facts.cfg.num_experts_per_tok:
            notes.append("the expert cache holds less than one layer's picks: every token reads its experts")
    if parts["engram"] <= room["host"]:
        where["engram"], engram_cache = "host", 0
        room["host"] -= parts["engram"]
    else:
        where["engram"], engram_cache = "disk", ENGRAM_ROW_CACHE
        if not engram_on_disk:
            notes.append("the Engram tables went to disk after the experts took the room: their row cache comes on "
                         "top of --memory")
    # Bytes per decode token, by the tier they are read from.
    per_token: dict[str, float] = {"accelerator": 0.0, "host": 0.0, "disk": 0.0, "host_to_accelerator": 0.0}
    per_token[compute] += facts.dense_per_token
    served = min(1.0, cache / parts["experts"]) if parts["experts"] else 1.0
    active = facts.active_expert_bytes
    if where["experts"] == compute:
        per_token[compute] += active
    else:
        per_token[compute] += served * active
        slow = "host_to_accelerator" if where["experts"] == "host" else "disk"
        per_token[slow] += (1 - served) * active
    per_token["host" if where["engram"] == "host" else "disk"] += facts.engram_row_bytes
    seconds = sum(b / bw[t] for t, b in per_token.items() if b)
    return PlacementPlan(memory, accelerator_memory, context, batch, parts, where, int(cache), int(engram_cache),
                     {k: v for k, v in per_token.items() if v}, bw, bandwidth is not None and bw != DEFAULT_BANDWIDTH,
                     1.0 / seconds if seconds else float("inf"), notes)


def write_placement(placement: PlacementPlan, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps({"run": placement.run_settings(), "plan": asdict(placement)}, indent=1) + "\n")
    return path


__all__ = ["PlacementPlan", "StoredModel", "plan_placement", "measure_bandwidth", "write_placement"]
