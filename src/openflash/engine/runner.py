"""Turns a scheduled step into model calls.

Prefill: a step's prompt chunks are packed into model calls of up to `prefill_batch` rows: their one-row caches are
joined (`ModelCache.concat`), `model.step` runs every row at its own positions, and the result is split back
(`select`). Chunks of different lengths share a call right-padded (`lengths`: the padding leaves no trace in the
caches), longest first, as long as the padding stays within `prefill_padding` of the call's tokens (0.25 by
default, by measurement: benchmarks/packed_prefill.py, docs/benchmarks.md). Bounded-replay prefill passes
last_chunk=False on all but a prompt's last chunk, so a pack holds only last or only non-last chunks.

Decode: every running sequence together, one token each, on a batched cache whose rows may sit at different
positions. The batched cache is kept across steps and regrouped only when the set of running sequences changes: rows
of finished sequences are dropped at once (`remove`), sequences that finished their prefill are appended at the next
decode. Regrouping copies the bounded per-row state (window rings, compressor open group, hash history) and only
block tables of the global cache (engine/cache.py).

Padded batches (`decode_buckets`, where decode steps replay CUDA graphs): the batch holds idle rows up to the
smallest bucket size that fits its sequences, so a graph recorded for a size serves every batch up to it. An idle
row is a restarted row (`ModelCache.restart`) that decodes token 0 at position 0 again each step: its state stays
bounded (one window slot, one compressed entry), no other row reads it and its logits are dropped. A sequence that
finishes turns its row idle in place, the batch's tensors untouched (the recording still replays); a batch regroups
only when sequences join or its bucket changes.

Engram and experts: each call goes through the runtime (runtime/runtime.py), which hashes the chunk or decode
step's token ids before the model runs (starting the rows' fetch from any tier) and hands rows and expert store down.

Prompt log-probabilities (a request's `prompt_logprobs`): its chunks run in exact mode with every position's logits,
each position scoring the prompt token after it (sampling.token_logprobs at temperature 1), in packs of their own.

Images: a prompt's image spans are encoded (ViT + aligner) once, at its first chunk that reaches one, and each
chunk gets the rows of the span positions inside it; the spans are DEAD for the Engram hash. Decode steps are text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol
from typing import Sequence as Sequence_

import torch

from openflash.engine.cache import CacheFactory
from openflash.engine.config import PREFILL_MODES
from openflash.engine.request import Sequence
from openflash.engine.sampling import TokenLogprob, token_logprobs
from openflash.engine.speculative import Acceptance, DraftChooser, accept
from openflash.model.cache import ModelCache
from openflash.model.lora import BASE
from openflash.model.transformer import TargetHidden, Transformer
from openflash.model.vision import ImageRows
from openflash.vision.prompt import EncodedImages, image_mask

@dataclass(frozen=True)
class ChunkTask:
    """Prompt tokens [start, end) of a sequence, to prefill after the `start` tokens its cache holds."""

    seq: Sequence
    start: int
    end: int


@dataclass
class ChunkResult:
    """What a prefilled chunk gave: logits [V] after a prompt's last chunk (else None), the log-probs of the prompt
    tokens after each of its positions (with prompt_logprobs), or the error that failed the pack it ran in."""

    logits: torch.Tensor | None = None
    error: Exception | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


class ModelRuntime(Protocol):
    """What the engine needs of the model it runs (runtime.Runtime): steps that prepare their own Engram rows and
    experts, the model for its config, caches and drafting."""

    model: Transformer

    def step(self, input_ids: torch.Tensor, cache: ModelCache, *, mode: str = "exact", last_chunk: bool = True,
             images: ImageRows | None = None, lengths: torch.Tensor | None = None,
             adapters: Sequence_[int] | None = None) -> torch.Tensor | None:
        """Logits of a prefill chunk or decode step after `cache` (Transformer.step); adapters: each row's LoRA
        adapter slot."""

    def step_hidden(self, input_ids: torch.Tensor, cache: ModelCache, *, mode: str = "exact",
                    last_chunk: bool = True, images: ImageRows | None = None, lengths: torch.Tensor | None = None,
                    all_logits: bool = False,
                    adapters: Sequence_[int] | None = None) -> tuple[torch.Tensor | None, TargetHidden | None]:
        """`step`, plus the drafter's input (Transformer.step_hidden)."""

    def decode(self, tokens: torch.Tensor, cache: ModelCache, adapters: Sequence_[int] | None = None) -> torch.Tensor:
        """Logits [B, V] of one token per row."""

    def speculate(self, logits: torch.Tensor, cache: ModelCache, k: int) -> None:
        """Start fetching the Engram rows of each row's k likeliest next tokens."""

    def replay(self, prompt_ids: list[int], start: int, stop: int, cache: ModelCache, *, bounded: bool,
               image_mask: torch.Tensor | None = None, images: ImageRows | None = None, adapter: int = BASE) -> None:
        """Rebuild a restored prefix cache's bounded state from prompt_ids[start:stop]."""


