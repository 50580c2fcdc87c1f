"""Rollouts: the engine samples each task's group of completions on the current policy.

The policy is the runtime's model itself (the frozen base with the adapter being trained, as the update leaves it:
no weights copied). Each step gets a fresh `LLMEngine` (the adapter changed, so no cached prefix of the last step
may serve), prefilling `exact` (every layer on every token, what the training forward computes). Every sample has
its own seed, derived from the run's seed, the step and its place, so a resumed run draws the same completions; the
engine keeps each sampled token's log-prob under softmax(logits / temperature) (engine/sampling.token_logprobs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from openflash.engine.config import EngineConfig
from openflash.engine.engine import EngineRuntime, LLMEngine
from openflash.engine.request import ERROR, LENGTH
from openflash.engine.sampling import SamplingParams
from openflash.rl.tasks import Task

MAX_BATCH = 64  # sequences the rollout engine runs at once


@dataclass
class Rollout:
    task: Task
    completion_ids: list[int]
    logprobs: list[float]  # the sampler's, one per completion id
    text: str
    truncated: bool  # ran into the token budget
    error: str | None  # the engine failed this sample (it is left out of the update)


@dataclass
class RolloutBatch:
    groups: list[list[Rollout]]  # one group per task, in task order
    seconds: float
    tokens: int  # completion tokens sampled

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """The seed of the index-th sample of a step: a fixed function of its place (resume draws the same)."""
    return ((run_seed * 1_000_003 + step) * 1_000_033 + index) & ((1 << 62) - 1)


def generate_groups(runtime: EngineRuntime, tasks: list[Task], group_size: int, max_tokens: int, temperature: float,
                    stop: tuple[str, ...], run_seed: int, step: int) -> RolloutBatch:
    """group_size completions of every task, sampled at `temperature` (0: greedy, one per task is enough)."""
    longest = max(len(t.prompt_ids) for t in tasks)
    engine = LLMEngine(runtime, EngineConfig(max_batch=min(MAX_BATCH, len(tasks) * group_size),
                                             max_context=longest + max_tokens + 1, prefill_mode="exact",
                                             max_waiting=len(tasks) * group_size + 1))
    start = time.perf_counter()
    prompts, params = [], []
    for i, task in enumerate(tasks):
        for j in range(group_size):
            prompts.append(list(task.prompt_ids))
            params.append(SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=stop, logprobs=True,
                                         seed=sample_seed(run_seed, step, i * group_size + j)))
    seqs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    groups = []
    for i, task in enumerate(tasks):
        group = []
        for seq in seqs[i * group_size:(i + 1) * group_size]:
            failed = seq.finish_reason == ERROR
            group.append(Rollout(task, [] if failed else list(seq.output_ids),
                                 [] if failed else list(seq.output_logprobs), seq.text, seq.finish_reason == LENGTH,
                                 seq.error if failed else None))
        groups.append(group)
    return RolloutBatch(groups, seconds, sum(len(r.completion_ids) for g in groups for r in g))
