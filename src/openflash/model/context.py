"""What one forward call shares across its layers.

CSA2 layers publish results for later layers in the same call (architecture.md §5.4): a FULL layer publishes its
compressed KV and index keys, every index source publishes its top-k, the candidate source publishes its candidate
mask. The reference does this through a mutable slot that layers overwrite; here the slots live in a `StepContext`
that exists for one call only, and carried state lives in the `ModelCache`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Protocol

import torch
from torch import nn

from openflash.kernels.triton_attention import Part
from openflash.model.cache import CompressedStore, ModelCache
from openflash.model.numerics import Numerics
from openflash.model.stores import row_of


class ExpertSource(Protocol):
    """Routed experts that live outside the model (memory/experts.py: host RAM or the checkpoint's shards on disk,
    behind a cache); a model loaded without its routed experts reads them from here, through `StepContext`
    (declared here, where the context that carries it lives: moe.py reads both)."""

    def experts(self, layer: int, ids: list[int]) -> Mapping[int, nn.Module]:
        """The experts `ids` of backbone layer `layer` that this process runs (all of them, or under expert
        parallelism its share), ready to run on the model's device: `model.moe.Expert` modules."""

    def combine(self, routed: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum over every process that ran a share (itself, in a single process)."""

    prefetching: bool  # whether `prefetch` hints are used (False: the model computes none)

    def prefetch(self, layer: int, ids: list[int]) -> None:
        """A hint: layer `layer` will probably ask for experts `ids` soon (start reading them)."""


class Probe(Protocol):
    """Observes named intermediates of one forward call (parity.py implements it for the golden comparisons).
    Absent (None), the model spends nothing on it."""

    def record(self, name: str, value: torch.Tensor) -> None:
        """Keep `value` (the model's tensor at the point called `name`)."""

    def force(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The tensor the model continues with at `name`: `value`, or a recorded reference tensor (teacher
        forcing, so each block is compared on identical inputs and one rounding difference cannot snowball)."""


def real_tokens(positions: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """[B, S] bool, like positions: the first lengths[b] entries of each right-padded row (all where lengths is
    None)."""
    if lengths is None:
        return torch.ones_like(positions, dtype=torch.bool)
    return torch.arange(positions.shape[1], device=positions.device) < lengths.unsqueeze(1)


class CompressedView:
    """The compressed entries a layer may read: [0, length[b]) of row b, `size` entries wide. Given as tensors
    (a training sequence), or read from a cache's store when asked: the indexer reads the index keys, and attention
    only the entries its queries picked (a decode step never decodes the whole compressed KV)."""

    def __init__(self, length: torch.Tensor, size: int, *, kv: torch.Tensor | None = None,
                 index_k: torch.Tensor | None = None, store: CompressedStore | None = None) -> None:
        if store is None and (kv is None or index_k is None):
            raise ValueError("a CompressedView needs its kv and index keys, or the store to read them from")
        self.length, self.size, self.store = length, size, store  # length [B]
        self._kv, self._index_k = kv, index_k

    @property
    def kv(self) -> torch.Tensor:
        """[B, size, head_dim], every entry (read whole from the store on first use)."""
        if self._kv is None:
            self._kv, self._index_k = self.store.read(self.size)
        return self._kv

    @property
    def index_k(self) -> torch.Tensor:
        """[B, size, index_head_dim]."""
        if self._index_k is None:
            self._index_k = self.store.read_index(self.size)
        return self._index_k

    def stored_scores(self, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """The indexer's fp32 scores [B, S, size] by the store's own kernel, or None (no store, the keys already
        read, or no kernel there)."""
        if self.store is None or self._index_k is not None:
            return None
        return self.store.index_scores(q, w, self.size)

    def stored_attention(self, q: torch.Tensor, picks: torch.Tensor,
                         scale: float) -> Part | None:
        """The partial softmax over the picked entries by the store's own kernel (CompressedStore.picked_attention),
        or None (no store, the entries already read, or no kernel there)."""
        if self.store is None or self._kv is not None:
            return None
        return self.store.picked_attention(q, picks, scale)

    def picked(self, picks: torch.Tensor) -> torch.Tensor:
        """The kv of the entries picks [B, S, k] names ([B, S, k, head_dim]; a -1 pick reads some entry: masked by
        the caller)."""
        if self._kv is None:
            return self.store.gather(picks.clamp(min=0))
        return self._kv[row_of(picks), picks.clamp(min=0)]


@dataclass
class StepContext:
    positions: torch.Tensor  # [B, S] absolute positions of this call's tokens
    numerics: Numerics
    cache: ModelCache | None = None  # None: a full sequence from position 0 (training forward)
    compressed: dict[int, CompressedView] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # [B, S, k] entry ids, -1 = none
    candidates: torch.Tensor | None = None  # [B, S, T] bool
    dense_indexer: bool = False  # indexer warm-up: attend to every visible compressed entry
    indexer_losses: list[torch.Tensor] = field(default_factory=list)
    probe: Probe | None = None  # parity checks: observes intermediates, keyed like the goldens
    taps: dict[int, torch.Tensor | None] = field(default_factory=dict)  # DSpark target layers -> mean input stream
    experts: "ExpertSource | None" = None  # routed experts kept outside the model (memory/experts.py)
    # One graph for the whole call (runtime/decode_graph.py): every shape fixed by the cache's capacity (compressed
    # stores read whole, writes masked, experts gathered per routed pair), no host read of a tensor's values.
    static: bool = False
    # Right-padded rows (prompt chunks of different lengths packed into one call): row b's first lengths[b]
    # tokens are real, the rest padding that writes no cache state and is routed to no expert. None: all real.
    lengths: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        """[B, S] bool: the real tokens."""
        return real_tokens(self.positions, self.lengths)

    @property
    def last_positions(self) -> torch.Tensor:
        """[B] the position of each row's last real token."""
        if self.lengths is None:
            return self.positions[:, -1]
        return self.positions.gather(1, (self.lengths - 1).unsqueeze(1)).squeeze(1)

    def shared_state(self) -> tuple:
        """What blocks hand to later blocks through the context (CSA2 reuse: compressed views, top-k picks, the
        candidate pool), as it stands now: `restored` puts it back for a rerun of a block (activation
        checkpointing), which must take the paths the first run took."""
        return dict(self.compressed), dict(self.topk), self.candidates

    @contextmanager
    def restored(self, state: tuple) -> Iterator[None]:
        now = self.compressed, self.topk, self.candidates
        self.compressed, self.topk, self.candidates = dict(state[0]), dict(state[1]), state[2]
        try:
            yield
        finally:
            self.compressed, self.topk, self.candidates = now

    def put(self, name: str, value: torch.Tensor) -> None:
        if self.probe is not None:
            self.probe.record(name, value)

    def forced(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return value if self.probe is None else self.probe.force(name, value)
