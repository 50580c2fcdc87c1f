"""Rollouts: the engine samples each task's group of completions on the current policy.

The policy is the runtime's model itself (the frozen base with the adapter being trained, as the update leaves it:
no weights copied). Each step gets a fresh `LLMEngine` (the adapter changed, so no cached prefix of the last step
may serve), prefilling `exact` (every layer on every token, what the training forward computes). A group's G
samples share one prompt, which the engine prefills once (its twins, engine/scheduler.py). Every sample has its own
seed, derived from the run's seed, the step, its place and its turn, so a resumed run draws the same completions;
the engine keeps each sampled token's log-prob under softmax(logits / temperature) (engine/sampling.token_logprobs).

A task with a tool environment (rl/environment.py) runs as an episode of turns: the samples whose reply ended
(EOS) with tool calls get the results appended to their context and write their next turn, all such samples in one
engine batch per turn, up to `max_turns` turns and `max_tokens` model tokens in all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from tokenizers import Tokenizer

from openflash.chat.conversation import Turn
from openflash.engine.config import EngineConfig
from openflash.engine.engine import EngineRuntime, LLMEngine
from openflash.engine.request import ERROR, LENGTH, Sequence
from openflash.engine.sampling import SamplingParams
from openflash.rl.environment import ChatTemplate, reply_turn, tool_turn_text
from openflash.rl.tasks import Task

log = logging.getLogger("openflash.rl")

MAX_BATCH = 64  # sequences the rollout engine runs at once
TOOL_ROOM = 1024  # context tokens allowed per turn for tool results (an episode past its context ends truncated)


@dataclass
class Rollout:
    task: Task
    index: int  # its place in the step (its seeds)
    completion_ids: list[int] = field(default_factory=list)  # after the prompt: the model's turns, tool results
    logprobs: list[float] = field(default_factory=list)  # the sampler's, one per completion id (0 on tool results)
    trained: list[bool] = field(default_factory=list)  # per completion id: the model wrote it (the loss covers it)
    text: str = ""  # the last turn's text (what the reward reads)
    truncated: bool = False  # ran into the token budget or the context
    error: str | None = None  # the engine failed this sample (it is left out of the update)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # calls the environment failed on
    chat: list[Turn] = field(default_factory=list)  # a tool episode's conversation so far

    @property
    def generated(self) -> int:
        """Tokens the model wrote."""
        return sum(self.trained)

    def take(self, seq: Sequence) -> None:
        """One turn's completion."""
        if seq.finish_reason == ERROR:
            self.error = seq.error
            return
        self.completion_ids += seq.output_ids
        self.logprobs += [t.logprob for t in seq.output_logprobs]
        self.trained += [True] * len(seq.output_ids)
        self.text, self.truncated, self.turns = seq.text, seq.finish_reason == LENGTH, self.turns + 1

    def feed(self, ids: list[int]) -> None:
        """Tokens the model did not write (tool results, the next turn's header)."""
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.trained += [False] * len(ids)


@dataclass
class RolloutBatch:
    groups: list[list[Rollout]]  # one group per task, in task order
    seconds: float
    tokens: int  # completion tokens sampled

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Generator(Protocol):
    """What samples the turns (LLMEngine.generate): sequences in the order of the prompts."""

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]: ...


def sample_seed(run_seed: int, step: int, index: int, turn: int = 0) -> int:
    """The seed of the index-th sample's turn in a step: a fixed function of its place (resume draws the same)."""
    return ((run_seed * 1_000_003 + step) * 1_000_033 + index + turn * 2_000_003) & ((1 << 62) - 1)


def generate_groups(runtime: EngineRuntime, tasks: list[Task], group_size: int, max_tokens: int, temperature: float,
                    stop: tuple[str, ...], run_seed: int, step: int, max_turns: int = 1,
                    fmt: ChatTemplate | None = None) -> RolloutBatch:
    """group_size rollouts of every task, sampled at `temperature` (0: greedy, one per task is enough)."""
    longest = max(len(t.prompt_ids) for t in tasks)
    context = longest + max_tokens + 1 + (max_turns - 1) * TOOL_ROOM
    engine = LLMEngine(runtime, EngineConfig(max_batch=min(MAX_BATCH, len(tasks) * group_size),
                                             max_context=context, prefill_mode="exact",
                                             max_waiting=len(tasks) * group_size + 1))
    return run_episodes(engine, runtime.tokenizer, fmt, runtime.model.cfg.eos_token_id, context, tasks, group_size,
                        max_tokens, temperature, stop, run_seed, step, max_turns)


def run_episodes(generator: Generator, tokenizer: Tokenizer, fmt: ChatTemplate | None, eos_token_id: int | None,
                 max_context: int, tasks: list[Task], group_size: int, max_tokens: int, temperature: float,
                 stop: tuple[str, ...], run_seed: int, step: int, max_turns: int) -> RolloutBatch:
    """The rollouts, turn by turn (module doc); a tool environment answers the calls between turns."""
    rollouts = [Rollout(t, i * group_size + j, chat=list(t.turns)) for i, t in enumerate(tasks)
                for j in range(group_size)]
    start = time.perf_counter()
    active = rollouts
    for turn in range(max_turns):
        room = [min(max_tokens - r.generated, max_context - 1 - len(r.task.prompt_ids) - len(r.completion_ids))
                for r in active]
        for r in (r for r, n in zip(active, room) if n < 1):
            r.truncated = True
        active, room = [r for r, n in zip(active, room) if n >= 1], [n for n in room if n >= 1]
        if not active:
            break
        params = [SamplingParams(temperature=temperature, max_tokens=n, stop=stop, logprobs=True,
                                 logprobs_of="sampler", seed=sample_seed(run_seed, step, r.index, turn))
                  for r, n in zip(active, room)]
        seqs = generator.generate([list(r.task.prompt_ids) + r.completion_ids for r in active], params)
        for r, seq in zip(active, seqs):
            r.take(seq)
        if turn + 1 < max_turns:
            active = [r for r, seq in zip(active, seqs) if _answer_calls(r, seq, fmt, tokenizer, eos_token_id)]
    seconds = time.perf_counter() - start
    groups = [rollouts[i * group_size:(i + 1) * group_size] for i in range(len(tasks))]
    return RolloutBatch(groups, seconds, sum(r.generated for r in rollouts))


def _answer_calls(rollout: Rollout, seq: Sequence, fmt: ChatTemplate | None, tokenizer: Tokenizer,
                  eos_token_id: int | None) -> bool:
    """Feed the environment's results of the tool calls this turn made; False when the episode is over (no
    environment, no calls, or the turn did not end as a reply does, with EOS)."""
    task = rollout.task
    if task.environment is None or fmt is None or rollout.error is not None or not seq.output_ids \
            or seq.output_ids[-1] != eos_token_id:
        return False
    reply = reply_turn(fmt, task.options, seq.text)
    if not reply.tool_calls:
        return False
    results = []
    for call in reply.tool_calls:
        text, problem = task.environment.answer(call, task.fields)
        if problem is not None:
            log.warning("%s: tool call %s: %s", task.where, call.name, problem)
            rollout.tool_errors += 1
        results.append(Turn("tool", (text,), tool_call_id=call.id))
    rollout.tool_calls += len(results)
    rollout.feed(tokenizer.encode(tool_turn_text(fmt, rollout.chat, task.options, reply, results),
                                  add_special_tokens=False).ids)
    rollout.chat += [reply, *results]
    return True
