"""Engram n-gram hashing: compressed token ids -> table row ids (engram.md §2-§4).

For every position and every Engram layer the hasher produces (max_ngram-1) * n_heads row ids, one per
(n-gram order, head). Each (layer, order, head) owns a disjoint row range of the layer's flat table whose length
is a prime; the row is `xor-hash(n-gram) mod prime + offset`.

Pipeline:  token ids --TokenMap--> compressed ids (DEAD for image tokens) --NgramHasher--> [B, S, L, C] row ids.
The only state carried between calls is, per sequence, the last max_ngram-1 compressed ids (`EngramHashState`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from openflash.errors import ConfigError, OpenflashError
from openflash.memory.tokenmap import TokenMap

if TYPE_CHECKING:
    from openflash.config import FlashConfig

INT64_MAX = 2**63 - 1
DEAD = -1  # history marker: no usable token (before the sequence start, or an image token)


# ---------------------------------------------------------------------------------------------------------------
# Layout: multipliers, primes, offsets (engram.md §2, §3)


def hash_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram: int) -> np.ndarray:
    """Odd int64 multipliers, one per look-back shift 0..max_ngram-1 (engram.md §2).

    The bound keeps `compressed_id * multiplier` below 2^63 for every compressed id, so the products never wrap.
    """
    bound = max(1, (INT64_MAX // compressed_vocab_size) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    return rng.integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin; these 12 bases are exact for n < 3.3e24."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def find_table_primes(engram_vocab_size: int, layer_ids: list[int], max_ngram: int, n_heads: int) -> list[list[int]]:
    """Per layer, (max_ngram-1)*n_heads distinct primes, order-major then head (engram.md §3).

    One used-set spans all layers, orders and heads; for each (layer, order) the search restarts just below
    engram_vocab_size and each head takes the next unused prime above the previous one.
    """
    used: set[int] = set()
    primes: list[list[int]] = []
    for _layer in layer_ids:
        layer_primes: list[int] = []
        for _order in range(2, max_ngram + 1):
            current = engram_vocab_size - 1
            for _head in range(n_heads):
                candidate = current + 1
                while candidate in used or not is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                layer_primes.append(candidate)
                current = candidate
        primes.append(layer_primes)
    return primes


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class EngramHashLayout:
    """Everything that fixes which table row a given n-gram lands on, for all Engram layers.

    Column c of a layer is (order n, head h) with c = (n-2)*n_heads + h; it owns rows
    [offsets[l, c], offsets[l, c] + primes[l, c]) of that layer's table of table_rows[l] rows.
    """

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    compressed_vocab_size: int
    multipliers: np.ndarray  # int64 [L, max_ngram]: one per look-back shift
    primes: np.ndarray  # int64 [L, C]
    offsets: np.ndarray  # int64 [L, C]: exclusive cumulative sum of primes, per layer
    table_rows: np.ndarray  # int64 [L]: sum of the layer's primes
    pad_id: int  # compressed id written into blocked n-gram slots

    @property
    def num_columns(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @classmethod
    def create(
        cls,
        layer_ids: list[int],
        engram_vocab_size: int,
        max_ngram: int,
        n_heads: int,
        compressed_vocab_size: int,
        pad_compressed_id: int,
        expected_num_embeddings: list[int] | None = None,
    ) -> "EngramHashLayout":
        if max_ngram < 2:
            raise ConfigError(f"engram_max_ngram_size must be >= 2 (bigrams and up), got {max_ngram}")
        if n_heads < 1:
            raise ConfigError(f"engram_n_heads must be >= 1, got {n_heads}")
        if engram_vocab_size < 1:
            raise ConfigError(f"engram_vocab_size must be >= 1, got {engram_vocab_size}")
        if compressed_vocab_size < 1:
            raise ConfigError(f"engram_compressed_vocab_size must be >= 1, got {compressed_vocab_size}")
        if not 0 <= pad_compressed_id < compressed_vocab_size:
            raise ConfigError(
                f"the compressed pad id {pad_compressed_id} is outside [0, engram_compressed_vocab_size="
                f"{compressed_vocab_size})"
            )

        multipliers = np.array([hash_multipliers(lid, compressed_vocab_size, max_ngram) for lid in layer_ids],
                               dtype=np.int64).reshape(len(layer_ids), max_ngram)
        # Every product id * multiplier must stay below 2^63, or the XOR hash would wrap (engram.md §2).
        largest = (compressed_vocab_size - 1) * int(multipliers.max(initial=1))
        if largest > INT64_MAX:
            raise ConfigError(
                f"engram_compressed_vocab_size {compressed_vocab_size} is too large: compressed id * hash multiplier "
                f"reaches {largest} > int64 max {INT64_MAX}"
            )

        primes = np.array(find_table_primes(engram_vocab_size, list(layer_ids), max_ngram, n_heads), dtype=np.int64)
        primes = primes.reshape(len(layer_ids), (max_ngram - 1) * n_heads)
        offsets = np.cumsum(primes, axis=1) - primes
        table_rows = primes.sum(axis=1)
        if expected_num_embeddings is not None:
            expected = [int(x) for x in expected_num_embeddings]
            found = [int(x) for x in table_rows]
            if expected != found:
                raise ConfigError(
                    f"engram_num_embeddings is {expected} in the config but the prime search over "
                    f"engram_vocab_size={engram_vocab_size}, engram_layer_ids={list(layer_ids)}, "
                    f"engram_max_ngram_size={max_ngram}, engram_n_heads={n_heads} gives table sizes {found}"
                )
        return cls(
            layer_ids=tuple(int(x) for x in layer_ids),
            max_ngram=int(max_ngram),
            n_heads=int(n_heads),
            compressed_vocab_size=int(compressed_vocab_size),
            multipliers=_frozen(multipliers),
            primes=_frozen(primes),
            offsets=_frozen(offsets),
            table_rows=_frozen(table_rows),
            pad_id=int(pad_compressed_id),
        )

    @classmethod
    def from_config(cls, config: "FlashConfig", token_map: TokenMap) -> "EngramHashLayout":
        """The layout of a model config, checked against the config's table sizes and compressed vocab size."""
        if token_map.compressed_vocab_size != config.engram_compressed_vocab_size:
            raise ConfigError(
                f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size} in the config but the "
                f"token map has {token_map.compressed_vocab_size} compressed ids"
            )
        return cls.create(
            layer_ids=list(config.engram_layer_ids),
            engram_vocab_size=config.engram_vocab_size,
            max_ngram=config.engram_max_ngram_size,
            n_heads=config.engram_n_heads,
            compressed_vocab_size=token_map.compressed_vocab_size,
            pad_compressed_id=token_map.pad_id,
            expected_num_embeddings=list(config.engram_num_embeddings),
        )

    def layout_fingerprint(self) -> str:
        """sha256 over the layer ids, sizes, primes, offsets and multipliers (little-endian int64).

        Table files record it so a table is never read with a layout that addresses it differently.
        """
        h = hashlib.sha256()
        h.update(b"openflash-engram-layout-v1\n")
        h.update(f"layers={list(self.layer_ids)} max_ngram={self.max_ngram} n_heads={self.n_heads}\n".encode())
        for name in ("primes", "offsets", "multipliers"):
            h.update(name.encode())
            h.update(getattr(self, name).astype("<i8").tobytes())
        return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Per-sequence history


