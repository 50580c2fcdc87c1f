"""A model ready to run: the one object callers step (spec: architecture.md §2; engram.md §4 for why rows are
prepared ahead).

The model computes and fetches nothing itself: each call needs the Engram rows of its tokens (hashed by the memory
from the same token ids, fetched from whichever tier holds the tables) and, for a model loaded without its routed
experts, the store they come from. `Runtime` holds the model with its tokenizer, Engram memory, expert source and
compiled decode graphs, and hands those down on every call:

    rt = open_model("tiny")                          # or a checkpoint folder; Runtime.of(model) for a built one
    cache = rt.new_cache()
    logits = rt.step(prompt_ids, cache)              # a prefill chunk [B, S]
    logits = rt.decode(logits.argmax(-1), cache)     # one token per row [B]
    out = rt.forward(ids, targets)                   # training: logits, loss
    rt.stats()                                       # Engram waits, expert cache, decode graphs

The compiled backend runs a decode step as one graph where it can (runtime/decode_graph.py); `Runtime.step` picks
that path or the model's own step, so results are the same either way to fp32 rounding.
"""

from __future__ import annotations

import tempfile
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tokenizers import Tokenizer

from openflash.errors import CheckpointError, OpenflashError, RequestError
from openflash.memory.experts import ExpertStore
from openflash.memory.frontend import EngramFrontend
from openflash.memory.placement import EngramMemory
from openflash.model.cache import ModelCache
from openflash.model.context import Probe
from openflash.model.engram import EngramRows
from openflash.model.lora import BASE, AdapterSelection
from openflash.model.numerics import Numerics
from openflash.model.transformer import ForwardOutput, TargetHidden, Transformer, check_lengths
from openflash.model.vision import ImageRows
from openflash.runtime.adapters import served_adapters
from openflash.runtime.decode_graph import DecodeGraph
from openflash.runtime.engram_tiers import placed_memory
from openflash.threads import StepThreads
from openflash.tokenizer import preset_tokenizer
from openflash.vision.preprocess import ImageSource
from openflash.vision.prompt import PromptImage, text_prompt

DISK_ROW_CACHE_BYTES = 64 << 20  # per table, for the disk tier when no size is given


