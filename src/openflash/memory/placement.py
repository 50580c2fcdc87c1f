"""Engram table placement in a running model: which tier holds the rows, and fetching them before they are needed.

Hash ids depend on token ids only (engram.md §4, §5), so the rows an Engram layer will read are known as soon as
the tokens are: before the forward for a prefill chunk, right after sampling for a decode step, one batch ahead in
training. `EngramMemory` owns the hashing (the frontend and each cache's hash history): `prepare` hashes the
tokens once, starts gathering every Engram layer's rows in the background, and returns the step's `EngramRows`
(model/engram.py), which the caller hands down to the model; each Engram layer then waits only for what has not
arrived yet, and that wait is measured per layer.

    memory = EngramMemory.attach(model, "disk", frontend=frontend, table_dir="tables/", cache_bytes=1 << 30)
    rows = memory.prepare(prompt, cache)                 # what runtime/runtime.py does before each step
    logits = model.step(prompt, cache, engram=rows)
    memory.speculate(logits, cache, k=4)                 # optional: rows of the 4 likeliest next tokens

Callers use it through the runtime (runtime/runtime.py, `Runtime.place_engram` to choose the tier), which does the
above.

Tiers (`--engram-placement`):
    device   the tables stay in the model (DeviceTable): rows gathered from them when a layer asks (with autograd,
             so training uses the same path)
    host     FP8 rows in CPU RAM (pinned when CUDA is present), looked-up rows copied to the device
    disk     table files from `openflash engram export` (positioned reads), an LRU row cache, reader threads
    sharded  rows split across the ranks of a torch.distributed group (every rank must run the same steps)

All tiers return bit-identical rows (tables.py), so model outputs are identical to `device`. Attaching host, disk or
sharded releases the model's own copies of the tables (DeviceTable.release): their memory is freed and the model
can no longer be saved with its tables (state_dict raises); save the checkpoint before attaching.

Speculative prefetch: the first Engram layer sits one block after the embedding, so a decode step leaves it little
slack. `speculate(logits, cache, k)` gathers, as soon as step t's logits exist, the rows of step t's top-k tokens
(hashed and gathered on a worker, likeliest first); if the token then sampled is among them its rows are already
here, only uncovered batch rows are fetched, and the unused candidates' queued gathers are cancelled. It only pays
when the time between logits and the sampled token's prepare() (sampling, detokenising, scheduling) is a real part
of the fetch latency: it costs k times the reads (benchmarks/engram_offload.py).

Not thread-safe: prepare / speculate / the model's steps must come from one thread (the engine's loop).
The model is consulted through public methods only (`engram_tables`, its config and device).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Protocol

import torch
from tokenizers import Tokenizer

from openflash.errors import ConfigError, EngramTableError
from openflash.memory.checkpoint_tables import read_engram_spec
from openflash.memory.frontend import EngramFrontend
from openflash.memory.hashing import EngramHashState
from openflash.memory.prefetch import EngramPrefetcher, Prefetch
from openflash.memory.rows import EngramTable
from openflash.memory.tables import PLACEMENTS, open_tables
from openflash.model.engram import EngramRows
from openflash.model.engram_table import DeviceTable

if TYPE_CHECKING:
    import torch.distributed as dist


class HashedSequences(Protocol):
    """What this memory reads and advances of a model cache: its batch size and the Engram hash history."""

    @property
    def batch_size(self) -> int: ...

    engram: EngramHashState | None
    spare: int  # tokens a rollback may undo: the hash history keeps that many more ids


@dataclass
class SpeculationStats:
    speculations: int = 0  # speculate() calls
    candidates: int = 0  # candidate tokens whose rows were gathered (batch rows x k)
    rows_checked: int = 0  # decode batch rows that followed a speculation
    rows_covered: int = 0  # ... whose sampled token was among the candidates
    rows_served: int = 0  # ... whose rows came from the speculation (no fetch after sampling)
    unused: int = 0  # speculations discarded: a prefill followed, or the batch / hash state changed
    cancelled: int = 0  # candidate gathers dropped before they started (their token was not sampled)

    @property
    def coverage(self) -> float:
        return self.rows_covered / self.rows_checked if self.rows_checked else 0.0


@dataclass
class MemoryStats:
    """Per Engram layer (keyed by layer id): seconds the layer waited for its rows, seconds between the
    prefetch's submission and the layer asking (the slack the prefetch had), and lookups."""

    steps: int = 0  # prepare() / prefetch_batch() calls
    prefetches: int = 0  # background gathers submitted (speculations not included)
    sync_gathers: int = 0  # lookups made when the layer asked (device tier, or prefetch off)
    prepare_seconds: float = 0.0  # in prepare() / prefetch_batch(): hashing and submitting
    speculate_seconds: float = 0.0  # in speculate(): top-k, hashing the candidates, submitting
    wait_seconds: dict[int, float] = field(default_factory=dict)
    slack_seconds: dict[int, float] = field(default_factory=dict)
    lookups: dict[int, int] = field(default_factory=dict)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)

    def add_wait(self, layer_id: int, waited: float, slack: float | None) -> None:
        self.wait_seconds[layer_id] = self.wait_seconds.get(layer_id, 0.0) + waited
        self.lookups[layer_id] = self.lookups.get(layer_id, 0) + 1
        if slack is not None:
            self.slack_seconds[layer_id] = self.slack_seconds.get(layer_id, 0.0) + slack


