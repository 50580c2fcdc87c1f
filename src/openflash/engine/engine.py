"""LLMEngine: requests in, tokens out, with continuous batching, a paged global KV cache and prefix caching.

    engine = LLMEngine(open_model("tiny"), EngineConfig(max_batch=16))     # a runtime (runtime/runtime.py) and a config
    rid = engine.add_request("def fib(n):", SamplingParams(max_tokens=32), on_output=print)
    while engine.has_work():
        engine.step()                      # or engine.start() for a background thread (the server)

One `step()`: take new requests and cancellations, let the scheduler pick prompt chunks and the decode set, prefill
the chunks (several packed into one model call, right-padded where their lengths differ), decode every running
sequence in one batched call, sample (each request with its own generator, so batch composition never changes a
result), apply stop conditions, free finished sequences at once, and hand each request its `RequestOutput`.

add_request / abort are thread-safe; everything else runs on the thread that calls step() (the engine thread).

Expert-parallel serving runs one engine per rank in lockstep (engine/lockstep.py, the `StepSync` declared here): the
leader's engine shares each step's arrivals and aborts before stepping, the followers' engines apply them and step
alike (`follow()`), so every rank makes the same model calls.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import asdict, replace
from typing import Any, Callable, Protocol
from typing import Sequence as Sequence_

import torch
from tokenizers import Tokenizer

from openflash.engine.cache import CacheFactory
from openflash.engine.config import EngineConfig
from openflash.engine.inbox import Inbox
from openflash.engine.lockstep import KEEPALIVE_SECONDS, LockstepError, RequestSpec, StepInputs
from openflash.engine.loop import EngineLoop
from openflash.engine.metrics import EngineMetrics
from openflash.engine.prefix_cache import PrefixCache, model_fingerprint
from openflash.engine.prompt import PromptIntake
from openflash.engine.logits import NO_CHOICE, NoTokenAllowed, TokenConstraint, choose_tokens, speculative_conflict
from openflash.engine.request import ABORT, ERROR, LENGTH, RequestOutput, Sequence
from openflash.engine.runner import ChunkTask, ModelRunner, ModelRuntime
from openflash.engine.sampling import NO_TOKEN, NonFiniteLogits, SamplerState, SamplingParams
from openflash.engine.scheduler import PrefillChunk, Scheduler, SchedulerConfig
from openflash.errors import EngramTableError, OpenflashError, RequestError
from openflash.model.lora import BASE
from openflash.vision.prompt import PromptImage

log = logging.getLogger("openflash.engine")


Outputs = list[tuple[Sequence, RequestOutput]]  # what a step produced, per sequence, in order (delivered at its end)


def failure_of(exc: BaseException) -> tuple[str, bool]:
    """What a request that failed on `exc` is told, and whether the failure is a storage tier's (retry later;
    its file paths stay in the server's log, not in the reply)."""
    if isinstance(exc, EngramTableError):
        return "an Engram table could not be read (the server log names it)", True
    return f"{type(exc).__name__}: {exc}", False


class EngineRuntime(ModelRuntime, Protocol):
    """What the engine needs of the model it serves (runtime.Runtime): the runner's steps, plus the tokenizer that
    detokenizes outputs, why steps cannot run now, and counters for /metrics."""

    tokenizer: Tokenizer
    adapter_keys: list[int]  # per served LoRA adapter slot: a digest of what it computes
    adapter_names: list[str]  # the served LoRA adapters, in slot order

    def adapter_slot(self, name: str | None) -> int:
        """The slot of a served adapter (None: the base model); RequestError for a name not served."""

    def problem(self) -> str | None:
        """Why a step cannot run now (an Engram table that cannot serve rows), or None; from the server's thread."""

    def stats(self) -> dict[str, Any]:
        """engram, experts and decode_graph counters (Runtime.stats)."""

    @property
    def records_decode_graphs(self) -> bool:
        """Decode steps replay CUDA graph recordings (the engine then pads its decode batches to a few sizes)."""


class StepSync(Protocol):
    """Engine replicas on several ranks kept in step (implemented by engine/lockstep.py's Lockstep)."""

    @property
    def leader(self) -> bool:
        """This rank's engine takes the requests; the others follow it."""

    def share(self, inputs: StepInputs | None) -> StepInputs:
        """The leader's step inputs (given on the leader, None elsewhere), on every rank; LockstepError when the
        link broke."""

    def intake(self, arrived: list[Sequence], aborts: list[str], abort_all: bool) -> StepInputs:
        """A step's arrivals and aborts as the leader took them in, on every rank."""