@dataclass
class EngramHashState:
    """Per batch row, the most recent compressed ids, oldest first (DEAD = blocked).

    Anything older than what is stored counts as DEAD, so `empty()` (zero columns) is the state at a sequence
    start; after a hash call the history holds exactly max_ngram-1 columns. Blocking is cumulative (engram.md §4),
    so nothing older than max_ngram-1 tokens can ever matter.
    """

    history: torch.Tensor  # int64 [B, H]

    @classmethod
    def empty(cls, batch_size: int, history_len: int = 0, device: torch.device | str | None = None) -> "EngramHashState":
        return cls(torch.full((batch_size, history_len), DEAD, dtype=torch.int64, device=device))

    @property
    def batch_size(self) -> int:
        return self.history.shape[0]

    def padded(self, history_len: int) -> torch.Tensor:
        """The last history_len ids, left-filled with DEAD where the stored history is shorter."""
        h = self.history[:, max(0, self.history.shape[1] - history_len):]
        missing = history_len - h.shape[1]
        if missing > 0:
            fill = torch.full((h.shape[0], missing), DEAD, dtype=torch.int64, device=h.device)
            h = torch.cat([fill, h], dim=1)
        return h

    def rollback(self, drop: torch.Tensor) -> None:
        """Forget the last drop[b] ids of row b (what was before them counts again, DEAD where none was kept); a
        state made with history_len = max_ngram - 1 + spare keeps the room to undo `spare` tokens exactly."""
        width = self.history.shape[1]
        source = torch.arange(width, device=self.history.device) - drop.to(self.history.device).unsqueeze(1)
        shifted = self.history.gather(1, source.clamp(min=0))
        self.history = torch.where(source >= 0, shifted, torch.full_like(shifted, DEAD))

    def restart(self, rows: torch.Tensor) -> None:
        """Those rows hold no ids (a sequence start), in place."""
        self.history.index_fill_(0, rows.to(self.history.device), DEAD)

    def select(self, rows: torch.Tensor | list[int]) -> "EngramHashState":
        """The states of some batch rows, in the given order (for regrouping a batch)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.history.device)
        return EngramHashState(self.history.index_select(0, index))

    @staticmethod
    def concat(states: list["EngramHashState"]) -> "EngramHashState":
        """Stack the rows of several states; shorter histories are left-filled with DEAD."""
        if not states:
            raise ValueError("EngramHashState.concat needs at least one state")
        width = max(s.history.shape[1] for s in states)
        return EngramHashState(torch.cat([s.padded(width) for s in states], dim=0))

    def clone(self) -> "EngramHashState":
        return EngramHashState(self.history.clone())

    def extend(self, compressed_ids: torch.Tensor, history_len: int,
               lengths: torch.Tensor | None = None) -> "EngramHashState":
        """The state after appending compressed_ids [B, S] (only the first lengths[b] of row b, if given)."""
        full = torch.cat([self.padded(history_len), compressed_ids], dim=1)  # [B, H + S]
        if lengths is None:
            return EngramHashState(full[:, full.shape[1] - history_len:].clone())
        # Row b's last valid id sits at column H-1 + lengths[b]; keep the H columns ending there.
        cols = lengths.to(full.device).view(-1, 1) + torch.arange(history_len, device=full.device)
        return EngramHashState(full.gather(1, cols))


# ---------------------------------------------------------------------------------------------------------------
# Hashing (engram.md §4)


def compress(
    token_ids: torch.Tensor, token_map: TokenMap | torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Map token ids [B, S] to compressed ids; DEAD where token_mask is False (image-span positions)."""
    table = token_map.tensor(token_ids.device) if isinstance(token_map, TokenMap) else token_map.to(token_ids.device)
    if token_ids.numel() > 0:
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= table.shape[0]:
            bad = lo if lo < 0 else hi
            raise OpenflashError(
                f"token id {bad} is outside the Engram token map (ids 0..{table.shape[0] - 1}); "
                "the tokenizer or vocab_size does not match the model"
            )
    compressed = table[token_ids]
    if token_mask is not None:
        compressed = compressed.masked_fill(~token_mask.to(device=compressed.device, dtype=torch.bool), DEAD)
    return compressed