@dataclass(eq=False)
class _Speculation:
    """Candidate next tokens of a decode batch, their rows gathered in the background, likeliest first."""

    cache_id: int  # id() of the cache it was made for: other sequences' steps (a prefill) leave it alone
    tokens: torch.Tensor  # [B, k] candidate token ids
    history: torch.Tensor  # [B, H] the hash state the candidates follow (what decides whether it is valid)
    prefetches: list[Prefetch] | None  # per candidate rank: rows (B, 1, C); None when not gathering


@dataclass(eq=False)
class _PrefetchedRows:
    """The EngramRows of one prepared step: rows arriving in the background, taken one Engram layer at a time."""

    memory: "EngramMemory"
    hash_ids: torch.Tensor  # [B, S, L, C]
    submitted: float  # perf_counter at submission
    prefetch: Prefetch | None  # all batch rows, or only those a speculation did not cover; None: gather on demand
    speculation: _Speculation | None = None
    covered: torch.Tensor | None = None  # bool [B]: row served from the speculation
    choice: torch.Tensor | None = None  # [B]: rank of the candidate it matched

    def get(self, slot: int) -> torch.Tensor:
        return self.memory._rows_of(self, slot)

    def arrived(self, slot: int) -> torch.Tensor:
        if self.speculation is None:
            return self.prefetch.rows(slot)
        rows = None
        for rank in torch.unique(self.choice[self.covered]).tolist():  # waits only for the ranks in use
            got = self.speculation.prefetches[rank].rows(slot)  # [B, 1, C, dim]
            if rows is None:
                rows = torch.empty_like(got)
            use = (self.covered & (self.choice == rank)).to(got.device)
            rows[use] = got[use]
        if self.prefetch is not None:
            rows[~self.covered.to(rows.device)] = self.prefetch.rows(slot)
        return rows


