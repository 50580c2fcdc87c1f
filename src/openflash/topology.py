"""The derived CSA2 / CED topology of a config: each layer's attention mode, the layers whose compressed KV, index
keys and top-k it reads, its RoPE kind, Engram placement and encoder/decoder half (spec: architecture.md §5.4, §7).

Derived once per config (`FlashConfig.topology`); every other module reads it from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol


class TopologySource(Protocol):
    """The config keys the topology derives from (FlashConfig has them; this module needs nothing else)."""

    num_hidden_layers: int
    compress_ratios: list[int]
    kv_source_layer_ids: list[int]
    index_source_layer_ids: list[int]
    engram_layer_ids: list[int]
    candidate_source_layer_id: int
    rope_theta: float
    compress_rope_theta: float


class LayerMode(str, Enum):
    """CSA2 attention mode of a layer (spec: architecture.md §5.4)."""

    WINDOW = "WINDOW"  # sliding window only
    FULL = "FULL"  # own compressor + index keys + indexer: publishes compressed KV, index keys, top-k
    REINDEX = "REINDEX"  # own indexer over the KV owner's index keys: publishes a fresh top-k
    REUSE = "REUSE"  # reads the latest compressed KV and top-k, computes only its own q and window KV


@dataclass(frozen=True)
class LayerTopology:
    """Everything a layer needs to know about its place in the model, derived once from the config."""

    index: int
    mode: LayerMode
    compress_ratio: int
    rope_theta: float
    rope_yarn: bool  # YaRN applies with compress_rope_theta on ratio > 0 layers only (architecture.md §1 "Trap")
    kv_owner: int | None  # layer whose compressed KV this layer attends to (None: window only)
    index_k_owner: int | None  # layer whose index keys this layer's indexer scores (None: no own indexer)
    topk_owner: int | None  # layer whose top-k selection this layer uses
    is_candidate_source: bool  # publishes the candidate-block mask (architecture.md §5.9)
    uses_candidates: bool  # restricts its indexer scores to the candidate pool
    engram_before: bool  # Engram is applied to the residual streams just before this block
    engram_slot: int | None  # position of this layer in engram_layer_ids
    half: str  # "encoder" or "decoder" (CED)

    @property
    def has_compressor(self) -> bool:
        return self.mode == LayerMode.FULL

    @property
    def has_indexer(self) -> bool:
        return self.mode in (LayerMode.FULL, LayerMode.REINDEX)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["mode"] = self.mode.value
        return out


@dataclass(frozen=True)
class Topology:
    layers: tuple[LayerTopology, ...]
    decoder_start: int  # first layer of the decoder half (the last KV source); == n_layers if no KV source
    kv_sources: tuple[int, ...]
    engram_layers: tuple[int, ...]

    @property
    def encoder_layers(self) -> range:
        return range(0, self.decoder_start)

    @property
    def decoder_layers(self) -> range:
        return range(self.decoder_start, len(self.layers))

    @property
    def bounded_replay_ok(self) -> bool:
        """CED bounded replay (architecture.md §7.3) needs every Engram layer in the encoder half: the replayed
        decoder tail has no n-gram history for the prompt positions it skips. The reference also runs models whose
        Engram sits in the decoder half; their prefill runs exact."""
        return all(layer < self.decoder_start for layer in self.engram_layers)


def build_topology(cfg: TopologySource) -> Topology:
    """Owner rule of architecture.md §5.4: walk the layers, tracking the latest KV and index source."""
    n = cfg.num_hidden_layers
    kv, idx = set(cfg.kv_source_layer_ids), set(cfg.index_source_layer_ids)
    decoder_start = max(cfg.kv_source_layer_ids) if cfg.kv_source_layer_ids else n
    engram_slots = {layer: slot for slot, layer in enumerate(cfg.engram_layer_ids)}
    kv_owner: int | None = None
    topk_owner: int | None = None
    layers = []
    for i in range(n):
        ratio = cfg.compress_ratios[i]
        if ratio == 0:
            mode, owner, k_owner, t_owner = LayerMode.WINDOW, None, None, None
        else:
            if i in kv:
                kv_owner = i
            if i in idx:
                topk_owner = i
            if i == kv_owner:
                mode = LayerMode.FULL
            elif i == topk_owner:
                mode = LayerMode.REINDEX
            else:
                mode = LayerMode.REUSE
            owner, t_owner = kv_owner, topk_owner
            k_owner = kv_owner if mode in (LayerMode.FULL, LayerMode.REINDEX) else None
        cand = cfg.candidate_source_layer_id
        layers.append(LayerTopology(
            index=i,
            mode=mode,
            compress_ratio=ratio,
            rope_theta=float(cfg.compress_rope_theta if ratio > 0 else cfg.rope_theta),
            rope_yarn=ratio > 0,
            kv_owner=owner,
            index_k_owner=k_owner,
            topk_owner=t_owner,
            is_candidate_source=(i == cand),
            uses_candidates=(mode == LayerMode.REINDEX and cand >= 0 and owner == cand and i > cand),
            engram_before=i in engram_slots,
            engram_slot=engram_slots.get(i),
            half="encoder" if i < decoder_start else "decoder",
        ))
    return Topology(layers=tuple(layers), decoder_start=decoder_start,
                    kv_sources=tuple(cfg.kv_source_layer_ids), engram_layers=tuple(cfg.engram_layer_ids))


def topology_table(topology: Topology) -> str:
    """The per-layer table `openflash config show` prints."""
    header = f"{'layer':>5} {'mode':<8} {'ratio':>5} {'rope':<16} {'kv_owner':>8} {'idx_k':>6} {'topk':>5} " \
             f"{'cand':<6} {'engram':<6} {'half':<7}"
    lines = [header, "-" * len(header)]
    for t in topology.layers:
        rope = f"{t.rope_theta:g}" + ("+yarn" if t.rope_yarn else "")
        cand = "source" if t.is_candidate_source else ("masked" if t.uses_candidates else "")
        lines.append(f"{t.index:>5} {t.mode.value:<8} {t.compress_ratio:>5} {rope:<16} "
                     f"{_dash(t.kv_owner):>8} {_dash(t.index_k_owner):>6} {_dash(t.topk_owner):>5} "
                     f"{cand:<6} {'yes' if t.engram_before else '':<6} {t.half:<7}")
    return "\n".join(lines)


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)


__all__ = ["LayerMode", "LayerTopology", "Topology", "TopologySource", "build_topology", "topology_table"]