class ModelRunner:
    def __init__(self, runtime: ModelRuntime, factory: CacheFactory, prefill_mode: str = "bounded",
                 speculate_k: int = 0, drafts: int = 0, prefill_batch: int = 16, prefill_padding: float = 0.25,
                 decode_buckets: tuple[int, ...] = ()) -> None:
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        if prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1, got {prefill_batch}")
        if not 0 <= prefill_padding < 1:
            raise ValueError(f"prefill_padding must be in [0, 1), got {prefill_padding}")
        if decode_buckets and drafts:
            raise ValueError("padded decode batches are for plain decode steps, not speculative rounds")
        self.prefill_batch = prefill_batch  # most prompt chunks packed into one model call
        self.prefill_padding = prefill_padding  # most of a packed call that may be padding
        self.runtime, self.model, self.factory, self.prefill_mode = runtime, runtime.model, factory, prefill_mode
        self.speculate_k = speculate_k
        self.drafts = drafts  # DSpark drafts verified per round (0: no speculative decoding)
        self.device = runtime.model.device
        self.decode_buckets = decode_buckets  # batch sizes a decode batch is padded up to (module doc)
        self.batch: ModelCache | None = None
        self.batch_ids: list[str | None] = []  # request id of each batch row (None: an idle row)
        self.regroups = 0
        self.idle_rows = 0  # idle rows decoded in padded batches (the padding's cost, in rows)
        self.prefill_calls = 0  # model calls that ran prompt chunks (packed or not)
        self._images: dict[str, EncodedImages] = {}  # prefilling requests with images: their encoded spans

    # ---- model calls ------------------------------------------------------------------------------------------
    def _encoded(self, seq: Sequence) -> EncodedImages | None:
        """The sequence's image spans, encoded on first use (kept until its prefill ends)."""
        if not seq.images:
            return None
        if seq.request_id not in self._images:
            self._images[seq.request_id] = EncodedImages(seq.images, self.model)
        return self._images[seq.request_id]

    def new_cache(self) -> ModelCache:
        return self.factory.empty(1)

    @torch.no_grad()
    def prefill_many(self, tasks: list[ChunkTask]) -> list[ChunkResult]:
        """Prefill chunks of distinct sequences, packing those that can share a model call; one result per task.
        A failing call fails the chunks packed into it (their caches are gone) and no others."""
        results: list[ChunkResult] = [ChunkResult()] * len(tasks)
        packs: dict[tuple, list[int]] = {}
        seen: set[str] = set()
        for i, t in enumerate(tasks):
            if t.seq.request_id in seen:  # chunks of one prompt run in order, one per call
                results[i] = ChunkResult(error=RuntimeError(f"request {t.seq.request_id}: two chunks in one "
                                                            f"prefill_many call"))
            elif t.seq.cache is None or t.seq.num_prefilled != t.start:
                results[i] = ChunkResult(error=RuntimeError(
                    f"request {t.seq.request_id}: prefill chunk [{t.start}, {t.end}) does not follow the "
                    f"{t.seq.num_prefilled} tokens in its cache"))
            else:
                packs.setdefault(self._pack_key(t), []).append(i)
            seen.add(t.seq.request_id)
        for members in packs.values():
            for part in self._split(members, tasks):
                try:
                    out = self._prefill_pack([tasks[i] for i in part])
                except Exception as exc:  # reported per request by the engine
                    out = [ChunkResult(error=exc)] * len(part)
                for i, r in zip(part, out):
                    results[i] = r
        return results

    def _pack_key(self, task: ChunkTask) -> tuple:
        """Chunks may share a model call when their caches are of one kind: in bounded mode all last chunks or
        none (the decoder half runs on last chunks), and pending replays in all or none; an Engram hash history
        in every cache or in none (the first chunk creates it); prompt log-probs asked alike (exact, every logit)."""
        cache = task.seq.cache
        bounded = self.prefill_mode == "bounded"
        return (bounded and task.end == task.seq.prompt_len, cache.replay is None, cache.engram is None,
                task.seq.params.prompt_logprobs)

    def _split(self, members: list[int], tasks: list[ChunkTask]) -> list[list[int]]:
        """Packs of up to `prefill_batch` chunks, longest first; a chunk joins the current pack while padding every
        row to the pack's longest keeps the padding within `prefill_padding` of the pack's tokens."""
        order = sorted(members, key=lambda i: tasks[i].start - tasks[i].end)  # longest first (stable)
        packs: list[list[int]] = []
        width = real = 0  # the current pack's longest chunk and its real tokens
        for i in order:
            n = tasks[i].end - tasks[i].start
            joins = packs and len(packs[-1]) < self.prefill_batch and \
                width * (len(packs[-1]) + 1) * (1 - self.prefill_padding) <= real + n
            if joins:
                packs[-1].append(i)
                real += n
            else:
                packs.append([i])
                width = real = n
        return packs

    def _prefill_pack(self, tasks: list[ChunkTask]) -> list[ChunkResult]:
        """One model call over the tasks' joined caches; each sequence gets its row back as its own cache."""
        seqs = [t.seq for t in tasks]
        last = tasks[0].end == seqs[0].prompt_len
        scored = seqs[0].params.prompt_logprobs  # (alike in a pack: _pack_key)
        mode = self.prefill_mode if scored is None else "exact"
        sizes = [t.end - t.start for t in tasks]
        width = max(sizes)
        # Right-padded to the longest chunk with id 0 (the padding writes no state and its outputs are dropped).
        ids = torch.tensor([s.prompt_ids[t.start:t.end] + [0] * (width - n) for s, t, n in zip(seqs, tasks, sizes)],
                           dtype=torch.long, device=self.device)
        lengths = None if min(sizes) == width else torch.tensor(sizes, dtype=torch.long, device=self.device)
        windows = []
        for s, t in zip(seqs, tasks):
            encoded = self._encoded(s)
            windows.append(None if encoded is None else encoded.window(t.start, t.end, self.device))
        images = ImageRows.stack(windows, ids.shape[1], self.device)
        adapters = [s.adapter for s in seqs]
        parts = [s.cache for s in seqs]
        batch = parts[0] if len(parts) == 1 else ModelCache.concat(parts)
        if len(parts) > 1:
            for part in parts:
                part.release()
        for s in seqs:
            s.cache = None  # the call owns the state until it is split back
        self.prefill_calls += 1
        try:
            every = scored is not None
            if self.drafts:
                logits, hidden = self.runtime.step_hidden(ids, batch, mode=mode, last_chunk=last, images=images,
                                                          lengths=lengths, all_logits=every, adapters=adapters)
            else:
                logits, hidden = self.runtime.step(ids, batch, mode=mode, last_chunk=last, images=images,
                                                   lengths=lengths, all_logits=every, adapters=adapters), None
            if hidden is not None:  # the drafter's rings take the positions the target layers ran on
                self.model.draft_seed(hidden, batch)
        except Exception:
            batch.release()  # the packed requests fail with the call
            raise
        for b, (s, t) in enumerate(zip(seqs, tasks)):
            s.cache = batch if len(seqs) == 1 else batch.select([b])
            if hidden is not None:
                s.draft_hidden = hidden.last()[b:b + 1]
            s.num_prefilled = t.end
            if t.end == s.prompt_len:
                self._images.pop(s.request_id, None)
        if len(seqs) > 1:
            batch.release()  # each row's cache holds its own references now
        if scored is None:
            return [ChunkResult(None if logits is None else logits[b]) for b in range(len(seqs))]
        return [self._scored(logits[b, :n], t, scored) for b, (t, n) in enumerate(zip(tasks, sizes))]

    @staticmethod
    def _scored(logits: torch.Tensor, task: ChunkTask, top: int) -> ChunkResult:
        """A chunk's result from its logits at every position [n, V]: the prompt tokens after its positions
        scored (the model's distribution, temperature 1), and the last position's logits after the last chunk."""
        targets = task.seq.prompt_ids[task.start + 1:task.end + 1]
        rows = logits[:len(targets)]
        scored = token_logprobs(rows, torch.tensor(targets, dtype=torch.long), torch.ones(len(targets)), top)
        return ChunkResult(logits[-1] if task.end == task.seq.prompt_len else None, prompt_logprobs=scored)

    def decode_step(self, seqs: list[Sequence], sample: Callable[[torch.Tensor, list[Sequence]], list[int]]
                    ) -> tuple[list[Sequence], list[list[int]], list[Acceptance]]:
        """One decode step of the running sequences, plain (`sample` picks each row's token from its logits) or a
        speculative round: the sequences in batch-row order, the tokens each commits, and the rounds (speculation
        only, else empty)."""
        if self.drafts:
            ordered, rounds = self.speculate(seqs)
            return ordered, [r.tokens for r in rounds], rounds
        ordered, logits = self.decode(seqs)
        return ordered, [[t] for t in sample(logits, ordered)], []

    @torch.no_grad()
    def decode(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor]:
        """One token for each sequence (its last sampled token as input). Returns the sequences in batch-row
        order and their logits [B, V]."""
        ordered = self._regroup(seqs, padded=bool(self.decode_buckets))
        by_id = {s.request_id: s for s in ordered}
        rows = [by_id.get(r) for r in self.batch_ids]  # (None: idle)
        idle = [i for i, s in enumerate(rows) if s is None]
        if idle:
            self.batch.rewind(idle)
            self.idle_rows += len(idle)
        tokens = torch.tensor([0 if s is None else s.last_token for s in rows], dtype=torch.long, device=self.device)
        logits = self.runtime.decode(tokens, self.batch, adapters=[BASE if s is None else s.adapter for s in rows])
        if self.speculate_k > 0:
            self.runtime.speculate(logits, self.batch, self.speculate_k)
        if idle:
            logits = logits[torch.tensor([i for i, s in enumerate(rows) if s is not None], device=logits.device)]
        return ordered, logits

    @torch.no_grad()
    def speculate(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[Acceptance]]:
        """One speculative round for every sequence (engine/speculative.py): returns the sequences in batch-row
        order and what each accepted. The batch cache ends after each row's committed tokens but the last."""
        ordered = self._regroup(seqs)
        batch, model = self.batch, self.model
        # Rows near max_tokens need fewer drafts; one K for the batch keeps the verify step rectangular.
        k = max(0, min([self.drafts] + [s.params.max_tokens - len(s.output_ids) - 1 for s in ordered]))
        anchor = torch.tensor([s.last_token for s in ordered], dtype=torch.long, device=self.device)
        start = batch.pos.clone()
        hidden = TargetHidden(torch.cat([s.draft_hidden for s in ordered]), (start - 1).unsqueeze(1))
        chooser = DraftChooser([s.sampler for s in ordered])
        if k:
            ids = model.draft(anchor, hidden, batch, chooser).tokens[:, :k + 1]
        else:  # no room for drafts: a plain step (the rings still take the last position)
            model.draft_seed(hidden, batch)
            ids = anchor.unsqueeze(1)
        logits, verified = self.runtime.step_hidden(ids, batch, all_logits=True, adapters=[s.adapter for s in ordered])
        results = []
        for b, seq in enumerate(ordered):
            drafts = ids[b, 1:].tolist()
            q = None if seq.params.greedy else [chooser.q[b, j] for j in range(k)]
            results.append(accept(logits[b], drafts, seq.sampler, q))
        kept = torch.tensor([r.accepted for r in results], dtype=torch.long, device=self.device)
        batch.rollback(start + kept + 1)  # anchor and kept drafts stay; the rejected ones are undone
        committed = torch.arange(k + 1, device=self.device).unsqueeze(0) <= kept.unsqueeze(1)
        model.draft_seed(verified, batch, valid=committed)
        last = verified.values[torch.arange(len(ordered), device=self.device), kept]
        for b, seq in enumerate(ordered):
            seq.draft_hidden = last[b].view(1, 1, -1)
        return ordered, results

    # ---- batch membership ---------------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        """The batch size n sequences decode at: the smallest bucket that holds them (n itself past the last)."""
        return next((b for b in self.decode_buckets if b >= n), n)

    def _regroup(self, seqs: list[Sequence], padded: bool = False) -> list[Sequence]:
        """Make the batch cache hold exactly these sequences (padded: and idle rows up to their bucket); returns
        them in batch-row order."""
        wanted = {s.request_id for s in seqs}
        by_id = {s.request_id: s for s in seqs}
        self.remove([r for r in self.batch_ids if r is not None and r not in wanted])
        present = set(self.batch_ids)
        joining = [s for s in seqs if s.request_id not in present]
        size = self._bucket(len(seqs)) if padded else len(seqs)
        if joining or self.batch is None or self.batch.batch_size != size:
            self._rebuild([i for i, r in enumerate(self.batch_ids) if r is not None], joining, size)
            self.regroups += 1
        return [by_id[r] for r in self.batch_ids if r is not None]

    def _rebuild(self, keep: list[int], joining: list[Sequence], size: int) -> None:
        """A new batch cache: the kept rows, then the joining sequences' caches, then idle rows up to `size`."""
        old = self.batch
        parts = [] if not keep else [old if keep == list(range(old.batch_size)) else old.select(keep)]
        parts += [s.cache for s in joining]
        ids = [self.batch_ids[i] for i in keep] + [s.request_id for s in joining]
        batch = None if not parts else parts[0] if len(parts) == 1 else ModelCache.concat(parts)
        if len(parts) > 1:
            for part in parts:
                part.release()
        if old is not None and (not parts or parts[0] is not old):
            old.release()
        if batch is not None and size > len(ids):  # idle rows: copies of row 0, restarted
            full = batch.select(list(range(len(ids))) + [0] * (size - len(ids)))
            full.restart(list(range(len(ids), size)))
            batch.release()
            batch = full
        self.batch = batch
        self.batch_ids = ids + [None] * (size - len(ids) if batch is not None else 0)
        for s in joining:
            s.cache = None  # the batch owns its state now

    def remove(self, request_ids: list[str]) -> None:
        """Drop rows from the decode batch now (their KV blocks go back to the pool). In a padded batch whose
        bucket still fits what is left, the rows turn idle in place."""
        leaving = set(request_ids)
        gone = [i for i, r in enumerate(self.batch_ids) if r is not None and r in leaving]
        if not gone:
            return
        keep = [i for i, r in enumerate(self.batch_ids) if r is not None and i not in gone]
        if self.decode_buckets and keep and self._bucket(len(keep)) == self.batch.batch_size:
            self.batch.restart(gone)
            for i in gone:
                self.batch_ids[i] = None
            return
        self._rebuild(keep, [], self._bucket(len(keep)) if self.decode_buckets else len(keep))

    def fork(self, leader: Sequence, twin: Sequence) -> None:
        """twin takes leader's state after their shared prompt (bounded state copied, paged blocks shared and
        copied on write), as if it had prefilled the prompt itself."""
        twin.cache = leader.cache.select([0])
        twin.draft_hidden = leader.draft_hidden
        twin.num_prefilled = twin.num_cached = leader.prompt_len

    def free_own(self, seq: Sequence) -> None:
        """Free the cache a sequence holds itself (while prefilling) and its encoded images; its batch rows go
        with `remove`."""
        self._images.pop(seq.request_id, None)
        if seq.cache is not None:
            seq.cache.release()
            seq.cache = None

    # ---- prefix-cache replay ----------------------------------------------------------------------------------
    @torch.no_grad()
    def replay_prefix(self, seq: Sequence, num_tokens: int) -> None:
        """Rebuild the bounded state after seq's first num_tokens prompt tokens in its cache, which holds only the
        global state (compressed KV, empty windows): run the last `sliding_window` prefix tokens over the cached
        global KV (with the rows of any image span among them).

        Every owner layer's compressed view is published up front, so no compressor runs and the cached entries are
        never rewritten (Transformer.replay). In bounded mode only the encoder half runs.
        """
        start = max(0, num_tokens - self.model.cfg.sliding_window)
        mask = image_mask(len(seq.prompt_ids), seq.images).to(self.device) if seq.images else None
        encoded = self._encoded(seq)
        images = None if encoded is None else encoded.window(start, num_tokens, self.device)
        self.runtime.replay(seq.prompt_ids, start, num_tokens, seq.cache, bounded=self.prefill_mode == "bounded",
                            image_mask=mask, images=images, adapter=seq.adapter)