class EngramMemory:
    """The Engram tables of one model in one tier, the hashing of its tokens, and background prefetch. Build with
    `EngramMemory.attach`; `prepare` (or `prefetch_batch` in training) gives each call's EngramRows."""

    def __init__(self, model: torch.nn.Module, placement: str, tables: dict[int, EngramTable],
                 frontend: EngramFrontend | None, prefetch: bool = True) -> None:
        self.model, self.placement, self.tables, self.frontend = model, placement, tables, frontend
        self.layer_ids = list(model.cfg.engram_layer_ids)
        self.prefetch = prefetch
        # The device tier gathers from the model's own tables when a layer asks (no worker: training needs the
        # gather inside autograd, and on one device there is nothing to overlap).
        background = bool(tables) and placement != "device"
        self._prefetcher = EngramPrefetcher(tables) if background else None
        # Speculative gathers (k rows per batch row) get their own worker so a real prefetch never queues behind
        # one; a ShardedTable's collectives must keep one order on every rank, so it shares the main worker.
        collective = any(t.collective for t in tables.values())
        self._speculator = EngramPrefetcher(tables) if background and not collective else self._prefetcher
        self._speculation: _Speculation | None = None
        self._stats = MemoryStats()

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, model: torch.nn.Module, placement: str = "device", *, frontend: EngramFrontend | None = None,
               tokenizer: Tokenizer | None = None, table_dir: str | Path | None = None, cache_bytes: int = 0,
               io_threads: int = 4, group: "dist.ProcessGroup | None" = None, prefetch: bool = True,
               checkpoint_dir: str | Path | None = None) -> "EngramMemory":
        """The Engram memory of `model` in `placement`; its `prepare` hands rows down to the model's steps.

        frontend: the token map and hasher of the model (EngramFrontend.of); without one, built from `tokenizer`
        (default: the DeepSeek tokenizer restricted to the vocabulary). device: the model's own tables. host /
        sharded: built from the model's FP8 DeviceTables (quantize fp32 tables with DeviceTable.to_fp8 first), or
        read straight from `checkpoint_dir`'s safetensors (a sharded rank reads only its block), so the model
        never needs to hold them. disk: opens `table_dir/engram_layer{L}.oftable` (from `openflash engram
        export`); `cache_bytes` is the row cache of each table, `io_threads` its readers. Table files and
        checkpoints are checked against the model's hash layout. sharded: `group` is the torch.distributed
        process group (None: the default group). Outside `device`, the model's own table copies are released
        (DeviceTable.release). prefetch=False gathers each layer's rows when the layer asks (for measuring what
        prefetch buys).
        """
        if placement not in PLACEMENTS:
            raise ConfigError(f"unknown Engram placement {placement!r}; choose one of {list(PLACEMENTS)}")
        if table_dir is not None and placement != "disk":
            raise ConfigError(f"a table folder ({table_dir}) only applies to Engram placement 'disk', not "
                              f"{placement!r}")
        if cache_bytes and placement != "disk":
            raise ConfigError(f"an Engram row cache (cache_bytes={cache_bytes}) only applies to placement 'disk'")
        if checkpoint_dir is not None and placement not in ("host", "sharded"):
            raise ConfigError(f"reading Engram tables from a checkpoint ({checkpoint_dir}) applies to placements "
                              f"'host' and 'sharded', not {placement!r}")
        cfg = model.cfg
        layer_ids = list(cfg.engram_layer_ids)
        if not layer_ids:
            return cls(model, placement, {}, None, prefetch)
        frontend = frontend if frontend is not None else EngramFrontend.for_config(cfg, tokenizer)
        embeds: dict[int, DeviceTable] = model.engram_tables()
        for j, lid in enumerate(layer_ids):
            if embeds[j].released is not None:
                raise EngramTableError(f"Engram layer {lid}: its table was already released to the "
                                       f"{embeds[j].released!r} tier (close that memory's model, or load the model "
                                       f"again)")
        if placement == "device":
            return cls(model, placement, dict(embeds), frontend, prefetch)
        for j, lid in enumerate(layer_ids):
            if placement in ("host", "sharded") and checkpoint_dir is None and embeds[j].storage != "fp8":
                raise EngramTableError(f"Engram layer {lid}: placement {placement!r} holds FP8 rows but the model's "
                                       f"table is {embeds[j].storage}; quantize it first (DeviceTable.to_fp8)")
        common = dict(layer_ids=layer_ids, num_rows=list(cfg.engram_num_embeddings), dim=cfg.engram_head_dim,
                      device=model.device)
        fingerprint = frontend.layout.layout_fingerprint()
        if placement == "disk":
            if table_dir is None:
                raise ConfigError("Engram placement 'disk' needs the folder of table files written by "
                                  "`openflash engram export`")
            tables = open_tables("disk", table_dir=table_dir, layout_fingerprint=fingerprint,
                                 cache_bytes=cache_bytes, io_threads=io_threads, **common)
        elif checkpoint_dir is not None:
            theirs = read_engram_spec(checkpoint_dir)
            if theirs.num_rows != common["num_rows"] or theirs.dim != common["dim"] or \
                    theirs.layout_fingerprint() != fingerprint:
                raise EngramTableError(f"{checkpoint_dir}: its Engram tables (layers {theirs.layer_ids}, rows "
                                       f"{theirs.num_rows}, dim {theirs.dim}) are not addressed like this model's "
                                       f"(layers {layer_ids}, rows {common['num_rows']}, dim {common['dim']}, "
                                       f"hash layout {fingerprint[:12]}...)")
            tables = open_tables(placement, checkpoint_dir=checkpoint_dir, group=group, **common)
        else:
            tables = open_tables(placement, device_tables=embeds, group=group, **common)
        for embed in embeds.values():
            embed.release(placement)
        return cls(model, placement, tables, frontend, prefetch)

    # ---- before a step -------------------------------------------------------------------------------------
    def _new_history(self, batch_size: int, cache: HashedSequences, device: torch.device) -> EngramHashState:
        """The hash history a sequence starts with: max_ngram - 1 ids, plus the cache's rollback room."""
        return EngramHashState.empty(batch_size, self.frontend.hasher.history_len + cache.spare, device)

    def _hash(self, input_ids: torch.Tensor, state: EngramHashState, image_mask: torch.Tensor | None,
              lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, EngramHashState]:
        return self.frontend.hash(input_ids, state, None if image_mask is None else ~image_mask, lengths)

    def prepare(self, input_ids: torch.Tensor, cache: HashedSequences, image_mask: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> EngramRows | None:
        """The EngramRows of a prefill chunk or decode step [B, S] following `cache`: hashes the tokens (advancing
        `cache.engram`, created here at a sequence's first call) and starts gathering the rows. Pass the result
        to `model.step(..., engram=...)`. None for a model without Engram layers. lengths: right-padded rows
        (Transformer.step), whose history advances by lengths[b] tokens."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(1)
        speculation = self._speculation
        if speculation is not None and speculation.cache_id == id(cache):
            self._speculation = None  # this step uses it or discards it
        else:
            speculation = None  # made for another cache (e.g. the decode batch while a new prompt prefills)
        if not self.layer_ids:
            return None
        start = time.perf_counter()
        if cache.batch_size != input_ids.shape[0]:
            raise ValueError(f"cache holds {cache.batch_size} sequences but input_ids has {input_ids.shape[0]} rows")
        before = cache.engram if cache.engram is not None else self._new_history(input_ids.shape[0], cache,
                                                                                  input_ids.device)
        hash_ids, cache.engram = self._hash(input_ids, before, image_mask, lengths)
        self._stats.steps += 1
        if speculation is not None:
            rows = self._use_speculation(speculation, input_ids, before, hash_ids, image_mask)
        else:
            rows = self._submit(hash_ids)
        self._stats.prepare_seconds += time.perf_counter() - start
        return rows

    def prefetch_batch(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None) -> EngramRows | None:
        """Training: the EngramRows of full sequences [B, S] from position 0 (on the device tier, gathered inside
        autograd when the layer asks). Call it for batch n+1 before running batch n; pass the result to
        `model(input_ids, targets, engram=...)`."""
        if not self.layer_ids:
            return None
        start = time.perf_counter()
        state = self.frontend.hasher.empty_state(input_ids.shape[0], input_ids.device)
        hash_ids, _ = self._hash(input_ids, state, image_mask)
        self._stats.steps += 1
        rows = self._submit(hash_ids)
        self._stats.prepare_seconds += time.perf_counter() - start
        return rows

    def prepare_replay(self, prompt_ids: list[int], start: int, stop: int, cache: HashedSequences,
                       image_mask: torch.Tensor | None = None) -> EngramRows | None:
        """The rows of prompt_ids[start:stop] for Transformer.replay, with the hash history rebuilt from the
        tokens before `start` (a restored prefix cache holds no history); leaves `cache.engram` after `stop`.
        image_mask: [len(prompt_ids)] bool, True on image-span positions (DEAD for the hash)."""
        if not self.layer_ids:
            return None
        device = self.model.device
        state = self._new_history(1, cache, device)
        history = self.frontend.hasher.history_len
        first = max(0, start - history)
        before = torch.tensor([prompt_ids[first:start]], dtype=torch.long, device=device)
        if before.shape[1]:
            _, state = self._hash(before, state, None if image_mask is None else image_mask[None, first:start])
        cache.engram = state
        return self.prepare(torch.tensor([prompt_ids[start:stop]], dtype=torch.long, device=device), cache,
                            None if image_mask is None else image_mask[None, start:stop])

    def speculate(self, logits: torch.Tensor, cache: HashedSequences, k: int) -> None:
        """Start gathering the rows of the k likeliest next tokens of each row of `logits` [B, V] (step t's
        output), without advancing the cache's hash state. The next `prepare` uses them for every row whose
        sampled token is among the candidates, and measures that coverage."""
        if k < 1:
            raise ValueError(f"speculation needs k >= 1 candidates, got {k}")
        if not self.layer_ids:
            return
        B = logits.shape[0]
        if cache.batch_size != B:
            raise ValueError(f"cache holds {cache.batch_size} sequences but logits has {B} rows")
        start = time.perf_counter()
        history = cache.engram.history.clone()
        tokens = logits.topk(min(k, logits.shape[-1]), dim=-1).indices.to(history.device)  # [B, k]
        k = tokens.shape[1]
        gather = self._speculator is not None and self.prefetch
        spec = self._stats.speculation
        if self._speculation is not None:  # superseded before any step used it
            self._cancel(self._speculation, keep=())
        prefetches = None
        if gather:
            frontend = self.frontend

            def candidate_hash_ids() -> torch.Tensor:  # runs on the speculation worker: [B, k, L, C]
                ids, _ = frontend.hash(tokens.reshape(B * k, 1), EngramHashState(history.repeat_interleave(k, 0)))
                return ids.view(B, k, *ids.shape[2:])

            prefetches = self._speculator.submit_candidates(candidate_hash_ids, k)
        self._speculation = _Speculation(id(cache), tokens, history, prefetches)
        spec.speculations += 1
        spec.candidates += B * k if gather else 0
        self._stats.speculate_seconds += time.perf_counter() - start

    def _use_speculation(self, spec: _Speculation, input_ids: torch.Tensor, before: EngramHashState,
                         hash_ids: torch.Tensor, image_mask: torch.Tensor | None) -> EngramRows:
        stats = self._stats.speculation
        B, S = input_ids.shape
        # Candidates are text tokens following this exact history; anything else hashes differently.
        if S != 1 or spec.tokens.shape[0] != B or not torch.equal(spec.history, before.history) or \
                (image_mask is not None and bool(image_mask.any())):
            stats.unused += 1
            self._cancel(spec, keep=())
            return self._submit(hash_ids)
        match = spec.tokens == input_ids.to(spec.tokens.device)  # [B, k]
        covered, choice = match.any(dim=1), match.int().argmax(dim=1)
        stats.rows_checked += B
        stats.rows_covered += int(covered.sum())
        self._cancel(spec, keep=set(choice[covered].tolist()))
        if spec.prefetches is None or not bool(covered.any()):
            return self._submit(hash_ids)
        stats.rows_served += int(covered.sum())
        rest = None
        if not bool(covered.all()):
            rest = self._prefetcher.submit(hash_ids[~covered.to(hash_ids.device)])
            self._stats.prefetches += 1
        return _PrefetchedRows(self, hash_ids, time.perf_counter(), rest, spec, covered, choice)

    def _cancel(self, spec: _Speculation, keep: Collection[int]) -> None:
        """Drop the queued gathers of candidates no step will use, so slow storage never builds a backlog of
        stale speculation. Not on a sharded tier: what is cancelled depends on timing, and its ranks must issue
        the same collectives."""
        if spec.prefetches is None or self._speculator is self._prefetcher:
            return
        for rank, prefetch in enumerate(spec.prefetches):
            if rank not in keep:
                self._stats.speculation.cancelled += prefetch.cancel()

    def _submit(self, hash_ids: torch.Tensor) -> _PrefetchedRows:
        """Rows of `hash_ids`, gathered in the background when this tier prefetches, else when a layer asks."""
        submitted = time.perf_counter()
        prefetch = None
        if self._prefetcher is not None and self.prefetch:
            prefetch = self._prefetcher.submit(hash_ids)
            self._stats.prefetches += 1
        return _PrefetchedRows(self, hash_ids, submitted, prefetch)

    # ---- during a step (EngramRows.get) --------------------------------------------------------------------
    def _rows_of(self, entry: _PrefetchedRows, slot: int) -> torch.Tensor:
        """Rows [B, S, C, dim] of Engram layer slot `slot` for a prepared step: arrived in the background, or
        gathered now (device tier, prefetch off); the wait is counted per layer."""
        start = time.perf_counter()
        if entry.prefetch is None and entry.speculation is None:
            self._stats.sync_gathers += 1
            rows = self._gather_now(slot, entry.hash_ids[:, :, slot])
            slack = None
        else:
            rows = entry.arrived(slot)
            slack = start - entry.submitted
        self._stats.add_wait(self.layer_ids[slot], time.perf_counter() - start, slack)
        return rows

    def _gather_now(self, slot: int, ids: torch.Tensor) -> torch.Tensor:
        if self.tables[slot].collective:
            return self._prefetcher.gather(slot, ids)  # collectives stay in the worker's order
        # The device tier reads the table the model holds now (one replaced since, e.g. by to_fp8, included).
        table = self.model.engram_tables()[slot] if self.placement == "device" else self.tables[slot]
        try:
            return table.gather(ids)
        except EngramTableError:
            raise
        except Exception as exc:
            raise EngramTableError(f"Engram lookup of layer {self.layer_ids[slot]} failed: "
                                   f"{type(exc).__name__}: {exc}") from exc

    # ---- reporting and shutdown ----------------------------------------------------------------------------
    def problem(self) -> str | None:
        """Why a table of this memory cannot serve rows now (naming its file), or None while every one can."""
        found = [f"Engram layer {self.layer_ids[j]}: {p}" for j, t in self.tables.items()
                 if (p := t.problem()) is not None]
        return "; ".join(found) or None

    def stats(self) -> dict[str, Any]:
        """Waits and slack per Engram layer (seconds, keyed by layer id), speculative coverage, and
        each table's lookup counters (row-cache hit rates for disk)."""
        s = self._stats
        tables = {self.layer_ids[j]: c for j, t in self.tables.items() if (c := t.counters()) is not None}
        hits = sum(t["hits"] for t in tables.values())
        looked_up = hits + sum(t["misses"] for t in tables.values())
        fetch = self._prefetcher.stats.fetch_seconds if self._prefetcher is not None else {}
        return {
            "placement": self.placement,
            "prefetch": self.prefetch,
            "steps": s.steps,
            "prefetches": s.prefetches,
            "sync_gathers": s.sync_gathers,
            "prepare_seconds": s.prepare_seconds,
            "speculate_seconds": s.speculate_seconds,
            "wait_seconds": dict(s.wait_seconds),
            "slack_seconds": dict(s.slack_seconds),
            "lookups": dict(s.lookups),
            "fetch_seconds": {self.layer_ids[j]: v for j, v in sorted(fetch.items())},
            "speculation": {**s.speculation.__dict__, "coverage": s.speculation.coverage},
            "tables": tables,
            "hit_rate": hits / looked_up if looked_up else None,
        }

    def reset_stats(self) -> None:
        """Zero every counter (this memory's, the prefetcher's and the tables')."""
        self._stats = MemoryStats()
        for prefetcher in (self._prefetcher, self._speculator):
            if prefetcher is not None:
                prefetcher.stats = type(prefetcher.stats)()
        for table in self.tables.values():
            table.reset_counters()

    def close(self) -> None:
        """Stop the background work and close table files. The model keeps its released tables, so it cannot
        run Engram lookups afterwards (it raises EngramTableError naming the tier)."""
        for prefetcher in {id(p): p for p in (self._prefetcher, self._speculator) if p is not None}.values():
            prefetcher.close()
        for table in self.tables.values():
            table.close()
        self._speculation = None

    def __enter__(self) -> "EngramMemory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["EngramMemory", "MemoryStats", "SpeculationStats", "HashedSequences"]