@dataclass
class Runtime:
    """The model, its tokenizer, its Engram memory (the `device` tier until `place_engram` moves it) and its routed
    experts' store (None: the model's own). Build with `open_model` (runtime/open.py) or `Runtime.of`."""

    model: Transformer
    tokenizer: Tokenizer
    memory: EngramMemory
    experts: ExpertStore | None = None
    note: str = ""  # what was loaded, for logs
    tokenizer_source: str = ""  # which tokenizer was loaded (a path, or why DeepSeek's), for error messages
    folder: Path | None = None  # the checkpoint folder it came from (None: a preset or a built model)
    # one per numerics policy and weight residency (a graph reads the weights as the residency keeps them)
    graphs: dict[tuple[Numerics, str], DecodeGraph] = field(default_factory=dict, repr=False)
    adapters: AdapterSelection | None = None  # served LoRA adapters (load_adapters); a step's rows pick theirs
    adapter_keys: list[int] = field(default_factory=list)  # per adapter: a digest of its product (prefix-cache keys)
    _scratch: tempfile.TemporaryDirectory | None = field(default=None, repr=False)  # exported tables, disk tier
    decode_threads: StepThreads = field(default_factory=StepThreads, repr=False)  # the CPU decode steps' threads

    @classmethod
    def of(cls, model: Transformer, tokenizer: Tokenizer | None = None, *, frontend: EngramFrontend | None = None,
           experts: ExpertStore | None = None, note: str = "", tokenizer_source: str = "",
           folder: Path | None = None) -> "Runtime":
        """The runtime of a built model. frontend: its Engram token map and hasher (default: from `tokenizer`,
        else the DeepSeek tokenizer restricted to the vocabulary); tokenizer default: the preset cut of
        DeepSeek's."""
        cfg = model.cfg
        frontend = frontend if frontend is not None else EngramFrontend.of(cfg, tokenizer)
        memory = EngramMemory.attach(model, "device", frontend=frontend)
        return cls(model, tokenizer if tokenizer is not None else preset_tokenizer(cfg), memory, experts, note,
                   tokenizer_source, folder)

    def with_model(self, model: Transformer) -> "Runtime":
        """A runtime of another model that reads tokens alike (a copy, the model with a drafter added): this one's
        tokenizer and Engram addressing, the new model's own tables and experts."""
        return Runtime.of(model, self.tokenizer, frontend=self.frontend, note=self.note,
                          tokenizer_source=self.tokenizer_source, folder=self.folder)

    @property
    def frontend(self) -> EngramFrontend | None:
        """The Engram token map and hasher (None for a model without Engram layers)."""
        return self.memory.frontend

    @property
    def cfg(self) -> Any:
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def records_decode_graphs(self) -> bool:
        """Decode steps are recorded as CUDA graphs and replayed (a compiled model on CUDA: decode_graph.py), so a
        batch of a size recorded before replays where a new size is recorded first. Not with served adapters or an
        expert store: those steps run on the per-kernel path (DecodeGraph.why_not)."""
        return self.device.type == "cuda" and self.model.numerics.compiled and self.adapters is None \
            and self.experts is None

    def new_cache(self, batch_size: int = 1, capacity: int = 0, spare: int = 0) -> ModelCache:
        return self.model.new_cache(batch_size, capacity, spare)

    # ---- inference ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, cache: ModelCache, *, mode: str = "exact", last_chunk: bool = True,
             images: ImageRows | None = None, lengths: torch.Tensor | None = None, probe: Probe | None = None,
             all_logits: bool = False, adapters: Sequence[int] | None = None) -> torch.Tensor | None:
        """A prefill chunk or decode step [B, S] after what `cache` holds (Transformer.step has the arguments):
        its Engram rows prepared, its experts supplied, a decode step run as one graph where the compiled backend
        can. adapters: each row's LoRA adapter slot (`adapter_slot`; None: the base model for every row)."""
        ids, images = self._on_device(input_ids, images)
        rows = self._rows(ids, cache, images, lengths, probe)
        graph = self._graph() if ids.shape[1] == 1 and not all_logits and lengths is None else None
        if graph is not None and graph.why_not(cache, images, probe, False, self.experts) is None:
            return graph(ids, cache, rows)
        with self._selected(adapters):
            return self.model.step(ids, cache, mode=mode, last_chunk=last_chunk, engram=rows, images=images,
                                   probe=probe, all_logits=all_logits, experts=self.experts, lengths=lengths)

    @torch.no_grad()
    def step_hidden(self, input_ids: torch.Tensor, cache: ModelCache, *, mode: str = "exact",
                    last_chunk: bool = True, images: ImageRows | None = None, lengths: torch.Tensor | None = None,
                    probe: Probe | None = None, all_logits: bool = False,
                    adapters: Sequence[int] | None = None) -> tuple[torch.Tensor | None, TargetHidden | None]:
        """`step`, plus the drafter's input (Transformer.step_hidden)."""
        ids, images = self._on_device(input_ids, images)
        rows = self._rows(ids, cache, images, lengths, probe)
        with self._selected(adapters):
            return self.model.step_hidden(ids, cache, mode=mode, last_chunk=last_chunk, engram=rows, images=images,
                                          probe=probe, all_logits=all_logits, experts=self.experts, lengths=lengths)

    # ---- LoRA adapters --------------------------------------------------------------------------------------------
    def load_adapters(self, named: dict[str, str | Path], verify: bool = False) -> None:
        """Serve the LoRA adapters `named` (name -> a PEFT adapter folder, or a `train --lora` run) beside the base
        model (runtime/adapters.py); a request picks one by name (`adapter_slot`). Once per runtime."""
        if self.adapters is not None:
            raise OpenflashError("this runtime serves adapters already; load them all in one call")
        self.adapters, self.adapter_keys = served_adapters(self.model, named, self.folder, self.experts is not None,
                                                           verify)

    @property
    def adapter_names(self) -> list[str]:
        return [] if self.adapters is None else list(self.adapters.names)

    def adapter_slot(self, name: str | None) -> int:
        """The slot of a served adapter (BASE for None); a RequestError naming the served ones for another."""
        if name is None:
            return BASE
        if self.adapters is None or name not in self.adapters.names:
            served = self.adapters.names if self.adapters is not None else []
            raise RequestError(f"no LoRA adapter {name!r} is loaded (adapters: {served})", param="model")
        return self.adapters.slot(name)

    def _selected(self, adapters: Sequence[int] | None) -> AbstractContextManager[None]:
        """The step's adapter selection: one slot per batch row."""
        if self.adapters is None or adapters is None:
            if adapters is not None and any(a != BASE for a in adapters):
                raise ValueError("a row asks for a LoRA adapter but none is loaded")
            return nullcontext()
        return self.adapters.use(torch.tensor(list(adapters), dtype=torch.long, device=self.device))

    def _on_device(self, input_ids: torch.Tensor, images: ImageRows | None) -> tuple[torch.Tensor,
                                                                                     ImageRows | None]:
        """A step's token ids [B, S] (or [B]) and image rows, moved to the model's device: callers build them
        where they like (the CPU, mostly)."""
        ids = input_ids.unsqueeze(1) if input_ids.dim() == 1 else input_ids
        return ids.to(self.device, non_blocking=True), None if images is None else images.to(self.device)

    def _rows(self, ids: torch.Tensor, cache: ModelCache, images: ImageRows | None, lengths: torch.Tensor | None,
              probe: Probe | None) -> EngramRows | None:
        """The step's Engram rows (their fetch started); a probe sees the hash ids as `engram_hash`."""
        if lengths is not None:  # checked before hashing advances the cache's history
            lengths = check_lengths(lengths, ids.shape[0], ids.shape[1], ids.device)
        rows = self.memory.prepare(ids, cache, None if images is None else images.mask, lengths)
        if probe is not None and rows is not None:
            probe.record("engram_hash", rows.hash_ids)
        return rows

    def decode(self, tokens: torch.Tensor, cache: ModelCache, adapters: Sequence[int] | None = None) -> torch.Tensor:
        """One token per row (tokens [B] or [B, 1]) at each row's own position; logits [B, V]. On the CPU at the
        thread count measured fastest for this batch size (threads.py: a machine shared with other processes)."""
        def step() -> torch.Tensor:
            return self.step(tokens.reshape(-1, 1), cache, adapters=adapters)

        return self.decode_threads.run(tokens.numel(), step) if self.device.type == "cpu" else step()

    def speculate(self, logits: torch.Tensor, cache: ModelCache, k: int) -> None:
        """Start fetching the Engram rows of each row's k likeliest next tokens (EngramMemory.speculate)."""
        self.memory.speculate(logits, cache, k)

    @torch.no_grad()
    def replay(self, prompt_ids: list[int], start: int, stop: int, cache: ModelCache, *, bounded: bool,
               image_mask: torch.Tensor | None = None, images: ImageRows | None = None,
               adapter: int = BASE) -> None:
        """Rebuild a restored prefix cache's bounded state from prompt_ids[start:stop] (Transformer.replay), the
        Engram hash history rebuilt from the tokens before. image_mask [len(prompt_ids)]: image-span positions;
        images: the rows of those among [start, stop)."""
        if image_mask is not None:
            image_mask = image_mask.to(self.device)
        images = None if images is None else images.to(self.device)
        rows = self.memory.prepare_replay(prompt_ids, start, stop, cache, image_mask)
        ids = torch.tensor([prompt_ids[start:stop]], dtype=torch.long, device=self.device)
        with self._selected([adapter]):
            self.model.replay(ids, cache, start, bounded=bounded, engram=rows, images=images, experts=self.experts)

    def _graph(self) -> DecodeGraph | None:
        """The current numerics policy's whole-step decode graph, on the compiled backend."""
        numerics = self.model.numerics
        if not numerics.compiled:
            return None
        key = (numerics, self.model.weight_residency)
        if key not in self.graphs:
            self.graphs[key] = DecodeGraph(self.model)
        return self.graphs[key]

    # ---- training -------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None, *,
                images: ImageRows | None = None, dense_indexer: bool = False, probe: Probe | None = None,
                hidden: bool = False, logits_at: torch.Tensor | None = None) -> ForwardOutput:
        """Full sequences [B, S] from position 0 with their Engram rows (Transformer.forward; in autograd on the
        device tier)."""
        input_ids, images = self._on_device(input_ids, images)
        targets = None if targets is None else targets.to(self.device, non_blocking=True)
        logits_at = None if logits_at is None else logits_at.to(self.device, non_blocking=True)
        rows = self.memory.prefetch_batch(input_ids, None if images is None else images.mask)
        return self.model(input_ids, targets, engram=rows, images=images, dense_indexer=dense_indexer, probe=probe,
                          hidden=hidden, logits_at=logits_at)

    # ---- prompts --------------------------------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int], images: Sequence[ImageSource] = ()) -> tuple[list[int],
                                                                                            list[PromptImage]]:
        """A prompt's token ids (text through the tokenizer, with images placed; ids as given) and image spans,
        checked against the model's vocabulary with an error naming the tokenizer that produced them."""
        if isinstance(prompt, str):
            ids, placed = text_prompt(self.tokenizer, prompt, images, self.cfg)
        elif images:
            raise CheckpointError("images come with a text prompt (its <image> placeholders), not with token ids")
        else:
            ids, placed = list(prompt), []
        vocab = self.cfg.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            made = f"; the ids came from {self.tokenizer_source}: give the model's own with --tokenizer PATH" \
                if isinstance(prompt, str) and self.tokenizer_source else ""
            raise CheckpointError(f"prompt token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})"
                                  + made)
        if not ids:
            raise CheckpointError("the prompt is empty")
        return ids, placed

    # ---- Engram placement -----------------------------------------------------------------------------------------
    def place_engram(self, placement: str, *, table_dir: str | Path | None = None,
                     cache_bytes: int = DISK_ROW_CACHE_BYTES, io_threads: int = 4, verify: bool = False) -> None:
        """Move the Engram tables to `placement` (runtime/engram_tiers.py), closing the memory that held them."""
        if placement == self.memory.placement:
            return
        memory, scratch = placed_memory(self.model, self.memory, self.folder, placement, table_dir=table_dir,
                                        cache_bytes=cache_bytes, io_threads=io_threads, verify=verify)
        self.memory.close()
        self.memory, self._scratch = memory, scratch or self._scratch

    # ---- reporting and shutdown -------------------------------------------------------------------------------------
    def problem(self) -> str | None:
        """Why a step cannot run now (an Engram table that cannot serve rows), or None."""
        return self.memory.problem()

    def stats(self) -> dict[str, Any]:
        """engram: the memory's waits and table counters (None without Engram layers); experts: the store's cache
        counters (None: the model's own); decode_graph: steps run as one graph, graphs compiled and the seconds the
        compiling steps took (None off the compiled backend)."""
        graph = self._graph()
        return {"engram": self.memory.stats() if self.memory.layer_ids else None,
                "experts": self.experts.summary() if self.experts is not None else None,
                "decode_graph": None if graph is None else graph.stats()}

    def close(self) -> None:
        """Stop the memory's background work, close table and expert files, remove exported tables."""
        self.memory.close()
        if self.experts is not None:
            self.experts.close()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Runtime", "DISK_ROW_CACHE_BYTES"]