class LLMEngine:
    def __init__(self, runtime: EngineRuntime, config: EngineConfig = EngineConfig(),
                 lockstep: StepSync | None = None) -> None:
        """runtime: the model to serve with its Engram memory and experts (open_model, runtime/open.py, or
        Runtime.of for a built model); lockstep: this engine is one of several replicas stepping together
        (expert-parallel serving)."""
        if not isinstance(config, EngineConfig):
            raise TypeError(f"LLMEngine(runtime, config): config must be an EngineConfig, got {type(config).__name__} "
                            f"(the runtime holds model and tokenizer: open_model(...) or Runtime.of(model, tokenizer))")
        self.config = config.validate()
        model = runtime.model
        if lockstep is not None and config.prefix_cache_dir:
            raise OpenflashError("a persisted prefix cache (prefix_cache_dir) is not supported with expert "
                                 "parallelism: each rank would load and save its own")
        if config.kv_storage == "packed" and not model.numerics.cache_qdq:
            raise OpenflashError(f"kv_storage 'packed' stores the trained cache formats, which needs numerics with "
                                 f"cache QDQ; the model runs {model.numerics.name!r}")
        self.runtime, self.model, self.tokenizer = runtime, model, runtime.tokenizer
        self.prompt_intake = PromptIntake.of(model.cfg, runtime.tokenizer, config.max_context)  # engine/prompt.py
        self._runtime_stats = runtime.stats()  # snapshot for other threads (memory and store are single-threaded)
        self.cfg = model.cfg
        drafts = config.drafts(model.cfg)
        self.factory = CacheFactory.create(model.cfg, config.kv_storage, config.kv_block_size, config.max_kv_blocks,
                                           model.device, spare=drafts + 1 if drafts else 0, draft=bool(drafts))
        self.runner = ModelRunner(runtime, self.factory, config.prefill_mode, config.engram_speculate, drafts,
                                  config.prefill_batch, config.prefill_padding,
                                  config.padded_batches(runtime.records_decode_graphs) if not drafts else ())
        self.scheduler = Scheduler(SchedulerConfig(config.max_batch, config.max_step_tokens, config.prefill_chunk,
                                                   config.max_waiting, config.share_prompts), self._admit)
        self.metrics = EngineMetrics()
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache:
            ratios = list(self.factory.owner_ratios().values()) or [1]
            block = config.prefix_block_tokens or (config.prefill_chunk if config.prefix_restore == "snapshot"
                                                   else 16 * max(ratios))
            fingerprint = model_fingerprint(model, config) if config.prefix_cache_dir else ""
            self.prefix_cache = PrefixCache(self.factory, block, config.prefix_cache_bytes, config.prefix_restore,
                                            fingerprint)
            if config.prefix_cache_dir:
                n = self.prefix_cache.load(config.prefix_cache_dir)
                log.info("prefix cache: loaded %d entries from %s", n, config.prefix_cache_dir)
        self.inbox = Inbox(config.max_waiting)  # requests and aborts from other threads, until the next step
        self._removals: list[str] = []
        self.lockstep = lockstep
        self.loop = EngineLoop(self, KEEPALIVE_SECONDS if lockstep is not None else None)  # engine/loop.py
        self._follower_output: Callable[[RequestOutput], None] | None = None  # follow(on_output)

    # ---- requests (any thread) ----------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, *, request_id: str | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None, ignore_eos: bool = False,
                    images: Sequence_[PromptImage] = (), adapter: str | None = None,
                    constraint: TokenConstraint | None = None) -> Sequence:
        """Queue a request; raises OpenflashError (PromptError, QueueFullError, EngineStoppedError) if it cannot be
        served. Outputs go to on_output (on the engine thread).

        images: the prompt's image spans (vision/prompt.py: `assemble` or `text_prompt` places them), at positions
        holding the image token id. adapter: the served LoRA adapter to run with (None: the base model).
        constraint: a grammar the completion must follow (engine/logits.py; structured output)."""
        params.validate(self.config.max_context - 1)
        if self.runner.drafts and (conflict := speculative_conflict(params, constraint)) is not None:
            raise RequestError(f"{conflict} is not supported under speculative decoding (its accepted tokens are "
                               f"drawn by rejection sampling inside the verifier); serve without --speculative for "
                               f"it", param=conflict)
        if constraint is not None and self.lockstep is not None:
            raise RequestError("structured output is not supported with expert-parallel serving (each rank would "
                               "need the grammar's state)", param="response_format")
        slot = self.runtime.adapter_slot(adapter)
        ids = self.prompt_intake.encode(prompt)
        self.prompt_intake.check_budget(ids, params.max_tokens)
        self.prompt_intake.check_images(ids, images)
        if self.lockstep is not None:
            if not self.lockstep.leader:
                raise RuntimeError("a follower engine takes its requests from the leader, not add_request")
            if not params.greedy and params.seed is None:  # every rank must draw the same tokens
                params = replace(params, seed=int.from_bytes(os.urandom(8), "little") >> 1)
        seq = self._sequence(RequestSpec(request_id or uuid.uuid4().hex, ids, params,
                                         None if ignore_eos else self.cfg.eos_token_id, list(images), slot), on_output)
        seq.constraint = constraint
        self.inbox.put(seq, len(self.scheduler.waiting))
        return seq

    def _sequence(self, spec: RequestSpec, on_output: Callable[[RequestOutput], None] | None = None) -> Sequence:
        key = self.runtime.adapter_keys[spec.adapter] if spec.adapter != BASE else 0
        return Sequence(spec.request_id, spec.prompt_ids, spec.params, SamplerState.create(spec.params),
                        eos_token_id=spec.eos_token_id, on_output=on_output, images=list(spec.images),
                        adapter=spec.adapter, adapter_key=key)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its state is freed at the start of the next step."""
        self.inbox.abort(request_id)

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters requests may name (`add_request(adapter=...)`)."""
        return self.runtime.adapter_names

    @property
    def accepting(self) -> bool:
        """False once shutdown began."""
        return self.inbox.accepting

    def problem(self) -> str | None:
        """Why requests would fail now (an Engram tier that cannot be read), or None; for a server's /health."""
        return self.runtime.problem()

    def has_work(self) -> bool:
        return self.inbox.pending() or self.scheduler.has_work

    def busy(self) -> bool:
        """The scheduler holds sequences (arrivals not yet taken aside)."""
        return self.scheduler.has_work

    # ---- one step (engine thread) -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: take what arrived (and the aborts), prefill the scheduled chunks, decode the running
        sequences, then deliver every output. Returns them (nothing when the group's leader stopped it)."""
        start, outputs = time.perf_counter(), []
        if not self._intake(outputs):
            return []
        plan = self.scheduler.schedule()
        self._prefill(plan.prefill_waves(), outputs)
        self._decode([s for s in plan.decodes if not s.finished], outputs)
        return self._end_step(start, outputs)

    def _intake(self, outputs: Outputs) -> bool:
        """New requests into the waiting queue and aborts done (with expert parallelism, the leader's: followers
        take its arrivals); False when the leader stopped the group."""
        inbox, aborts = self.inbox.take()
        abort_all = self.inbox.abort_all
        self.scheduler.waiting.extend(inbox)  # capacity was checked in add_request
        if self.lockstep is not None:
            shared = self.lockstep.intake(inbox, aborts, abort_all)
            if shared.stop:
                self.inbox.stop()
                return False
            if not self.lockstep.leader:
                self.scheduler.waiting.extend(self._sequence(r, self._follower_output) for r in shared.arrivals)
                aborts, abort_all = shared.aborts, shared.abort_all
        if abort_all:
            aborts += [s.request_id for s in self.scheduler.all_sequences()]
        for rid in aborts:
            seq = self.scheduler.find(rid)
            if seq is not None:
                outputs.append((seq, self._finish(seq, ABORT)))
        return True

    def _prefill(self, waves: list[list[PrefillChunk]], outputs: Outputs) -> None:
        """The scheduled prompt chunks, wave by wave (StepPlan.prefill_waves); a last chunk samples its sequence's
        first token."""
        for wave in waves:
            wave = [c for c in wave if not c.seq.finished]
            results = self.runner.prefill_many([ChunkTask(c.seq, c.start, c.end) for c in wave])
            for chunk, result in zip(wave, results):
                seq = chunk.seq
                try:
                    if result.error is not None:  # a failure fails this request, not the server
                        raise result.error
                    self.metrics.prompt_tokens += chunk.num_tokens
                    if self.prefix_cache is not None:
                        self.prefix_cache.offer(seq.key_ids, chunk.start, chunk.end, seq.cache)
                except Exception as exc:
                    outputs.extend(self._fail([seq], exc, "prefill"))
                    continue
                seq.prompt_logprobs += result.prompt_logprobs
                if chunk.last:
                    self.scheduler.promote(seq)
                    group = []
                    for s in [seq, *self._forks(seq)]:
                        if s.params.max_tokens == 0:  # the prompt's log-probs were all it asked for
                            outputs.append((s, self._finish(s, LENGTH)))
                        else:
                            group.append(s)
                    if not group:
                        continue
                    tokens = self.next_tokens(result.logits.unsqueeze(0).expand(len(group), -1), group)
                    outputs += [(s, self._append(s, t)) for s, t in zip(group, tokens)]

    def _forks(self, seq: Sequence) -> list[Sequence]:
        """The twins that waited for seq's prompt (scheduler.py), each given a copy of its state, now running."""
        twins = self.scheduler.take_twins(seq)
        for twin in twins:
            self.runner.fork(seq, twin)
            twin.prompt_logprobs = list(seq.prompt_logprobs)  # (a twin asks for the same: scheduler.py)
            twin.scheduled_time = time.perf_counter()
            self.metrics.queue_time.observe(twin.scheduled_time - twin.arrival_time)
            self.metrics.cached_prompt_tokens += twin.prompt_len
        return twins

    def _decode(self, decodes: list[Sequence], outputs: Outputs) -> None:
        """One batched decode step (or speculative round) of the running sequences; each commits its tokens."""
        if not decodes:
            return
        try:
            ordered, committed, rounds = self.runner.decode_step(decodes, self.next_tokens)
        except Exception as exc:
            outputs.extend(self._fail(decodes, exc, "batched decode"))
            return
        self.metrics.record_rounds(rounds)
        for seq, tokens in zip(ordered, committed):
            for token in tokens:  # a finished sequence drops the rest
                outputs.append((seq, self._append(seq, token)))
                if seq.finished:
                    break

    def _end_step(self, start: float, outputs: Outputs) -> list[RequestOutput]:
        """Drop what finished from the batch, snapshot the counters other threads read, deliver the outputs."""
        self._flush_removals()
        self._runtime_stats = self.runtime.stats()
        self.metrics.steps += 1
        self.metrics.step_time.observe(time.perf_counter() - start)
        for seq, out in outputs:
            self._deliver(seq, out)
        return [out for _, out in outputs]

    def next_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """The next token of each sequence from its logits row (logits.choose_tokens: shaped as it asks, sampled
        with its own sampler, its log-prob kept when asked)."""
        return choose_tokens(logits, seqs)

    def _admit(self, seq: Sequence) -> bool:
        """Give an admitted sequence its cache, restoring the longest cached prefix of its prompt."""
        seq.scheduled_time = time.perf_counter()
        self.metrics.queue_time.observe(seq.scheduled_time - seq.arrival_time)
        try:
            # Prompt log-probs come from a prefill of every prompt token: nothing restored.
            restorable = self.prefix_cache is not None and seq.params.prompt_logprobs is None
            entry = self.prefix_cache.lookup(seq.key_ids) if restorable else None
            if entry is None:
                seq.cache = self.runner.new_cache()
                return True
            seq.cache = self.prefix_cache.restore(entry)
            if self.prefix_cache.restore_mode == "replay":
                self.runner.replay_prefix(seq, entry.num_tokens)
            seq.num_prefilled = seq.num_cached = entry.num_tokens
            self.metrics.cached_prompt_tokens += entry.num_tokens
            return True
        except Exception as exc:
            for failed, out in self._fail([seq], exc, "admission"):
                self._deliver(failed, out)
            return False

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        if token in (NO_TOKEN, NO_CHOICE):  # this request fails, the others in its batch go on
            return self._fail([seq], NonFiniteLogits() if token == NO_TOKEN else NoTokenAllowed(), "sampling")[0][1]
        now = time.perf_counter()
        if seq.params.logprobs:
            seq.output_logprobs.append(seq.pending_logprob)
        if seq.constraint is not None and not seq.constraint.advance(token):
            return self._fail([seq], RuntimeError(f"the grammar refused token {token}, which its own mask allowed"),
                              "structured output")[0][1]
        out = seq.append_token(token, self.tokenizer.decode, now)
        self.metrics.record_token(seq, now)
        if seq.finished:
            self._release(seq)
        return out

    def _finish(self, seq: Sequence, reason: str, error: str | None = None,
                unavailable: bool = False) -> RequestOutput:
        seq.finish(reason, error, unavailable)
        self._release(seq)
        return seq.emit([])

    def _fail(self, seqs: Sequence_[Sequence], exc: BaseException,
              during: str) -> list[tuple[Sequence, RequestOutput]]:
        """The one failure path: log the exception once with its details, finish each sequence with the message
        its client gets (failure_of)."""
        log.error("%s of request(s) %s failed", during, ", ".join(s.request_id for s in seqs), exc_info=exc)
        return [(seq, self._finish(seq, ERROR, *failure_of(exc))) for seq in seqs]

    def _release(self, seq: Sequence) -> None:
        """Forget a finished sequence: its own cache now, its decode-batch rows at the end of the step."""
        self.scheduler.remove(seq)
        self.runner.free_own(seq)
        self._removals.append(seq.request_id)
        self.metrics.record_finish(seq)

    def _flush_removals(self) -> None:
        """Drop the decode-batch rows of every sequence finished in this step, in one regroup."""
        removals, self._removals = self._removals, []
        self.runner.remove(removals)

    def _deliver(self, seq: Sequence, out: RequestOutput) -> None:
        if seq.on_output is None:
            return
        try:
            seq.on_output(out)
        except Exception:  # a broken consumer must not stop the engine; cancel its request
            log.exception("output callback of request %s failed; aborting it", seq.request_id)
            if not seq.finished:
                self.abort(seq.request_id)

    # ---- offline use ------------------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 ignore_eos: bool = False, images: list[Sequence_[PromptImage]] | None = None,
                 adapters: list[str | None] | None = None) -> list[Sequence]:
        """Run prompts to completion on the calling thread (no background loop); sequences in input order.
        images, adapters: each prompt's image spans and LoRA adapter (see add_request)."""
        if self.loop.running:
            raise RuntimeError("generate() runs the engine itself; the background loop is running")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        spans = images if images is not None else [()] * len(prompts)
        named = adapters if adapters is not None else [None] * len(prompts)
        seqs = [self.add_request(p, sp, ignore_eos=ignore_eos, images=im, adapter=a)
                for p, sp, im, a in zip(prompts, plist, spans, named)]
        while self.has_work():
            self.step()
        return seqs

    # ---- the loops that step it (engine/loop.py) and shutdown ---------------------------------------------------
    def start(self) -> None:
        """Step on a background thread (the server's) from now on."""
        self.loop.start()

    def follow(self, on_output: Callable[[RequestOutput], None] | None = None) -> None:
        """A follower rank's engine (expert-parallel serving): step with the leader until it stops the group;
        on_output gets this replica's outputs of every request (for logs and checks: the leader's are the ones
        served)."""
        if self.lockstep is None or self.lockstep.leader:
            raise RuntimeError("follow() is for the follower engines of an expert-parallel group")
        self._follower_output = on_output
        self.loop.follow()

    def fail_in_flight(self, exc: BaseException, during: str) -> None:
        for seq, out in self._fail(self.scheduler.all_sequences(), exc, during):
            self._deliver(seq, out)
        self._flush_removals()

    def abandon(self) -> None:
        """The expert-parallel group is gone: take nothing new, fail what arrived and what is in flight."""
        self.inbox.close()
        self.scheduler.waiting.extend(self.inbox.take()[0])
        self.fail_in_flight(LockstepError("the expert-parallel group stopped"), "the group's step")

    def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Stop taking requests, let running ones finish for up to drain_timeout seconds, abort the rest, stop the
        loop, tell the follower ranks to stop, and persist the prefix cache if configured."""
        self.loop.drain(drain_timeout)
        if self.lockstep is not None and self.lockstep.leader:
            try:
                self.lockstep.share(StepInputs(stop=True))
            except LockstepError:
                log.exception("could not tell the follower ranks to stop")
        if self.prefix_cache is not None and self.config.prefix_cache_dir:
            path = self.prefix_cache.save(self.config.prefix_cache_dir)
            log.info("prefix cache: saved %d entries to %s", len(self.prefix_cache.entries), path)

    # ---- reporting ------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        pool = self.factory.pool
        out: dict[str, Any] = {
            "waiting": len(self.scheduler.waiting) + len(self.inbox),
            "prefilling": len(self.scheduler.prefilling),
            "running": len(self.scheduler.running),
            "kv_blocks_in_use": pool.blocks_in_use,
            "kv_blocks_total": pool.num_blocks - 1,
            "kv_block_entries": pool.block_size,
            "kv_storage": self.config.kv_storage,
            "global_cache_bytes_per_token": self.factory.global_bytes_per_token(),
            "window_bytes_per_sequence": self.factory.window_bytes_per_sequence(),
            "prefix_cache": self.prefix_cache.summary() if self.prefix_cache is not None else None,
            "kv_bytes_in_use": pool.blocks_in_use * pool.block_bytes,
            "kv_pool_bytes": pool.nbytes(),
            **self._runtime_stats,  # engram, experts, decode_graph
            "regroups": self.runner.regroups,
            "idle_decode_rows": self.runner.idle_rows,
            "config": asdict(self.config),
        }
        return out