class NgramHasher:
    """Turns compressed ids into Engram table row ids, vectorised over batch and positions."""

    def __init__(self, layout: EngramHashLayout) -> None:
        self.layout = layout
        n_orders = layout.max_ngram - 1
        L = len(layout.layer_ids)
        self._multipliers = torch.from_numpy(layout.multipliers.copy())  # [L, N]
        self._primes = torch.from_numpy(layout.primes.copy()).view(L, n_orders, layout.n_heads)
        self._offsets = torch.from_numpy(layout.offsets.copy()).view(L, n_orders, layout.n_heads)

    @property
    def history_len(self) -> int:
        return self.layout.max_ngram - 1

    def empty_state(self, batch_size: int, device: torch.device | str | None = None) -> EngramHashState:
        return EngramHashState.empty(batch_size, self.history_len, device)

    def compress(
        self, token_ids: torch.Tensor, token_map: TokenMap | torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return compress(token_ids, token_map, token_mask)

    def hash(
        self, compressed_ids: torch.Tensor, state: EngramHashState, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, EngramHashState]:
        """Row ids [B, S, L, C] for compressed_ids [B, S] following `state`, and the state after them.

        lengths (optional, [B]): row b holds lengths[b] real tokens followed by padding; the padding's hash ids
        are meaningless and the new state ends at the last real token.
        """
        layout = self.layout
        if compressed_ids.dim() != 2:
            raise ValueError(f"compressed_ids must be [batch, seq], got shape {tuple(compressed_ids.shape)}")
        if state.batch_size != compressed_ids.shape[0]:
            raise ValueError(f"state has {state.batch_size} rows but compressed_ids has {compressed_ids.shape[0]}")
        ids = compressed_ids.to(torch.int64)
        if ids.numel() > 0 and (int(ids.min()) < DEAD or int(ids.max()) >= layout.compressed_vocab_size):
            raise OpenflashError(
                f"compressed ids must be in [0, {layout.compressed_vocab_size}) or DEAD={DEAD}, got range "
                f"[{int(ids.min())}, {int(ids.max())}]: the token map does not match engram_compressed_vocab_size"
            )
        device, (B, S), H = ids.device, ids.shape, self.history_len
        mult = self._multipliers.to(device)
        primes, offsets = self._primes.to(device), self._offsets.to(device)

        # History is written before it is read, so look-back inside the chunk works (engram.md §4 step 1).
        full = torch.cat([state.padded(H).to(device), ids], dim=1)  # [B, H + S]
        blocked = torch.zeros(B, S, dtype=torch.bool, device=device)
        xor = None
        ngram_hashes = []  # v_1 .. v_{N-1}: orders 2 .. N, each [B, S, L]
        for k in range(H + 1):
            src = full[:, H - k: H - k + S]  # compressed id k positions back
            # Cumulative: once a shift is blocked (sequence start / image token), all older shifts are too.
            blocked = blocked | (src == DEAD)
            tok = torch.where(blocked, torch.full_like(src, layout.pad_id), src)
            product = tok.unsqueeze(-1) * mult[:, k]  # [B, S, L]; cannot wrap (bounded multipliers)
            xor = product if xor is None else torch.bitwise_xor(xor, product)
            if k > 0:
                ngram_hashes.append(xor)
        v = torch.stack(ngram_hashes, dim=-1)  # [B, S, L, N-1], all non-negative
        rows = torch.remainder(v.unsqueeze(-1), primes) + offsets  # [B, S, L, N-1, heads]
        rows = rows.reshape(B, S, len(layout.layer_ids), layout.num_columns)
        # The state keeps at least H ids; a longer history (rollback room) keeps its width.
        new_state = EngramHashState(state.history.to(device)).extend(ids, max(H, state.history.shape[1]), lengths)
        return rows, new_state
